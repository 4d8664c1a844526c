"""Generation tokens/s of a run's rollout servers, interleaved on one machine (issue 33 item 4).

A built-in server and a vLLM server over the same random-init model (``--preset``), each at
one thread, both started before the clock; each step is ``B`` groups of ``n`` samples of
``T`` tokens (``ignore_eos``, the rollout controller's seeds) through ``generate_many``, as a
run's rollout sends them. Steps alternate between three sides so that the load of a shared
machine falls on each alike: the built-in server, the vLLM server driven as before issue 33
(one request per sample, server-side detokenisation on) and as now (one request per group).
Prints each side's tokens/s per step, the medians and the ratios built-in / vLLM.

    PYTHONPATH=$PWD python scripts/vllm_group_generation.py --preset small --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from relayrl.config.loader import load_config
from relayrl.engine import vllm_client
from relayrl.engine.types import SamplingParams
from relayrl.launch.backends import make_backend
from relayrl.models.build import create_model_dir
from relayrl.rollout.controller import request_seed
from relayrl.tasks.registry import make_task


class PerSampleClient(vllm_client.VLLMClient):
    """The vLLM client before issue 33: one request per sample, detokenisation on."""

    def generate_body(self, input_ids: list[int], sampling_params: Any) -> dict[str, Any]:
        body = super().generate_body(input_ids, sampling_params)
        body["sampling_params"]["detokenize"] = True
        return body

    async def generate_many(self, input_ids, sampling_params, key=None):
        params = [vllm_client._params_dict(p) for p in sampling_params]
        return await self._one_per_sample(input_ids, params, key)


async def step(client, index: int, args, rng: random.Random) -> float:
    """One step's groups at once; generated tokens per second."""
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(8, 24))] for _ in range(args.B)]
    groups = [
        [
            SamplingParams(
                max_new_tokens=args.T,
                seed=request_seed(0, index * args.B + i, j),
                ignore_eos=True,
            )
            for j in range(args.n)
        ]
        for i in range(args.B)
    ]
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(
            client.generate_many([p] * args.n, g, key=f"{index}-{i}")
            for i, (p, g) in enumerate(zip(prompts, groups, strict=True))
        )
    )
    return sum(len(o.output_ids) for group in outs for o in group) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--B", type=int, default=8, help="groups per step")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--T", type=int, default=48, help="tokens per sample")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-group-gen-"))
    model = tmp / "model"
    create_model_dir(model, make_task("arithmetic"), args.preset, seed=0)

    def backend(engine: str):
        overrides = [f"model.path={model}", "model.max_context=160", f"rollout.engine={engine}"]
        overrides += ["rollout.server_threads=1", "rollout.startup_timeout_s=400"]
        return make_backend(load_config(None, overrides), model)

    builtin, vllm = backend("builtin"), backend("vllm")
    with builtin.launcher(tmp / "builtin") as lb, vllm.launcher(tmp / "vllm") as lv:
        result = asyncio.run(measure(args, builtin, lb.urls, vllm, lv.urls))
    report(result)


async def measure(args, builtin, builtin_urls, vllm, vllm_urls) -> dict[str, list[float]]:
    rng = random.Random(0)
    async with (
        builtin.client(builtin_urls, timeout=600.0) as cb,
        PerSampleClient(vllm_urls, timeout=600.0, api_key=vllm.api_key) as before,
        vllm_client.VLLMClient(vllm_urls, timeout=600.0, api_key=vllm.api_key) as after,
    ):
        await builtin.check_servers(cb)
        await vllm.check_servers(after)
        sides = {"builtin": cb, "vllm_per_sample": before, "vllm_per_group": after}
        for client in sides.values():
            await step(client, 10_000, args, rng)  # warm-up
        result: dict[str, list[float]] = {name: [] for name in sides}
        for index in range(args.rounds):
            for name, client in sides.items():
                result[name].append(await step(client, index, args, rng))
        return result


def report(result: dict[str, list[float]]) -> None:
    medians = {k: sorted(v)[len(v) // 2] for k, v in result.items()}
    for name, values in result.items():
        print(f"{name}: tokens/s per step {[round(v) for v in values]} median {medians[name]:.0f}")
    for side in ("vllm_per_sample", "vllm_per_group"):
        per_round = [b / v for b, v in zip(result["builtin"], result[side], strict=True)]
        print(
            f"builtin/{side}={medians['builtin'] / medians[side]:.2f} "
            f"(per round {[round(r, 2) for r in per_round]})"
        )


if __name__ == "__main__":
    main()
