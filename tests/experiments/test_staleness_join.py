"""The joined lag-emulation page (`relayrl experiment staleness --lag fixed`): the tables'
numbers against hand-computed means, stds and paired differences, the not-separable rule, the
plot, the hand-written text kept around the generated part, and the command writing it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from relayrl.cli import main
from relayrl.experiments.staleness import command, join, stats
from relayrl.experiments.staleness.runner import CellResult

# final pass@1 per seed 0 / 1 / 2 (hand-picked so that the statistics are easy by hand)
HIGH = {
    ("naive", 0): [0.7, 0.8, 0.9],
    ("naive", 8): [0.6, 0.7, 0.9],  # paired vs η 0: -0.1, -0.1, 0.0
    ("recompute", 0): [0.7, 0.8, 0.9],
    ("recompute", 8): [0.8, 0.7, 0.9],  # vs η 0: +0.1, -0.1, 0.0 (not separable)
    ("decoupled", 0): [0.7, 0.8, 0.9],
    ("decoupled", 4): [0.6, 0.6, 0.7],
    ("decoupled", 8): [0.4, 0.5, 0.6],  # vs η 0: -0.3 each; vs naive: -0.2, -0.2, -0.3
    ("decoupled_matched", 8): [0.3, 0.3, 0.4],
    ("darl", 8): [0.5, 0.6, 0.7],  # vs decoupled +0.1 each; vs naive -0.1, -0.1, -0.2
    ("darl_uniform", 8): [0.45, 0.55],  # two seeds only
}
LOW = {("naive", 0): [0.6, 0.6, 0.6], ("naive", 8): [0.7, 0.5, 0.6]}


def save(directory: Path, values, lag: str = "fixed", drift: float = 0.01) -> None:
    (directory / "cells").mkdir(parents=True, exist_ok=True)
    for (method, eta), finals in values.items():
        for seed, final in enumerate(finals):
            curve = [(0, 0.5, 200), (1000, 0.5 + (final - 0.5) * (seed + 1) / 3, 200)]
            result = CellResult(
                method, eta, seed, final, [*curve, (2000, final, 500)], float(eta), 10.0,
                replayed_frac=0.3 if method.startswith("darl") else 0.0,
                drift_kl=drift * (seed + 1) * (1 + eta), behav_prox_kl=0.002 * (seed + 1),
                settings={"budget": {"lag": lag}},
            )  # fmt: skip
            name = f"{method}-eta{eta}-seed{seed}.json"
            (directory / "cells" / name).write_text(json.dumps(asdict(result)))


def test_paired_differences_and_the_not_separable_rule():
    runs = lambda m, e: [  # noqa: E731
        CellResult(m, e, s, v, [], 0.0, 0.0) for s, v in enumerate(HIGH[(m, e)])
    ]
    degr = stats.paired(runs("naive", 8), runs("naive", 0))
    assert degr == pytest.approx([-0.1, -0.1, 0.0])
    assert stats.fmt_paired(degr) == "-0.067 ± 0.058"  # mean -1/15, std 0.1/√3
    assert stats.fmt_paired(stats.paired(runs("recompute", 8), runs("recompute", 0))) == (
        "+0.000 ± 0.100 (not separable)"
    )
    # seeds pair up by number, not by position: seed 2 of the two-seed cell is missing
    two = [r for r in runs("decoupled", 8) if r.seed != 1]
    assert stats.paired(two, runs("naive", 8)) == pytest.approx([-0.2, -0.3])
    assert stats.separable([0.1, 0.1]) and not stats.separable([0.2])  # one seed: no std
    assert stats.fmt_paired([]) == "—"


def test_joined_tables_hand_computed(tmp_path):
    save(tmp_path / "high_drift", HIGH)
    save(tmp_path / "low_drift", LOW, drift=1e-5)
    save(tmp_path / "low_drift", {("decoupled", 8): [0.1]}, lag="async")  # another lag
    page = tmp_path / "page.md"
    join.write_joined(page, [tmp_path / "high_drift", tmp_path / "low_drift"], "fixed", "cmd", None)
    text = page.read_text()
    assert (
        "high_drift (29 runs), low_drift (6 runs; 1 cells of another rollout.lag left out)" in text
    )
    # columns: η 0 | η 4 | η 8 | drift at 8 | KL(μ‖π_v) at 8 | degradation | vs naive.
    # drift at η 8: 0.01 · 9 · (1 + 2 + 3) / 3 = 0.18; KL(μ‖π_v): 0.002 · 2 = 0.004
    assert (
        "| naive | 0.800 ± 0.100 | — | 0.733 ± 0.153 | 1.80e-01 | 4.00e-03 | -0.067 ± 0.058 | — |"
        in text
    )
    assert (
        "| recompute | 0.800 ± 0.100 | — | 0.800 ± 0.100 | 1.80e-01 | 4.00e-03 "
        "| +0.000 ± 0.100 (not separable) | +0.067 ± 0.115 (not separable) |" in text
    )
    assert (
        "| decoupled | 0.800 ± 0.100 | 0.633 ± 0.058 | 0.500 ± 0.100 | 1.80e-01 | 4.00e-03 "
        "| -0.300 ± 0.000 | -0.233 ± 0.058 |" in text
    )
    # low drift: naive +0.1, -0.1, 0.0 at η 8; drift 1e-5 · 9 · 2 = 1.8e-4
    assert (
        "| naive | 0.600 ± 0.000 | 0.600 ± 0.100 | 1.80e-04 | 4.00e-03 | +0.000 ± 0.100 (not separable) | — |"
        in text
    )
    # D-ARL at η 8: the best asynchronous baseline there is recompute (0.800)
    assert "### D-ARL at η = 8 (high_drift)" in text
    assert (
        "| method | final pass@1 | vs decoupled (paired) | vs recompute (paired) | replayed share |"
        in text
    )
    assert "| darl | 0.600 ± 0.100 | +0.100 ± 0.000 | -0.200 ± 0.100 | 0.30 |" in text
    assert (
        "| darl_uniform | 0.500 ± 0.071 (n = 2) | +0.050 ± 0.000 | -0.250 ± 0.141 | 0.30 |" in text
    )
    assert "| decoupled_matched | 0.333 ± 0.058 | -0.167 ± 0.058 | -0.467 ± 0.058 | 0.00 |" in text
    rows = [
        line.split(" | ")[0]
        for line in text.split("### D-ARL")[1].split("\n\n")[1].splitlines()
        if line.startswith("| ")
    ]
    assert rows[2:] == [
        "| recompute",
        "| decoupled",
        "| decoupled_matched",
        "| darl",
        "| darl_uniform",
    ]
    # sample efficiency: step-0 0.5, best final mean 0.8 -> target 0.65. recompute's seed-mean
    # curve at 1000 samples: 0.5 + (0.3/3 + 0.2·2/3 + 0.4) / 3 = 0.711 -> reached there (every seed by its final 0.7-0.9; D-ARL only seed 2, 0.7)
    assert "reaches the target 0.650" in text
    assert (
        "| 8 | recompute (AReaL's baseline: clip around π_prox, no w) | 0.800 ± 0.100 | 1000 | 3/3 |"
        in text
    )
    assert "| 8 | D-ARL | 0.600 ± 0.100 | not reached | 1/3 |" in text
    assert (
        "Per seed (0 / 1 / 2) at η = 8, high_drift: naive 0.600 / 0.700 / 0.900; recompute "
        "0.800 / 0.700 / 0.900; decoupled 0.400 / 0.500 / 0.600; decoupled_matched 0.300 / "
        "0.300 / 0.400; darl 0.500 / 0.600 / 0.700" in text
    )
    assert "![degradation against per-version drift](page.png)" in text
    points = join.degradation_points(
        join.load_setting(tmp_path / "high_drift", "fixed") for _ in [0]
    )
    assert (
        "high_drift",
        "decoupled",
        4,
        pytest.approx(0.1),
        pytest.approx(-5 / 30),
        pytest.approx(0.057735, abs=1e-6),
    ) in points
    image = plt.imread(tmp_path / "page.png")
    assert image.ndim == 3 and image[..., :3].std() > 0.05


def test_hand_written_text_is_kept_and_a_page_without_markers_refused(tmp_path):
    save(tmp_path / "a", LOW)
    page = tmp_path / "page.md"
    prose = f"# mine\n\nprose naming `{join.BEGIN}` inline\n\n"
    page.write_text(f"{prose}{join.BEGIN}\nold tables\n{join.END}\n\nprose after\n")
    join.write_joined(page, [tmp_path / "a"], "fixed", "cmd", None)
    text = page.read_text()
    assert text.startswith(prose + join.BEGIN)
    assert text.endswith(join.END + "\n\nprose after\n") and "old tables" not in text
    assert "| naive | 0.600 ± 0.000 | 0.600 ± 0.100 |" in text
    # the committed results page has its markers: its hand-written findings survive
    committed = (Path(__file__).parents[2] / "docs/results/staleness_lag_fixed.md").read_text()
    page.write_text(committed)
    join.write_joined(page, [tmp_path / "a"], "fixed", "cmd", None)
    head, tail = committed.split(join.BEGIN + "\n")[0], committed.split(join.END)[1]
    text = page.read_text()
    assert text.startswith(head) and text.endswith(tail) and "### a" in text
    assert "## What the numbers say" in tail
    page.write_text("# hand-written only\n")
    with pytest.raises(Exception, match="has no generated part"):
        join.write_joined(page, [tmp_path / "a"], "fixed", "cmd", None)
    with pytest.raises(Exception, match="--join: .* has no cells"):
        join.write_joined(tmp_path / "new.md", [tmp_path / "b"], "fixed", "cmd", None)


def test_quick_lag_fixed_command_writes_the_joined_page(tmp_path, monkeypatch, capsys):
    """`relayrl experiment staleness --quick --lag fixed` end to end, with each training run
    replaced by a made-up result (the runs themselves are tested elsewhere)."""
    calls = []

    def fake_grid(cells, budget, model_dir, out, log):
        def runner(cell, b, m, o):
            calls.append(cell.name)
            final = 0.5 - 0.01 * cell.eta
            return CellResult(cell.method, cell.eta, cell.seed, final, [(0, 0.4, 16), (32, final, 32)],
                              float(cell.eta), 1.0, drift_kl=0.001 * (1 + cell.eta))  # fmt: skip

        return run_grid(cells, budget, model_dir, out, runner, log)

    run_grid = command.run_grid
    monkeypatch.setattr(command, "run_grid", fake_grid)
    monkeypatch.setattr(command, "sft_base", lambda args, out: {"model": str(tmp_path / "m")})
    out = tmp_path / "q"
    assert main(["experiment", "staleness", "--quick", "--lag", "fixed", "--out", str(out)]) == 0
    assert len(calls) == 9 and (out / "invocation.md").is_file()
    page = (out / "staleness_lag_fixed.md").read_text()
    assert f"### {out.name}" in page and "### D-ARL at η = 4 (q)" in page
    assert "| naive | 0.500 | 0.460 | 5.00e-03 | n/a | -0.040 (not separable) | — |" in page
    assert (out / "staleness_lag_fixed.png").is_file()
    # a second directory joined without running anything; the page keeps its prose
    other = tmp_path / "low"
    save(other, LOW)
    (out / "staleness_lag_fixed.md").write_text(page + "\nmy findings\n")
    argv = ["experiment", "staleness", "--lag", "fixed", "--report-only", "--results", str(out)]
    assert main([*argv, "--join", str(out), str(other)]) == 0
    assert len(calls) == 9
    page = (out / "staleness_lag_fixed.md").read_text()
    assert "### low" in page and "### q" in page and page.endswith("my findings\n")
    assert main(["experiment", "staleness", "--join", str(other)]) != 0
    assert "--join: the joined page is for lag emulation" in capsys.readouterr().err
    assert main([*argv, "--join", str(tmp_path / "none")]) != 0
    assert f"--join: {tmp_path / 'none'} is not a directory" in capsys.readouterr().err
