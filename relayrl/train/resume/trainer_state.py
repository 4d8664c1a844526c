"""The trainer's part of a checkpoint: what is written and how it is loaded back.

Owns: :func:`trainer_state` (optimizer, scheduler, version and D-ARL state, without the
weights, which go to the checkpoint's model directory), :func:`load_trainer_state` and
:func:`restore_trainer` (weights and state from a checkpoint written at any world size: the
DCP shards of a data-parallel run, else the Hugging Face weights and ``trainer.pt``; into the
ranks of a data-parallel trainer or this process).

Imports: relayrl.train.checkpoint, relayrl.engine.weights and relayrl.train.fsdp (when
restoring).
"""

from __future__ import annotations

from typing import Any

from relayrl.train.checkpoint import Checkpoint


def trainer_state(trainer: Any) -> dict[str, Any]:
    """The trainer's state (optimizer, scheduler, version and, with D-ARL, the replay buffer
    and policy snapshots) without the weights, which go to the model directory."""
    state = trainer.state_dict()
    state.pop("model")
    return state


def load_trainer_state(trainer: Any, state: dict[str, Any]) -> None:
    trainer.load_state_dict({**state, "model": trainer.model.state_dict()})


def restore_trainer(trainer: Any, ckpt: Checkpoint) -> None:
    """Weights, optimizer, scheduler, version (and D-ARL state) from ``ckpt``: the sharded
    files when the checkpoint has them (written at world size > 1), else the Hugging Face
    weights and ``trainer.pt``; into the ranks of a data-parallel trainer, or this process."""
    from relayrl.engine.weights import load_into, read_state_dict
    from relayrl.train.fsdp import SHARDS_DIR, SHARDS_METADATA, load_sharded
    from relayrl.train.lora import is_lora, load_adapter_dir

    shards = ckpt.path / SHARDS_DIR if ckpt.has(SHARDS_METADATA, "") else None
    state = ckpt.read_torch("trainer")
    if hasattr(trainer, "restore_checkpoint"):  # the data-parallel ranks
        trainer.restore_checkpoint(ckpt.model_dir, shards, state)
        return
    if shards is not None:
        load_sharded(trainer.model, trainer.optimizer, shards)
        state = {k: v for k, v in state.items() if k != "optimizer"}
    elif is_lora(trainer.model):  # the checkpoint's model/ is a PEFT adapter directory
        load_adapter_dir(trainer.model, ckpt.model_dir)
    else:
        load_into(trainer.model, read_state_dict(ckpt.model_dir))
    load_trainer_state(trainer, state)
