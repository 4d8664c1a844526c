"""``relayrl bench publish [--quick] [--engine builtin|vllm]``: publication latency per weight
transport (disk vs broadcast), side by side, on the demo's tiny model and on the ``small``
preset.

Per preset: two ``relayrl serve`` processes (``--engine vllm``: vLLM servers, started as a
run starts them, ``relayrl.launch.vllm``) over a fresh model, and this process as the
trainer. Each round publishes new weights (seeded noise on the model) once per transport,
the transports alternating within the round so both see the same machine load, each through
its real publisher (``relayrl.sync.transports``) and the real client, ``publish_mode=retract``,
servers idle. Per publication:

* ``hold_s``: the trainer is held (``WeightPublisher.snapshot``): disk = write the safetensors
  snapshot (``/dev/shm`` when present, as a run does); broadcast = a CPU copy of the weights
  (its disk snapshot is written every ``train.broadcast_snapshot_every`` publications; here
  only the first, outside the timed rounds);
* ``load_s``: until every server has loaded it (``WeightPublisher.load``): disk = each server
  reads the files; broadcast = HTTP announce, gloo broadcast, load (the group formed once,
  before the timed rounds); on vLLM both also pause the server, set its weight version and
  resume it (``relayrl.engine.vllm_client``);
* ``total_s`` = hold + load. Medians over the rounds; the ratios are broadcast / disk.

``--checks``: also the cost of a publication's checks (``relayrl.sync.transaction``), per
transport: each round publishes through the run's own transaction (``Publication`` under a
``ServerSupervisor``) three ways, alternating: no checks, verify (version and checksum, on
the trainer and on each server), verify + canary (a model copy, 8 tokens per server, the
trainer's recompute); the median total per publication of each and the differences:
``verify_overhead_s`` and ``canary_overhead_s`` (a run pays the canary every
``train.publish_canary_every``-th publication only).

``--lora R``: instead, adapter-only vs full publication on the disk transport (built-in
servers, docs/lora.md): the same base with rank-R LoRA adapters on every linear layer
(``model.lora.target_modules=all-linear``, new seeded adapter values each round) published as
an adapter snapshot, alternating with a full snapshot of the same model; the trainer is held
for the snapshot and its checksum, as in a run with the verify step (full: a SHA-256 of the
snapshot's tensors; adapter: the checksum of the merged weights, computed while writing it);
per kind the bytes written per publication and the median hold / load / total seconds
(load: the servers read it; the adapter is merged into the copy there); the last line is
``publish_lora_vs_full_<preset>=X.XX`` (total-latency ratio, below 1: the adapter is faster).

The last line is ``publish_broadcast_vs_disk_<preset>=X.XX`` (``publish_vllm_broadcast_vs_disk_
<preset>`` on vLLM), the total-latency ratio on the last preset (below 1: broadcast is
faster).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "weight publication latency: disk vs broadcast transport, tiny and small presets"

TRANSPORTS = ("disk", "broadcast")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 rounds (< 1 minute)")
    parser.add_argument("--presets", default="tiny,small", help="comma-separated model presets")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10)")
    parser.add_argument("--servers", type=int, default=2, help="rollout servers (default 2)")
    parser.add_argument(
        "--engine", choices=("builtin", "vllm"), default="builtin", help="the rollout servers"
    )
    parser.add_argument(
        "--checks",
        action="store_true",
        help="also time the publication checks: verify (version, checksum) and the canary",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="adapter-only (rank R) vs full publication, disk transport, built-in servers",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="--engine vllm: the vLLM environment's python "
        "(rollout.vllm.python; default .venv-vllm)",
    )


def snapshot_root() -> Path:
    """A fresh directory for the disk snapshots: under /dev/shm when writable (as a run)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="relayrl-bench-publish-", dir=base))


