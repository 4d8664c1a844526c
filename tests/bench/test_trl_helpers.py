"""Pure helpers of ``relayrl bench trl`` (no TRL needed): the eval-free clock of relayrl's
metrics rows, time to target, the ratio's bound, the workloads' settings, argument checks,
the common target rule, the mean ± std over seeds and the written outputs."""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.bench.trl import (
    LONGTAIL,
    SideResult,
    choose_target,
    late_reward_by_side,
    parse_sides,
    relayrl_curve,
    settings_from_args,
    side_summaries,
    write_outputs,
)
from relayrl.bench.trl_target import compare, fixed_target
from relayrl.errors import RelayError
from tests.bench._settings import TINY


def _args(**kw) -> argparse.Namespace:
    base = {"quick": False, "steps": None, "eval_every": None, "eval_problems": None}
    return argparse.Namespace(**{**base, "target": None, "workload": "demo", **kw})


def test_relayrl_curve_subtracts_every_evaluation_so_far():
    rows = [
        {"step": 0, "eval_pass@1": 0.5, "time_eval_s": 2.0},
        {"step": 1, "elapsed_s": 5.0},
        {"step": 2, "elapsed_s": 10.0, "eval_pass@1": 0.7, "time_eval_s": 3.0},
        {"step": 3, "elapsed_s": 13.0},
        {"step": 3, "final": True, "eval_pass@1": 0.9, "time_eval_s": 4.0},
    ]
    r = relayrl_curve("relayrl_async", rows, samples_per_step=128)
    # step 2's elapsed (10) includes the step-0 and step-2 evaluations (2 + 3)
    assert r.curve == [(0, 0.0, 0.5), (2, 5.0, 0.7), (3, 8.0, 0.9)]
    assert r.train_seconds == 8.0 and r.samples == 3 * 128
    assert r.time_to_target(0.7) == (5.0, True)
    assert r.time_to_target(0.95) == (8.0, False)


def test_training_reward_per_step_and_its_second_half():
    rows = [
        {"step": 0, "eval_pass@1": 0.5, "time_eval_s": 2.0},
        *({"step": k, "elapsed_s": 5.0 * k, "reward_mean": 0.1 * k} for k in range(1, 5)),
        {"step": 4, "final": True, "eval_pass@1": 0.9, "time_eval_s": 4.0},
    ]
    r = relayrl_curve("relayrl_async", rows, samples_per_step=8)
    assert r.train_reward == [(1, 0.1), (2, 0.2), (3, 0.1 * 3), (4, 0.4)]
    # steps 3 and 4 are the second half of 4 steps
    assert r.late_train_reward() == pytest.approx(0.35)
    assert SideResult("trl", [(0, 0.0, 0.2)], 1.0, 8).late_train_reward() is None
    other = SideResult("relayrl_async", [], 1.0, 8, seed=1, train_reward=[(1, 0.0), (2, 0.25)])
    no_rewards = SideResult("trl", [], 1.0, 8)
    late = late_reward_by_side([r, other, no_rewards])
    assert late.keys() == {"relayrl_async"}  # trl recorded none
    assert late["relayrl_async"]["mean"] == pytest.approx((0.35 + 0.25) / 2)
    assert late["relayrl_async"]["std"] == pytest.approx(0.1 / 2**0.5)


def test_compare_marks_lower_bounds():
    assert compare((30.0, True), (10.0, True)) == (3.0, "", "")
    assert compare((30.0, False), (10.0, True))[:2] == (3.0, ">")
    assert compare((30.0, True), (10.0, False))[:2] == (3.0, "<")
    assert compare((30.0, False), (10.0, False))[1] == "?"


def test_settings_quick_and_overrides():
    s = settings_from_args(_args(quick=True))
    assert s.steps <= 5 and s.eval_problems <= 32
    s = settings_from_args(_args(steps=7, target=0.6))
    assert (s.steps, s.target, s.prompts_per_step, s.n_samples) == (7, 0.6, 16, 8)
    with pytest.raises(RelayError, match="--target"):
        settings_from_args(_args(target=1.5))
    with pytest.raises(RelayError, match="--steps"):
        settings_from_args(_args(steps=0))


def test_parse_sides():
    assert parse_sides("trl, relayrl_async") == ["trl", "relayrl_async"]
    with pytest.raises(RelayError, match="unknown"):
        parse_sides("trl,verl")


