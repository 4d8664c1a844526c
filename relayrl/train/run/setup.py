"""What every run of the training loop builds and tears down, whatever feeds it.

Owns: :class:`RunSetup` (the tokenizer, the policy and its trainer, the held-out splits, the
run logger and the :class:`~relayrl.train.loop.TrainingLoop` over them; ``close`` and
``finish``: the final model, ``train_summary.json`` and the :class:`TrainResult`),
:class:`TrainResult`, :func:`resolve_model_dir` and :func:`train_problems`. A live run
(``relayrl.train.run.live``), a lagged one (``relayrl.train.run.lagged``) and a recorded
one (``relayrl.train.run.recorded``) each build one :class:`RunSetup` and pass their batch
source to its loop: the trainer, logger and evaluation are the same code for all three.

Imports: config, errors, models, tasks, the trainer factory of relayrl.train.distributed,
the training loop and the run logger.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relayrl.config.schema import RunConfig
from relayrl.eval.evaluate import EvalReport
from relayrl.eval.sets import eval_problems, load_source
from relayrl.heap import peak_rss_mb
from relayrl.metric_names import EVAL_PASS_AT_1, TRAINER_PEAK_RSS_MB
from relayrl.tasks.base import Problem, SyntheticTask
from relayrl.train.distributed import TrainerGroup, make_trainer
from relayrl.train.loop import TrainingLoop
from relayrl.train.lora import save_model
from relayrl.train.metrics import RunLogger, drift_summary, realised_staleness
from relayrl.train.trainer import RLTrainer


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_pass_at_1: float | None
    evals: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)
    eval_reports: list[EvalReport] = field(default_factory=list)  # in the order of evals


def train_problems(config: RunConfig, task: SyntheticTask | None) -> list[Problem]:
    """The train prompts: ``rollout.dataset`` if set, else the task's train split."""
    if config.rollout.dataset:
        return load_source(config.rollout.dataset, "rollout.dataset", "train")
    assert task is not None, "no rollout.dataset: the task's train split is needed"
    return task.problems("train", config.task.train_size, config.task.seed)


def planned_model_dir(config: RunConfig) -> Path:
    """Where the run's initial policy is (or will be, once SFT wrote it):
    :func:`resolve_model_dir`'s answer, without running anything."""
    if config.model.path:
        return Path(config.model.path)
    return Path(config.output_dir) / config.name / "sft_model"


def resolve_model_dir(config: RunConfig, progress: bool, reuse_sft: bool = False) -> Path:
    """``model.path``, or the SFT warm start written to ``<run>/sft_model`` (reused when
    ``reuse_sft`` and the SFT job finished, i.e. wrote ``sft_summary.json`` after the model:
    a resumed run keeps its initial policy)."""
    model_dir = planned_model_dir(config)
    if config.model.path:
        return model_dir
    if reuse_sft and (model_dir.parent / "sft_summary.json").is_file():
        return model_dir
    from relayrl.train.sft import run_sft

    base = run_sft(config, progress=progress)
    print(f"sft warm start: base_pass@1={base:.2f}", flush=True)
    return model_dir


@dataclass
class RunSetup:
    """One run's tokenizer, trainer, task and held-out splits, logger and training loop.
    Build it with :meth:`build`; ``close`` it once the loop is done, then ``finish``."""

    config: RunConfig
    run_dir: Path
    model_dir: Path
    tokenizer: Any
    trainer: RLTrainer | TrainerGroup
    task: SyntheticTask
    logger: RunLogger
    training: TrainingLoop

    @classmethod
    def build(
        cls,
        config: RunConfig,
        run_dir: Path,
        model_dir: Path,
        append: bool = False,
        total_steps: int | None = None,
    ) -> RunSetup:
        """Load the tokenizer and (seeded) the policy from ``model_dir``, make the trainer
        (``relayrl.train.distributed.make_trainer``: rank 0 of the data-parallel ranks when
        ``train.world_size`` > 1), the task's held-out splits, the logger (``append``: a
        resumed run) and the loop over ``total_steps`` (default ``train.total_steps``)."""
        from relayrl.models.loading import load_model, load_tokenizer
        from relayrl.tasks.registry import make_task

        task = make_task(config.task.name, config.task.params)
        tokenizer = load_tokenizer(model_dir)
        torch.manual_seed(config.seed)
        model = load_model(model_dir, config.model.device, config.model.dtype)
        trainer = make_trainer(model, config, tokenizer.pad_token_id, model_dir, run_dir)
        test = eval_problems(config, task)  # eval.datasets, else the task's test split
        decode = _decoder(tokenizer)
        logger = RunLogger.from_config(run_dir, config, decode, append=append)
        training = TrainingLoop(
            config,
            trainer,
            tokenizer,
            logger,
            test[: config.train.eval_problems],
            test,
            config.train.total_steps if total_steps is None else total_steps,
        )
        return cls(config, run_dir, model_dir, tokenizer, trainer, task, logger, training)

    # ------------------------------------------------------------------ text
    def encode(self, problem: Problem) -> list[int]:
        from relayrl.models.loading import encode_prompt

        return encode_prompt(self.tokenizer, problem.prompt, self.config.model.system_prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ teardown
    def result(
        self, final: dict[str, Any] | None, seconds: float, summary: dict[str, Any]
    ) -> TrainResult:
        """The loop's result: its steps, final and periodic evaluations, and ``summary``."""
        return TrainResult(
            self.run_dir,
            self.training.total_steps,
            final[EVAL_PASS_AT_1] if final else None,
            self.training.evals,
            seconds,
            summary,
            self.training.reports,
        )

    def close(self) -> None:
        """Stop the trainer's other ranks (world size > 1) and close the logs."""
        if isinstance(self.trainer, TrainerGroup):
            self.trainer.close()
        self.logger.close()

    def finish(self, result: TrainResult) -> TrainResult:
        """After :meth:`close`: save the final model (``train.save_final``), add the final
        pass@1, realised staleness and drift to the summary and write
        ``train_summary.json``."""
        if self.config.train.save_final:
            out = self.run_dir / "final_model"
            save_model(self.trainer.model, out)  # merged + adapter/ under LoRA
            self.tokenizer.save_pretrained(out)
        metrics = self.run_dir / "metrics.jsonl"
        result.summary["final_pass@1"] = result.final_pass_at_1
        # this process: the trainer, the controller and (eval.backend=trainer) evaluation
        result.summary[TRAINER_PEAK_RSS_MB] = peak_rss_mb()
        result.summary.update(realised_staleness(metrics))
        result.summary.update(drift_summary(metrics))
        with contextlib.suppress(OSError):
            (self.run_dir / "train_summary.json").write_text(json.dumps(result.summary, indent=2))
        return result


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def with_progress(config: RunConfig, progress: bool | None) -> RunConfig:
    """``config`` with ``train.progress`` set to ``progress`` (unchanged for None)."""
    if progress is None:
        return config
    return config.model_copy(
        update={"train": config.train.model_copy(update={"progress": progress})}
    )
