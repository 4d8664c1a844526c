"""Every metrics row with a held-out pass@1 carries its wall-clock time, so the report's
wall-clock chart shows pass@1 as its step chart does (issue 44: the step-0 and final
evaluations' rows had no ``elapsed_s``, so a run evaluating only at its end showed none)."""

from __future__ import annotations

from relayrl.metric_names import ELAPSED_S, EVAL_PASS_AT_1, STEP
from relayrl.report.logs import load_run
from relayrl.train.run import run_train
from tests.train.conftest import parity_grader, rl_config


def test_every_evaluation_row_has_its_elapsed_time(tmp_path, tiny_model_dir):
    config = rl_config(
        tmp_path, tiny_model_dir, "rollout.lag=fixed", "train.total_steps=2", "train.eval_every=1"
    )
    run_train(config, grader=parity_grader)
    logs = load_run(tmp_path / "run")
    evals = [row for row in logs.metrics if EVAL_PASS_AT_1 in row]
    assert [row[STEP] for row in evals] == [0, 1, 2]  # step 0, periodic, final
    times = [row.get(ELAPSED_S) for row in evals]
    assert None not in times and times == sorted(times), times
    by_time, _ = logs.series(EVAL_PASS_AT_1, ELAPSED_S)
    by_step, _ = logs.series(EVAL_PASS_AT_1, STEP)
    assert len(by_time) == len(by_step) == 3
