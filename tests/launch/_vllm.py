"""What the tests against a real vLLM server share (tests/launch/test_vllm_*.py): the vLLM
environment (and the mark that skips without it), the run config (and a two-step run's), one
server started on loopback for a module, 'trained' weights, the trainer's logprob recompute, prompts."""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relayrl.config.loader import load_config
from relayrl.launch.backends import make_backend
from relayrl.launch.servers import ServerLauncher
from relayrl.launch.vllm import VENV_DIR, vllm_version
from relayrl.train.trainer import RLTrainer

CHECKOUT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = CHECKOUT / VENV_DIR / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.is_file() or vllm_version(str(VLLM_PYTHON)) is None,
    reason=f"no vLLM environment at {VLLM_PYTHON} (`make vllm` builds it; `make test` does)",
)

# measured on the tiny model, float32, 2-core CPU (2026-11-23): max |Δ logprob| 6e-6,
# mean k3 ~1e-12; the bounds leave two orders of magnitude for other CPUs' kernels
MAX_LOGPROB_DIFF = 1e-3
MAX_MEAN_K3 = 1e-7


def vllm_config(model_dir: Path, *overrides: str):
    base = [
        f"model.path={model_dir}",
        "model.max_context=128",
        "rollout.engine=vllm",
        "rollout.max_running_requests=16",
        "rollout.startup_timeout_s=400",
        f"rollout.vllm.python={VLLM_PYTHON}",
    ]
    return load_config(None, base + list(overrides))


# a short run on the tiny model: small batches, no evaluation, checkpoint or final save
SHORT_RUN = (
    "rollout.prompts_per_step=2",
    "rollout.n_samples=2",
    "rollout.max_new_tokens=16",
    "algo.dynamic_sampling=false",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "train.save_final=false",
    "eval.num_problems=4",
    "eval.max_new_tokens=16",
    "runtime.threads=1",
    "train.trainer_threads=1",
)


def short_run_config(tmp_path: Path, model_dir: Path, url: str, *overrides: str):
    """A two-step run on the vLLM server at ``url`` (external: not launched, not stopped)."""
    return vllm_config(
        model_dir,
        f"output_dir={tmp_path}",
        "name=ext",
        f"rollout.server_urls=[{url}]",
        *SHORT_RUN,
        "rollout.eta=0",  # step 2 waits for the publication of version 1: it always completes
        "train.total_steps=2",
        *overrides,
    )


@contextmanager
def vllm_servers(model_dir: Path, log_dir: Path, *overrides: str) -> Iterator[ServerLauncher]:
    """vLLM servers over ``model_dir`` on loopback, started, checked and finally stopped."""
    backend = make_backend(vllm_config(model_dir, *overrides), model_dir)
    launcher = backend.launcher(log_dir)

    async def check() -> None:
        async with backend.client(launcher.urls) as client:
            await backend.check_servers(client)

    with launcher:
        asyncio.run(check())
        yield launcher


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise on every weight (a 'trained' version)."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return out


def publish_dir(model: torch.nn.Module, directory: Path) -> Path:
    """Save ``model`` exactly as the trainer publishes (``RLTrainer.save_weights``)."""
    return RLTrainer.save_weights(SimpleNamespace(model=model), directory)


def recompute(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """The trainer's view: ``log_softmax(logits / T)`` of each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(4, 16))] for _ in range(n)]


def count_spanning_and_check_versions(batch, gens, models, mode: str, budget: int) -> int:
    """Generations of ``batch`` made while publications landed: each has ``budget`` tokens
    with non-decreasing versions, and (unless ``mode`` is ``keep``, where tokens after a
    publication continue on old KV) every token's logprob is that of the model its version
    names (``models``: version -> model) within :data:`MAX_LOGPROB_DIFF`. Returns how many
    requests span more than one version."""
    spanning = 0
    for prompt, gen in zip(batch, gens, strict=True):
        assert len(gen.output_ids) == budget == len(gen.output_logprobs)
        assert gen.output_versions == sorted(gen.output_versions)
        spanning += len(set(gen.output_versions)) > 1
        if mode == "keep":
            continue
        got, versions = torch.tensor(gen.output_logprobs), torch.tensor(gen.output_versions)
        for version, model in models.items():
            mine = versions == version
            if mine.any():
                ref = recompute(model, prompt, gen.output_ids, 1.0)
                assert (got - ref)[mine].abs().max().item() < MAX_LOGPROB_DIFF, version
    return spanning
