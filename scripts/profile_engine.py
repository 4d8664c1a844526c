"""Profile a few engine decode steps (any device): where a step's time goes.

python scripts/profile_engine.py --device cuda --preset qwen3-0.6b --dtype bfloat16
Prints the profiler's table (top ops by self CPU time) and the step rate.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions, SamplingParams
from relayrl.models.build import create_model_dir
from relayrl.tasks.registry import make_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cuda-activity", action="store_true", help="also trace CUDA kernels")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = create_model_dir(
            tmp, make_task("arithmetic"), args.preset, seed=0, max_position_embeddings=512
        )
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, ignore_eos=True)
    prompts = [[5 + (i % 50)] * 16 for i in range(args.batch)]
    with Engine(model, options=EngineOptions(max_running_requests=args.batch)) as engine:
        engine.generate_batch(prompts[:4], params)  # warm-up
        start = time.perf_counter()
        engine.generate_batch(prompts, params)
        seconds = time.perf_counter() - start
        print(
            f"decode steps/s={args.tokens / seconds:.1f} tokens/s={args.batch * args.tokens / seconds:.0f}"
        )
        # Profile in this thread: pause the loop thread (it then idles on its command
        # queue) and drive the scheduler by hand.
        engine.pause("in_place")
        futures = [engine.submit(p, params) for p in prompts]
        engine.stats()  # the submits above have run on the loop thread
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.cuda_activity:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof, torch.inference_mode():
            while engine.scheduler.has_work():
                engine.step()
        assert all(f.done() for f in futures)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
