"""The typed run configuration. Every section rejects unknown keys.

Sections are added as the system grows; ``docs/config.md`` is generated from these classes
(``relayrl config --reference``), so field descriptions here are the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo

from relayrl.algo.advantages import advantage_estimator
from relayrl.algo.losses import Aggregation, ISLevel, ISMode, KLEstimator, LossConfig, loss_class
from relayrl.algo.params import ObjectiveParams, validate_params
from relayrl.config.objectives import SEAMS, objective_keys, selected_params
from relayrl.engine.types import EngineOptions
from relayrl.models.precision import bf16_is_fast
from relayrl.plugins import load_plugins
from relayrl.registry import (
    DEFAULT_LAUNCHER,
    LAUNCHERS,
    LOGGERS,
    ROLLOUT_BACKENDS,
    WEIGHT_TRANSPORTS,
)
from relayrl.rewards.dispatch import GRADERS
from relayrl.rollout.controller import ControllerOptions
from relayrl.rollout.eta import DEFAULT_ETA, DEFAULT_ETA_BUDGET, StalenessBound
from relayrl.rollout.workflow import WORKFLOWS
from relayrl.tasks.datasets import FieldMap
from relayrl.tasks.registry import TASKS, make_task

# Each setting's default is written once, by the part that uses it (the loss's LossConfig, the
# rollout controller's ControllerOptions, the engine's EngineOptions); the run config reads
# it from there (tests/test_config_defaults.py holds it).
LOSS, CONTROLLER, ENGINE = LossConfig, ControllerOptions, EngineOptions


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @classmethod
    def accepted_fields(cls) -> dict[str, FieldInfo]:
        """Every key the section accepts, as the loader checks and the reference lists them:
        its fields (``AlgoConfig`` adds the keys the registered objectives declare)."""
        return dict(cls.model_fields)


class TaskConfig(Section):
    """The synthetic task the run trains and evaluates on."""

    name: str = Field(
        "arithmetic",
        description="synthetic task, a name registered in relayrl.tasks.registry.TASKS: "
        "arithmetic | countdown | tool_multiply | reasoning_gym (any reasoning-gym dataset, "
        "task.params.dataset; pip install 'relayrl[reasoning-gym]'; docs/your-own.md), or "
        "one a plugin registers",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="difficulty knobs passed to the task (e.g. max_steps, tail, max_value)",
    )
    seed: int = Field(0, description="seed of problem generation (splits are disjoint)")
    train_size: int = Field(20000, gt=0, description="train problems generated")

    @field_validator("name")
    @classmethod
    def _registered_task(cls, name: str) -> str:
        TASKS.lookup(name)  # a ValueError names the registered tasks
        return name

    @model_validator(mode="after")
    def _registered_grader(self) -> TaskConfig:
        """The grader the task's problems name is registered (one problem is generated)."""
        problem = make_task(self.name, self.params).problems("test", 1, self.seed)[0]
        if problem.grader not in GRADERS:
            raise ValueError(
                f"task {self.name!r} grades with {problem.grader!r}, which no module "
                f"registered; registered graders: {sorted(GRADERS)} (a plugin must register it)"
            )
        return self


class LoraConfig(Section):
    """LoRA adapters (``peft``, docs/lora.md): only the adapters train and are published."""

    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is alpha/r · B·A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="module names to adapt (peft's target_modules; 'all-linear': every "
        "linear layer but the output head); each must be a torch Linear",
    )


class ModelConfig(Section):
    """The policy model: an existing Hugging Face directory or a preset built from scratch."""

    path: str | None = Field(
        None, description="existing Hugging Face model directory; null = build from preset"
    )
    preset: Literal["tiny", "small", "medium"] = Field(
        "tiny", description="size preset when building: tiny ~0.4M, small ~3M, medium ~25M"
    )
    max_context: int = Field(256, gt=8, description="maximum prompt + completion tokens")
    vocab_size: int = Field(384, ge=260, description="BPE vocabulary when training a tokenizer")
    dtype: Literal["float32", "bfloat16", "float16"] = ENGINE.dtype
    device: str = Field(ENGINE.device, description="torch device for training and generation")
    lora: LoraConfig | None = Field(
        None, description="LoRA adapters (RL and SFT, docs/lora.md); null = full fine-tuning"
    )
    system_prompt: str | None = Field(
        None,
        description="a system message before every prompt in SFT, RL and evaluation: the "
        "chat template's system turn (a template that refuses one is an error), without a "
        "template a first paragraph",
    )


