"""Evaluation: generation on held-out problems through the engine, grading, pass@1,
unbiased pass@k and maj@k.

Imports: relayrl.engine, relayrl.rewards, relayrl.tasks, relayrl.models.
"""
