"""Problem sources: synthetic verifiable reasoning tasks (multi-step arithmetic, Countdown,
multiplication with a calculator tool) with deterministic, disjoint splits and SFT
demonstrations, the task seam (``registry``: ``TASKS``, ``register_task``), real benchmark
and user dataset files (``datasets``: GSM8K, MATH-500, AIME, HumanEval, MATH train, JSONL
or Parquet files) and reasoning-gym's procedural datasets (``reasoning_gym``).

Imports: the standard library, relayrl.registry and relayrl.errors (datasets, pyarrow and
reasoning_gym lazily); nothing above (grading lives in relayrl.rewards).
"""
