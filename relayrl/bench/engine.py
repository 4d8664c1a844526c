"""``relayrl bench engine``: built-in engine vs vLLM vs ``model.generate`` on a long-tail workload.

Same random-init model, same machine, same thread count. The workload is ``n`` requests with
random prompts and requested output lengths from a truncated Pareto distribution (shape 1)
between ``min_len`` and ``max_len`` tokens, generated with ``ignore_eos`` so every request
produces exactly the length it asked for. The engine gets all requests at once and batches
them continuously; ``model.generate`` runs them in arrival order as static batches of the
same size as the engine's ``max_running_requests``, each batch decoding up to its longest
request. Throughput on every side is *requested* tokens per second (padding and tokens past
a request's own length do not count).

``--engines`` picks the sides (default ``builtin,hf``). ``vllm`` serves the same model
directory with a vLLM server from the vLLM environment (``.venv-vllm``, ``make vllm``;
``--vllm-python`` for another), started and warmed up before the clock starts, with
``max_num_seqs`` = the batch size and the same thread count, and sends every request at once
through relayrl's vLLM client (``/inference/v1/generate``, one request per prompt: the
prompts differ, so none is a group that one request with ``n`` could carry).

What the comparison measures: the built-in side runs in this process (no HTTP, no server
process), the vLLM side is a server of three processes (API server, engine core, worker)
reached over HTTP, so the gap is vLLM's per-step cost on CPU plus its HTTP and IPC hops
between processes sharing the machine's cores. A run's generation, where a group of ``n``
samples is one request on both engines, is ``relayrl bench async rollout.engine=vllm``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from relayrl.errors import RelayError

HELP = "built-in engine vs vLLM vs HF model.generate on a long-tail workload"
ENGINES = ("builtin", "vllm", "hf")


@dataclass
class Workload:
    prompts: list[list[int]]
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> Workload:
    """``n`` random prompts (8-32 tokens) and heavy-tailed output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n)]
    # Truncated Pareto(alpha=1): P(L > x) = min_len / x, clipped to max_len.
    lengths = [min(max_len, int(min_len / (1.0 - rng.random()))) for _ in range(n)]
    return Workload(prompts, lengths)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small workload (< 1 minute)")
    parser.add_argument("--preset", default="small", help="model size preset (default: small)")
    parser.add_argument("--requests", type=int, default=None, help="number of requests")
    parser.add_argument(
        "--batch", type=int, default=None, help="engine slots = HF batch size (64; quick: 16)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device of both sides (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", help="model dtype (float32, bfloat16)")
    parser.add_argument(
        "--engines",
        default="builtin,hf",
        help="comma-separated sides among builtin, vllm, hf (default: builtin,hf)",
    )
    parser.add_argument(
        "--vllm-python", default=None, help="python of the vLLM environment (default .venv-vllm)"
    )


def parse_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise RelayError(f"--engines: {text!r}; expected a comma-separated subset of {ENGINES}")
    return names


def _bench_vllm(model_dir: Path, work: Workload, batch: int, args) -> float:
    """Seconds for vLLM to generate ``work`` (server start and warm-up excluded)."""
    from relayrl.engine.types import SamplingParams
    from relayrl.engine.vllm_client import VLLMClient
    from relayrl.launch.servers import ServerLauncher
    from relayrl.launch.vllm import VLLMServerSpec, find_vllm_python
    from relayrl.runkey import new_key

    spec = VLLMServerSpec(
        model_dir=str(model_dir),
        python=find_vllm_python(args.vllm_python),
        threads=args.threads,
        max_running_requests=batch,
        dtype=args.dtype,
        api_key=new_key(),
    )

    async def run(url: str) -> float:
        async with VLLMClient(
            [url], api_key=spec.api_key, timeout=3600.0, max_connections=len(work.prompts)
        ) as client:
            warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
            await asyncio.gather(*(client.generate(p, warm) for p in work.prompts[:batch]))
            start = time.perf_counter()
            outs = await asyncio.gather(
                *(
                    client.generate(p, SamplingParams(max_new_tokens=n, seed=i, ignore_eos=True))
                    for i, (p, n) in enumerate(zip(work.prompts, work.lengths, strict=True))
                )
            )
            elapsed = time.perf_counter() - start
        produced = sum(len(o.output_ids) for o in outs)
        if produced != work.tokens:
            raise RuntimeError(f"vLLM produced {produced} tokens, expected {work.tokens}")
        return elapsed

    with tempfile.TemporaryDirectory() as logs:
        launcher = ServerLauncher(spec, 1, log_dir=Path(logs), startup_timeout_s=600)
        with launcher:
            return asyncio.run(run(launcher.urls[0]))


