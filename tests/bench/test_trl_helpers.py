"""Pure helpers of ``relayrl bench trl`` (no TRL needed): the eval-free clock of relayrl's
metrics rows, time to target, the ratio's bound, argument checks and the written outputs."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

from relayrl.bench.trl import (
    Settings,
    SideResult,
    compare,
    parse_sides,
    relayrl_curve,
    settings_from_args,
    write_outputs,
)
from relayrl.errors import RelayError


def _args(**kw) -> argparse.Namespace:
    base = {"quick": False, "steps": None, "eval_every": None, "eval_problems": None}
    return argparse.Namespace(**{**base, "target": None, **kw})


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
    s = Settings(
        steps=2,
        prompts_per_step=2,
        n_samples=2,
        max_new_tokens=8,
        eval_every=1,
        eval_problems=4,
        eval_max_new_tokens=8,
        target=0.5,
    )
    results = [
        SideResult("relayrl_async", [(0, 0.0, 0.25), (2, 1.0, 0.75)], 1.0, 8, 100.0),
        SideResult("trl", [(0, 0.0, 0.25), (2, 3.0, 0.5)], 3.0, 8, 80.0),
    ]
    png = write_outputs(results, s, tmp_path, {"model": "m"})
    assert png.is_file() and png.stat().st_size > 1000
    rows = list(csv.DictReader((tmp_path / "trl_bench.csv").open()))
    assert [r["side"] for r in rows] == ["relayrl_async"] * 2 + ["trl"] * 2
    doc = json.loads((tmp_path / "trl_bench.json").read_text())
    assert doc["sides"]["trl"]["time_to_target_s"] == 3.0
    assert doc["sides"]["relayrl_async"]["samples_per_s"] == 8.0


def test_base_model_evaluation_does_not_count():
    r = SideResult("trl", [(0, 0.0, 0.9), (5, 2.0, 0.85), (10, 4.0, 0.95)], 4.0, 10)
    assert r.time_to_target(0.9) == (4.0, True)
