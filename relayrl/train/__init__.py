"""Trainers: SFT warm start, the RL trainer (proximal recompute, updates, D-ARL) and its
data-parallel ranks, the training loop, checkpoints and resume, a run
(``relayrl.train.run``: one setup and the batch source that feeds the loop) and the
preflight (``relayrl.train.preflight``: ``relayrl check``, everything a run needs tried once
in seconds, without training).

Imports: every package below it; imported by relayrl.cli, relayrl.bench and
relayrl.experiments.
"""
