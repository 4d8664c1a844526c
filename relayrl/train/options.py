"""What the RL trainer reads of a run's configuration, typed, built in one place.

Owns: :class:`TrainerOptions` (the trainer's knobs: the loss, the staleness bound and
sampling temperature it checks against, the optimizer and its schedule, the step's
micro-/mini-batching, drift metrics, D-ARL replay) with :meth:`TrainerOptions.from_config`,
the only reader of the ``rollout``/``algo``/``optim``/``train``/``replay`` sections on the
trainer's behalf, :class:`ShardingOptions` (what the data-parallel rank adds: FSDP2's
mixed precision and activation checkpointing) and :func:`loss_config_from` (``algo`` →
:class:`LossConfig`).

A trainer built from options never sees the rest of the run's configuration (servers,
evaluation, logging), so what changes a training step is this one record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from relayrl.algo.losses import LossConfig
from relayrl.config.schema import AlgoConfig, ReplayConfig, RunConfig

Schedule = Literal["constant", "cosine", "linear"]


def loss_config_from(algo: AlgoConfig) -> LossConfig:
    """``LossConfig`` from the ``algo`` config section: its shared knobs by name, and the
    selected loss's own parameters (``algo.params_of("loss")``), so a loss's new parameter
    needs no line here."""
    shared = {knob.name: getattr(algo, knob.name) for knob in LossConfig.shared_knobs()}
    return LossConfig(**shared, params=algo.params_of("loss"))


@dataclass(frozen=True)
class TrainerOptions:
    """The knobs of :class:`relayrl.train.trainer.RLTrainer` (config key in brackets).

    - ``loss``: the policy loss (``algo.*``, see :class:`LossConfig`).
    - ``eta``: the staleness bound every trained sample is checked against (``rollout.eta``;
      with ``auto``, ``rollout.eta_max``, the largest bound the rule may choose).
    - ``temperature``: T of the logprobs ``log_softmax(logits / T)``, the sampler's own
      (``rollout.temperature``).
    - ``max_new_tokens``: the generation budget, the ``seq_sum`` normaliser's length
      (``rollout.max_new_tokens``).
    - ``lr``, ``betas``, ``weight_decay``: AdamW (``optim.*``); ``warmup_steps``,
      ``schedule``, ``total_steps``: the learning-rate schedule (``optim.*``,
      ``train.total_steps``); ``grad_clip``: max global gradient norm (``optim.grad_clip``).
    - ``micro_batch_tokens``, ``ppo_minibatches``, ``ppo_epochs``: how a step is cut
      (``optim.*``).
    - ``drift_metrics``: the per-version drift pass after the update (``train.drift_metrics``).
    - ``replay``: D-ARL's settings when ``replay.enable``, else None.
    - ``stale_kl``: log ``stale_kl_per_version``, the per-version drift of the batch's stale
      tokens that ``rollout.eta=auto`` reads (on with ``auto``).
    - ``autocast_bf16``: forward passes under bf16 autocast, fp32 weights, gradients and
      optimizer state (``train.mixed_precision=bf16`` at ``train.world_size=1``; FSDP2's
      mixed precision does it above).
    - ``share_prompts``: the samples of a prompt in a micro-batch compute the prompt once
      (``optim.share_prompts``; ``relayrl.train.shared_prompts``).
    """

    loss: LossConfig
    eta: int
    temperature: float
    max_new_tokens: int
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    schedule: Schedule
    total_steps: int
    grad_clip: float
    micro_batch_tokens: int
    ppo_minibatches: int
    ppo_epochs: int
    drift_metrics: bool
    replay: ReplayConfig | None
    share_prompts: bool
    stale_kl: bool = False
    autocast_bf16: bool = False

    @classmethod
    def from_config(cls, config: RunConfig) -> TrainerOptions:
        """The trainer's options of a run (its validated configuration)."""
        optim = config.optim
        return cls(
            loss=loss_config_from(config.algo),
            eta=config.rollout.staleness.hard,
            temperature=config.rollout.temperature,
            max_new_tokens=config.rollout.max_new_tokens,
            lr=optim.lr,
            betas=(optim.betas[0], optim.betas[1]),
            weight_decay=optim.weight_decay,
            warmup_steps=optim.warmup_steps,
            schedule=optim.schedule,
            total_steps=config.train.total_steps,
            grad_clip=optim.grad_clip,
            micro_batch_tokens=optim.micro_batch_tokens,
            ppo_minibatches=optim.ppo_minibatches,
            ppo_epochs=optim.ppo_epochs,
            drift_metrics=config.train.drift_metrics,
            replay=config.replay.model_copy() if config.replay.enable else None,
            share_prompts=optim.share_prompts,
            stale_kl=config.rollout.staleness.auto,
            autocast_bf16=config.train.mixed_precision == "bf16" and config.train.world_size == 1,
        )


@dataclass(frozen=True)
class ShardingOptions:
    """How a data-parallel rank shards its model (``train.mixed_precision``: ``none`` or
    ``bf16``; ``train.activation_checkpointing``), read by ``relayrl.train.fsdp``."""

    mixed_precision: Literal["none", "bf16"]
    activation_checkpointing: bool

    @classmethod
    def from_config(cls, config: RunConfig) -> ShardingOptions:
        return cls(config.train.mixed_precision, config.train.activation_checkpointing)
