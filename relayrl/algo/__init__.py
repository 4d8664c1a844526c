"""RL mathematics: advantages, policy losses (PPO, decoupled PPO, importance corrections,
multi-behaviour D-ARL), KL estimators, dynamic micro-batching.

Imports: torch only; pure functions that are unit-tested against hand-computed values.
"""
