"""What a checkpoint of a `relayrl train` run holds, when it is written, how it is restored.

Owns: :class:`RunCheckpoints` (the trainer plus a registry of named stateful components:
save at a step boundary, the periodic checkpoint, the checkpoint of a stop, restore) and the
:class:`Stateful` protocol a component implements. The on-disk format (atomic writes,
manifest, checksums, keep-last-N) is ``relayrl.train.checkpoint``'s.

A checkpoint taken after step k holds: the policy (Hugging Face directory), optimizer and
scheduler state and the trainer version (``trainer.pt``, ``relayrl.train.resume.
trainer_state``), RNG states (``relayrl.train.resume.rng``), and every registered
component's ``state_dict()`` as JSON: the rollout controller (loader position,
complete-but-untrained groups with their trajectories, per-token logprobs and versions,
in-flight prompt indices) and, when the loop registers one, the replay buffer. Adding a
component is one line: ``checkpoints.register("replay", buffer)``.

Imports: relayrl.train.checkpoint, relayrl.train.fsdp (the shards' directory name),
relayrl.errors, the other modules of relayrl.train.resume.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from relayrl.errors import RelayError
from relayrl.train.checkpoint import Checkpoint, CheckpointStore
from relayrl.train.resume.rng import RngState
from relayrl.train.resume.signals import StopRequested, StopSignal
from relayrl.train.resume.trainer_state import restore_trainer, trainer_state

RESERVED = frozenset({"trainer", "manifest", "model"})


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RunCheckpoints:
    """The checkpoints of one run: the trainer (weights, optimizer, scheduler, version),
    always, plus registered components; see the module docstring."""

    def __init__(self, run_dir: Path, every: int, keep: int, trainer: Any, tokenizer: Any) -> None:
        self.run_dir = Path(run_dir)
        self.store = CheckpointStore(self.run_dir / "checkpoints", keep)
        self.every = every
        self.trainer, self.tokenizer = trainer, tokenizer
        self.components: dict[str, tuple[Stateful, bool]] = {}
        self.last_step: int | None = None
        self.register("rng", RngState())

    def register(self, name: str, component: Stateful, required: bool = True) -> None:
        """Save ``component.state_dict()`` (JSON) in every checkpoint under ``name`` and
        restore it on resume; ``required=False`` lets a checkpoint without it load."""
        if name in RESERVED or name in self.components:
            raise ValueError(f"checkpoint component name {name!r} is taken")
        self.components[name] = (component, required)

    async def save(self, step: int) -> Checkpoint:
        """Checkpoint after ``step`` steps. The states are captured at once (the caller
        holds the trainer still); the files are written in a worker thread so the event
        loop keeps feeding the rollout servers meanwhile."""
        json_states = {name: c.state_dict() for name, (c, _) in self.components.items()}
        torch_states = {"trainer": trainer_state(self.trainer)}
        ckpt = await asyncio.to_thread(
            self.store.write,
            step,
            self.trainer.model,
            self.tokenizer,
            json_states,
            torch_states,
            self._shard_writer(),
        )
        self.last_step = step
        return ckpt

    async def after_step(self, done: int, total: int, stop: StopSignal) -> None:
        """The periodic checkpoint after ``done`` of ``total`` steps; then raise
        :class:`StopRequested` if a signal asked for a stop."""
        periodic = self.every > 0 and done % self.every == 0
        if periodic and done < total and done != self.last_step:
            await self.save(done)
        if stop.requested:
            raise StopRequested(stop.signal_name)

    async def save_and_stop(self, done: int) -> None:
        """The checkpoint of a stop on a signal (none after step 0: nothing to keep)."""
        if done and done != self.last_step:
            await self.save(done)
        print(
            f"stopped after step {done}; continue with: relayrl train --resume {self.run_dir}",
            flush=True,
        )

    def _shard_writer(self) -> Callable[[Path], None] | None:
        """Data-parallel ranks (``train.world_size`` > 1) also write sharded model and
        optimizer state (every rank its part) into the checkpoint."""
        save_shards = getattr(self.trainer, "save_shards", None)
        if save_shards is None:
            return None
        from relayrl.train.fsdp import SHARDS_DIR

        return lambda directory: save_shards(directory / SHARDS_DIR)

    def restore(self, ckpt: Checkpoint) -> int:
        """Load ``ckpt`` into the trainer and every registered component; returns its step.
        A checkpoint from any world size loads at any other (``relayrl.train.fsdp``)."""
        restore_trainer(self.trainer, ckpt)
        for name, (component, required) in self.components.items():
            if ckpt.has(name):
                component.load_state_dict(ckpt.read_json(name))
            elif required:
                raise RelayError(f"checkpoint {ckpt.path} holds no {name!r} state")
        self.last_step = ckpt.step
        return ckpt.step
