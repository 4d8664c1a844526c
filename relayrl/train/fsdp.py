"""The data-parallel trainer rank: :class:`ShardedRLTrainer`, FSDP2 over torch.distributed.

Owns: :class:`ShardedRLTrainer` (one rank of ``train.world_size``), :func:`shard_model`,
and the checkpoint helpers that work at any world size: :func:`save_sharded` /
:func:`load_sharded` (``torch.distributed.checkpoint``: model and optimizer, re-sharded on
load) and :func:`optimizer_state_by_name` (a single-process optimizer state keyed by
parameter name, to load a world-size-1 checkpoint into sharded ranks).

Every rank holds the whole batch (rank 0 broadcasts it, ``relayrl.train.distributed``) and
runs the same ``RLTrainer.train_step``; what differs is below the step:

- micro-batches: the step's (or PPO mini-batch's) sequences are dealt to ranks by tokens,
  then packed first-fit-decreasing under ``optim.micro_batch_tokens`` per rank
  (``relayrl.algo.microbatch.rank_micro_batches``); every rank runs as many micro-batches
  as the busiest one (the others add a one-token padding micro-batch with no loss), because
  each FSDP forward and backward is a collective;
- the token-mean normaliser is the all-reduced sum of the ranks' completion tokens, and the
  gradients are *summed* over ranks (divide factor 1, sum-only collectives: FSDP2's
  averaging is wrong on gloo, pytorch#162338, and the loss is already a global mean), so a
  step's gradient is the one of the whole batch at any world size;
- gradient sync once per optimizer step (the last micro-batch), global-norm clipping over
  the sharded gradients, statistics added up over ranks;
- the no-grad passes (π_prox, the reference policy, D-ARL candidates) run on each rank's
  share and are all-gathered, so D-ARL selection sees every sample, as at world size 1;
- publication gathers the full state dict on rank 0 (CPU offload) and writes the same
  safetensors file as the single-process trainer;
- under LoRA (``model.lora``) the sharded model is the peft model: only the adapters train
  and are in the optimizer, :meth:`ShardedRLTrainer.adapter_state` gathers only them (rank 0
  publishes from its replica, ``relayrl.train.distributed``), and the DCP shards hold only
  the adapters and their optimizer state (the base is the run's model), loadable at any
  world size.

Imports: torch, torch.distributed (FSDP2, DCP), relayrl.algo.microbatch, relayrl.train.options,
relayrl.train.trainer.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from relayrl.algo.microbatch import rank_micro_batches
from relayrl.rollout.trajectory import Trajectory
from relayrl.train.dcp_json import JsonReader, JsonWriter, SafeLoadPlanner
from relayrl.train.lora import adapter_state_from_dir, is_lora
from relayrl.train.options import ShardingOptions, TrainerOptions
from relayrl.train.trainer import RLTrainer, _collate, _MicroBatch

SHARDS_DIR = "shards"  # the DCP directory inside a checkpoint
SHARDS_METADATA = f"{SHARDS_DIR}/.metadata.json"  # JSON (relayrl.train.dcp_json), never a pickle


def decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``; under
    LoRA, of the peft model's base model)."""
    if is_lora(model):
        model = model.get_base_model()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__} has no model.layers to shard")
    return list(layers)


def shard_model(model: torch.nn.Module, sharding: ShardingOptions, device_type: str) -> None:
    """``fully_shard`` each decoder layer, then the root, over all ranks (in place).

    Gradients are reduced with a plain sum (divide factor 1, sum-only collectives): the
    loss each rank backpropagates is already divided by the global token count. With
    ``train.activation_checkpointing`` each layer recomputes its activations in backward;
    ``train.mixed_precision=bf16`` computes in bf16 and reduces in fp32."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if sharding.mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if sharding.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _padding_batch(pad_id: int, device: torch.device) -> _MicroBatch:
    """A micro-batch with no completion token: a rank with fewer micro-batches than the
    busiest runs it so that every rank joins each forward/backward collective."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    zeros = torch.zeros((1, 1), dtype=torch.float32, device=device)
    attn = torch.ones((1, 2), dtype=torch.long, device=device)
    return _MicroBatch([], ids, attn, ids[:, 1:], zeros, zeros, zeros, [])


