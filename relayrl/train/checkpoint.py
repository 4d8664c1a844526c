"""Atomic, verified checkpoints: one directory per training step under ``<run>/checkpoints``.

Owns: :class:`CheckpointStore` (write, verify, find the newest good checkpoint, keep the last
N), :class:`Checkpoint` (a verified checkpoint on disk), :class:`CorruptCheckpoint`,
:class:`UnsafeCheckpoint` and :class:`CheckpointWarning`. What goes *into* a checkpoint is ``relayrl.train.resume``'s job.

Layout of ``<run>/checkpoints/step-000012/``::

    model/          the policy as a Hugging Face directory (save_pretrained: config,
                    model.safetensors, tokenizer), loadable by transformers unchanged;
                    under LoRA the PEFT adapter directory (adapter_config.json,
                    adapter_model.safetensors, tokenizer) instead
    shards/         train.world_size > 1 only: model and optimizer state as
                    torch.distributed.checkpoint shards (one file per rank + the metadata
                    as .metadata.json, relayrl.train.dcp_json), loadable at any world size
                    (relayrl.train.fsdp)
    <name>.json     one JSON state per name (controller, RNG, replay buffer, ...)
    <name>.pt       torch states (optimizer, scheduler)
    manifest.json   format, step, and the size and sha256 of every other file; written last

Atomicity: everything is written under ``.tmp-step-000012-<pid>/``; every file is fsynced,
the manifest is written and fsynced last, the directory is renamed to its final name and the
parent directory fsynced. A crash at any moment leaves the previous checkpoints untouched plus
at most one ``.tmp-*`` directory (removed by the next writer), never a half-written
``step-*``. Reading verifies every size and checksum: a checkpoint that fails (a partial copy,
a flipped bit, a missing file) is skipped with a :class:`CheckpointWarning` and the previous
one is used. A manifest missing a field or naming a file outside the checkpoint is corrupt
too. Nothing read back is unpickled: JSON, safetensors, ``torch.load(weights_only=True)``
(torch's restricted loader) for ``<name>.pt``, JSON metadata for the DCP shards. The sha256
sums catch accidents, not a writer: whoever can write a checkpoint can also rewrite its
manifest (docs/security.md). A failed write (disk full, unwritable directory) raises a :class:`RelayError`
naming the directory; the previous checkpoints stay intact.

Test hook: ``RELAYRL_TEST_CHECKPOINT_DELAY_S`` sleeps inside every write, after the data files
and before the manifest, so a test can kill the process in that window.

Imports: torch (saving states), relayrl.engine.weights (reading the model back), relayrl.errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.errors import RelayError

FORMAT = 1
MANIFEST = "manifest.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DELAY_ENV = "RELAYRL_TEST_CHECKPOINT_DELAY_S"
PICKLED_DCP_METADATA = ".metadata"  # what torch's own DCP writer leaves: a pickle


class CorruptCheckpoint(Exception):
    """A checkpoint directory failed verification; the message says what is wrong."""


class UnsafeCheckpoint(CorruptCheckpoint):
    """A checkpoint that loading could run code from (a pickled DCP ``.metadata``, written by
    an older relayrl): skipped like a corrupt one but left on disk."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt or partial) and an older one is used instead."""


# a checkpoint's model: a Hugging Face directory, or under LoRA a PEFT adapter directory
MODEL_FILES = ("model/config.json", "model/adapter_config.json")


