"""`relayrl experiment staleness` without training: the grid, per-cell configs, reading a
run's metrics, resuming from saved cells, the summary numbers and the results page."""

from __future__ import annotations

import json
from dataclasses import replace

import matplotlib.pyplot as plt
import pytest

from relayrl.cli import main
from relayrl.experiments.staleness import command, plan, report, stats
from relayrl.experiments.staleness import runner as grid


def result(method: str, eta: int, seed: int, final: float, curve=None, **kw) -> grid.CellResult:
    curve = curve or [(0, 0.2, 10), (100, (0.2 + final) / 2, 10), (200, final, 20)]
    return grid.CellResult(method, eta, seed, final, curve, kw.pop("stale", eta / 2), 10.0, **kw)


def test_plan_full_and_quick_grids():
    cells = plan.plan_cells(plan.FULL)
    assert len(cells) == len(set(cells)) == 6 * 3 * 3 + 2 * 3 * 3 + 3 * 3
    assert {c.eta for c in cells if c.method in plan.ABLATIONS} == {8}
    assert {c.eta for c in cells if c.method == "darl"} == {4, 8}
    assert {c.eta for c in cells if c.method == "decoupled_tis"} == {4, 8}
    assert {c.eta for c in cells if c.method == "recompute"} == {4, 8}
    assert len({c.eta for c in cells if c.method == "decoupled_mask"}) == 6
    assert [c.name for c in plan.plan_cells(plan.QUICK)] == [
        "naive-eta0-seed0",
        "decoupled-eta0-seed0",
        "decoupled_mask-eta0-seed0",
        "naive-eta4-seed0",
        "decoupled-eta4-seed0",
        "decoupled_mask-eta4-seed0",
        "recompute-eta4-seed0",
        "decoupled_tis-eta4-seed0",
        "darl-eta4-seed0",
    ]


def test_cell_configs_follow_the_presets(tmp_path):
    naive = plan.cell_config(plan.Cell("naive", 8, 2), plan.FULL, tmp_path / "m", tmp_path)
    assert (naive.algo.loss, naive.rollout.eta, naive.seed, naive.replay.enable) == (
        "ppo",
        8,
        2,
        False,
    )
    assert naive.optim.lr == plan.FULL.lr and naive.train.total_steps == plan.FULL.steps
    darl = plan.cell_config(plan.Cell("darl", 4, 0), plan.QUICK, tmp_path / "m", tmp_path)
    # the window spans the staleness bound plus darl_k_beyond_eta versions
    assert darl.algo.loss == "decoupled" and darl.replay.enable and darl.replay.k == 4 + 4
    preset_k = replace(plan.QUICK, darl_k_beyond_eta=None)
    at_eta8 = plan.Cell("darl", 8, 0)
    assert plan.cell_config(at_eta8, preset_k, tmp_path, tmp_path).replay.k == 8  # the preset's
    assert plan.cell_config(at_eta8, plan.QUICK, tmp_path, tmp_path).replay.k == 12
    assert darl.replay.warmup == 1  # quick: replay from the second step
    assert darl.output_dir == str(tmp_path) and darl.name == "darl-eta4-seed0"
    tis = plan.cell_config(plan.Cell("decoupled_tis", 4, 0), plan.FULL, tmp_path / "m", tmp_path)
    assert (tis.algo.loss, tis.algo.is_level, tis.algo.is_mode, tis.algo.is_cap) == (
        "decoupled",
        "token",
        "truncate",
        2.0,
    )
    mask = plan.cell_config(plan.Cell("decoupled_mask", 4, 0), plan.FULL, tmp_path / "m", tmp_path)
    assert (mask.algo.is_level, mask.algo.is_mode, mask.algo.is_cap, mask.algo.is_floor) == (
        "token",
        "mask",
        5.0,
        0.0,
    )


