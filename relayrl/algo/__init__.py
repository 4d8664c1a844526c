"""RL mathematics: advantage estimators, policy losses (PPO, decoupled PPO, GSPO, CISPO,
importance corrections, multi-behaviour D-ARL), the parameters each loss and estimator
declares for itself (``params``), KL estimators, dynamic micro-batching; and the seams'
registries ``LOSSES`` and ``ADVANTAGES``.

Imports: torch, pydantic (``params``), relayrl.registry and relayrl.metric_names; nothing
else of relayrl (never relayrl.models, its independent sibling, nor any layer above). Pure
functions, unit-tested against hand-computed values.
"""
