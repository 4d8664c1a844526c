"""``eval.backend=servers``: the training loop's held-out evaluations generate on the run's
rollout servers (loopback built-in servers started by the run), report the trainer's
version, and give exactly what the in-process evaluation of the same weights gives (same
seed: the built-in server samples each request from its own seeded generator)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from relayrl.config.loader import load_config
from relayrl.errors import RelayError
from relayrl.eval.remote import RemoteEngine
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.tasks.registry import make_task
from relayrl.train.loop import evaluate_model
from relayrl.train.run import run_train
from relayrl.train.run.live import TIME_EVAL_PUBLISH_S
from tests.launch.test_server_restart import serve_pids
from tests.train.conftest import parity_grader, rl_config

SAMPLED_EVAL = ("eval.temperature=1.0", "eval.n_samples=2", "eval.num_problems=4")


def in_process_report(config, model_dir: Path, problems):
    """The in-process evaluation (``eval.backend=trainer``) of the weights in ``model_dir``."""
    cfg = config.eval.model_copy(update={"num_problems": len(problems)})
    model = load_model(model_dir, "cpu", "float32")
    return evaluate_model(model, load_tokenizer(model_dir), problems, cfg, config.seed)


def test_server_evaluations_are_the_trainers_weights(tmp_path, tiny_model_dir):
    """η = 0, 3 steps, an evaluation before training, after step 2 and at the end. Step 2's
    publication starts in the background just before its evaluation (which waits for it);
    the last step publishes nothing (the final evaluation publishes v3 first). Each evaluation equals,
    completion for completion, the in-process one of the same weights: the initial model, the
    step-2 checkpoint, the final model."""
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "eval.backend=servers",
        "rollout.eta=0",
        "train.eval_every=2",
        "train.eval_problems=3",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=3",
        *SAMPLED_EVAL,
    )
    result = run_train(config, grader=parity_grader)
    assert [e["eval_version"] for e in result.evals] == [0, 2, 3]
    assert [r.weight_version for r in result.eval_reports] == [0, 2, 3]
    assert all(e[TIME_EVAL_PUBLISH_S] >= 0 for e in result.evals)

    run = tmp_path / "run"
    test = make_task(config.task.name, config.task.params).problems(
        "test", config.eval.num_problems, config.task.seed
    )
    expected = [
        (tiny_model_dir, test[:3]),
        (run / "checkpoints" / "step-000002" / "model", test[:3]),
        (run / "final_model", test),
    ]
    completions = set()
    for report, (weights, problems) in zip(result.eval_reports, expected, strict=True):
        local = in_process_report(config, weights, problems)
        assert report.per_problem == local.per_problem
        assert report.pass_at_1 == local.pass_at_1
        completions |= {c for p in report.per_problem for c in p["completions"]}
    assert len(completions) > 10  # not vacuous: sampled completions differ
    initial = in_process_report(config, tiny_model_dir, test[:3])
    assert result.eval_reports[1].per_problem != initial.per_problem  # the weights moved


@pytest.mark.timeout(150)
# the disk transport's restart is the plain path (a benchmark, for the suite's time); the
# broadcast one also needs the restart snapshot written at the evaluated version
@pytest.mark.parametrize(
    "transport", [pytest.param("disk", marks=pytest.mark.benchmark), "broadcast"]
)
def test_server_killed_during_the_evaluation_is_restarted(
    transport, tmp_path, tiny_model_dir, monkeypatch
):
    """The final evaluation's server is killed (-9) once the evaluation has read its version:
    the evaluation's requests fail over through the supervisor (its lock is not held by the
    evaluation, so no deadlock), the restarted server loads the trainer's version from disk,
    and the evaluation finishes on it. pytest-timeout ends a deadlock.

    Broadcast, a disk snapshot every 10 publications: v1 went to disk, v2 (published by the
    final evaluation) was broadcast only, so the evaluation wrote v2 to disk as the restart
    source; the replacement loads it and needs no catch-up broadcast (which would form a
    second transfer group)."""
    config = rl_config(
        tmp_path,
        tiny_model_dir,
        "eval.backend=servers",
        "rollout.server_mode=process",
        "rollout.max_server_restarts=1",
        "train.total_steps=2",
        "train.save_final=false",
        f"train.weight_transport={transport}",
        "train.broadcast_snapshot_every=10",
        *SAMPLED_EVAL,
    )
    killed: list[int] = []
    sharing = RemoteEngine.sharing.__func__

    def sharing_then_kill(cls, client, loop):
        engine = sharing(cls, client, loop)
        (server,) = serve_pids()
        os.kill(server, signal.SIGKILL)
        killed.append(server)
        return engine

    monkeypatch.setattr(RemoteEngine, "sharing", classmethod(sharing_then_kill))
    result = run_train(config, grader=parity_grader)
    assert len(killed) == 1
    (final,) = result.evals
    assert final["eval_version"] == result.eval_reports[0].weight_version == 2
    assert final["eval_problems"] == 4
    # the only server was dead when the evaluation sent its requests: they were served by
    # its replacement, reached through the supervisor's failover
    assert result.summary["server_restarts"] == 1.0
    assert result.summary["server_failovers"] >= 1.0
    if transport == "broadcast":
        assert result.summary["disk_snapshots"] == 1.0  # v1 only: v2 was broadcast only
        assert result.summary["transfer_groups"] == 1.0  # no catch-up broadcast


def test_default_backend_evaluates_in_process(tmp_path, tiny_model_dir):
    """The default stays the in-process evaluation: no publication for it (no
    ``time_eval_publish_s``), the trainer's version in the row."""
    config = rl_config(tmp_path, tiny_model_dir, "train.total_steps=1")
    assert config.eval.backend == "trainer"
    result = run_train(config, grader=parity_grader)
    assert [e["eval_version"] for e in result.evals] == [1]
    assert TIME_EVAL_PUBLISH_S not in result.evals[0]


def test_bad_backend_is_a_clear_error():
    with pytest.raises(RelayError) as bad:
        load_config(None, ["eval.backend=gpu"])
    assert str(bad.value) == (
        "override 'eval.backend': config key 'eval.backend' = 'gpu' is invalid: Input should "
        "be 'trainer' or 'servers' (expected one of 'trainer', 'servers')"
    )
    with pytest.raises(
        RelayError,
        match=r"eval.backend=servers evaluates on the rollout servers; "
        r"rollout.lag=fixed starts none",
    ):
        load_config(None, ["eval.backend=servers", "rollout.lag=fixed", "rollout.eta=1"])
