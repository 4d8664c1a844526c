"""What a run checks before it starts any process or writes into its run directory.

Owns: :func:`check_run_inputs` and :func:`slow_bf16_warning`. Every user input a run can check in this process, without
starting a server, a grading worker or a trainer rank, is checked here, so that a bad input
ends in one ``error:`` line naming its key, and an earlier run under the same name is left
exactly as it was (``relayrl.config.loader.claim_run_dir`` runs after this, the run
directory is written only after both).

Imports: config, eval (held-out sets), models (loading: the model directory and its chat
template), the train prompts of relayrl.train.run.setup, the loggers' and ranks' checks.
"""

from __future__ import annotations

import sys

import torch

from relayrl.config.schema import RunConfig
from relayrl.eval.sets import default_datasets, eval_problems
from relayrl.models.loading import check_model_path
from relayrl.models.precision import cpu_has_fast_bf16
from relayrl.train.distributed import check_trainer_ranks
from relayrl.train.loggers import check_loggers
from relayrl.train.run.setup import train_problems


def check_run_inputs(config: RunConfig) -> None:
    """The model, the train dataset, the held-out sets (``eval.datasets``, or the train
    dataset's test split), the loggers' packages and the trainer ranks."""
    check_model_path(config.model.path, config.model.system_prompt)
    if config.rollout.dataset:
        train_problems(config, None)
    if default_datasets(config):  # a rollout.dataset without a held-out set is an error
        from relayrl.tasks.registry import make_task

        eval_problems(config, make_task(config.task.name, config.task.params))
    check_loggers(config)
    check_trainer_ranks(config)
    warning = slow_bf16_warning(config, cpu_has_fast_bf16())
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def slow_bf16_warning(config: RunConfig, fast_bf16: bool) -> str | None:
    """Which bf16 settings will run slower than float32 on this CPU, or None."""
    if fast_bf16 or not config.model.device.startswith("cpu"):
        return None
    keys = [f"rollout.dtype={config.served_dtype}"] if config.served_dtype == "bfloat16" else []
    if config.train.mixed_precision == "bf16":
        keys.append("train.mixed_precision=bf16")
    if not keys:
        return None
    return (
        f"{' and '.join(keys)} on a CPU without fast bf16 (no AVX-512 or AMX: "
        f"{torch.backends.cpu.get_cpu_capability()}): bf16 is emulated and runs several times "
        "slower than float32 here; add rollout.dtype=float32 train.mixed_precision=none"
    )