class SFTConfig(Section):
    """The SFT warm start (`relayrl sft`)."""

    steps: int = Field(
        1800,
        gt=0,
        description="optimizer steps (fewer leave some seeds without the long-chain lookup: "
        "docs/demo.md)",
    )
    batch_size: int = Field(
        64,
        gt=0,
        description="sequences per step (40 left a seed without the long-chain lookup at "
        "1800 steps: docs/demo.md)",
    )
    lr: float = Field(6e-3, gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    wrong_fraction: float = Field(
        0.6,
        ge=0,
        le=1,
        description="fraction of demonstrations with one wrong step (sets base pass@1)",
    )
    task_params: dict[str, Any] = Field(
        default_factory=dict,
        description="task parameters for the demonstrations only, over the task's "
        "demonstration defaults and task.params (arithmetic's default: {tail: 0.65}, long "
        "chains 2-3x as often as at the task's 0.5, so the rare step labels' lookup is "
        "learned); evaluation and RL keep task.params, and the test split, chosen by problem "
        "key, stays unseen",
    )
    log_every: int = Field(50, gt=0)


class DataSource(Section):
    """Rows of a dataset and how each becomes a problem (``rollout.dataset``, each entry of
    ``eval.datasets``): which columns hold the id, the prompt and the gold answer, the
    prompt template over the row's columns, and the grader by name."""

    data: str = Field(
        description="a known dataset name (gsm8k, math500, ...); a .jsonl/.parquet path; a "
        "directory datasets' save_to_disk wrote; or hub:<name>"
    )
    id_field: str | None = Field(
        None,
        description="column of the row's id (default: id when the rows have one, else "
        "the row's number)",
    )
    prompt_field: str | None = Field(
        None, description="column of the prompt text, {problem} in the template (default prompt)"
    )
    answer_field: str | None = Field(None, description="column of the gold answer (default answer)")
    template: str | None = Field(
        None,
        description="the prompt, with {column} replaced by the row's column and {problem} by "
        "the prompt column (e.g. 'Question: {question}\\nOptions: {choices}'); other braces "
        "stay as written; default: the prompt column as is (a known dataset: its own)",
    )
    grader: str | None = Field(
        None,
        description="grader by name: math | exact | code | countdown | a plugin's (default: "
        "recognised from the rows); graders see the whole row as problem.row",
    )

    @model_validator(mode="before")
    @classmethod
    def _path_is_data(cls, source: object) -> object:
        """A plain path (``rollout.dataset=FILE``, an ``eval.datasets`` entry) is
        ``{data: FILE}``; the config loader reads it so too before setting a sub-key."""
        return {"data": source} if isinstance(source, str) else source

    @field_validator("grader")
    @classmethod
    def _registered(cls, grader: str | None) -> str | None:
        if grader is not None:
            GRADERS.lookup(grader)
        return grader

    def field_map(self) -> FieldMap | None:
        """The columns as a :class:`FieldMap`; None when none is set (the dataset's own)."""
        if self.id_field is None and self.prompt_field is None and self.answer_field is None:
            return None
        return FieldMap(
            self.id_field or "id",
            self.prompt_field or "prompt",
            self.answer_field or "answer",
            id_if_present=self.id_field is None,
        )

    def formats_rows(self) -> bool:
        """Whether any column, template or grader setting is given."""
        return self.field_map() is not None or self.template is not None or bool(self.grader)


class EvalDataset(DataSource):
    """One held-out set of ``eval.datasets``: its problems keep their own grader."""

    data: str = Field(
        description="task = the run's synthetic task's test split; a known dataset name "
        "(gsm8k, math500, aime24, aime25, humaneval); a .jsonl/.parquet path; a directory "
        "datasets' save_to_disk wrote (its test split); or hub:<name>"
    )
    name: str | None = Field(
        None,
        description="label in metrics (eval_pass@1/<name>); default: the task's name (data: "
        "task), the dataset's name or the file's stem",
    )
    limit: int | None = Field(None, gt=0, description="first N problems (default: all)")

    @model_validator(mode="after")
    def _task_has_no_columns(self) -> EvalDataset:
        if self.data == "task" and self.formats_rows():
            raise ValueError(
                "data: task is the synthetic task's test split: it takes no id_field, "
                "prompt_field, answer_field, template or grader"
            )
        return self


class EvalConfig(Section):
    """Held-out evaluation (pass@1 at the sampling temperature)."""

    num_problems: int = Field(500, gt=0, description="held-out problems per evaluation")
    n_samples: int = Field(1, gt=0, description="samples per problem (pass@1 = mean)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (RL's own)")
    max_new_tokens: int = Field(160, gt=0)
    batch_size: int = Field(250, gt=0)
    backend: Literal["trainer", "servers"] = Field(
        "trainer",
        description="where `relayrl train` evaluates (periodic and final): trainer = the "
        "built-in engine in this process over the trainer's weights; servers = the run's "
        "rollout servers (any rollout.engine), after publishing the trainer's weights to them, "
        "while rollouts go on (docs/engine.md); needs rollout.lag=async",
    )
    datasets: list[EvalDataset] = Field(
        default_factory=list,
        description="held-out sets evaluated together, each {data, name, limit} and, like "
        "rollout.dataset, id_field, prompt_field, answer_field, template and grader; metrics "
        "per set as eval_pass@1/<name> (and pass@k, maj@k) beside the pooled eval_pass@1. "
        "Empty: the test split of rollout.dataset (gsm8k_train -> gsm8k, math_train -> "
        "math500, hub:<name> or a saved DatasetDict -> its test split, read with its columns, "
        "template and grader); a rollout.dataset without one is an error; no rollout.dataset: "
        "the task's",
    )


class RuntimeConfig(Section):
    """Process settings of the main process."""

    threads: int = Field(2, gt=0, description="torch threads of the main process")
    debug: bool = False


# --------------------------------------------------------------------------- RL sections
# Owned by `relayrl train` (relayrl/train/run/, relayrl/rollout/controller.py); see
# docs/async.md for how they interact (admission bound, publication, thread budget).


class VLLMConfig(Section):
    """The vLLM rollout backend (`rollout.engine=vllm`, docs/engine.md "vLLM backend")."""

    python: str | None = Field(
        None,
        description="interpreter of the vLLM environment (null: .venv-vllm/bin/python of the "
        "current directory or of the relayrl checkout, built by `make vllm`); GPU users "
        "point it at their own CUDA vLLM install",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="more arguments for vLLM's OpenAI server (e.g. [--gpu-memory-utilization, "
        "'0.5'])",
    )
    kv_cache_gib: int = Field(
        1, gt=0, description="CPU KV cache per server in GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    threads_bind: str = Field(
        "nobind",
        description="VLLM_CPU_OMP_THREADS_BIND: nobind, auto, or core ids such as '0-1' "
        "(one entry per server separated by '|')",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="port of the first server (server i: port + i); null = free ports",
    )
    enforce_eager: bool = Field(
        True, description="--enforce-eager (no graph capture: fast start, CPU default)"
    )


class RolloutConfig(Section):
    workflow: str = Field(
        "episode",
        description="rollout workflow, a name registered in relayrl.rollout.workflow.WORKFLOWS: "
        "what one admitted prompt becomes (episode: each sample an episode in its problem's "
        "environment, one model turn graded by the grader when it names none, docs/agents.md; "
        "single_turn: always one turn; docs/extending.md)",
    )
    n_samples: int = Field(8, gt=0, description="completions per prompt (one group)")
    prompts_per_step: int = Field(
        16, gt=0, description="B: groups (prompts) per training step; a step trains B·n samples"
    )
    max_new_tokens: int = Field(80, gt=0, description="generation budget per completion")
    temperature: float = Field(
        CONTROLLER.temperature,
        gt=0,
        description="sampling temperature; the trainer uses the same T for logprobs",
    )
    top_p: float = Field(
        CONTROLLER.top_p, gt=0, le=1, description="nucleus sampling (1 = off, exact RL)"
    )
    eta: int | Literal["auto"] = Field(
        DEFAULT_ETA,
        description="staleness bound η: no sample is trained more than η versions after the "
        "oldest weights that produced it (0 = synchronous RL); auto = chosen after every "
        "step in [1, rollout.eta_max] from the batch's per-version drift and (live) the "
        "generation vs training time (docs/async.md, η = auto)",
    )
    eta_max: int = Field(
        DEFAULT_ETA,
        ge=1,
        description="rollout.eta=auto: the largest bound the rule may choose (default the "
        "fixed default η: auto only lowers the bound where the drift is high; docs/async.md)",
    )
    eta_budget: float = Field(
        DEFAULT_ETA_BUDGET,
        gt=0,
        description="rollout.eta=auto: the drift budget, a KL in nats per token: η is kept "
        "to η·k̂ ≤ eta_budget, k̂ the smoothed per-version drift (docs/async.md)",
    )
    concurrency: int = Field(
        -1,
        ge=-1,
        description="max requests in flight from the controller (-1 = 2·prompts_per_step·"
        "n_samples, so the oldest groups are not queued behind (η + 1)·B·n requests; "
        "0 = only the η bound limits)",
    )
    num_servers: int = Field(1, gt=0, description="rollout server processes")
    server_threads: int = Field(1, gt=0, description="torch threads of each rollout server")
    max_running_requests: int = Field(
        ENGINE.max_running_requests,
        gt=0,
        description="KV slots (concurrently decoded requests) per server",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = Field(
        None,
        description="the rollout servers' weights (null = model.dtype): bfloat16 generates "
        "about 2× faster than float32 on a CPU with AVX-512 BF16 or AMX (docs/real-model.md) "
        "and several times slower on one without (emulated); auto = bfloat16 where bf16 is "
        "fast on model.device (and no model.lora), else model.dtype, resolved when the config "
        "is loaded (the run directory's config.yaml records the choice). The trainer keeps "
        "model.dtype; behaviour logprobs then differ from the trainer's by the rounding (engine_trainer_kl_k3 at η = 0), publications are "
        "verified by the checksum of the trainer's weights rounded to this dtype and the "
        "logprob canary is off (train.publish_canary_every)",
    )
    share_prefill: bool = Field(
        ENGINE.share_prefill,
        description="built-in servers prefill a group's prompt once and copy its KV to the "
        "group's other samples (the same tokens and logprobs as prefilling each; false: "
        "prefill each, for comparison)",
    )
    max_adapters: int = Field(
        ENGINE.max_adapters,
        ge=1,
        description="LoRA (model.lora): adapter versions each built-in server keeps and "
        "serves at once; 1 = each publication is merged into a copy of the weights and running "
        "requests are prefilled again (train.publish_mode); K >= 2 = every request keeps the "
        "adapter of the version it started under, so a publication interrupts none while "
        "K >= η + 1 (docs/lora.md)",
    )
    server_mode: Literal["process", "thread"] = Field(
        "process",
        description="process: `relayrl serve` children (the real path); thread: in-process "
        "servers (tests, debugging)",
    )
    dataset: DataSource | None = Field(
        None,
        description="train prompts from a dataset instead of the synthetic task's train "
        "split: a known name, .jsonl/.parquet path, a directory datasets' save_to_disk wrote "
        "(its train split) or hub:<name>; or a mapping {data, id_field, prompt_field, "
        "answer_field, template, grader} naming its columns, prompt template and grader "
        "(docs/your-own.md)",
    )
    reward_workers: int = Field(1, gt=0, description="grading processes")
    reward_timeout_s: float = Field(10.0, gt=0, description="per-sample grading timeout")
    startup_timeout_s: float = Field(120.0, gt=0, description="wait for servers to be healthy")
    max_server_restarts: int = Field(
        3,
        ge=0,
        description="rollout servers restarted after a crash or hang, in total over the run; "
        "one more failure stops the run (docs/reliability.md)",
    )
    server_hang_timeout_s: float = Field(
        60.0, gt=0, description="a live server process not answering /health this long is hung"
    )
    engine: str = Field(
        "builtin",
        description="rollout backend, a name registered in relayrl.registry.ROLLOUT_BACKENDS: "
        "builtin (`relayrl serve`) or vllm (a vLLM OpenAI server with its RL endpoints, "
        "started from rollout.vllm.python), or a plugin's (docs/extending.md)",
    )
    server_urls: list[str] = Field(
        default_factory=list,
        description="servers someone else started (of rollout.engine's kind, serving "
        "model.path): none is launched or restarted; empty = launch rollout.num_servers",
    )
    api_key: str | None = Field(
        None,
        exclude=True,  # never written to the run directory's config.yaml
        description="bearer key of rollout.server_urls (servers someone else started); "
        "prefer $RELAYRL_API_KEY or $RELAYRL_API_KEY_FILE. Launched servers always get a "
        "key of their own, derived from a fresh run key (docs/security.md)",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    lag: Literal["async", "fixed", "uniform"] = Field(
        "async",
        description="staleness: async = as the machine makes it (rollout servers, bound η); "
        "fixed / uniform = deterministic lag emulation (docs/async.md): the batch trained at "
        "version v is generated in this process, on the built-in engine, by exactly the "
        "weights v − d, d = η (fixed) or d drawn uniformly from {0, …, η} by a function of "
        "seed and v (uniform), clipped to v at the first steps; keeps the last η + 1 weight "
        "snapshots in memory; no rollout servers, no checkpoints",
    )

    @field_validator("eta", mode="before")
    @classmethod
    def _eta_int_or_auto(cls, eta: object) -> object:
        return StalenessBound.validate(eta)

    @property
    def staleness(self) -> StalenessBound:
        """``eta``, ``eta_max`` and ``eta_budget`` as the run uses them: the hard bound
        (``.hard``), the first admission bound (``.initial``), the auto rule (``.rule()``)."""
        return StalenessBound(self.eta, self.eta_max, self.eta_budget)

    @field_validator("lag")
    @classmethod
    def _lag_runs_in_process(cls, lag: str, info: ValidationInfo) -> str:
        if lag == "async":
            return lag
        if info.data.get("server_urls"):
            raise ValueError(
                f"rollout.lag={lag} generates in this process on the built-in engine; it "
                "cannot use rollout.server_urls (leave them empty or use rollout.lag=async)"
            )
        if info.data.get("engine", "builtin") != "builtin":
            raise ValueError(
                f"rollout.lag={lag} generates on the built-in engine; rollout.engine="
                f"{info.data['engine']} needs rollout.lag=async"
            )
        return lag

    @field_validator("server_urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"rollout.server_urls: {url!r} is not an http(s):// URL")
        return [u.rstrip("/") for u in urls]

    @field_validator("workflow")
    @classmethod
    def _registered_workflow(cls, name: str) -> str:
        WORKFLOWS.lookup(name)
        return name

    @field_validator("engine")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        return ROLLOUT_BACKENDS.check(name)  # a ValueError names the registered backends


class AlgoConfig(Section):
    """The objective: advantages, policy loss, reward shaping. The selected loss's and
    advantage's own parameters are keys of this section too, declared by their classes
    (relayrl.config.objectives; the rows marked "loss=NAME only"): a parameter of an
    objective that is not selected is accepted at its default and dropped, and is an error
    at any other value (it would change nothing); `relayrl config` shows the selected ones."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    advantage: str = Field(
        CONTROLLER.advantage,
        description="advantage estimator, a name registered in relayrl.algo.advantages."
        "ADVANTAGES: grpo | drgrpo | rloo | reinforce_pp_baseline | reinforce_pp, or your own "
        "(docs/extending.md)",
    )
    loss: str = Field(
        LOSS.loss,
        description="policy loss, a name registered in relayrl.algo.losses.LOSSES: ppo = ratio "
        "π_θ/μ (sync PPO at η=0, naive async above); decoupled = AReaL's w·min(u·A, clip(u)·A) "
        "with u = π_θ/π_prox, w = π_prox/μ; recompute = AReaL's non-decoupled baseline "
        "min(u·A, clip(u)·A) (π_prox replaces μ, no w); gspo = decoupled with GSPO's sequence "
        "ratio exp(mean log π_θ/π_prox) (clip range algo.gspo_eps_*); cispo = MiniMax-M1's "
        "−sg(min(π_θ/μ, algo.cispo_cap))·A·log π_θ; or your own (docs/extending.md)",
    )
    gamma: float = Field(
        CONTROLLER.gamma,
        ge=0,
        le=1,
        description="discount of the per-token returns (advantage=reinforce_pp)",
    )
    eps_low: float = Field(LOSS.eps_low, ge=0, lt=1, description="lower clip range")
    eps_high: float = Field(
        LOSS.eps_high, ge=0, description="upper clip range (> eps_low: clip-higher)"
    )
    dual_clip: float | None = Field(
        LOSS.dual_clip, gt=1, description="dual-clip constant c (null = off)"
    )
    is_level: ISLevel = Field(
        LOSS.is_level, description="rollout importance correction of w (decoupled loss only)"
    )
    is_mode: ISMode = Field(LOSS.is_mode, description="truncate or mask w")
    is_cap: float = Field(LOSS.is_cap, gt=0, description="upper bound C of the importance weight")
    is_floor: float | None = Field(
        LOSS.is_floor, description="lower bound for mask mode (null = 1/C)"
    )
    kl_coef: float = Field(
        LOSS.kl_coef, ge=0, description="KL penalty to the initial policy (0 = off)"
    )
    kl_estimator: KLEstimator = LOSS.kl_estimator
    aggregation: Aggregation = Field(
        LOSS.aggregation,
        description="how token losses are averaged over the step: token_mean (all tokens "
        "alike), seq_sum (Dr.GRPO: token sum / max_new_tokens, mean over sequences) or "
        "seq_mean_token_mean (each sequence's token mean, mean over sequences: TRL's grpo)",
    )
    overlong_buffer: int = Field(
        CONTROLLER.overlong_buffer,
        ge=0,
        description="DAPO soft overlong penalty ramp length in tokens (0 = off)",
    )
    overlong_penalty: float = Field(
        CONTROLLER.overlong_penalty, ge=0, description="magnitude of the overlong penalty"
    )
    dynamic_sampling: bool = Field(
        CONTROLLER.dynamic_sampling,
        description="DAPO: drop groups whose rewards are all equal and admit replacements",
    )
    max_filtered_per_step: float | None = Field(
        2.0,
        gt=0,
        description="dynamic sampling drops at most this × rollout.prompts_per_step groups per "
        "trainer step; past that, all-equal groups fill the batch (zero GRPO advantage) "
        "instead of waiting for more: a nearly solved task no longer starves the trainer "
        "(null: no cap; 2 keeps the demo's accuracy and generates less than 4 once it is "
        "nearly solved: docs/demo.md)",
    )

    @classmethod
    def accepted_fields(cls) -> dict[str, FieldInfo]:
        keys = objective_keys(cls.model_fields)
        return {**cls.model_fields, **{k: key.reference_field() for k, key in keys.items()}}

    @model_validator(mode="before")
    @classmethod
    def _objective_params(cls, data: Any) -> Any:
        """The keys that are no field of this section are the selected objectives'
        parameters: validated by their ``Params`` and kept, with the unset ones' defaults
        (relayrl.config.objectives)."""
        if not isinstance(data, dict):
            return data
        shared = {k: v for k, v in data.items() if k in cls.model_fields}
        own = {k: v for k, v in data.items() if k not in cls.model_fields}
        selected = {seam: shared.get(seam, cls.model_fields[seam].default) for seam in SEAMS}
        params = selected_params(own, selected, cls.model_fields)
        return {**shared, **{k: v for p in params.values() for k, v in p.model_dump().items()}}

    def params_of(self, seam: str) -> ObjectiveParams:
        """The validated ``Params`` of the objective ``algo.<seam>`` selects (``seam``:
        ``"loss"`` or ``"advantage"``), what the trainer and the controller hand it."""
        name = getattr(self, seam)
        params_class = SEAMS[seam].lookup(name).Params
        own = {k: v for k, v in (self.model_extra or {}).items() if k in params_class.model_fields}
        return validate_params(params_class, own, f"the {seam} {name!r}", "algo.")

    @field_validator("loss")
    @classmethod
    def _registered_loss(cls, name: str) -> str:
        loss_class(name)  # a ValueError names the registered losses
        return name

    @field_validator("advantage")
    @classmethod
    def _registered_advantage(cls, name: str) -> str:
        advantage_estimator(name)
        return name

    @model_validator(mode="after")
    def _correction_needs_a_weighted_loss(self) -> AlgoConfig:
        """algo.is_level corrects the behaviour weight π_prox/μ: a loss without one
        (cispo, ppo, ...) cannot take it (the trainer's LossConfig refuses it too)."""
        if self.is_level != "none" and not loss_class(self.loss).uses_behaviour_weight:
            raise ValueError(
                f"algo.is_level={self.is_level!r} corrects the behaviour weight π_prox/μ, "
                f"which algo.loss={self.loss!r} does not use; set algo.is_level=none or a "
                "loss that weights by it (e.g. decoupled)"
            )
        return self


class OptimConfig(Section):
    lr: float = Field(3e-4, gt=0, description="peak learning rate (AdamW)")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(2, ge=0, description="linear warm-up steps")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="learning-rate schedule after warm-up"
    )
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    micro_batch_tokens: int = Field(
        2048,
        gt=0,
        description="token budget of one micro-batch (dynamic batching), counted as the "
        "padded batch computes it: rows × longest sequence",
    )
    share_prompts: bool = Field(
        True,
        description="the samples of one prompt in a micro-batch compute the prompt once: "
        "one packed row of the prompt and their completions, a block attention mask "
        "(models whose attention takes a custom mask: sdpa, eager; "
        "relayrl.train.shared_prompts). The loss and gradient are the unshared pass's up "
        "to summation order",
    )
    ppo_minibatches: int = Field(
        1,
        ge=1,
        description="AdamW steps per batch: the batch's groups are split into this many "
        "mini-batches (PPO's inner loop; AReaL's ppo_n_minibatches). Proximal logprobs are "
        "computed once before the first (with one mini-batch, one epoch, no replay and one "
        "rank they are the update's own forward pass: no extra pass, and the clip never "
        "binds); the weight version advances by one per batch",
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over the batch's mini-batches")


class TrainConfig(Section):
    total_steps: int = Field(120, gt=0, description="optimizer steps (trainer versions)")
    publish_every: int = Field(
        1, gt=0, description="publish weights to the servers every k steps (capped at η + 1)"
    )
    publish_mode: Literal["retract", "abort", "inflight"] = Field(
        "retract",
        description="how a publication interrupts generation: retract = load without "
        "pausing, the server re-queues running requests and prefills them again under the "
        "new weights (requests stay open); abort = pause(abort), load, continue, and the "
        "client resubmits each partial output (any SGLang-style server); inflight = load "
        "without pausing and running requests keep the KV built under older weights "
        "(PipelineRL's in-flight update: no re-prefill; relayrl servers only)",
    )
    publish_timeout_s: float = Field(
        900.0,
        gt=0,
        description="deadline of one whole publication (pause, load, verify, resume on every "
        "server); past it the publication fails naming the server, step and version, and the "
        "watchdog resumes a server still paused (docs/engine.md)",
    )
    publish_step_timeout_s: float = Field(
        300.0, gt=0, description="deadline of each step of a publication (on each server)"
    )
    publish_verify: bool = Field(
        True,
        description="after loading, each server reports the version it serves and the "
        "checksum of the weights it loaded; a mismatch with the trainer's fails the run",
    )
    publish_canary_every: int = Field(
        10,
        ge=0,
        description="the publication canary (a fixed prompt's token logprobs on each server "
        "against the trainer's for the same weights) on the first publication and then every "
        "k-th (0 = never); a mismatch stops the run naming the server and version",
    )
    publish_canary_tolerance: float = Field(
        1e-2, gt=0, description="the canary's largest |Δ logprob| in nats"
    )
    eval_every: int = Field(10, ge=0, description="held-out pass@1 every N steps (0 = end only)")
    eval_problems: int = Field(
        200, gt=0, description="held-out problems per evaluation (eval.* sets the sampling)"
    )
    trainer_threads: int = Field(1, gt=0, description="torch threads of the trainer process")
    switch_interval_ms: float = Field(
        0.5,
        gt=0,
        description="Python GIL switch interval of the trainer process (sys.setswitchinterval; "
        "CPython's default is 5 ms): how long the training thread can wait for the GIL "
        "while the controller's event loop holds it (docs/async.md, measured)",
    )
    weight_transport: str = Field(
        "disk",
        description="how published weights reach the rollout servers, a name registered in "
        "relayrl.registry.WEIGHT_TRANSPORTS (docs/cluster.md; a plugin's: docs/extending.md): "
        "disk = "
        "a safetensors snapshot in train.weights_dir that each server loads; broadcast = "
        "HTTP control plus a gloo transfer group (trainer = rank 0) that broadcasts every "
        "tensor to all servers (built-in or vLLM), re-formed under a new name after a "
        "server restart",
    )
    broadcast_timeout_s: float = Field(
        60.0,
        gt=0,
        description="weight_transport=broadcast: deadline of forming the transfer group and "
        "of each publication; past it the publication fails naming the server",
    )
    broadcast_snapshot_every: int = Field(
        10,
        ge=1,
        description="weight_transport=broadcast: also write the disk snapshot (the restart "
        "source) every k publications, the first always; a server restarted in between loads "
        "it and then receives the newest weights by broadcast (1 = every publication)",
    )
    weights_dir: str | None = Field(
        None,
        description="where published weights go (null: /dev/shm if present, else the run dir; "
        "the run dir when the launcher may place servers on other nodes, e.g. launcher=ray on "
        "a cluster address, so that every node sees them)",
    )
    save_final: bool = Field(True, description="save <run>/final_model (Hugging Face directory)")
    log_text: bool = Field(
        True, description="write each sample's prompt and completion text into samples.jsonl"
    )
    dump_trajectories: bool = Field(
        False,
        description="also write every trained trajectory in full into samples.jsonl (token "
        "ids, behaviour logprobs, versions, reward, advantage) for `relayrl train --replay-from`",
    )
    inspect_groups: int = Field(
        4,
        ge=0,
        description="write the tokens of the first k groups of every step into inspect.jsonl "
        "for `relayrl inspect` (per token: decoded text, weight version, behaviour and "
        "proximal logprob; ≈ 25 bytes a token); 0 = none",
    )
    drift_metrics: bool = Field(
        False,
        description="(off by default: one more no-grad forward pass per batch, ≈ 1.3× trainer time "
        "as measured before π_prox was fused into the update; the staleness experiment "
        "turns it on) log per-version drift on every batch's trained tokens, alike for every "
        "loss: drift_kl_k3 = KL(π_v ‖ π_v+1) (one more no-grad forward pass over the batch "
        "after the update) and behav_prox_kl_k3 = KL(μ ‖ π_v) (from π_prox, which is the "
        "update's own forward when one AdamW step covers the batch; ppo in mini-batches "
        "pays one more pass before); docs/async.md",
    )
    loggers: list[str] | None = Field(
        None,
        description="metric loggers besides metrics.jsonl: names registered in "
        f"relayrl.registry.LOGGERS, built in {', '.join(LOGGERS)} (docs/observability.md; a "
        "plugin's: docs/extending.md); null = [tensorboard] when tensorboard is installed, "
        "else []; wandb / mlflow need relayrl[wandb] / relayrl[mlflow]",
    )
    wandb_project: str = Field("relayrl", description="W&B project")
    wandb_mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="W&B mode (null = $WANDB_MODE if set, else offline: no network)"
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow store (null = $MLFLOW_TRACKING_URI if set, else <run>/mlruns)"
    )
    mlflow_experiment: str = Field("relayrl", description="MLflow experiment name")
    progress: bool = Field(
        True,
        description="live console dashboard (a bar on a terminal, plain lines otherwise); "
        "false = quiet",
    )
    log_every: int = Field(
        10, ge=0, description="steps between plain progress lines when stdout is not a terminal"
    )
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="write <run>/checkpoints/step-N every N steps (0 = only on SIGINT/SIGTERM); "
        "continue with `relayrl train --resume RUN_DIR` (docs/reliability.md)",
    )
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept (newest)")
    world_size: int = Field(
        1,
        ge=1,
        description="trainer ranks (data parallel, FSDP2; docs/async.md): 1 = the trainer runs "
        "in the main process; N > 1 = rank 0 there plus N − 1 worker processes, each with "
        "train.trainer_threads threads (CPU: N·threads ≤ the cores; CUDA: N ≤ the GPUs)",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend of the trainer ranks (auto: nccl on CUDA, "
        "else gloo)",
    )
    master_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the trainer ranks' rendezvous on 127.0.0.1 (0 = any free "
        "port; ignored under torchrun, which sets MASTER_ADDR/MASTER_PORT)",
    )
    dist_timeout_s: float = Field(
        600.0, gt=0, description="how long a trainer collective may wait before failing"
    )
    mixed_precision: Literal["none", "bf16", "auto"] = Field(
        "none",
        description="bf16 compute with fp32 weights, gradients and optimizer state: FSDP2's "
        "mixed precision at world_size > 1 (fp32 gradient reduction), bf16 autocast at "
        "world_size 1 (about 2× the training tokens/s of SmolLM2-135M on a CPU with AVX-512 "
        "BF16, docs/real-model.md; logprobs then carry bf16 rounding). none: model.dtype. "
        "auto: bf16 where bf16 is fast on model.device, else none (resolved at load, as "
        "rollout.dtype=auto)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the backward pass "
        "(less memory, about one more forward)",
    )

    @field_validator("weight_transport")
    @classmethod
    def _registered_transport(cls, name: str) -> str:
        return WEIGHT_TRANSPORTS.check(name)  # a ValueError names the registered transports

    @field_validator("loggers")
    @classmethod
    def _registered_loggers(cls, names: list[str] | None) -> list[str] | None:
        # a ValueError names the registered loggers
        return None if names is None else [LOGGERS.check(name) for name in names]


class ReplayConfig(Section):
    """D-ARL: replay over the K most recent behaviour versions (relayrl's reading of the
    paper; docs/darl.md). Off by default: the trainer then trains each batch once."""

    enable: bool = Field(False, description="replay trained samples of recent versions (D-ARL)")
    k: int = Field(
        4,
        ge=1,
        description="K behaviour versions kept: a trained sample may be replayed while its "
        "oldest token version is ≥ v − K + 1 (K = 1: no replay)",
    )
    pmis: bool = Field(
        True,
        description="multi-behaviour policy optimisation: per-version decoupled losses "
        "combined by replay.weighting; false: one pooled decoupled loss (weighting ignored, "
        "= uniform)",
    )
    warmup: int = Field(5, ge=0, description="first steps train fresh samples only")
    select: Literal["none", "variance"] = Field(
        "variance",
        description="variance-guided selection of replayed samples: keep those whose score "
        "mean_t (π_prox/μ − 1)² is within replay.quantile of the fresh samples' scores",
    )
    quantile: float | None = Field(
        0.8, ge=0, le=1, description="quantile q of the fresh samples' scores (the cutoff)"
    )
    threshold: float | None = Field(
        None,
        ge=0,
        description="absolute score cutoff instead of the quantile (needs replay.quantile=null)",
    )
    max_reuse: int = Field(2, ge=1, description="times a sample is trained at most (1 = no replay)")
    batch_fraction: float = Field(
        0.5,
        ge=0,
        description="replayed samples per step at most, as a fraction of the fresh samples "
        "(lowest scores first); the step trains fresh + replayed",
    )
    weighting: Literal["ess", "uniform", "balance"] = Field(
        "ess",
        description="ess: α_k = ESS_k / Σ_j ESS_j; uniform: every token alike (= decoupled "
        "PPO); balance: MIS balance heuristic over the stored weights of the recent versions",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ReplayConfig:
        if self.select == "variance" and self.quantile is None and self.threshold is None:
            raise ValueError("replay.select=variance needs replay.quantile or replay.threshold")
        if self.quantile is not None and self.threshold is not None:
            raise ValueError(
                "give replay.quantile or replay.threshold, not both "
                "(set replay.quantile=null to use the threshold)"
            )
        if not self.pmis and self.weighting == "balance":
            raise ValueError(
                "replay.weighting='balance' needs replay.pmis=true (pmis=false pools every "
                "token with its own decoupled weight)"
            )
        return self


class RayConfig(Section):
    """Where the rollout servers and trainer ranks 1..N-1 run with ``launcher: ray``
    (docs/cluster.md)."""

    address: str = Field(
        "local",
        description="Ray cluster: 'local' (start one in this process, for development), 'auto' "
        "(the cluster this node belongs to, e.g. under the Slurm script) or 'host:port'",
    )
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="wait for the Ray head at ray.address to answer (a head may be starting) "
        "before failing",
    )
    server_cpus: float = Field(1.0, gt=0, description="CPUs reserved per rollout server")
    server_gpus: float = Field(0.0, ge=0, description="GPUs reserved per rollout server")
    server_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per rollout server"
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description="placement group strategy of the rollout servers"
    )
    trainer_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="placement group strategy of trainer ranks 1..N-1 (train.world_size > "
        "1: one bundle of train.trainer_threads CPUs, + 1 GPU on CUDA, per rank)",
    )
    placement_timeout_s: float = Field(
        60.0, gt=0, description="wait for the servers' (or trainer ranks') resources before failing"
    )


class SandboxConfig(Section):
    """The sandbox of model-written code (code grading, the python tool; docs/security.md)."""

    allow_unisolated: bool = Field(
        False,
        description="run model-written code even where no namespace can be made (non-root "
        "without user namespaces, root without CAP_SYS_ADMIN): it can then read and change "
        "what this user can; off = such a run stops at its first sandbox use",
    )


class DistillConfig(Section):
    """On-policy distillation (docs/darl.md): the student samples, a teacher server scores
    the student's tokens, and each trained token's advantage becomes
    ``task_weight · A + coef · (log π_teacher − log π_student)``."""

    teacher: str | None = Field(
        None,
        description="the teacher: a model directory (started as one more built-in rollout "
        "server for the run) or the http(s):// URL of a running relayrl or SGLang server; "
        "null = off",
    )
    coef: float = Field(1.0, ge=0, description="weight of the per-token reverse-KL reward")
    task_weight: float = Field(
        1.0, ge=0, description="weight of the task advantage (0: distillation only)"
    )
    mode: Literal["reverse_kl"] = Field(
        "reverse_kl",
        description="per-token reward −(log π_student − log π_teacher) of the sampled tokens",
    )
    api_key: str | None = Field(
        None,
        exclude=True,  # never written to the run directory's config.yaml
        description="bearer key of a teacher URL someone else started (else $RELAYRL_API_KEY); "
        "a teacher the run launches gets a fresh key (docs/security.md)",
    )

    @field_validator("teacher")
    @classmethod
    def _teacher(cls, teacher: str | None) -> str | None:
        if teacher is None or teacher.startswith(("http://", "https://")):
            return teacher.rstrip("/") if teacher else teacher
        if not Path(teacher).is_dir():
            raise ValueError(
                f"distill.teacher: {teacher!r} is neither an http(s):// URL nor a model directory"
            )
        return teacher

    @property
    def enabled(self) -> bool:
        return self.teacher is not None


class RunConfig(Section):
    """One run."""

    name: str = Field("demo", description="run name: outputs go to <output_dir>/<name>")
    output_dir: str = Field("runs", description="parent directory of run directories")
    seed: int = Field(0, description="global seed (torch, python, numpy)")
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    launcher: str = Field(
        DEFAULT_LAUNCHER,
        description="who starts the rollout servers and trainer ranks 1..N-1, a name "
        "registered in relayrl.registry.LAUNCHERS (a plugin's: docs/extending.md): local = "
        "child processes of this one; ray = Ray actors placed by placement groups (ray.*, "
        "docs/cluster.md)",
    )
    ray: RayConfig = Field(default_factory=RayConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    plugins: list[str] = Field(
        default_factory=list,
        description="user modules imported before the config is validated, in every process "
        "of the run: dotted module names or .py file paths (stored absolute); they register "
        "tasks, graders, losses, advantages, workflows (docs/extending.md); --plugin on the "
        "command line adds more",
    )

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("plugins"):
            if not isinstance(data["plugins"], list):
                raise ValueError("plugins must be a list of module names or .py paths")
            data = {**data, "plugins": load_plugins(data["plugins"])}
        return data

    distill: DistillConfig = Field(default_factory=DistillConfig)

    @field_validator("launcher")
    @classmethod
    def _registered_launcher(cls, launcher: str, info: ValidationInfo) -> str:
        LAUNCHERS.check(launcher)  # a ValueError names the registered launchers
        rollout = info.data.get("rollout")
        if launcher != DEFAULT_LAUNCHER and rollout is not None and rollout.lag != "async":
            raise ValueError(
                f"rollout.lag={rollout.lag} starts no rollout server (it generates in this "
                f"process); launcher={launcher} needs rollout.lag=async"
            )
        return launcher

    @field_validator("rollout")
    @classmethod
    def _server_eval_needs_servers(cls, rollout: RolloutConfig, info: ValidationInfo):
        evaluation = info.data.get("eval")
        if evaluation is not None and evaluation.backend == "servers" and rollout.lag != "async":
            raise ValueError(
                f"eval.backend=servers evaluates on the rollout servers; rollout.lag="
                f"{rollout.lag} starts none (use eval.backend=trainer or rollout.lag=async)"
            )
        return rollout

    @field_validator("replay")
    @classmethod
    def _replay_needs_decoupled(cls, replay: ReplayConfig, info: ValidationInfo) -> ReplayConfig:
        algo = info.data.get("algo")
        if replay.enable and algo is not None and algo.loss != "decoupled":
            raise ValueError(
                f"replay.enable=true needs algo.loss='decoupled' (got {algo.loss!r}): "
                "selection and the multi-behaviour loss use π_prox"
            )
        train = info.data.get("train")
        if replay.enable and replay.weighting == "balance" and train and train.world_size > 1:
            raise ValueError(
                "replay.weighting='balance' keeps unsharded weight snapshots and is not "
                f"supported with train.world_size={train.world_size} (use 'ess' or 'uniform')"
            )
        if replay.enable and algo is not None and algo.aggregation == "seq_mean_token_mean":
            raise ValueError(
                "replay.enable=true weights tokens per behaviour version; it does not combine "
                "with algo.aggregation='seq_mean_token_mean'"
            )
        if replay.enable and replay.pmis and replay.weighting == "ess" and algo is not None:
            if algo.aggregation != "token_mean":
                raise ValueError(
                    "replay.weighting='ess' is a token mean per version; it needs "
                    "algo.aggregation='token_mean'"
                )
        return replay

    @model_validator(mode="after")
    def _resolve_auto_precision(self) -> RunConfig:
        """rollout.dtype=auto and train.mixed_precision=auto: bf16 where it is fast on
        model.device (relayrl.models.precision), else float32 compute."""
        auto = (self.rollout.dtype == "auto", self.train.mixed_precision == "auto")
        if not any(auto):
            return self
        fast = bf16_is_fast(self.model.device)
        if auto[0]:  # a LoRA run serves in model.dtype (_lora_supported)
            bf16_served = fast and self.model.lora is None
            self.rollout.dtype = "bfloat16" if bf16_served else self.model.dtype
        if auto[1]:
            self.train.mixed_precision = "bf16" if fast else "none"
        return self

    @model_validator(mode="after")
    def _adapters_at_once(self) -> RunConfig:
        """rollout.max_adapters >= 2 needs adapters to keep and a server that keeps them."""
        if self.rollout.max_adapters == 1:
            return self
        needed = {
            "model.lora": (self.model.lora is not None, "set (a LoRA run)"),
            "rollout.engine": (self.rollout.engine == "builtin", "'builtin'"),
            "train.publish_mode": (self.train.publish_mode == "retract", "'retract'"),
        }
        for key, (ok, what) in needed.items():
            if not ok:
                raise ValueError(
                    f"rollout.max_adapters={self.rollout.max_adapters} needs {key} {what} "
                    "(docs/lora.md), or set rollout.max_adapters=1"
                )
        return self

    @property
    def served_dtype(self) -> str:
        """The rollout servers' weights dtype: rollout.dtype, else model.dtype."""
        return self.rollout.dtype or self.model.dtype

    @model_validator(mode="after")
    def _lora_supported(self) -> RunConfig:
        """LoRA runs only where it is implemented (docs/lora.md "Not done yet")."""
        if self.model.lora is None:
            return self
        unsupported = {
            "rollout.lag": (self.rollout.lag, "async"),
            "rollout.dtype": (self.served_dtype, self.model.dtype),
        }
        for key, (value, needed) in unsupported.items():
            if value != needed:
                raise ValueError(
                    f"model.lora is not supported with {key}={value!r} yet (it needs "
                    f"{key}={needed!r}; docs/lora.md), or set model.lora=null"
                )
        return self
