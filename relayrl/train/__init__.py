"""Trainers and runs: SFT warm start (``sft``), the RL trainer (``trainer``: proximal
recompute, updates, shared prompts, D-ARL's step) and its data-parallel ranks
(``distributed``, ``fsdp``, the Ray and worker ranks), the training loop (``loop``),
checkpoints and resume (``relayrl.train.resume``), run logs, the dashboard and the
metric-logger seam (``metrics``, ``dashboard``, ``loggers``), a run (``relayrl.train.run``:
one setup and the batch source that feeds the loop) and the preflight
(``relayrl.train.preflight``: ``relayrl check``, everything a run needs tried once in
seconds, without training).

Imports: every package below it (relayrl.sync for a live run's publications,
relayrl.launch, relayrl.eval, relayrl.config and lower); imported by relayrl.cli,
relayrl.bench and relayrl.experiments.
"""