def test_write_outputs(tmp_path):
    s = replace(TINY, target=0.5)
    results = [
        SideResult("relayrl_async", [(0, 0.0, 0.25), (2, 1.0, 0.75)], 1.0, 8, 100.0, seed=0),
        SideResult("trl", [(0, 0.0, 0.25), (2, 3.0, 0.5)], 3.0, 8, 80.0, seed=0),
        SideResult("relayrl_async", [(0, 0.0, 0.25), (2, 2.0, 0.5)], 2.0, 8, 100.0, seed=1),
        SideResult("trl", [(0, 0.0, 0.25), (2, 4.0, 0.25)], 4.0, 8, 80.0, seed=1),
    ]
    target = fixed_target(0.5)
    summaries = side_summaries(results, target.value, ["relayrl_async", "trl"])
    png = write_outputs(results, s, target, summaries, tmp_path, {"model": "m"})
    assert png.is_file() and png.stat().st_size > 1000
    rows = list(csv.DictReader((tmp_path / "trl_bench.csv").open()))
    assert [(r["side"], r["seed"]) for r in rows] == [
        *[("relayrl_async", "0")] * 2,
        *[("trl", "0")] * 2,
        *[("relayrl_async", "1")] * 2,
        *[("trl", "1")] * 2,
    ]
    doc = json.loads((tmp_path / "trl_bench.json").read_text())
    assert doc["target"]["value"] == 0.5
    assert [(r["side"], r["seed"], r["time_to_target_s"]) for r in doc["runs"]] == [
        ("relayrl_async", 0, 1.0),
        ("trl", 0, 3.0),
        ("relayrl_async", 1, 2.0),
        ("trl", 1, 4.0),  # never reached 0.5: its total time, flagged below
    ]
    assert doc["runs"][0]["samples_per_s"] == 8.0
    trl = doc["sides"]["trl"]
    assert trl["time_to_target"]["mean"] == 3.5 and trl["reached_all"] is False
    assert doc["sides"]["relayrl_async"]["seeds"] == [0, 1]


def test_base_model_evaluation_does_not_count():
    r = SideResult("trl", [(0, 0.0, 0.9), (5, 2.0, 0.85), (10, 4.0, 0.95)], 4.0, 10)
    assert r.time_to_target(0.9) == (4.0, True)


# --------------------------------------------------------------------------- workloads


def _longtail_params() -> dict:
    from relayrl.bench.trl import run_config

    return run_config(LONGTAIL.full, Path("/nonexistent"), None).task.params


def test_longtail_workload_settings(tmp_path):
    from relayrl.bench.trl import run_config

    s = settings_from_args(_args(workload="longtail"))
    assert s == LONGTAIL.full and s.workload == "longtail" and s.target is None
    assert (s.prompts_per_step, s.n_samples, s.max_new_tokens, s.eval_max_new_tokens) == (
        8,
        8,
        512,
        512,
    )
    config = run_config(s, tmp_path, None, "relayrl_sync")
    assert config.task.params == {
        "min_steps": 2,
        "max_steps": 24,
        "tail": 0.85,
        "max_value": 20,
        "max_operand": 3,
    }
    assert (config.model.preset, config.model.max_context) == ("tiny", 768)
    assert (config.rollout.max_new_tokens, config.eval.max_new_tokens) == (512, 512)
    assert (config.rollout.eta, config.name, config.algo.dynamic_sampling) == (
        0,
        "relayrl_sync_seed0",
        False,
    )
    quick = settings_from_args(_args(workload="longtail", quick=True))
    assert quick.steps <= 5 and quick.eval_problems <= 32 and quick.workload == "longtail"


def test_smollm2_workload_is_the_recipe_with_the_benchmarks_budget(
    tmp_path, tiny_model_dir, monkeypatch
):
    from relayrl.bench.trl import SMOLLM2, run_config

    # the recipe's precision is auto: bf16 on a CPU with fast bf16 (as here), else float32
    monkeypatch.setattr("relayrl.config.schema.bf16_is_fast", lambda device: True)
    s = settings_from_args(_args(workload="smollm2"))
    assert s == SMOLLM2.full and s.config_file == "configs/smollm2.yaml"
    config = run_config(s, tmp_path, tiny_model_dir, "relayrl_async")
    # the recipe's task, optimizer and precision (configs/smollm2.yaml) ...
    assert config.task.name == "reasoning_gym" and config.task.params["dataset"] == "chain_sum"
    assert config.task.params["extract"] == ["tag", "hash", "last_number"]
    assert (config.rollout.dtype, config.train.mixed_precision) == ("bfloat16", "bf16")
    # ... and optimizer (lr 2e-5, cosine over the benchmark's steps) ...
    assert (config.optim.lr, config.optim.schedule, config.optim.warmup_steps) == (
        2e-5,
        "cosine",
        2,
    )
    # ... with the benchmark's budget, its model and one evaluator for every side
    assert (config.train.total_steps, config.rollout.max_new_tokens) == (20, 40)
    assert config.model.path == str(tiny_model_dir) and config.eval.backend == "trainer"
    assert config.algo.dynamic_sampling is False


