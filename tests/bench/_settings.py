"""The smallest ``relayrl bench trl`` settings the bench tests run or write outputs for."""

from relayrl.bench.trl import Settings

TINY = Settings(
    steps=2,
    prompts_per_step=2,
    n_samples=2,
    max_new_tokens=8,
    eval_every=1,
    eval_problems=4,
    eval_max_new_tokens=8,
)