class ShardedRLTrainer(RLTrainer):
    """One rank of the data-parallel trainer (see the module docstring). Built on every
    rank after ``torch.distributed.init_process_group``, with the same model and config."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: TrainerOptions,
        sharding: ShardingOptions,
        pad_id: int,
        device_type: str,
    ) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        kl = options.loss.kl_coef > 0
        # the KL reference stays an unsharded, frozen replica (no-grad passes only)
        self._reference = copy.deepcopy(model).eval().requires_grad_(False) if kl else None
        shard_model(model, sharding, device_type)
        super().__init__(model, options, pad_id)

    def _reference_copy(self, model: torch.nn.Module) -> torch.nn.Module:  # noqa: ARG002
        assert self._reference is not None
        return self._reference

    # ------------------------------------------------------------------ the split
    def _micro_batches(self, trajs: Sequence[Trajectory]) -> list[_MicroBatch]:
        """This rank's micro-batches of ``trajs``, padded to the busiest rank's count."""
        plans = rank_micro_batches(
            [t.num_tokens for t in trajs], self.world_size, self.options.micro_batch_tokens
        )
        device = self._device()
        mine = [_collate(trajs, idx, self.pad_id, device) for idx in plans[self.rank]]
        count = max(len(p) for p in plans)
        return mine + [_padding_batch(self.pad_id, device) for _ in range(count - len(mine))]

    def _device(self) -> torch.device:
        param = next(self.model.parameters())
        return param.to_local().device if isinstance(param, DTensor) else param.device

    def traj_logprobs(
        self,
        model: torch.nn.Module,
        trajs: Sequence[Trajectory],
        mbs: list[_MicroBatch] | None = None,
    ) -> list[torch.Tensor]:
        """No-grad logprobs of every trajectory: each rank's share, all-gathered."""
        mbs = mbs if mbs is not None else self._micro_batches(trajs)
        local = super().traj_logprobs(model, trajs, mbs)
        mine = {i: local[i] for mb in mbs for i in mb.index}
        shares: list[dict[int, torch.Tensor] | None] = [None] * self.world_size
        dist.all_gather_object(shares, mine)
        out = list(local)
        for share in shares:
            assert share is not None
            for i, values in share.items():
                out[i] = values
        return out

    # ------------------------------------------------------------------ the update
    def _count_tokens(self, trajs: Sequence[Trajectory], mbs: list[_MicroBatch]) -> int:
        """The all-reduced sum of the ranks' completion tokens (checked against the batch
        every rank holds: a mismatch means the ranks disagree about the step)."""
        count = sum(int(mb.mask.sum().item()) for mb in mbs)
        local = torch.tensor([count], dtype=torch.long, device=self._device())
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        total = int(local.item())
        expected = super()._count_tokens(trajs, mbs)
        if total != expected:
            raise AssertionError(f"ranks hold {total} completion tokens, the batch {expected}")
        return total

    def _backward(self, loss: torch.Tensor, index: int, count: int) -> None:
        """Accumulate locally; reduce-scatter (sum over ranks) after the last micro-batch."""
        self.model.set_requires_gradient_sync(index == count - 1)
        loss.backward()

    def _clip_gradients(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.options.grad_clip)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _reduce_stat_sums(
        self,
        sums: dict[str, float],
        maxes: dict[str, float],
        total: int,
        weight_sums: dict[str, float],
    ) -> tuple[dict[str, float], dict[str, float], int]:
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, (sums, maxes, total, dict(weight_sums)))
        sums, maxes, total = {}, {}, 0
        for key in weight_sums:
            weight_sums[key] = 0.0
        for rank_sums, rank_maxes, rank_total, rank_weights in parts:
            for key, value in rank_sums.items():
                sums[key] = sums.get(key, 0.0) + value
            for key, value in rank_maxes.items():
                maxes[key] = max(maxes.get(key, value), value)
            total += rank_total
            for key, value in rank_weights.items():
                weight_sums[key] += value
        return sums, maxes, total

    # ------------------------------------------------------------------ weights and state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights on rank 0's CPU (an empty dict on the other ranks);
        a collective: every rank calls it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Under LoRA: the unsharded adapter parameters by name on rank 0 (an empty dict on
        the other ranks), only they travel (all-gathered one by one); a collective."""
        state = {}
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                full = param.full_tensor() if isinstance(param, DTensor) else param
                state[name] = full.detach().to("cpu", copy=True)
        return state if self.rank == 0 else {}

    def save_weights(self, directory: Path | None) -> Path | None:
        """Gather the weights and, on rank 0, write ``directory/model.safetensors`` as the
        single-process trainer does (tied tensors once); a collective."""
        from safetensors.torch import save_file

        state = self.full_state_dict()
        if self.rank != 0:
            return None
        assert directory is not None
        directory.mkdir(parents=True, exist_ok=True)
        names = [name for name, _ in self.model.named_parameters()]
        save_file({n: state[n].contiguous() for n in names}, str(directory / "model.safetensors"))
        return directory

    def state_dict(self) -> dict[str, Any]:
        """Scheduler, version and D-ARL state; the weights and the optimizer state go to
        the sharded checkpoint (:meth:`save_shards`)."""
        state: dict[str, Any] = {
            "model": None,
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "world_size": self.world_size,
        }
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The counterpart of :meth:`state_dict`; a single-process ``optimizer`` state
        (a world-size-1 checkpoint) is loaded too, re-sharded."""
        if "optimizer" in state:
            full = optimizer_state_by_name(self.model, state["optimizer"])
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                full,
                options=StateDictOptions(full_state_dict=True),
            )
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if self.replay is not None and "replay" in state:
            self.replay.load_state_dict(state["replay"])

    def save_shards(self, directory: Path) -> None:
        save_sharded(self.model, self.optimizer, directory)

    def load_full_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (every rank passes the same, e.g. a Hugging Face dir)."""
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))

    def restore_checkpoint(
        self, model_dir: Path, shards: Path | None, trainer_state: dict[str, Any]
    ) -> None:
        """Load a checkpoint written at any world size: the DCP shards when it has them,
        else the Hugging Face weights and the single-process optimizer state."""
        if shards is not None:
            load_sharded(self.model, self.optimizer, shards)
            trainer_state = {k: v for k, v in trainer_state.items() if k != "optimizer"}
        elif is_lora(self.model):  # model_dir: a PEFT adapter directory (world size 1)
            set_model_state_dict(
                self.model,
                adapter_state_from_dir(self.model, model_dir),
                options=StateDictOptions(full_state_dict=True, strict=False),
            )
        else:
            from relayrl.engine.weights import read_state_dict

            self.load_full_weights(read_state_dict(model_dir))
        self.load_state_dict(trainer_state)


# --------------------------------------------------------------------------- checkpoints
def _dcp_options(model: torch.nn.Module) -> StateDictOptions:
    """Under LoRA the frozen base weights stay out of the shards (they are the run's model):
    only the adapters are saved, and loaded without asking for the base."""
    lora = is_lora(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write model and optimizer with ``torch.distributed.checkpoint`` (each rank its
    shards, rank 0 the metadata; a collective when a process group is up); under LoRA only
    the adapters and their optimizer state."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_dcp_options(model))
    state = {"model": model_state, "optimizer": optim_state}
    dcp.save(state, storage_writer=JsonWriter(str(directory)))  # JSON metadata, no pickle


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load :func:`save_sharded`'s files into ``model``/``optimizer`` at this world size
    (FSDP2 ranks or one plain process): DCP re-shards to the current layout."""
    options = _dcp_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    with warnings.catch_warnings():  # one process, no group: loading in-process is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # JSON metadata and weights_only byte items: resuming never unpickles (dcp_json)
        dcp.load(state, storage_reader=JsonReader(str(directory)), planner=SafeLoadPlanner())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )


def optimizer_state_by_name(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A single-process ``optimizer.state_dict()`` (parameters by position in
    the trainable ``model.parameters()``, all but a LoRA model's frozen base) keyed by
    parameter name instead, as ``set_optimizer_state_dict(..., full_state_dict=True)``
    takes it."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(i)] for i in group["params"]]}
            for group in state["param_groups"]
        ],
    }