def test_ablation_cells_are_darl_with_one_override(tmp_path):
    cfg = plan.cell_config(plan.Cell("darl_uniform", 8, 1), plan.FULL, tmp_path / "m", tmp_path)
    assert cfg.replay.enable and cfg.replay.weighting == "uniform" and cfg.replay.k == 12
    assert cfg.replay.select == "variance"  # everything else as D-ARL
    off = plan.cell_config(plan.Cell("darl_noreplay", 8, 0), plan.FULL, tmp_path, tmp_path)
    assert off.replay.batch_fraction == 0 and off.replay.weighting == "ess"
    assert (
        plan.cell_config(
            plan.Cell("darl_noselect", 8, 0), plan.FULL, tmp_path, tmp_path
        ).replay.select
        == "none"
    )
    settings = plan.cell_settings(plan.Cell("darl_uniform", 8, 0), plan.FULL, tmp_path)
    assert settings["ablation"] == ["replay.weighting=uniform"] and settings["replay_k"] == 12
    rows = report.table_ablation(
        stats.group(
            [
                result("darl", 8, 0, 0.6, behav_kl=0.03),
                result("darl", 8, 1, 0.7, behav_kl=0.05),
                result("darl_uniform", 8, 0, 0.4),  # saved before behav_kl existed
            ]
        ),
        (8,),
    )
    assert rows[2] == "| 8 | D-ARL | 0.650 ± 0.071 | 0.0400 ± 0.0141 | 0.00 ± 0.00 | 10 ± 0 |"
    assert rows[3].startswith(
        "| 8 | D-ARL with uniform weights (replay + selection) | 0.400 | n/a |"
    )


def test_sample_matched_control_is_decoupled_with_three_epochs(tmp_path):
    """The control trains D-ARL's sample-passes: its override must win over the budget's."""
    budget = replace(plan.FULL, lag="fixed")
    cfg = plan.cell_config(plan.Cell("decoupled_matched", 8, 0), budget, tmp_path, tmp_path)
    plain = plan.cell_config(plan.Cell("decoupled", 8, 0), budget, tmp_path, tmp_path)
    assert (cfg.optim.ppo_epochs, plain.optim.ppo_epochs) == (3, 2)
    assert cfg.algo == plain.algo and cfg.optim.ppo_minibatches == 4
    settings = plan.cell_settings(plan.Cell("decoupled_matched", 8, 0), budget, tmp_path)
    assert settings["control"] == ["optim.ppo_epochs=3"] and "control" not in (
        plan.cell_settings(plan.Cell("decoupled", 8, 0), budget, tmp_path)
    )


def test_darl_window_is_part_of_darl_cells_settings_only(tmp_path):
    wider = replace(plan.FULL, darl_k_beyond_eta=8)
    naive = plan.Cell("naive", 4, 0)
    darl = plan.Cell("darl", 4, 0)
    assert plan.cell_settings(naive, wider, tmp_path) == plan.cell_settings(
        naive, plan.FULL, tmp_path
    )
    assert plan.cell_settings(darl, plan.FULL, tmp_path)["replay_k"] == 8
    assert plan.cell_settings(darl, wider, tmp_path)["replay_k"] == 12


