"""The lag-emulation grid knows GSPO and per-sequence token means as methods (issue 34):
their presets reach each cell's run config."""

from __future__ import annotations

import argparse

from relayrl.experiments.staleness import command, plan


def test_gspo_and_seq_mean_cells(tmp_path):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        ["--methods", "gspo,seq_mean_token_mean", "--etas", "0,8", "--darl-etas", "",
         "--ablation-etas", "", "--lag", "fixed"]
    )  # fmt: skip
    budget = command.budget_from(args)
    names = [c.name for c in plan.plan_cells(budget) if c.seed == 0]
    assert names == [
        "gspo-eta0-seed0",
        "seq_mean_token_mean-eta0-seed0",
        "gspo-eta8-seed0",
        "seq_mean_token_mean-eta8-seed0",
    ]
    gspo = plan.cell_config(plan.Cell("gspo", 8, 0), budget, tmp_path / "m", tmp_path)
    assert (gspo.algo.loss, gspo.algo.is_level, gspo.algo.is_cap, gspo.algo.aggregation) == (
        "gspo",
        "geometric",
        2.0,
        "seq_mean_token_mean",
    )
    assert (gspo.algo.gspo_eps_low, gspo.algo.gspo_eps_high) == (3e-4, 4e-4)
    seq = plan.cell_config(plan.Cell("seq_mean_token_mean", 8, 0), budget, tmp_path / "m", tmp_path)
    assert (seq.algo.loss, seq.algo.aggregation, seq.rollout.eta) == (
        "ppo",
        "seq_mean_token_mean",
        8,
    )
