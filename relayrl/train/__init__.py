"""Trainers: SFT warm start and the asynchronous RL trainer (proximal recompute, updates,
weight publication, checkpoints).

Imports: every package above; nothing imports relayrl.train except relayrl.cli and relayrl.launch.
"""