def test_read_run_curve_wall_time_and_replay_share(tmp_path):
    rows = [
        {"step": 0, "version": 0, "eval_pass@1": 0.25, "eval_problems": 8, "time_eval_s": 3},
        {"step": 1, "train_tokens": 5, "step_time_s": 2.0, "staleness_mean": 1.0,
         "replay_fresh": 16, "replay_replayed": 0, "drift_kl_k3": 0.01,
         "behav_prox_kl_k3": 0.0},
        {"step": 2, "train_tokens": 5, "step_time_s": 7.0, "staleness_mean": 2.0,
         "replay_fresh": 16, "replay_replayed": 8, "eval_pass@1": 0.5, "eval_problems": 8,
         "time_eval_s": 4.0, "drift_kl_k3": 0.03, "behav_prox_kl_k3": 0.5},
        {"step": 2, "final": True, "eval_pass@1": 0.375, "eval_problems": 16},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = grid.read_run(tmp_path, plan.Cell("darl", 4, 0), samples_per_step=16)
    assert r.curve == [(0, 0.25, 8), (32, 0.5, 8), (32, 0.375, 16)]
    assert r.final_pass == 0.375
    assert r.train_seconds == pytest.approx(2.0 + 3.0)  # evaluation time excluded
    assert r.staleness_mean == pytest.approx(1.5)
    assert r.replayed_frac == pytest.approx(8 / 40)
    assert (r.drift_kl, r.behav_prox_kl) == pytest.approx((0.02, 0.25))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(Exception, match="no finished run"):
        grid.read_run(tmp_path, plan.Cell("darl", 4, 0), 16)


def test_grid_resumes_from_saved_cells(tmp_path):
    budget = replace(plan.QUICK, etas=(0,), darl_etas=())
    cells = plan.plan_cells(budget)
    calls, lines = [], []

    def runner(cell, b, model_dir, out):
        calls.append(cell.name)
        return result(cell.method, cell.eta, cell.seed, 0.3)

    first = grid.run_grid(cells, budget, tmp_path / "m", tmp_path, runner, lines.append)
    assert calls == ["naive-eta0-seed0", "decoupled-eta0-seed0", "decoupled_mask-eta0-seed0"]
    assert "2 runs left, ETA" in lines[1] and "0 runs left" in lines[5]
    again = grid.run_grid(cells, budget, tmp_path / "m", tmp_path, runner, lines.append)
    assert len(calls) == 3 and [r.final_pass for r in again] == [r.final_pass for r in first]
    grid.run_grid(
        cells, replace(budget, lr=budget.lr * 2), tmp_path / "m", tmp_path, runner, lines.append
    )
    assert len(calls) == 6  # another lr: the saved cells do not apply


def test_summary_numbers_and_results_page(tmp_path):
    curve = lambda *ps: [(100 * i, p, 10) for i, p in enumerate(ps)]  # noqa: E731
    results = [
        result("naive", 0, 0, 0.40),
        result("naive", 0, 1, 0.42),
        result("decoupled", 0, 0, 0.40),
        result("decoupled", 0, 1, 0.42),
        result("naive", 4, 0, 0.20, curve(0.2, 0.2, 0.2)),
        result("naive", 4, 1, 0.22, curve(0.2, 0.22, 0.22)),
        result("decoupled", 4, 0, 0.40, curve(0.2, 0.3, 0.4)),
        result("decoupled", 4, 1, 0.42, curve(0.2, 0.34, 0.42)),
        result("darl", 4, 0, 0.44, curve(0.2, 0.36, 0.44), replayed_frac=0.3),
        result("darl", 4, 1, 0.46, curve(0.2, 0.3, 0.46), replayed_frac=0.3),
    ]
    cells = stats.group(results)
    xs, ys = zip(*stats.mean_curve(cells[("darl", 4)]), strict=True)
    assert xs == (0, 100, 200) and ys == pytest.approx((0.2, 0.33, 0.45))
    # base 0.2, best final mean 0.45 (D-ARL) -> target 0.325
    target = stats.default_target(cells, (4,))
    assert target == pytest.approx(0.325)
    assert stats.samples_to_target(stats.mean_curve(cells[("darl", 4)]), target) == 100
    assert stats.samples_to_target(stats.mean_curve(cells[("decoupled", 4)]), target) == 200
    assert stats.samples_to_target(stats.mean_curve(cells[("naive", 4)]), target) is None
    budget = replace(plan.FULL, etas=(0, 4), darl_etas=(4,), seeds=2)
    found = "\n".join(report.findings(cells, budget))
    assert "naive async: 0.410 at η = 0, lowest 0.210 at η = 4; it degrades visibly" in found
    assert "decoupled PPO: 0.410 at η = 0, lowest 0.410 at η = 4; it does NOT" in found
    assert "η = 4: D-ARL 0.450 vs decoupled 0.410, above." in found

    md, png = tmp_path / "staleness.md", tmp_path / "staleness.png"
    base = {"model": "m", "pass": "0.200"}
    report.write_markdown(md, results, budget, "relayrl experiment staleness", base, target, 60.0)
    report.write_plot(png, results, budget)
    text = md.read_text()
    assert "| 4 | 0.210 ± 0.014 | 0.410 ± 0.014 | 2.00 / 2.00 |" in text
    assert "| 4 | D-ARL | 0.450 ± 0.014 | 100 | 2/2 |" in text
    assert "| 4 | naive async | 0.210 ± 0.014 | not reached | 0/2 |" in text
    assert "the default's rationale" in text  # a non-default budget says so
    image = plt.imread(png)  # a real picture, not an empty canvas
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    assert image[..., :3].std() > 0.05


def test_bad_arguments_are_clear_errors(capsys):
    assert main(["experiment", "staleness", "--seeds", "0"]) != 0
    assert "--seeds must be >= 1" in capsys.readouterr().err
    assert main(["experiment", "staleness", "--model-path", "/nonexistent"]) != 0
    assert "is not a directory" in capsys.readouterr().err
    assert command.command_line(["x", "experiment", "staleness", "--quick"]).endswith(
        "staleness --quick"
    )


def test_lag_flag_reaches_every_run_and_keeps_async_cells_apart(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--quick", "--lag", "fixed"])
    budget = command.budget_from(args)
    config = plan.cell_config(plan.Cell("naive", 4, 0), budget, tmp_path / "m", tmp_path)
    assert (config.rollout.lag, config.rollout.eta) == ("fixed", 4)
    assert config.train.drift_metrics  # on, although measured runs switch it off
    assert budget.run_settings()["lag"] == "fixed"  # a lag cell is never an async cell
    assert "lag" not in plan.FULL.run_settings()  # cells saved before --lag stay valid
    assert command.default_out(args) == "runs/staleness_quick_lag_fixed"
    assert command.default_out(parser.parse_args([])) == "runs/staleness"
    assert "`rollout.lag=fixed`" in report.staleness_setting(budget)
    assert "rollout.lag" not in report.staleness_setting(plan.FULL)
    with pytest.raises(SystemExit):
        parser.parse_args(["--lag", "sometimes"])


def test_grid_flags_choose_methods_etas_and_the_update(tmp_path):
    """One invocation per setting of the lag study (docs/results/staleness_lag_plan.md):
    methods, η values and the per-version update reach the cells and their configs; the
    grid's shape never enters a cell's identity (saved cells stay reusable)."""
    import argparse

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        [
            "--methods",
            "naive,recompute,decoupled_geo",
            "--etas",
            "0,8",
            "--darl-etas",
            "",
            "--prompts-per-step",
            "64",
            "--ppo-minibatches",
            "1",
            "--ppo-epochs",
            "1",
            "--lag",
            "fixed",
        ]
    )
    budget = command.budget_from(args)
    cells = plan.plan_cells(budget)
    assert [c.name for c in cells if c.seed == 0] == [
        "naive-eta0-seed0",
        "recompute-eta0-seed0",
        "decoupled_geo-eta0-seed0",
        "naive-eta8-seed0",
        "recompute-eta8-seed0",
        "decoupled_geo-eta8-seed0",
        # the full budget's D-ARL ablation at η = 8 stays unless --ablation-etas says so
        *[f"{m}-eta8-seed0" for m in plan.ABLATIONS],
    ]
    geo = plan.cell_config(plan.Cell("decoupled_geo", 8, 1), budget, tmp_path / "m", tmp_path)
    assert (geo.algo.loss, geo.algo.is_level, geo.algo.is_cap) == ("decoupled", "geometric", 2.0)
    assert (geo.rollout.prompts_per_step, geo.optim.ppo_minibatches, geo.optim.ppo_epochs) == (
        64,
        1,
        1,
    )
    recompute = plan.cell_config(plan.Cell("recompute", 0, 0), budget, tmp_path / "m", tmp_path)
    assert recompute.algo.loss == "recompute"
    assert "over_eta" not in budget.run_settings() and "compared" not in budget.run_settings()
    assert budget.run_settings()["prompts_per_step"] == 64  # the update is part of a cell
    empty = parser.parse_args(["--ablation-etas", "", "--darl-etas", ""])
    assert {c.method for c in plan.plan_cells(command.budget_from(empty))} == set(plan.OVER_ETA)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--methods", "naive,bogus"], "--methods: unknown method(s) ['bogus']"),
        (["--etas", "0,x"], "--etas: expected comma-separated integers"),
        (["--etas", "4,4"], "--etas: expected distinct integers >= 0"),
        (["--etas", ""], "--etas needs at least one η"),
        (["--ppo-epochs", "0"], "--ppo-epochs must be >= 1, got 0"),
    ],
)
def test_bad_grid_flags_are_one_clear_error(capsys, flags, message):
    assert main(["experiment", "staleness", *flags]) != 0
    assert message in capsys.readouterr().err
