"""``relayrl bench demo``: argument parsing and the per-seed summary from known results."""

from __future__ import annotations

import pytest

from relayrl.bench.demo import SeedResult, parse_seeds, seed_line, seed_overrides, summary_lines
from relayrl.cli import build_parser
from relayrl.errors import RelayError


def _result(seed: int, base: float, final: float, wall: float) -> SeedResult:
    return SeedResult(
        seed,
        base,
        final,
        sft_seconds=200.0,
        wall_seconds=wall,
        staleness_mean=1.5,
        rl_seconds=wall - 230.0,
        eval_seconds=6.0,
    )


def test_seeds_parse_from_the_command_line(tmp_path):
    args = build_parser().parse_args(["bench", "demo", "--quick", "--seeds", "3,0,7", "a.b=1"])
    assert parse_seeds(args.seeds) == [3, 0, 7] and args.quick and args.overrides == ["a.b=1"]
    assert parse_seeds(build_parser().parse_args(["bench", "demo"]).seeds) == [0, 1, 2]
    got = seed_overrides(args, 7, tmp_path)
    assert got[:3] == ["seed=7", f"output_dir={tmp_path}", "name=demo-seed7"]
    assert got[-1] == "a.b=1"  # the user's overrides come last, after the quick budget
    assert "train.total_steps=2" in got


@pytest.mark.parametrize("bad", ["", "0,x", "1,1", "0;1"])
def test_bad_seeds_name_the_option(bad):
    with pytest.raises(RelayError, match="--seeds"):
        parse_seeds(bad)


def test_summary_reports_the_worst_seed_last():
    results = [
        _result(0, 0.48, 0.93, 280.0),
        _result(1, 0.41, 0.90, 312.4),
        _result(2, 0.55, 0.96, 300.0),
    ]
    lines = summary_lines(results)
    assert lines[-1] == "demo_min_final_pass@1=0.90"
    assert "demo_mean_final_pass@1=0.930 std=0.030" in lines  # stdev of .93, .90, .96
    assert "demo_base_pass@1_range=0.41-0.55" in lines
    assert "demo_max_wall_s=312" in lines
    assert seed_line(results[1]).endswith("within_300s=no")
    assert seed_line(results[2]).endswith("within_300s=yes")  # the budget is inclusive
    assert seed_line(results[0]).startswith(
        "seed=0 base_pass@1=0.48 final_pass@1=0.93 wall_s=280 sft_s=200 rl_s=50 other_s=30 "
        "evals_in_rl_s=6"
    )


def test_rl_stage_reads_the_loop_time_and_its_evaluations(tmp_path):
    from relayrl.bench.demo import rl_stage_seconds

    rows = [
        '{"step": 0, "eval_pass@1": 0.5, "time_eval_s": 1.5}',
        '{"step": 1, "elapsed_s": 2.0}',
        '{"step": 2, "elapsed_s": 4.25, "eval_pass@1": 0.7, "time_eval_s": 0.5}',
        '{"step": 2, "final": true, "eval_pass@1": 0.9, "time_eval_s": 2.0}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert rl_stage_seconds(tmp_path / "metrics.jsonl") == (4.25, 4.0)
    assert rl_stage_seconds(tmp_path / "missing.jsonl") == (0.0, 0.0)


def test_one_seed_has_no_spread():
    assert "demo_mean_final_pass@1=0.800 std=0.000" in summary_lines([_result(0, 0.5, 0.8, 1.0)])
