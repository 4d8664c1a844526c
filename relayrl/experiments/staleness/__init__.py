"""``relayrl experiment staleness``: how staleness η hurts naive asynchronous RL, how much
decoupled PPO (AReaL) recovers, and what D-ARL's replay adds (docs/darl.md).

Two tables, every cell a real ``relayrl train`` run (rollout server processes, controller,
grading pool, trainer) from one SFT base on the default task, ``--seeds`` seeds each:

1. AReaL Table 2 shape: η ∈ {0, 1, 2, 4, 8, 16} × {naive async (PPO ratio against the stale
   μ, ``configs/async_naive.yaml``), decoupled PPO (``configs/async_decoupled.yaml``),
   decoupled PPO with AReaL's behaviour-weight cap (``configs/async_decoupled_mask.yaml``)}:
   final held-out pass@1, mean ± std over seeds, and the realised mean staleness.
2. At η ∈ {4, 8}: those three, decoupled with token-level truncated importance sampling
   (``configs/async_decoupled_tis.yaml``) and D-ARL (``configs/darl.yaml``, its window K
   widened to η + ``darl_k_beyond_eta`` so that something can be replayed): final pass@1,
   the generated samples needed to reach a target pass@1 (sample efficiency, from the
   periodic evaluations) and the training wall time (evaluation excluded).
3. At η = 8: D-ARL with one part switched off (no replay, uniform weights, no variance
   selection; the preset plus one override each), to see which part carries its result.

Each finished cell is saved as ``<out>/cells/<cell>.json`` with its settings and reused
when the command is run again with the same settings, so an interrupted grid resumes.
Writes ``<results>/staleness.md`` and ``<results>/staleness.png``. In lag emulation
(``--lag fixed|uniform``) this invocation's tables go to ``<out>/invocation.md`` and the
results page ``<results>/staleness_lag_<lag>.md`` (+ .png) joins every saved cell of ``--out``
and of the ``--join`` directories, one section per directory, between markers that keep the
page's hand-written text (``join``).

The package: ``plan`` (methods, budgets, cells, configs), ``runner`` (runs and the cell
cache), ``stats`` (spreads, paired differences, curves, samples to target), ``report``
(tables, findings, plot), ``join`` (the joined lag-emulation page) and ``command`` (``HELP``, ``add_arguments``, ``run``, re-exported here).

Imports: this package's modules, SFT, the config loader.
"""

from relayrl.experiments.staleness.command import HELP, add_arguments, run

__all__ = ["HELP", "add_arguments", "run"]