def nudge(model, seed: int) -> None:
    """New weights for the next publication: seeded noise on every parameter."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=generator))


async def publish_rounds(
    urls: list[str], model, root: Path, rounds: int, client_class: Any
) -> dict[str, dict]:
    """Time ``rounds`` publications per transport through a ``client_class`` client; per
    transport, the median seconds of each phase."""
    from relayrl.sync.transports import BroadcastPublisher, DiskPublisher, ModelSource

    source = ModelSource(model)
    publishers = {"disk": DiskPublisher(), "broadcast": BroadcastPublisher(120.0, 10**9)}
    times: dict[str, dict[str, list[float]]] = {
        t: {"hold_s": [], "load_s": [], "total_s": []} for t in TRANSPORTS
    }
    version = 0
    async with client_class(urls, timeout=600.0) as client:
        # untimed: the broadcast transport's first snapshot (written to disk) and group
        for publisher in publishers.values():
            version += 1
            snapshot = await asyncio.to_thread(publisher.snapshot, source, root, version)
            await publisher.load(client, snapshot, "retract")
        for r in range(rounds):
            order = TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]
            for name in order:
                version += 1
                nudge(model, version)
                start = time.perf_counter()
                snapshot = await asyncio.to_thread(publishers[name].snapshot, source, root, version)
                held = time.perf_counter()
                await publishers[name].load(client, snapshot, "retract")
                done = time.perf_counter()
                times[name]["hold_s"].append(held - start)
                times[name]["load_s"].append(done - held)
                times[name]["total_s"].append(done - start)
        publishers["broadcast"].close()
    return {t: {k: statistics.median(v) for k, v in times[t].items()} for t in TRANSPORTS}


LORA_KINDS = ("full", "adapter")


def lora_sources(model_dir: Path, rank: int) -> dict:
    """The full-weights and the adapter-only weight source over the same base model."""
    from relayrl.config.schema import LoraConfig
    from relayrl.models.loading import load_model
    from relayrl.sync.transports import ModelSource
    from relayrl.train.lora import apply_lora, save_adapter_snapshot

    class AdapterSource:
        def __init__(self) -> None:
            self.model = apply_lora(load_model(model_dir), LoraConfig(r=rank, alpha=2 * rank))

        def save_weights(self, directory: Path) -> Path:
            return save_adapter_snapshot(self.model, directory)

    return {"full": ModelSource(load_model(model_dir)), "adapter": AdapterSource()}


def new_values(source, seed: int) -> None:
    """New weights for the next publication: noise on every trained parameter."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in source.model.parameters():
            if p.requires_grad:
                p.add_(1e-3 * torch.randn(p.shape, generator=generator))


async def lora_rounds(urls: list[str], model_dir: Path, root: Path, args) -> dict[str, dict]:
    """``args.rounds`` disk publications per kind (full, adapter), alternating; per kind the
    bytes of one snapshot and the median seconds of each phase."""
    from relayrl.engine.client import RolloutClient
    from relayrl.sync.transaction import snapshot_checksum
    from relayrl.sync.transports import DiskPublisher

    sources, publisher = lora_sources(model_dir, args.lora), DiskPublisher()
    times = {k: {"hold_s": [], "load_s": [], "total_s": []} for k in LORA_KINDS}
    sizes: dict[str, int] = {}
    version = 0
    async with RolloutClient(urls, timeout=600.0) as client:
        for r in range(args.rounds + 1):  # round 0: untimed warm-up
            for kind in LORA_KINDS if r % 2 == 0 else LORA_KINDS[::-1]:
                version += 1
                new_values(sources[kind], version)
                start = time.perf_counter()
                snapshot = await asyncio.to_thread(publisher.snapshot, sources[kind], root, version)
                await asyncio.to_thread(snapshot_checksum, snapshot)  # as a run's verify step
                held = time.perf_counter()
                await publisher.load(client, snapshot, "retract")
                done = time.perf_counter()
                sizes[kind] = sum(f.stat().st_size for f in snapshot.path.iterdir())
                if r > 0:
                    times[kind]["hold_s"].append(held - start)
                    times[kind]["load_s"].append(done - held)
                    times[kind]["total_s"].append(done - start)
    out = {k: {n: statistics.median(v) for n, v in times[k].items()} for k in LORA_KINDS}
    for kind in LORA_KINDS:
        out[kind]["bytes"] = sizes[kind]
    return out


def run_lora(args: argparse.Namespace, presets: list[str]) -> int:
    """``--lora R``: adapter-only vs full publication per preset (see the module docstring)."""
    import shutil

    from relayrl.launch.servers import ServerLauncher, ServerSpec
    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    last = 1.0
    for preset in presets:
        with tempfile.TemporaryDirectory(prefix="relayrl-bench-publish-") as tmp:
            model_dir = Path(tmp) / "model"
            create_model_dir(model_dir, make_task("arithmetic"), preset, seed=0, corpus_size=500)
            root = snapshot_root()
            try:
                with ServerLauncher(
                    ServerSpec(str(model_dir)), args.servers, log_dir=Path(tmp)
                ) as launcher:
                    r = asyncio.run(lora_rounds(launcher.urls, model_dir, root, args))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        for kind in LORA_KINDS:
            row = r[kind]
            print(
                f"preset={preset} lora_r={args.lora} publication={kind} bytes={row['bytes']} "
                f"hold_s={row['hold_s']:.4f} load_s={row['load_s']:.4f} "
                f"total_s={row['total_s']:.4f}"
            )
        last = r["adapter"]["total_s"] / r["full"]["total_s"]
        print(
            f"preset={preset} adapter/full: bytes={r['adapter']['bytes'] / r['full']['bytes']:.3f}"
        )
    print(f"publish_lora_vs_full_{presets[-1]}={last:.2f}")
    return 0


class _Listener:
    """The rollout controller's side of a publication: a failure ends the benchmark."""

    def set_published_version(self, version: int) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        raise exc

    failure = None


CHECKS = {"none": (False, 0), "verify": (True, 0), "verify+canary": (True, 1)}


