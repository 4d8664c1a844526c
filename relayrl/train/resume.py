"""Checkpoint and resume of a `relayrl train` run: what a checkpoint holds, when it is
written, how a run continues from one, and stopping cleanly on SIGINT/SIGTERM.

Owns: :class:`RunCheckpoints` (the trainer plus a registry of named stateful components:
save at a step boundary, restore), :class:`RngState`, :func:`begin_run` (fresh start or
resume), :func:`truncate_logs`, :func:`resume_config`, :class:`StopSignal` and
:class:`StopRequested`. The on-disk format (atomic writes, manifest, checksums, keep-last-N)
is ``relayrl.train.checkpoint``'s.

A checkpoint taken after step k holds: the policy (Hugging Face directory), optimizer and
scheduler state and the trainer version (``trainer.pt``), RNG states (python, numpy, torch),
and every registered component's ``state_dict()`` as JSON: the rollout controller (loader
position, complete-but-untrained groups with their trajectories, per-token logprobs and
versions, in-flight prompt indices) and, when the loop registers one, the replay buffer.
Adding a component is one line: ``checkpoints.register("replay", buffer)``.

Logs: on resume ``metrics.jsonl`` keeps rows with ``step <= k`` (minus the final
evaluation) and ``samples.jsonl`` rows with ``step < k`` (0-based step of training), so
both continue without gaps or duplicates; a torn last line is dropped.

Imports: relayrl.train.checkpoint, relayrl.engine.weights, relayrl.config, relayrl.errors,
numpy and torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from relayrl.errors import RelayError
from relayrl.train.checkpoint import Checkpoint, CheckpointStore

SUMMARY = "train_summary.json"
RESERVED = frozenset({"trainer", "manifest", "model"})


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RngState:
    """The global RNGs of this process (python, numpy, torch CPU and CUDA) as JSON."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist(),
        }
        if torch.cuda.is_available():
            state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
            )


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

    shards = ckpt.path / SHARDS_DIR if ckpt.has(SHARDS_METADATA, "") else None
    state = ckpt.read_torch("trainer")
    if hasattr(trainer, "restore_checkpoint"):  # the data-parallel ranks
        trainer.restore_checkpoint(ckpt.model_dir, shards, state)
        return
    if shards is not None:
        load_sharded(trainer.model, trainer.optimizer, shards)
        state = {k: v for k, v in state.items() if k != "optimizer"}
    else:
        load_into(trainer.model, read_state_dict(ckpt.model_dir))
    load_trainer_state(trainer, state)


# --------------------------------------------------------------------------- run start
def begin_run(run_dir: Path, config: Any, resume: bool) -> Checkpoint | None:
    """Prepare ``run_dir`` for training; returns the checkpoint to continue from, if any.

    Fresh start: checkpoints and the summary of an earlier run under this name are removed
    (the logs are rewritten anyway). Resume: the newest checkpoint that verifies, with the
    logs cut back to it; none yet means starting from step 0.
    """
    store = CheckpointStore(run_dir / "checkpoints", config.train.keep_checkpoints)
    if not resume:
        removed = store.clear()
        (run_dir / SUMMARY).unlink(missing_ok=True)
        if removed:
            print(f"note: removed {removed} checkpoint(s) of an earlier run in {run_dir}")
        return None
    if (run_dir / SUMMARY).exists():
        raise RelayError(f"{run_dir} already finished ({SUMMARY} exists); nothing to resume")
    ckpt = store.latest()
    if ckpt is None:
        print(f"resume: no checkpoint in {run_dir} yet, starting from step 0", flush=True)
        return None
    if ckpt.step >= config.train.total_steps:
        raise RelayError(
            f"checkpoint {ckpt.path} is at step {ckpt.step}, train.total_steps is "
            f"{config.train.total_steps}: nothing left to train"
        )
    truncate_logs(run_dir, ckpt.step)
    return ckpt


def _rewrite_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash mid-write
        if isinstance(row, dict) and keep(row):
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def truncate_logs(run_dir: Path, step: int) -> None:
    """Cut ``metrics.jsonl`` and ``samples.jsonl`` back to a checkpoint after ``step`` steps."""
    _rewrite_jsonl(
        run_dir / "metrics.jsonl",
        lambda row: not row.get("final") and int(row.get("step", 0)) <= step,
    )
    _rewrite_jsonl(run_dir / "samples.jsonl", lambda row: int(row.get("step", 0)) < step)


def resume_config(run_dir: str | Path, overrides: list[str]) -> Any:
    """The config of the run in ``run_dir`` (its saved ``config.yaml``) plus ``overrides``,
    with ``output_dir``/``name`` pointing at ``run_dir`` wherever it now lives."""
    from relayrl.config.loader import load_config

    run = Path(run_dir)
    saved = run / "config.yaml"
    if not saved.is_file():
        raise RelayError(f"--resume {run_dir}: no config.yaml there (not a relayrl run directory)")
    location = [f"output_dir={run.resolve().parent}", f"name={run.name}"]
    return load_config(str(saved), [*overrides, *location])


def remove_orphaned_dirs(base: Path, prefix: str) -> list[Path]:
    """Remove ``base/<prefix><pid>-*`` directories whose process is gone (a run killed with
    -9 cannot clean up its published weights); returns the removed paths."""
    removed = []
    for path in base.glob(f"{prefix}*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- signals
class StopRequested(KeyboardInterrupt):
    """SIGINT/SIGTERM asked the run to checkpoint and stop (a KeyboardInterrupt, so that
    ``except Exception`` never swallows it and the CLI exits with 130 as for Ctrl-C)."""


class StopSignal:
    """SIGINT/SIGTERM during the loop: finish the current step, checkpoint, stop. A second
    signal stops at once (KeyboardInterrupt, no checkpoint). ``on_stop(StopRequested)`` is
    called on the first signal (the loop passes ``controller.fail``, so a wait for a batch
    ends at once). Only the main thread can own signal handlers; elsewhere this is inert.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_stop: Callable[[BaseException], None]) -> None:
        self.on_stop = on_stop
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            self._loop.add_signal_handler(sig, self._handle, sig)

    def uninstall(self) -> None:
        if self._loop is None:
            return
        for sig, previous in self._previous.items():
            self._loop.remove_signal_handler(sig)
            signal.signal(sig, previous)
        self._previous.clear()
        self._loop = None

    def _handle(self, sig: int) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(sig).name
        print(
            f"\n{self.signal_name}: stopping after this step with a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        self.on_stop(StopRequested(self.signal_name))
