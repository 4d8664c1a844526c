"""Trainers: SFT warm start, the RL trainer (proximal recompute, updates, D-ARL) and its
data-parallel ranks, the training loop, checkpoints and resume, and a run
(``relayrl.train.run``: one setup and the batch source that feeds the loop).

Imports: every package below it; imported by relayrl.cli, relayrl.bench and
relayrl.experiments.
"""