async def check_rounds(launcher, model, root: Path, rounds: int, client_class: type) -> dict:
    """Per transport, the median seconds of one whole publication through the run's
    transaction with each of :data:`CHECKS` (verify on/off, canary every publication/never),
    alternating; plus the overheads."""
    from relayrl.config.schema import TrainConfig
    from relayrl.launch.supervisor import ServerSupervisor
    from relayrl.sync.canary import Canary
    from relayrl.sync.transports import ModelSource, make_publisher
    from relayrl.sync.weight_sync import WeightSync

    source, version, out = ModelSource(model), 1000, {}
    async with client_class(list(launcher.urls), timeout=600.0) as client:
        for transport in TRANSPORTS:
            publisher = make_publisher(
                TrainConfig(
                    weight_transport=transport,
                    broadcast_timeout_s=120.0,
                    broadcast_snapshot_every=10**9,
                )
            )
            runs = {}
            for name, (verify, every) in CHECKS.items():
                supervisor = ServerSupervisor(launcher, client, 0)
                runs[name] = WeightSync(
                    supervisor, publisher, root, _Listener(), Canary(every), verify=verify
                )
            times: dict[str, list[float]] = {name: [] for name in CHECKS}
            for r in range(rounds + 1):  # the first round untimed (group, first snapshot)
                names = list(CHECKS) if r % 2 == 0 else list(CHECKS)[::-1]
                for name in names:
                    version += 1
                    nudge(model, version)
                    start = time.perf_counter()
                    await runs[name].submit(source, version, wait=True)
                    if r:
                        times[name].append(time.perf_counter() - start)
            publisher.close()
            med = {name: statistics.median(v) for name, v in times.items()}
            out[transport] = {
                **{f"{k}_s": v for k, v in med.items()},
                "verify_overhead_s": med["verify"] - med["none"],
                "canary_overhead_s": med["verify+canary"] - med["verify"],
            }
    return out


def server_spec(model_dir: Path, args: argparse.Namespace):
    """The server spec and client class of ``--engine``."""
    from relayrl.runkey import new_key

    key = new_key()  # a run key, as a run's launcher makes: each server gets one derived
    if args.engine == "vllm":
        from relayrl.engine.vllm_client import VLLMClient
        from relayrl.launch.vllm import VLLMServerSpec, find_vllm_python

        python = find_vllm_python(args.vllm_python)
        return VLLMServerSpec(str(model_dir), python, max_seq_len=256, api_key=key), VLLMClient
    from relayrl.engine.client import RolloutClient
    from relayrl.launch.servers import ServerSpec

    return ServerSpec(str(model_dir), api_key=key), RolloutClient


def measure(preset: str, args: argparse.Namespace) -> dict:
    import shutil

    from relayrl.launch.servers import ServerLauncher
    from relayrl.models.build import create_model_dir
    from relayrl.models.loading import load_model
    from relayrl.tasks.registry import make_task

    with tempfile.TemporaryDirectory(prefix="relayrl-bench-publish-") as tmp:
        model_dir = Path(tmp) / "model"
        create_model_dir(model_dir, make_task("arithmetic"), preset, seed=0, corpus_size=500)
        model = load_model(model_dir)
        root = snapshot_root()
        try:
            spec, client_class = server_spec(model_dir, args)
            with ServerLauncher(
                spec, num_servers=args.servers, log_dir=Path(tmp), startup_timeout_s=600.0
            ) as launcher:
                # each server is sent its own key (the client learns them from the launcher)
                client_class = functools.partial(client_class, **launcher.client_keys())
                result = asyncio.run(
                    publish_rounds(launcher.urls, model, root, args.rounds, client_class)
                )
                if args.checks:
                    result["checks"] = asyncio.run(
                        check_rounds(launcher, model, root, args.rounds, client_class)
                    )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    result["params"] = sum(p.numel() for p in model.parameters())
    return result


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    args.rounds = args.rounds or (3 if args.quick else 10)
    presets = [p for p in args.presets.split(",") if p]
    if args.lora:
        return run_lora(args, presets)
    print(
        f"publish bench: {args.servers} {args.engine} servers, {args.rounds} rounds per transport "
        "(alternating), publish_mode=retract, idle servers, medians in seconds"
    )
    last = 1.0
    for preset in presets:
        r = measure(preset, args)
        mb = r["params"] * 4 / 2**20
        for t in TRANSPORTS:
            row = r[t]
            print(
                f"preset={preset} params={r['params']} fp32_MiB={mb:.1f} transport={t} "
                f"hold_s={row['hold_s']:.4f} load_s={row['load_s']:.4f} "
                f"total_s={row['total_s']:.4f}"
            )
        for t, row in r.get("checks", {}).items():
            print(
                f"preset={preset} transport={t} checks: "
                + " ".join(f"{k}={v:.4f}" for k, v in row.items())
            )
        ratios = {k: r["broadcast"][k] / r["disk"][k] for k in ("hold_s", "load_s", "total_s")}
        print(
            f"preset={preset} broadcast/disk: hold={ratios['hold_s']:.2f} "
            f"load={ratios['load_s']:.2f} total={ratios['total_s']:.2f}"
        )
        last = ratios["total_s"]
    engine = "vllm_" if args.engine == "vllm" else ""
    print(f"publish_{engine}broadcast_vs_disk_{presets[-1]}={last:.2f}")
    return 0
