"""Resume after a crash: with η = 0 and a fixed seed, a run that crashes after a checkpoint
and is resumed ends with the same weights (bitwise), samples and logs as an uninterrupted
run; finished and missing runs are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import build_parser
from relayrl.cli import train as train_cli
from relayrl.config.loader import prepare_run_dir
from relayrl.errors import RelayError
from relayrl.models.loading import load_model
from relayrl.train.resume import begin_run, resume_config, truncate_logs
from relayrl.train.run import run_train
from relayrl.train.trainer import RLTrainer
from tests.train.conftest import parity_grader, rl_config

SAMPLE_KEYS = ("step", "prompt_id", "group_id", "sample_index", "reward", "completion_tokens")


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def sample_keys(run_dir):
    return sorted(
        tuple(r[k] for k in (*SAMPLE_KEYS, "version_min", "version_max"))
        for r in rows(run_dir / "samples.jsonl")
    )


def crash_on_call(monkeypatch, n: int) -> None:
    """Make the n-th ``train_step`` raise, as a crash of the trainer mid-run would."""
    real, calls = RLTrainer.train_step, []

    def step(self, groups):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected crash")
        return real(self, groups)

    monkeypatch.setattr(RLTrainer, "train_step", step)


def test_eta0_crash_and_resume_equals_uninterrupted(tmp_path, tiny_model_dir, monkeypatch):
    # one request at a time per server: the engine's batch composition (the one source of
    # last-bit differences in behaviour logprobs, docs/engine.md) cannot vary between runs
    common = ("rollout.eta=0", "train.total_steps=4", "rollout.max_running_requests=1")
    full = rl_config(tmp_path / "a", tiny_model_dir, *common)
    run_train(full, grader=parity_grader)

    cut = rl_config(tmp_path / "b", tiny_model_dir, *common, "train.checkpoint_every=2")
    crash_on_call(monkeypatch, 4)  # step 4 crashes; the checkpoint after step 2 survives
    with pytest.raises(RuntimeError, match="injected crash"):
        run_train(cut, grader=parity_grader)
    monkeypatch.undo()
    run_dir = tmp_path / "b" / "run"
    assert [r["step"] for r in rows(run_dir / "metrics.jsonl")] == [1, 2, 3]
    run_train(cut, grader=parity_grader, resume=True)

    a_dir = tmp_path / "a" / "run"
    assert sample_keys(run_dir) == sample_keys(a_dir)  # same prompts, tokens, rewards
    steps = [(r["step"], r.get("final", False)) for r in rows(run_dir / "metrics.jsonl")]
    assert steps == [(1, False), (2, False), (3, False), (4, False), (4, True)]
    a = load_model(a_dir / "final_model")
    b = dict(load_model(run_dir / "final_model").named_parameters())
    worst = max((p - b[n]).abs().max().item() for n, p in a.named_parameters())
    moved = max(
        (p - q).abs().max().item()
        for p, q in zip(a.parameters(), load_model(tiny_model_dir).parameters(), strict=True)
    )
    print(f"max |Δw| resumed vs uninterrupted: {worst:.3g} (training moved weights by {moved:.3g})")
    assert moved > 1e-4
    assert worst == 0.0  # bitwise


def test_resume_refuses_a_finished_run_and_a_missing_one(tmp_path, tiny_model_dir):
    with pytest.raises(RelayError, match="no config.yaml"):
        resume_config(tmp_path / "nope", [])
    config = rl_config(tmp_path, tiny_model_dir, "train.total_steps=1")
    run_dir = prepare_run_dir(config)
    moved = tmp_path / "moved"
    run_dir.rename(moved)  # a run directory can be resumed wherever it now lives
    config = resume_config(moved, ["train.total_steps=5"])
    assert Path(config.output_dir) == tmp_path and config.name == "moved"
    assert config.train.total_steps == 5 and config.rollout.n_samples == 4
    assert begin_run(moved, config, resume=True) is None  # no checkpoint yet: from step 0
    args = build_parser().parse_args(["train", "--resume", str(moved), "train.total_steps=7"])
    assert train_cli._config(args).train.total_steps == 7  # argparse took it as CONFIG
    args = build_parser().parse_args(["train", "c.yaml", "--resume", str(moved)])
    with pytest.raises(RelayError, match="pass only KEY=VALUE overrides"):
        train_cli._config(args)
    (moved / "train_summary.json").write_text("{}")
    with pytest.raises(RelayError, match="already finished"):
        begin_run(moved, config, resume=True)


def test_truncate_logs_cuts_back_to_the_checkpoint(tmp_path):
    metrics = [{"step": s} for s in range(5)] + [{"step": 4, "final": True}]
    samples = [{"step": s, "i": i} for s in range(4) for i in range(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    text = "".join(json.dumps(r) + "\n" for r in samples)
    (tmp_path / "samples.jsonl").write_text(text + '{"step": 4, "i"')  # torn by a kill
    truncate_logs(tmp_path, 2)
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert [r["step"] for r in rows(tmp_path / "samples.jsonl")] == [0, 0, 1, 1]