def step_dirname(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_bytes(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _json_bytes(name: str, state: Any) -> bytes:
    try:
        return json.dumps(state, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise RelayError(f"checkpoint state {name!r} is not JSON-serialisable: {exc}") from exc


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint directory."""

    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    def read_json(self, name: str) -> Any:
        return json.loads((self.path / f"{name}.json").read_text())

    def read_torch(self, name: str) -> Any:
        return torch.load(self.path / f"{name}.pt", map_location="cpu", weights_only=True)

    def has(self, name: str, suffix: str = ".json") -> bool:
        return f"{name}{suffix}" in self.manifest["files"]


def verify(path: Path) -> Checkpoint:
    """Check ``path``'s manifest, and every listed file's size and sha256."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError as exc:
        raise CorruptCheckpoint("no manifest.json (a partial write)") from exc
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"unreadable manifest.json: {exc}") from exc
    files = _checked_manifest(manifest)
    for rel, meta in files.items():
        file = path / rel
        try:
            size = file.stat().st_size
        except OSError as exc:
            raise CorruptCheckpoint(f"{rel}: missing ({exc.strerror})") from exc
        if size != meta["bytes"]:
            raise CorruptCheckpoint(f"{rel}: {size} bytes, the manifest says {meta['bytes']}")
        if _sha256(file) != meta["sha256"]:
            raise CorruptCheckpoint(f"{rel}: sha256 differs from the manifest (corrupt)")
    return Checkpoint(path, manifest["step"], manifest)


def _checked_manifest(manifest: Any) -> dict[str, dict[str, Any]]:
    """The ``files`` of a manifest whose every field has the type it must have (a missing
    or mistyped field is a :class:`CorruptCheckpoint`, never a ``KeyError``); file names
    stay inside the checkpoint, and a pickled DCP ``.metadata`` is refused (loading it
    could run code: relayrl.train.dcp_json)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"manifest.json is not a format-{FORMAT} checkpoint manifest")
    step = manifest.get("step")
    if type(step) is not int or step < 0:
        raise CorruptCheckpoint(f"manifest.json: step must be a non-negative integer, got {step!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not any(f in files for f in MODEL_FILES):
        raise CorruptCheckpoint("manifest.json lists no model")
    for rel, meta in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            raise CorruptCheckpoint(f"manifest.json: file {rel!r} lies outside the checkpoint")
        if parts[-1] == PICKLED_DCP_METADATA:
            raise UnsafeCheckpoint(
                f"{rel}: pickled DCP metadata (written by an older relayrl); not loaded, "
                "unpickling runs code"
            )
        if not isinstance(meta, dict) or type(meta.get("bytes")) is not int:
            raise CorruptCheckpoint(f"manifest.json: {rel!r} has no integer 'bytes'")
        if not isinstance(meta.get("sha256"), str):
            raise CorruptCheckpoint(f"manifest.json: {rel!r} has no 'sha256'")
    return files


class CheckpointStore:
    """Checkpoints of one run under ``root``; the newest ``keep`` complete ones are kept."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = Path(root)
        self.keep = keep

    # ------------------------------------------------------------------ listing
    def step_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step-*`` directory, newest first (unverified)."""
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.iterdir():
            if (
                path.is_dir()
                and path.name.startswith(PREFIX)
                and path.name[len(PREFIX) :].isdigit()
            ):
                out.append((int(path.name[len(PREFIX) :]), path))
        return sorted(out, reverse=True)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; each newer bad one is reported and removed
        (a run resumed from an older step will write those steps again)."""
        for _, path in self.step_dirs():
            try:
                return verify(path)
            except CorruptCheckpoint as exc:
                unsafe = isinstance(exc, UnsafeCheckpoint)
                done = "left it in place" if unsafe else "removed it"
                warnings.warn(
                    CheckpointWarning(
                        f"checkpoint {path} is unusable ({exc}); {done}, trying the previous one"
                    ),
                    stacklevel=2,
                )
                if not unsafe:
                    shutil.rmtree(path, ignore_errors=True)
        return None

    def clear(self) -> int:
        """Remove every checkpoint (a fresh run in an old run directory); returns how many."""
        n = len(self.step_dirs())
        shutil.rmtree(self.root, ignore_errors=True)
        return n

    # ------------------------------------------------------------------ writing
    def write(
        self,
        step: int,
        model: Any,
        tokenizer: Any,
        json_states: Mapping[str, Any],
        torch_states: Mapping[str, Any],
        write_extra: Callable[[Path], None] | None = None,
    ) -> Checkpoint:
        """Write checkpoint ``step`` atomically, then keep the newest ``keep``.

        ``model``/``tokenizer``: anything with ``save_pretrained``; the states: name → value;
        ``write_extra(directory)`` writes more files (the sharded trainer state), all of
        which the manifest lists.
        Raises RelayError (naming the directory and the cause) if anything fails; the
        previous checkpoints are untouched then.
        """
        final = self.root / step_dirname(step)
        tmp = self.root / f"{TMP_PREFIX}{step_dirname(step)}-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_partial()
            tmp.mkdir()
            files = self._write_contents(
                tmp, model, tokenizer, json_states, torch_states, write_extra
            )
            _sleep_for_tests()
            manifest = {"format": FORMAT, "step": step, "created": time.time(), "files": files}
            _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_path(tmp)
            if final.exists():  # an unusable leftover of an interrupted run
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_path(self.root)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            previous = [p.name for _, p in self.step_dirs() if p != final]
            kept = f"the previous checkpoint {previous[0]} is intact" if previous else "none older"
            raise RelayError(
                f"cannot write checkpoint {final}: {exc}; {kept}. Free space or fix the "
                f"permissions of {self.root}, then continue with `relayrl train --resume "
                f"{self.root.parent}`"
            ) from exc
        self._prune()
        return Checkpoint(final, step, manifest)

    def _write_contents(
        self,
        tmp: Path,
        model: Any,
        tokenizer: Any,
        json_states: Mapping[str, Any],
        torch_states: Mapping[str, Any],
        write_extra: Callable[[Path], None] | None,
    ) -> dict[str, dict[str, Any]]:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        if write_extra is not None:
            write_extra(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        for name, state in json_states.items():
            _write_bytes(tmp / f"{name}.json", _json_bytes(name, state))
        for name, state in torch_states.items():
            _write_bytes(tmp / f"{name}.pt", _torch_bytes(state))
        files: dict[str, dict[str, Any]] = {}
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync_path(file)
            files[file.relative_to(tmp).as_posix()] = {
                "bytes": file.stat().st_size,
                "sha256": _sha256(file),
            }
        _fsync_path(tmp / "model")
        return files

    def _remove_partial(self) -> None:
        for path in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        for _, path in self.step_dirs()[self.keep :]:
            # rename first: a crash mid-delete must not leave a step-* that looks complete
            doomed = path.with_name(f"{TMP_PREFIX}old-{path.name}")
            with contextlib.suppress(OSError):
                os.rename(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)


def _sleep_for_tests() -> None:
    delay = os.environ.get(DELAY_ENV)
    if delay:
        time.sleep(float(delay))
