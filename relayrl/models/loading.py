"""Load any Hugging Face causal-LM directory and turn prompts into token ids."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from relayrl.errors import RelayError


def check_model_dir(path: str | Path, key: str | None = None) -> Path:
    """Raise a clear error unless ``path`` is a Hugging Face model directory; ``key`` (e.g.
    ``model.path``) is named first in the message."""
    p = Path(path)
    named = f"{key}: " if key else ""
    if not p.is_dir():
        raise RelayError(
            f"{named}model path {str(p)!r} is not a directory; expected a Hugging Face "
            "model directory (config.json + weights)"
        )
    if not (p / "config.json").is_file():
        raise RelayError(
            f"{named}model path {str(p)!r} has no config.json; expected a Hugging Face "
            "model directory (config.json + weights)"
        )
    return p


def check_prompt_template(tokenizer, system_prompt: str | None) -> None:
    """Render one prompt through ``tokenizer`` as every run does: a chat
    template that refuses ``model.system_prompt`` is a RelayError naming the key here,
    before any process starts, not in the middle of a run."""
    if not system_prompt:
        return
    prompt_text(tokenizer, "1 + 1 = ?", system_prompt)


def check_model_path(path: str | None, system_prompt: str | None) -> None:
    """``model.path`` is a model directory whose tokenizer loads, and its chat template
    takes ``model.system_prompt`` (a template that refuses a system turn is an error
    naming the key). Without ``model.path`` the run builds its own tokenizer (no
    template): nothing to check."""
    if not path:
        return
    model_dir = check_model_dir(path, key="model.path")
    check_prompt_template(load_tokenizer(model_dir), system_prompt)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    p = check_model_dir(path)
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        raise RelayError(f"cannot load a tokenizer from {str(p)!r}: {exc}") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | Path, device: str = "cpu", dtype: str = "float32"):
    """Load a causal LM in eval mode; ``dtype`` is a torch dtype name."""
    import torch
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=getattr(torch, dtype))
    except Exception as exc:  # noqa: BLE001
        raise RelayError(f"cannot load a causal LM from {str(p)!r}: {exc}") from exc
    prefer_shape_agnostic_attention(device)
    return model.to(device).eval()


def prefer_shape_agnostic_attention(device) -> None:
    """On CUDA, take the cuDNN backend out of ``scaled_dot_product_attention``.

    cuDNN builds an execution plan for every new input shape (about 2 ms per attention call
    on an H100, docs/benchmarks.md "GPU"), and RL shapes change at every decode step (the KV
    length grows) and every micro-batch. The memory-efficient and flash kernels need no
    plan. Process-wide; a no-op on CPU.
    """
    import torch

    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def quiet_libraries() -> None:
    """Turn transformers' and huggingface_hub's progress bars off for this process and the
    processes it starts ("Writing model shards" on every ``save_pretrained``, "Loading
    weights"): relayrl's dashboard is the display, and a weight publication or evaluation
    save would print one bar each. Process-wide; imports neither library (the CLI calls it
    at start): the environment switch is read when they are imported, and a library
    already imported is switched off directly."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # huggingface_hub's bars too
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


PLAIN_TEMPLATE = "{prompt}\n"


def encode_prompt(tokenizer, prompt: str, system_prompt: str | None = None) -> list[int]:
    """Token ids for a user prompt: the chat template when the tokenizer has one, otherwise
    the plain template (the prompt and a newline, after which the completion starts).
    ``system_prompt`` (``model.system_prompt``): a system message before the prompt, the
    template's system turn; without a template, a first paragraph."""
    text = prompt_text(tokenizer, prompt, system_prompt)
    return leading_special_ids(tokenizer) + tokenizer(text, add_special_tokens=False)["input_ids"]


def leading_special_ids(tokenizer) -> list[int]:
    """What a prompt without a chat template starts with: the BOS the tokenizer puts before
    a text of its own accord (a base model's, e.g. Llama's or Gemma's, which it saw before
    every pretraining document; Gemma 3 270M without it wrote no sense). A chat template
    writes its own; a tokenizer that adds none (the tiny models') gets none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or getattr(tokenizer, "chat_template", None):
        return []
    return [bos] if tokenizer("", add_special_tokens=True)["input_ids"][:1] == [bos] else []


def prompt_text(tokenizer, prompt: str, system_prompt: str | None = None) -> str:
    """The text :func:`encode_prompt` tokenizes (for callers that tokenize many at once)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja's TemplateError: raise_exception() in the template
            if not system_prompt:
                raise
            raise RelayError(
                f"model.system_prompt: the tokenizer's chat template refuses a system "
                f"message ({exc}); unset it or put the instructions in the prompt template"
            ) from exc
    if system_prompt:
        prompt = f"{system_prompt}\n\n{prompt}"
    return PLAIN_TEMPLATE.format(prompt=prompt)
