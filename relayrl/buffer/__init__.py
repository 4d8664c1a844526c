"""Replay buffer keyed by behaviour version (D-ARL): eviction beyond K versions, reuse
limits, warm-up, checkpoint state. Selection and the loss are ``relayrl.algo.darl``; the
trainer-side step is ``relayrl.train.replay_step``.

Imports: relayrl.rollout (Trajectory) and the standard library.
"""
