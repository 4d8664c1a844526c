"""LoRA training with ``peft`` (``model.lora``, docs/lora.md).

Owns: :func:`apply_lora` (wrap a policy in LoRA adapters: only they require gradients),
:func:`is_lora`, :func:`trainable_parameters` (what an optimizer steps), :func:`adapter_of`
(the adapters as ``relayrl.engine.adapter.Adapter``, under the base model's module names),
:func:`save_adapter_snapshot` (an adapter-only publication, with the checksum of the merged
weights a server will report), :func:`save_model` (the final or SFT model: the merged model
plus the standard PEFT adapter directory in ``adapter/``) and :func:`load_adapter_dir` (a
checkpoint's PEFT adapter back into the trainer's adapters).

Imports: relayrl.config, relayrl.engine.adapter, relayrl.errors, peft (lazily), torch.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch

from relayrl.config.schema import LoraConfig
from relayrl.engine.adapter import Adapter, merged_checksum, write_adapter
from relayrl.errors import RelayError

ADAPTER_NAME = "default"  # peft's name of the one adapter
PEFT_DIR = "adapter"  # the PEFT adapter directory inside a saved model directory

__all__ = [
    "PEFT_DIR",
    "adapter_names",
    "adapter_of",
    "adapter_snapshot",
    "adapter_state_from_dir",
    "apply_lora",
    "is_lora",
    "load_adapter_dir",
    "save_adapter_snapshot",
    "save_model",
    "trainable_parameters",
]


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise RelayError(
            "model.lora needs the peft package: pip install 'relayrl[lora]' (or set "
            "model.lora=null for full fine-tuning)"
        ) from exc
    return peft


def apply_lora(
    model: torch.nn.Module, lora: LoraConfig, seed: int | None = None
) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``lora.target_modules`` (a ``peft`` model; ``model``
    itself is changed in place). RelayError when a target is not a torch Linear. ``seed``:
    the adapters' initial values are drawn from it (without touching the global random
    state), so every trainer rank and a rank-0 replica start from the same adapters."""
    peft = _peft()
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
    )
    try:
        with torch.random.fork_rng(devices=[], enabled=seed is not None), warnings.catch_warnings():
            # peft 0.21 asks transformers 5 the deprecated `is_gradient_checkpointing`: a
            # FutureWarning in every LoRA run's output that the user can do nothing about
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            if seed is not None:
                torch.manual_seed(seed)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        raise RelayError(f"model.lora.target_modules={lora.target_modules!r}: {exc}") from exc
    for name, module in _lora_layers(wrapped):
        if type(module.get_base_layer()) is not torch.nn.Linear:
            raise RelayError(
                f"model.lora.target_modules: {name!r} is a "
                f"{type(module.get_base_layer()).__name__}, only torch Linear layers are "
                "supported"
            )
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``peft`` model (without importing peft when it is not)."""
    return any(c.__module__.startswith("peft.") for c in type(model).__mro__)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: all of them, or only the adapters under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def _lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(module name in the base model, peft LoRA layer) of every adapted module."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return [
        (name, m)
        for name, m in base.named_modules()
        if isinstance(m, LoraLayer) and ADAPTER_NAME in m.lora_A
    ]


def adapter_of(model: torch.nn.Module) -> Adapter:
    """The adapters of ``model`` (a peft model), detached, under the base model's names."""
    pairs, scales = {}, set()
    for name, layer in _lora_layers(model):
        a = layer.lora_A[ADAPTER_NAME].weight.detach()
        b = layer.lora_B[ADAPTER_NAME].weight.detach()
        pairs[name] = (a, b)
        scales.add(float(layer.scaling[ADAPTER_NAME]))
    if len(scales) != 1:
        raise RelayError(f"LoRA layers must share one scale, found {sorted(scales)}")
    return Adapter(pairs, scales.pop())


def base_named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base model's parameters under the plain model's names (a tied tensor once)."""
    return [
        (name.replace(".base_layer.", "."), p)
        for name, p in model.get_base_model().named_parameters()
        if ".lora_" not in name
    ]


def adapter_snapshot(model: torch.nn.Module) -> Adapter:
    """The adapters of ``model`` (a peft model) as one publication, with the checksum of the
    merged weights that a server applying them holds (``relayrl.engine.adapter``)."""
    adapter = adapter_of(model)
    adapter.checksum = merged_checksum(base_named(model), adapter)
    return adapter


def save_adapter_snapshot(model: torch.nn.Module, directory: Path) -> Path:
    """An adapter-only publication of ``model`` in ``directory`` (:func:`adapter_snapshot`)."""
    return write_adapter(adapter_snapshot(model), directory)


def absolute_base_paths(model: torch.nn.Module) -> None:
    """Each adapter's ``base_model_name_or_path`` as an absolute path when it names a
    directory relative to this process's working directory (``model.path=my_model``), so
    that ``adapter_config.json`` loads with peft from any directory; a hub name is kept."""
    for peft_config in getattr(model, "peft_config", {}).values():
        base = getattr(peft_config, "base_model_name_or_path", None)
        if base and not Path(base).is_absolute() and Path(base).is_dir():
            peft_config.base_model_name_or_path = str(Path(base).resolve())


def save_model(model: torch.nn.Module, out: Path, merge_in_place: bool = False) -> torch.nn.Module:
    """Save ``model`` as a Hugging Face directory ``out``. A LoRA model is saved merged
    (base + adapters: what the servers serve), with its PEFT adapter directory in
    ``out/adapter`` (``adapter_config.json`` + ``adapter_model.safetensors``). Returns the
    merged model (``merge_in_place``: ``model`` itself is merged, no copy)."""
    if not is_lora(model):
        model.save_pretrained(out)
        return model
    absolute_base_paths(model)
    model.save_pretrained(out / PEFT_DIR)
    merged = (model if merge_in_place else copy.deepcopy(model)).merge_and_unload()
    merged.save_pretrained(out)
    return merged


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s adapter parameters (its trainable ones under LoRA), in
    ``model.named_parameters()`` order: the optimizer's order too."""
    return [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" in n]


def adapter_state_from_dir(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The PEFT adapter directory ``directory`` as ``model``'s adapter parameters by name
    (peft saves ``X.lora_A.weight`` for the parameter ``X.lora_A.default.weight``): what
    sharded ranks load with ``set_model_state_dict``. RelayError when it does not fit."""
    from safetensors.torch import load_file

    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        raise RelayError(f"{str(directory)!r} holds no PEFT adapter (adapter_model.safetensors)")
    saved = load_file(str(file))
    wanted = {n.replace(f".{ADAPTER_NAME}.", "."): n for n in adapter_names(model)}
    if set(saved) != set(wanted):
        missing = sorted(set(wanted) - set(saved))
        unexpected = sorted(set(saved) - set(wanted))
        raise RelayError(
            f"adapter {str(file)!r} does not fit the model's adapters: unexpected "
            f"{unexpected[:3]}, missing {missing[:3]}"
        )
    return {wanted[k]: v for k, v in saved.items()}


def load_adapter_dir(model: torch.nn.Module, directory: Path) -> None:
    """Load the PEFT adapter directory ``directory`` (a checkpoint's ``model/``) into
    ``model``'s adapters; RelayError when it does not fit them exactly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        raise RelayError(f"{str(directory)!r} holds no PEFT adapter (adapter_model.safetensors)")
    result = set_peft_model_state_dict(model, load_file(str(file)))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if ".lora_" in k]
    if unexpected or missing:
        raise RelayError(
            f"adapter {str(file)!r} does not fit the model's adapters: unexpected "
            f"{unexpected[:3]}, missing {missing[:3]}"
        )
