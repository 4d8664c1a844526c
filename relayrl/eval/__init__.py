"""Evaluation: generation on held-out problems through an engine (the built-in one in this
process, or rollout servers through ``remote``), grading, pass@1, unbiased pass@k and
maj@k; the held-out sets (``sets``).

Imports: relayrl.config, relayrl.engine, relayrl.rewards (graders, the pool),
relayrl.rollout (environments), relayrl.tasks, relayrl.models, relayrl.errors; never
relayrl.launch (its independent sibling), relayrl.sync or relayrl.train.
"""
