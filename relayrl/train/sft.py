"""SFT warm start: teach the small model the task format from generated demonstrations.

A fraction ``sft.wrong_fraction`` of demonstrations contain one wrong step, so the model
learns to make avoidable mistakes at a controlled rate: its held-out pass@1 lands between
0.2 and 0.6 (competent but improvable), which is what RL then fixes. Prompt tokens are
masked from the loss; the loss is the mean over completion tokens.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from relayrl.config.schema import RunConfig
from relayrl.models.loading import (
    check_model_path,
    leading_special_ids,
    prefer_shape_agnostic_attention,
    prompt_text,
    quiet_libraries,
)
from relayrl.tasks.base import Problem, SyntheticTask
from relayrl.train.lora import apply_lora, save_model, trainable_parameters

IGNORE_INDEX = -100


@dataclass
class SFTResult:
    model_dir: Path
    steps: int
    final_loss: float
    seconds: float


def encode_example(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) with the prompt masked and EOS appended to the completion."""
    return encode_segments(tokenizer, prompt, [(completion, True)])


Segments = list[tuple[str, bool]]  # (text, written by the model) in order


def encode_segments(
    tokenizer, prompt: str, segments: Segments, system_prompt: str | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a multi-turn demonstration: each segment encoded on its own
    (as an episode encodes each turn and observation), the prompt and the segments not
    written by the model (observations) masked, EOS appended as the model's."""
    return encode_demonstrations(tokenizer, [(prompt, segments)], system_prompt)[0]


def encode_demonstrations(
    tokenizer, demonstrations: list[tuple[str, Segments]], system_prompt: str | None = None
) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_segments` of many demonstrations with one tokenizer call (a call per
    text cost SFT ~8 % of its step time on the demo's model)."""
    prompts = [prompt_text(tokenizer, prompt, system_prompt) for prompt, _ in demonstrations]
    texts = [text for _, segments in demonstrations for text, _ in segments]
    encoded = iter(tokenizer(prompts + texts, add_special_tokens=False)["input_ids"])
    lead = leading_special_ids(tokenizer)
    prompt_ids = [lead + list(next(encoded)) for _ in prompts]
    examples = []
    for ids, (_, segments) in zip(prompt_ids, demonstrations, strict=True):
        ids = list(ids)
        labels = [IGNORE_INDEX] * len(ids)
        for _, trained in segments:
            part = next(encoded)
            ids += part
            labels += part if trained else [IGNORE_INDEX] * len(part)
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
        examples.append((ids, labels))
    return examples


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded input ids, attention mask and labels."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([x + [pad_id] * (width - len(x)) for x, _ in examples])
    labels = torch.tensor([y + [IGNORE_INDEX] * (width - len(y)) for _, y in examples])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in examples])
    return ids, mask, labels


def completion_loss(model, ids, mask, labels) -> torch.Tensor:
    """Mean next-token cross-entropy over unmasked label positions."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    targets = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def lr_lambda(warmup: int, total: int):
    """Linear warm-up then cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class DemonstrationStream:
    """An endless, seeded stream of tokenized demonstrations over the train split.

    Batches are grouped by length (a pool of ``group_batches`` batches is sorted by length,
    cut into batches and shuffled) so that padding, which costs as much compute as real
    tokens, stays small.
    """

    def __init__(
        self,
        task: SyntheticTask,
        problems: list[Problem],
        tokenizer,
        wrong_fraction: float,
        seed: int,
        group_batches: int = 16,
        system_prompt: str | None = None,
    ):
        self.task, self.problems, self.tokenizer = task, problems, tokenizer
        self.system_prompt = system_prompt
        self.wrong_fraction = wrong_fraction
        self.group_batches = group_batches
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.ready: list[list[tuple[list[int], list[int]]]] = []

    def _next_demonstration(self) -> tuple[str, Segments]:
        if not self.order:
            self.order = list(range(len(self.problems)))
            self.rng.shuffle(self.order)
        problem = self.problems[self.order.pop()]
        wrong = self.rng.random() < self.wrong_fraction
        return problem.prompt, self.task.demonstration_segments(problem, self.rng, wrong)

    def next_batch(self, size: int) -> list[tuple[list[int], list[int]]]:
        if not self.ready:
            demonstrations = [self._next_demonstration() for _ in range(size * self.group_batches)]
            pool = sorted(
                encode_demonstrations(self.tokenizer, demonstrations, self.system_prompt),
                key=lambda e: len(e[0]),
            )
            self.ready = [pool[i : i + size] for i in range(0, len(pool), size)]
            self.rng.shuffle(self.ready)
        return self.ready.pop()


def train_sft(
    config: RunConfig, task: SyntheticTask, model, tokenizer, out_dir: Path, progress: bool = True
) -> SFTResult:
    """Run SFT in place on ``model`` and save it (with the tokenizer) to ``out_dir``."""
    from tqdm import tqdm

    sft = config.sft
    torch.manual_seed(config.seed)
    problems = task.problems("train", config.task.train_size, config.task.seed)
    stream = DemonstrationStream(
        task,
        problems,
        tokenizer,
        sft.wrong_fraction,
        config.seed,
        system_prompt=config.model.system_prompt,
    )
    if config.model.lora is not None:
        model = apply_lora(model, config.model.lora)
    optimizer = torch.optim.AdamW(
        trainable_parameters(model), lr=sft.lr, weight_decay=sft.weight_decay, betas=(0.9, 0.98)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(sft.warmup_steps, sft.steps))
    model.train()
    device = next(model.parameters()).device
    prefer_shape_agnostic_attention(device)
    start, loss_value = time.perf_counter(), float("nan")
    bar = tqdm(range(sft.steps), desc="sft", disable=not progress, mininterval=1.0)
    for step in bar:
        batch = collate(stream.next_batch(sft.batch_size), tokenizer.pad_token_id)
        ids, mask, labels = (x.to(device) for x in batch)
        loss = completion_loss(model, ids, mask, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), sft.grad_clip)
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
        if step % sft.log_every == 0 or step == sft.steps - 1:
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = save_model(model, out_dir, merge_in_place=True)  # merged + adapter/ under LoRA
    tokenizer.save_pretrained(out_dir)
    return SFTResult(out_dir, sft.steps, loss_value, time.perf_counter() - start)


def demonstration_task(config: RunConfig) -> SyntheticTask:
    """The task SFT draws its demonstrations from: the task's ``demonstration_params``, then
    ``task.params``, then ``sft.task_params`` over them. Only the distribution changes: the
    test split is chosen by problem key, so no held-out problem becomes a demonstration."""
    from relayrl.tasks.registry import make_task

    task = make_task(config.task.name, config.task.params)
    params = {**task.demonstration_params, **config.task.params, **config.sft.task_params}
    return make_task(config.task.name, params)


def run_sft(config: RunConfig, progress: bool = True, overwrite: bool = True) -> float:
    """The `relayrl sft` job: build (or load) the model, SFT it, evaluate, return pass@1.

    Writes ``<run>/sft_model`` (a Hugging Face directory), ``<run>/sft_eval.jsonl`` and
    ``<run>/sft_summary.json``, after ``model.path`` and its chat template are checked;
    ``overwrite=False`` (the CLI without ``--overwrite``): an earlier run under the same
    name is an error.
    """
    import json

    from relayrl.engine.engine import Engine
    from relayrl.engine.types import EngineOptions
    from relayrl.eval.evaluate import evaluate
    from relayrl.models.build import create_model_dir
    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.tasks.registry import make_task

    torch.set_num_threads(config.runtime.threads)
    quiet_libraries()  # no "Writing model shards" bar under the SFT progress bar
    task = make_task(config.task.name, config.task.params)
    from relayrl.config.loader import claim_run_dir, prepare_run_dir, run_dir_of

    check_model_path(config.model.path, config.model.system_prompt)
    claim_run_dir(run_dir_of(config), overwrite=overwrite)
    run_dir = prepare_run_dir(config)
    if config.model.path:
        model = load_model(config.model.path, config.model.device, config.model.dtype)
        tokenizer = load_tokenizer(config.model.path)
    else:
        model, tokenizer = create_model_dir(
            run_dir / "base_model",
            task,
            config.model.preset,
            seed=config.seed,
            max_position_embeddings=config.model.max_context,
            vocab_size=config.model.vocab_size,
        )
        model = model.to(config.model.device)
    result = train_sft(
        config, demonstration_task(config), model, tokenizer, run_dir / "sft_model", progress
    )
    problems = task.problems("test", config.eval.num_problems, config.task.seed)
    options = EngineOptions(
        device=config.model.device, max_running_requests=256, max_seq_len=config.model.max_context
    )
    with Engine(model, tokenizer, options) as engine:
        report = evaluate(
            engine,
            tokenizer,
            problems,
            config.eval,
            seed=config.seed,
            system_prompt=config.model.system_prompt,
        )
    with open(run_dir / "sft_eval.jsonl", "w") as f:
        for row in report.per_problem:
            f.write(json.dumps(row) + "\n")
    summary = {
        "base_pass@1": report.pass_at_1,
        "num_problems": report.num_problems,
        "temperature": report.temperature,
        "sft_seconds": result.seconds,
        "sft_final_loss": result.final_loss,
        "model_dir": str(result.model_dir),
    }
    (run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return report.pass_at_1