def test_eta_sets_the_async_side_only(tmp_path):
    from relayrl.bench.trl import run_config
    from relayrl.config.schema import RolloutConfig

    s = settings_from_args(_args(eta="2"))
    assert run_config(s, tmp_path, None, "relayrl_async").rollout.eta == 2
    assert run_config(s, tmp_path, None, "relayrl_sync").rollout.eta == 0
    auto = settings_from_args(_args(eta="auto"))
    assert run_config(auto, tmp_path, None, "relayrl_async").rollout.eta == "auto"
    assert run_config(auto, tmp_path, None, "relayrl_sync").rollout.eta == 0
    # no --eta: the async side runs at relayrl's own default, whatever it is
    default = settings_from_args(_args())
    config = run_config(default, tmp_path, None, "relayrl_async")
    assert config.rollout.eta == RolloutConfig().eta
    with pytest.raises(RelayError, match="--eta must be ≥ 1"):
        settings_from_args(_args(eta="0"))
    with pytest.raises(RelayError, match="integer ≥ 1 or auto"):
        settings_from_args(_args(eta="fast"))


def test_user_overrides_reach_every_relayrl_side_after_the_workload_settings(tmp_path):
    from relayrl.bench.trl import run_config
    from relayrl.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "trl", "--workload", "longtail", "algo.loss=ppo", "task.params.max_steps=12"]
    )
    s = settings_from_args(args)
    assert s.user_overrides == ("algo.loss=ppo", "task.params.max_steps=12")
    for side in ("relayrl_async", "relayrl_sync"):
        config = run_config(s, tmp_path, None, side)
        assert config.algo.loss == "ppo"
        assert config.task.params["max_steps"] == 12  # after the workload's 24
        assert config.task.params["tail"] == 0.85  # the workload's own, kept
    # the SFT base's settings come last, and an override of the algorithm leaves them alone
    sft = run_config(s, tmp_path, None, extra=("sft.steps=7",))
    assert sft.sft.steps == 7 and sft.algo.loss == "ppo"
    assert settings_from_args(build_parser().parse_args(["bench", "trl"])).user_overrides == ()


def test_longtail_chain_lengths_have_a_long_tail():
    """2 + Geometric(0.85) steps: P(steps ≥ 2 + k) = 0.85^k, so the median is 6
    (0.85^4 = 0.52 ≥ 0.5 > 0.85^5 = 0.44) and p90 is 16 (0.85^14 = 0.10); capped at 24."""
    import statistics

    from relayrl.tasks.registry import make_task

    task = make_task("arithmetic", _longtail_params())
    steps = sorted(len(p.meta["ops"]) for p in task.problems("train", 4000, 0))
    assert abs(statistics.median(steps) - 6) <= 1
    assert abs(steps[int(0.9 * len(steps))] - 16) <= 1
    assert steps[-1] == 24 and steps[0] == 2  # 0.85^22 = 2.8 %: the cap is reached


def test_longtail_prompts_fit_the_context():
    from relayrl.bench.trl import check_prompts_fit
    from relayrl.models.build import task_corpus
    from relayrl.models.tokenizer import train_tokenizer
    from relayrl.tasks.registry import make_task

    task = make_task("arithmetic", _longtail_params())
    tokenizer = train_tokenizer(task_corpus(task, 200, 0), vocab_size=384)
    problems = task.problems("train", 1000, 0)
    check_prompts_fit(tokenizer, problems, 768, 512)
    with pytest.raises(RelayError, match="model.max_context 600 is too small"):
        check_prompts_fit(tokenizer, problems, 600, 512)


def test_sft_fingerprint_follows_task_not_run_name(tmp_path):
    from relayrl.bench.trl import DEMO, run_config, sft_fingerprint

    demo = run_config(DEMO.full, tmp_path, None, "sft")
    assert sft_fingerprint(demo) == sft_fingerprint(run_config(DEMO.full, tmp_path / "x", None))
    assert sft_fingerprint(demo) != sft_fingerprint(run_config(LONGTAIL.full, tmp_path, None))


