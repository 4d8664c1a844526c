"""The data-parallel trainer (``train.world_size`` > 1, FSDP2 on gloo, real processes, one
thread per rank): the same update as world size 1 on the same batches, checkpoints that
resume at another world size, a killed rank named, bad input as one error.

Tolerances, measured on fixed batches of 3 steps (tests/train/dp_harness.py, AdamW lr 1e-3,
5 micro-batches at world size 1, 3 per rank at 2): the gradient norms of world sizes 1 and 2
agree to 6e-7 relative, the weights to 4.6e-6 absolute (float32 sums taken in another order:
the micro-batches and the cross-rank reduction group the tokens differently; AdamW divides
tiny gradient differences by tiny second moments, hence weights looser than gradients). The
bounds below are ~10x those. Averaging instead of summing the ranks' gradients (FSDP2's
default, or pytorch#162338's sum where a mean is meant, with another normaliser) halves or
doubles the gradient: AdamW's and clipping's scale invariance hide that in the weights, so
the test compares gradient norms, which it fails by a factor of 2.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relayrl.algo.microbatch import rank_micro_batches, split_over_ranks
from relayrl.cli import main
from relayrl.errors import RelayError
from relayrl.train.run import run_train
from tests.train.conftest import rl_config

GRAD_RTOL = 1e-5
WEIGHT_ATOL = 5e-5
STEPS = 3
ROOT = Path(__file__).resolve().parents[2]


def harness(tmp: Path, name: str, world_size: int, **spec) -> subprocess.Popen:
    spec = {
        "run_dir": str(tmp / name),
        "world_size": world_size,
        "steps": STEPS,
        "out": str(tmp / f"{name}.pt"),
        **spec,
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.train.dp_harness", str(path)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_harness(tmp: Path, name: str, world_size: int, **spec) -> dict:
    proc = harness(tmp, name, world_size, **spec)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return torch.load(tmp / f"{name}.pt")


def assert_same_update(a: dict, b: dict, steps: slice = slice(None)) -> None:
    assert a["version"] == b["version"]
    for sa, sb in zip(a["stats"][steps], b["stats"], strict=True):
        assert sa["train_tokens"] == sb["train_tokens"]
        assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=GRAD_RTOL)
    assert a["weights"].keys() == b["weights"].keys()
    for key, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][key], w, atol=WEIGHT_ATOL, rtol=0)


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model_dir) -> tuple[Path, dict]:
    """The uninterrupted world-size-1 run (the plain RLTrainer in one process)."""
    tmp = tmp_path_factory.mktemp("dp")
    return tmp, run_harness(tmp, "single", 1, model_dir=str(tiny_model_dir))


# --------------------------------------------------------------------------- the split
def test_split_over_ranks_balances_tokens_longest_first():
    # 9 → r0; 7 → r1; 5 → r1 (7 < 9); 4 → r0 (9 < 12); 1 → r1 (12 < 13): 13 tokens each
    assert split_over_ranks([5, 9, 1, 7, 4], 2) == [[1, 4], [0, 2, 3]]
    assert split_over_ranks([3, 3], 4) == [[0], [1], [], []]
    plans = rank_micro_batches([5, 9, 1, 7, 4], 2, max_tokens=10)
    # per rank, padded cost rows × longest ≤ 10: r0 9 | 4 (2 × 9 > 10); r1 7 | 5, 1 (2 × 5)
    assert plans == [[[1], [4]], [[3], [0, 2]]]
    assert sorted(i for p in plans for b in p for i in b) == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- equivalence
# 20 s; the D-ARL test below asserts the same update of world sizes 1 and 2 on a harder
# case, and the resume at world size 2 below continues the plain run: `pytest -m benchmark`
@pytest.mark.benchmark
def test_world_size_2_gives_the_update_of_world_size_1(single, tiny_model_dir):
    tmp, one = single
    two = run_harness(tmp, "two", 2, model_dir=str(tiny_model_dir))
    assert [s["micro_batches"] for s in two["stats"]] != [s["micro_batches"] for s in one["stats"]]
    assert_same_update(one, two)
    assert all(s["grad_norm"] > 0 for s in two["stats"])
    log = (tmp / "two" / "trainer-rank1.log").read_text()
    assert "trainer rank 1/2 ready (gloo" in log


DARL = ["replay.enable=true", "replay.warmup=0", "algo.kl_coef=0.01", "optim.ppo_minibatches=2"]


def test_world_size_2_matches_1_with_darl_replay_kl_and_minibatches(tmp_path, tiny_model_dir):
    """D-ARL replay (selection over all-gathered π_prox), the KL reference and two PPO
    mini-batches per step: the same selections and update (measured: 1.8e-5 on weights
    after 4 steps = 8 AdamW steps, gradient norms 6e-7 relative)."""
    spec = {"model_dir": str(tiny_model_dir), "steps": 4, "overrides": DARL}
    one = run_harness(tmp_path, "darl1", 1, **spec)
    two = run_harness(tmp_path, "darl2", 2, **spec)
    assert [s["micro_batches"] for s in two["stats"]] != [s["micro_batches"] for s in one["stats"]]
    assert_same_update(one, two)
    replayed = [s["replay_replayed"] for s in two["stats"]]
    assert replayed == [s["replay_replayed"] for s in one["stats"]] and sum(replayed) > 0
    assert all(s["optimizer_steps"] == 2 and s["kl_ref"] > 0 for s in two["stats"][1:])
    log = (tmp_path / "darl2" / "trainer-rank1.log").read_text()
    assert "trainer rank 1/2 ready (gloo" in log


# 2 -> 1 goes through the same DCP resharding as 1 -> 2 (a benchmark, for the suite's time)
@pytest.mark.parametrize(
    ("saved", "resumed"), [pytest.param(2, 1, marks=pytest.mark.benchmark), (1, 2)]
)
def test_resume_at_another_world_size_matches_the_uninterrupted_run(
    single, tiny_model_dir, saved, resumed
):
    tmp, one = single
    name = f"ckpt{saved}{resumed}"
    run_harness(tmp, name, saved, model_dir=str(tiny_model_dir), checkpoint_after=2)
    ckpt = tmp / name / "checkpoints" / "step-000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    if saved == 2:  # every rank's shard is listed (and checksummed) by rank 0's manifest
        assert {"shards/.metadata.json", "shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(
            manifest
        )
    else:
        assert not any(f.startswith("shards/") for f in manifest)
    cont = run_harness(tmp, name, resumed, model_dir=str(tiny_model_dir), resume=True)
    assert_same_update(one, cont, steps=slice(2, None))


# --------------------------------------------------------------------------- failures
# 11 s; test_relayrl_train_with_a_killed_rank_resumes_without_loss asserts the same error line
# through the CLI (and the resume after it): `pytest -m benchmark` runs this one
@pytest.mark.benchmark
def test_a_killed_rank_stops_the_job_naming_it(tmp_path, tiny_model_dir):
    proc = harness(tmp_path, "kill", 2, model_dir=str(tiny_model_dir), steps=100000)
    log = tmp_path / "kill" / "trainer-rank1.log"
    deadline = time.monotonic() + 120
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.1)
    pid = int(log.read_text().split("pid ")[1].split(")")[0])
    time.sleep(1.0)  # a few steps in
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert f"trainer rank 1 (pid {pid}) died (killed by SIGKILL)" in err


def test_world_size_beyond_the_cores_is_one_error(tmp_path, tiny_model_dir):
    with pytest.raises(RelayError, match=r"train.world_size=4096 × train.trainer_threads=1"):
        run_train(rl_config(tmp_path, tiny_model_dir, "train.world_size=4096"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_nccl_without_cuda_is_one_error(tmp_path, tiny_model_dir):
    config = rl_config(tmp_path, tiny_model_dir, "train.world_size=2", "train.backend=nccl")
    with pytest.raises(RelayError, match="train.backend=nccl needs CUDA"):
        run_train(config)


def test_master_port_in_use_is_one_error(tmp_path, tiny_model_dir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = rl_config(
            tmp_path, tiny_model_dir, "train.world_size=2", f"train.master_port={port}"
        )
        with pytest.raises(RelayError, match=f"train.master_port={port} is in use"):
            run_train(config)


def test_unknown_backend_is_one_error_line(capsys):
    assert main(["train", str(ROOT / "configs" / "async.yaml"), "train.backend=mpi"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "train.backend" in err[0]


def cli_overrides(tmp_path: Path, model_dir: Path, steps: int) -> list[str]:
    return [
        f"output_dir={tmp_path}",
        "name=run",
        f"model.path={model_dir}",
        "model.max_context=128",
        "rollout.prompts_per_step=2",
        "rollout.n_samples=2",
        "rollout.max_new_tokens=16",
        "rollout.server_mode=thread",
        "algo.dynamic_sampling=false",
        f"train.total_steps={steps}",
        "train.eval_every=0",
        "train.progress=false",
        "train.checkpoint_every=1",
        "eval.num_problems=4",
        "eval.max_new_tokens=16",
        "train.trainer_threads=1",
        "runtime.threads=1",
    ]


CLI = [sys.executable, "-m", "relayrl.cli", "train"]


def wait_for_checkpoint(run: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while not (run / "checkpoints" / f"step-{step:06d}").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)


def worker_pid(run: Path) -> int:
    return int((run / "trainer-rank1.log").read_text().split("pid ")[1].split(")")[0])


def test_relayrl_train_with_a_killed_rank_resumes_without_loss(tmp_path, tiny_model_dir):
    """`relayrl train` at world size 2: SIGKILL rank 1 after a checkpoint → one error line
    naming it; `--resume` (at world size 1: re-sharding) trains every group exactly once."""
    run, steps = tmp_path / "run", 5
    overrides = cli_overrides(tmp_path, tiny_model_dir, steps)
    cli = CLI
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    config = str(ROOT / "configs" / "async.yaml")
    proc = subprocess.Popen(
        [*cli, config, *overrides, "train.world_size=2"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(run, 2, proc)
    pid = worker_pid(run)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, err[-2000:]
    assert f"error: trainer rank 1 (pid {pid}) died (killed by SIGKILL)" in errors[0]
    assert f"--resume {run}" in errors[0]
    resumed = subprocess.run(
        [*cli, "--resume", str(run), "train.world_size=1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if not r.get("final")] == list(range(1, steps + 1))
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    keys = [(r["group_id"], r["sample_index"]) for r in samples]
    assert len(keys) == len(set(keys)) == steps * 2 * 2  # every sample once, none lost
    assert [r["step"] for r in samples] == sorted(r["step"] for r in samples)


def test_ctrl_c_to_the_process_group_checkpoints_with_every_rank(tmp_path, tiny_model_dir):
    """SIGINT to rank 0 and its worker at once (a terminal's Ctrl-C): the worker leaves the
    stop to rank 0, which finishes the step and writes a sharded checkpoint; exit 130."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [*CLI, str(ROOT / "configs" / "async.yaml"), *cli_overrides(tmp_path, tiny_model_dir, 400)]
        + ["train.world_size=2", "train.checkpoint_every=2"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for_checkpoint(run, 2, proc)
    pid = worker_pid(run)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    stopped = int(out.split("stopped after step ")[1].split(";")[0])
    ckpt = run / "checkpoints" / f"step-{stopped:06d}"
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(manifest)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()
