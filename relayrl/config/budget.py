"""The size of one short RL run, as benchmarks and experiments set it, and the dotted
overrides that apply it to a run config.

Owns :class:`RunBudget`. ``relayrl bench async``, ``relayrl bench trl`` and ``relayrl
experiment staleness`` all size their runs with it, so "the same budget" means the same
overrides everywhere. Imports: nothing of relayrl.
"""

from __future__ import annotations

from dataclasses import dataclass

# Settings of a run that is measured rather than used: a fixed number of trained samples
# per step (no dynamic-sampling refills), no final model, no console bar, no checkpoints,
# no metric loggers and no drift-metric passes inside the timed loop.
MEASURED_RUN = (
    "algo.dynamic_sampling=false",
    "train.save_final=false",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.loggers=[]",
    "train.drift_metrics=false",
)


@dataclass(frozen=True, kw_only=True)
class RunBudget:
    """Steps, batch, token budgets and evaluation of one run; ``None`` keeps the config's
    value."""

    steps: int
    prompts_per_step: int
    n_samples: int
    max_new_tokens: int
    eval_every: int
    eval_problems: int
    final_problems: int | None = None  # None: eval_problems
    eval_max_new_tokens: int | None = None
    lr: float | None = None

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n_samples

    def overrides(self) -> list[str]:
        """Dotted overrides applying this budget to a run config (plus :data:`MEASURED_RUN`)."""
        final = self.eval_problems if self.final_problems is None else self.final_problems
        out = [
            f"rollout.prompts_per_step={self.prompts_per_step}",
            f"rollout.n_samples={self.n_samples}",
            f"rollout.max_new_tokens={self.max_new_tokens}",
            f"train.total_steps={self.steps}",
            f"train.eval_every={self.eval_every}",
            f"train.eval_problems={self.eval_problems}",
            f"eval.num_problems={final}",
        ]
        if self.eval_max_new_tokens is not None:
            out.append(f"eval.max_new_tokens={self.eval_max_new_tokens}")
        if self.lr is not None:
            out.append(f"optim.lr={self.lr}")
        return out + list(MEASURED_RUN)