# --------------------------------------------------------------------------- target and seeds

RUN_A = [(0, 0.0, 0.30), (5, 10.0, 0.50), (10, 20.0, 0.70)]
RUN_B = [(0, 0.0, 0.34), (5, 12.0, 0.40), (10, 25.0, 0.60)]
RUN_C = [(0, 0.0, 0.32), (5, 8.0, 0.55), (10, 16.0, 0.52)]


def test_common_target_is_reached_by_every_run():
    from relayrl.bench.trl_target import common_target, time_to_target

    # base = (0.30 + 0.34 + 0.32) / 3 = 0.32; bests 0.70, 0.60, 0.55 -> worst best 0.55
    t = common_target([RUN_A, RUN_B, RUN_C], 0.8)
    assert t.base == pytest.approx(0.32) and t.worst_best == 0.55 and t.improved
    assert t.value == pytest.approx(0.32 + 0.8 * 0.23)  # 0.504
    times = [time_to_target(c, 99.0, t.value) for c in (RUN_A, RUN_B, RUN_C)]
    assert times == [(20.0, True), (25.0, True), (8.0, True)]  # A's 0.50 < 0.504
    full = common_target([RUN_A, RUN_B, RUN_C], 1.0)
    assert full.value == 0.55
    assert [time_to_target(c, 99.0, full.value) for c in (RUN_A, RUN_B, RUN_C)] == [
        (20.0, True),
        (25.0, True),
        (8.0, True),
    ]


def test_common_target_when_a_run_never_beats_the_base():
    from relayrl.bench.trl_target import common_target, time_to_target

    stuck = [(0, 0.0, 0.32), (5, 9.0, 0.25), (10, 18.0, 0.20)]
    t = common_target([RUN_A, stuck], 0.8)
    # base 0.31 > worst best 0.25: the target falls to 0.25 so that it is still reached
    assert t.value == 0.25 and not t.improved
    assert time_to_target(stuck, 18.0, t.value) == (9.0, True)
    assert time_to_target(RUN_A, 20.0, t.value) == (10.0, True)


def test_common_target_rejects_bad_input():
    from relayrl.bench.trl_target import common_target

    with pytest.raises(RelayError, match="--target-fraction"):
        common_target([RUN_A], 0.0)
    with pytest.raises(RelayError, match="--target-fraction"):
        common_target([RUN_A], 1.5)
    with pytest.raises(RelayError, match="run 1 has no held-out evaluation after step 0"):
        common_target([RUN_A, [(0, 0.0, 0.3)]], 0.8)


def test_mean_and_std_over_seeds_and_ratio_of_means():
    from relayrl.bench.trl_target import ratio_of_means

    # async reaches 0.55 at 10, 12, 14 s; TRL at 30, 36, 42 s (mean 36, sample std 6)
    results = [
        SideResult("relayrl_async", [(0, 0.0, 0.3), (5, t, 0.6)], 2 * t, 1280, seed=i)
        for i, t in enumerate((10.0, 12.0, 14.0))
    ] + [
        SideResult("trl", [(0, 0.0, 0.3), (5, t, 0.6)], 2 * t, 1280, seed=i)
        for i, t in enumerate((30.0, 36.0, 42.0))
    ]
    summaries = side_summaries(results, 0.55, ["relayrl_async", "trl"])
    a, trl = summaries["relayrl_async"], summaries["trl"]
    assert (a.time_to_target.mean, a.time_to_target.std, a.seeds) == (12.0, 2.0, (0, 1, 2))
    assert (trl.time_to_target.mean, trl.time_to_target.std) == (36.0, 6.0)
    # samples/s = 1280 / (2 t): 64, 53.33, 45.71 for async
    assert a.samples_per_s.mean == pytest.approx((64 + 1280 / 24 + 1280 / 28) / 3)
    assert str(trl.time_to_target) == "36.0 ± 6.0"
    assert ratio_of_means(trl, a) == (3.0, "", "")  # 36 / 12, not a mean of ratios
    # a fixed target one TRL seed misses: its total time enters the mean, a lower bound
    summaries = side_summaries(results, 0.65, ["relayrl_async", "trl"])
    assert summaries["trl"].time_to_target.mean == 72.0 and not summaries["trl"].reached_all
    assert ratio_of_means(summaries["trl"], summaries["relayrl_async"])[1] == "?"


