"""Replay buffer keyed by behaviour version (D-ARL): eviction beyond K versions, reuse
limits, warm-up and variance-guided selection.

Imports: torch, relayrl.rollout (Trajectory), relayrl.config.
"""