def _bench_engine(model, work: Workload, batch: int) -> float:
    from relayrl.engine.engine import Engine
    from relayrl.engine.types import EngineOptions, SamplingParams

    with Engine(model, options=EngineOptions(max_running_requests=batch)) as engine:
        start = time.perf_counter()
        futures = [
            engine.submit(
                p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
            )
            for i, (p, n) in enumerate(zip(work.prompts, work.lengths, strict=True))
        ]
        results = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
    produced = sum(len(r.output_ids) for r in results)
    if produced != work.tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {work.tokens}")
    return elapsed


def _bench_hf(model, work: Workload, batch: int, pad_id: int) -> float:
    import torch

    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch):
        prompts, lengths = work.prompts[i : i + batch], work.lengths[i : i + batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
        )
        longest = max(lengths)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                pad_token_id=pad_id,
            )
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import torch

    from relayrl.models.build import create_model_dir
    from relayrl.models.loading import prefer_shape_agnostic_attention
    from relayrl.tasks.registry import make_task

    engines = parse_engines(args.engines)
    torch.set_num_threads(args.threads)
    n = args.requests or (64 if args.quick else 256)
    batch = args.batch or (16 if args.quick else 64)
    max_len = 128 if args.quick else 512
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = create_model_dir(
            tmp,
            make_task("arithmetic"),
            args.preset,
            seed=args.seed,
            max_position_embeddings=max_len + 64,
            corpus_size=300,
        )
        model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
        prefer_shape_agnostic_attention(args.device)  # both sides alike
        work = make_workload(n, 8, max_len, len(tok), args.seed)
        print(
            f"preset={args.preset} requests={n} lengths=[8,{max_len}] "
            f"requested_tokens={work.tokens} batch={batch} threads={args.threads} "
            f"device={args.device} dtype={args.dtype} engines={','.join(engines)}"
        )
        if args.device != "cpu":  # CUDA context, kernel selection and allocator warm-up
            warm = make_workload(4, 8, 16, len(tok), args.seed + 1)
            _bench_engine(model, warm, batch)
            _bench_hf(model, warm, batch, tok.pad_token_id)
        tps: dict[str, float] = {}
        for name in engines:
            if name == "builtin":
                seconds = _bench_engine(model, work, batch)
                label = "engine"
            elif name == "hf":
                seconds = _bench_hf(model, work, batch, tok.pad_token_id)
                label = "hf_generate"
            else:
                seconds = _bench_vllm(Path(tmp), work, batch, args)
                label = "vllm"
            tps[name] = work.tokens / seconds
            print(f"{label}_seconds={seconds:.2f} {label}_tokens_per_s={tps[name]:.1f}")
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak_rss_mib={peak_kib / 1024:.0f}")
    ratios = []
    if "vllm" in tps and "hf" in tps:
        ratios.append(("vllm_speedup_vs_hf_generate", tps["vllm"] / tps["hf"]))
    if "vllm" in tps and "builtin" in tps:
        ratios.append(("engine_speedup_vs_vllm", tps["builtin"] / tps["vllm"]))
    if "builtin" in tps and "hf" in tps:
        ratios.append(("engine_speedup_vs_hf_generate", tps["builtin"] / tps["hf"]))
    for name, value in ratios:
        print(f"{name}={value:.2f}")
    if not ratios:  # one side only: its throughput is the result
        (name,) = tps
        print(f"{name}_tokens_per_s={tps[name]:.1f}")
    sys.stdout.flush()
    return 0