def test_one_seed_has_zero_spread_and_choose_target():
    from relayrl.bench.trl_target import spread

    assert (spread([5.0]).mean, spread([5.0]).std) == (5.0, 0.0)
    results = [SideResult("trl", RUN_A, 20.0, 10), SideResult("relayrl_async", RUN_C, 16.0, 10)]
    s = settings_from_args(_args())
    assert choose_target(results, s).value == pytest.approx(0.31 + 0.8 * (0.55 - 0.31))
    assert choose_target(results, replace(s, target=0.6)).value == 0.6


def test_percentiles_nearest_rank():
    from relayrl.bench.trl_target import percentiles

    assert percentiles([10, 1, 9, 2, 8, 3, 7, 4, 6, 5]) == {"p50": 5, "p90": 9, "max": 10}
    assert percentiles([7]) == {"p50": 7, "p90": 7, "max": 7}
    # 20 lengths: p90 is the 18th smallest
    assert percentiles(list(range(1, 21))) == {"p50": 10, "p90": 18, "max": 20}


def test_crossing_midpoint_halves_the_evaluation_grid():
    from relayrl.bench.trl import SideResult, midpoint_means
    from relayrl.bench.trl_target import crossing_midpoint

    curve = [(0, 0.0, 0.4), (5, 10.0, 0.5), (10, 20.0, 0.62), (15, 30.0, 0.7)]
    assert crossing_midpoint(curve, 0.6) == 15.0  # crossed between 10 s and 20 s
    assert crossing_midpoint(curve, 0.45) == 5.0  # between the base (0 s) and 10 s
    assert crossing_midpoint(curve, 0.8) is None
    runs = [
        SideResult("trl", curve, 30.0, 960, seed=0),
        SideResult("trl", [(0, 0.0, 0.4), (5, 4.0, 0.61)], 4.0, 320, seed=1),
    ]
    assert midpoint_means(runs, 0.6) == {"trl": (15.0 + 2.0) / 2}
    assert midpoint_means(runs, 0.65) == {}  # seed 1 never reached it


def test_a_target_within_the_bases_noise_is_flagged():
    from relayrl.bench.trl_target import common_target

    # relayrl's runs in the smollm2 bench of 2026-12-07 (TRL's step-0 evaluations are the
    # same; seed 2 never passed 0.05): base 0.038 on 200 problems, standard error
    # sqrt(0.0383 * 0.9617 / 200) = 0.01358
    runs = [
        [(0, 0.0, 0.025), (10, 241.2, 0.090), (20, 449.6, 0.095)],
        [(0, 0.0, 0.050), (10, 199.7, 0.050), (20, 385.7, 0.120)],
        [(0, 0.0, 0.040), (10, 202.1, 0.050), (20, 400.5, 0.035)],
    ]
    noisy = common_target(runs, 0.8, problems=200)
    assert noisy.base == pytest.approx(0.115 / 3)  # 0.0383
    assert noisy.base_stderr == pytest.approx(0.013576, abs=1e-6)
    assert noisy.improved and noisy.within_noise  # 0.050 - 0.0383 = 0.0117 <= 0.0136: flagged
    # the same curves on 2000 problems: a standard error of 0.0043, so a real improvement
    assert not common_target(runs, 0.8, problems=2000).within_noise
    # without the number of problems (a fixed rule or older callers) nothing is flagged
    assert not common_target(runs, 0.8).within_noise


def _sleep_forever(ignore_sigterm: bool, ready) -> None:
    import signal
    import time

    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(0.05)


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_an_interrupted_bench_leaves_no_side_running(ignore_sigterm, capsys):
    import multiprocessing
    import signal
    import time

    from relayrl.bench.trl import stop_process

    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    proc = context.Process(target=_sleep_forever, args=(ignore_sigterm, ready), name="bench-side")
    proc.start()
    assert ready.wait(60), "the child never started"
    t0 = time.perf_counter()
    stop_process(proc, grace_s=1.0)
    assert not proc.is_alive()
    if ignore_sigterm:  # killed once the grace ran out, and said so
        assert proc.exitcode == -signal.SIGKILL
        assert "error: bench-side did not stop within 1 s of SIGTERM" in capsys.readouterr().out
    else:
        assert proc.exitcode == -signal.SIGTERM and time.perf_counter() - t0 < 1.0
    stop_process(proc, grace_s=1.0)  # a process that has exited: nothing to do
