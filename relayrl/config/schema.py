"""The typed run configuration. Every section rejects unknown keys.

Sections are added as the system grows; ``docs/config.md`` is generated from these classes
(``relayrl config --reference``), so field descriptions here are the reference.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskConfig(Section):
    name: str = Field("arithmetic", description="synthetic task: arithmetic | countdown")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="difficulty knobs passed to the task (e.g. max_steps, tail, max_value)",
    )
    seed: int = Field(0, description="seed of problem generation (splits are disjoint)")
    train_size: int = Field(20000, gt=0, description="train problems generated")
    test_size: int = Field(500, gt=0, description="held-out problems used for evaluation")


class ModelConfig(Section):
    path: str | None = Field(
        None, description="existing Hugging Face model directory; null = build from preset"
    )
    preset: Literal["tiny", "small", "medium"] = Field(
        "small", description="size preset when building: tiny ~0.4M, small ~3M, medium ~25M"
    )
    max_context: int = Field(256, gt=8, description="maximum prompt + completion tokens")
    vocab_size: int = Field(384, ge=260, description="BPE vocabulary when training a tokenizer")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", description="torch device for training and generation")


class SFTConfig(Section):
    steps: int = Field(1500, gt=0, description="optimizer steps")
    batch_size: int = Field(64, gt=0, description="sequences per step")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    wrong_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="fraction of demonstrations with one wrong step (sets base pass@1)",
    )
    log_every: int = Field(50, gt=0)


class EvalConfig(Section):
    num_problems: int = Field(500, gt=0, description="held-out problems per evaluation")
    n_samples: int = Field(1, gt=0, description="samples per problem (pass@1 = mean)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (RL's own)")
    max_new_tokens: int = Field(160, gt=0)
    batch_size: int = Field(250, gt=0)


class RuntimeConfig(Section):
    threads: int = Field(2, gt=0, description="torch threads of the main process")
    debug: bool = False


class RunConfig(Section):
    name: str = Field("demo", description="run name: outputs go to <output_dir>/<name>")
    output_dir: str = Field("runs", description="parent directory of run directories")
    seed: int = Field(0, description="global seed (torch, python, numpy)")
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
