"""``--etas …,auto``: the staleness experiment runs ``rollout.eta=auto`` cells and the joined
table puts them after the integer η with auto's paired difference to the best fixed η."""

from __future__ import annotations

import pytest

from relayrl.errors import RelayError
from relayrl.experiments.staleness import command, join, plan
from relayrl.experiments.staleness.runner import CellResult

FINALS = {
    0: [0.7, 0.8, 0.9],
    4: [0.6, 0.7, 0.8],
    8: [0.5, 0.6, 0.7],
    "auto": [0.72, 0.79, 0.88],  # vs η 0 (the best fixed mean, 0.8): +0.02, −0.01, −0.02
}


def test_parse_etas_accepts_auto_in_etas_only():
    assert command.parse_etas("0,4,8,auto", "--etas", auto=True) == (0, 4, 8, "auto")
    with pytest.raises(RelayError, match="--darl-etas: expected comma-separated integers"):
        command.parse_etas("auto", "--darl-etas")
    with pytest.raises(RelayError, match="distinct"):
        command.parse_etas("auto,auto", "--etas", auto=True)
    assert sorted([8, "auto", 0], key=plan.eta_key) == [0, 8, "auto"]


def test_auto_cell_config(tmp_path):
    cell = plan.Cell("naive", "auto", 1)
    config = plan.cell_config(cell, plan.FULL, tmp_path / "m", tmp_path)
    assert (config.rollout.eta, config.rollout.staleness.hard, config.name) == (
        "auto",
        4,  # rollout.eta_max's default: the fixed default η
        "naive-etaauto-seed1",
    )


def test_joined_table_with_auto_hand_computed():
    cells = {
        ("naive", eta): [
            CellResult("naive", eta, seed, final, [(0, 0.5, 200)], 1.0, 1.0, drift_kl=0.01)
            for seed, final in enumerate(finals)
        ]
        for eta, finals in FINALS.items()
    }
    lines = join.table_final(cells)
    assert lines[0] == (
        "| method | η = 0 | η = 4 | η = 8 | η = auto | drift KL(π_v‖π_v+1) at η = 8 | "
        "KL(μ‖π_v) at η = 8 | degradation η 8 − η 0 (paired) | vs naive at η = 8 (paired) | "
        "auto − best fixed η (paired) |"
    )
    # auto − η 0 per seed: +0.02, −0.01, −0.02: mean −0.00333, sample std 0.0208
    assert lines[2].endswith("| -0.003 ± 0.021 (not separable) (η = 0) |")
    assert "| 0.797 ± 0.080 |" in lines[2]  # auto's own final pass@1


def test_eta_budget_and_eta_max_flags_reach_the_auto_cells(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    flags = ["--lag", "fixed", "--etas", "0,auto", "--eta-budget", "4e-4", "--eta-max", "4"]
    budget = command.budget_from(parser.parse_args(flags))
    assert budget.etas == (0, "auto")
    config = plan.cell_config(plan.Cell("naive", "auto", 0), budget, tmp_path / "m", tmp_path)
    assert (config.rollout.eta, config.rollout.eta_budget, config.rollout.eta_max) == (
        "auto",
        4e-4,
        4,
    )
    assert budget.run_settings()["eta_max"] == 4  # another cache key than the default's
    default = command.budget_from(parser.parse_args(["--lag", "fixed"]))
    assert "eta_budget" not in default.run_settings()  # cells saved before stay valid
    assert "eta_max" not in default.run_settings()
    with pytest.raises(RelayError, match="--eta-max must be >= 1"):
        command.budget_from(parser.parse_args(["--eta-max", "0"]))
