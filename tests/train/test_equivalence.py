"""η = 0 through the whole asynchronous machinery (rollout server, controller, grading pool,
trainer, weight publication) equals a plain synchronous loop written here."""

from __future__ import annotations

import json

from relayrl.algo.advantages import compute_advantages
from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions, SamplingParams
from relayrl.models.loading import encode_prompt, load_model, load_tokenizer
from relayrl.rollout.controller import request_seed
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.trajectory import Trajectory
from relayrl.tasks.registry import make_task
from relayrl.train.options import TrainerOptions
from relayrl.train.run import run_train
from relayrl.train.trainer import RLTrainer
from tests.train.conftest import parity_grader, rl_config


def reference_run(config, model_dir):
    """Generate B·n with the run's seeds → rewards → advantages → the same update."""
    tokenizer = load_tokenizer(model_dir)
    task = make_task(config.task.name, config.task.params)
    loader = PromptLoader(task.problems("train", config.task.train_size, config.task.seed), 0)
    trainer = RLTrainer(
        load_model(model_dir), TrainerOptions.from_config(config), pad_id=tokenizer.pad_token_id
    )
    r = config.rollout
    options = EngineOptions(
        max_seq_len=config.model.max_context,
        max_running_requests=config.rollout.max_running_requests,
    )
    batches = []
    with Engine(load_model(model_dir), tokenizer, options) as engine:
        for _ in range(config.train.total_steps):
            drawn = [loader.next() for _ in range(r.prompts_per_step)]
            groups = []
            for index, problem in drawn:
                ids = encode_prompt(tokenizer, problem.prompt)
                params = [
                    SamplingParams(r.max_new_tokens, r.temperature, seed=request_seed(0, index, j))
                    for j in range(r.n_samples)
                ]
                outs = engine.generate_batch([ids] * r.n_samples, params)
                texts = [tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
                rewards = [parity_grader(problem, t) for t in texts]
                advs = compute_advantages([rewards], config.algo.advantage)[0]
                groups.append(
                    [
                        Trajectory(
                            problem.id,
                            f"g{index}",
                            j,
                            ids,
                            o.output_ids,
                            o.output_logprobs,
                            o.output_versions,
                            trainer.version,
                            o.finish_reason,
                            rw,
                            "ok",
                            a,
                        )
                        for j, (o, rw, a) in enumerate(zip(outs, rewards, advs, strict=True))
                    ]
                )
            batches.append(
                [(t.prompt_id, t.reward, len(t.completion_ids)) for g in groups for t in g]
            )
            trainer.train_step(groups)
            state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            engine.update_weights(state, version=trainer.version)
    return trainer.model, batches


def test_eta0_equals_synchronous_loop(tmp_path, tiny_model_dir):
    """Same prompts, seeds, tokens and rewards at every step; bitwise the same final weights.

    Both engines decode one request at a time (``rollout.max_running_requests=1``): the
    server batches requests as they arrive over HTTP, the reference engine all at once, and
    a different batch shape changes the last bits of the behaviour logprobs (docs/engine.md,
    "Seeds and determinism"), which Adam amplifies to ~1e-6 in the weights. With equal
    shapes nothing but the machinery differs, so the weights must be identical.
    """
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "rollout.eta=0",
        "optim.lr=1e-4",
        "rollout.max_running_requests=1",
    )
    run_train(config, grader=parity_grader)
    ref_model, ref_batches = reference_run(config, tiny_model_dir)

    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    got = [[] for _ in ref_batches]
    for row in sorted(rows, key=lambda x: (x["step"], int(x["group_id"][1:]), x["sample_index"])):
        got[row["step"]].append((row["prompt_id"], row["reward"], row["completion_tokens"]))
        assert row["version_min"] == row["version_max"] == row["step"]  # η = 0: on-policy
    assert got == ref_batches
    assert len({r for b in ref_batches for _, r, _ in b}) == 2  # rewards vary: real updates

    trained = load_model(tmp_path / "run" / "final_model")
    ref = dict(ref_model.named_parameters())
    worst = max((p - ref[n]).abs().max().item() for n, p in trained.named_parameters())
    moved = max(
        (p - q).abs().max().item()
        for (_, p), (_, q) in zip(
            trained.named_parameters(), load_model(tiny_model_dir).named_parameters(), strict=True
        )
    )
    assert moved > 1e-4  # the run did train
    assert worst == 0.0, f"weights differ from the synchronous reference by {worst}"
    print(f"max |Δw| vs synchronous reference: {worst:.3g}")
