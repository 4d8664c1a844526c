#!/usr/bin/env bash
# The CUDA paths on one GPU (docs/benchmarks.md, "GPU"). Logs go to $OUT (or ./gpu_out).
#   bash scripts/gpu_check.sh engine  # engine profile + engine vs HF generate, Qwen3-0.6B shape, bf16
#   bash scripts/gpu_check.sh rl      # the demo (SFT + async RL) on the GPU, then bench async with its model
# Needs a CUDA torch and the project importable (pip install -e . or PYTHONPATH).
set -uo pipefail
stage=${1:-all}
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
if [[ $stage == engine || $stage == all ]]; then
    timeout 120 $py scripts/profile_engine.py --device cuda --preset qwen3-0.6b --dtype bfloat16 \
        --tokens 16 2>&1 | grep -v "it/s" | tee "$out/profile.log" | head -40
    timeout 300 $py -m relayrl.cli bench engine --device cuda --preset qwen3-0.6b --dtype bfloat16 \
        --requests 128 2>&1 | tee "$out/engine.log" | grep -v "it/s"
fi
if [[ $stage == rl || $stage == all ]]; then
    timeout 290 $py -m relayrl.cli demo model.device=cuda output_dir=/tmp/relayrl-gpu \
        train.progress=false 2>&1 | tee "$out/demo.log" | grep -v "it/s" | tail -15
    cp /tmp/relayrl-gpu/demo/metrics.jsonl "$out/demo_metrics.jsonl" 2>/dev/null
    timeout 200 $py -m relayrl.cli bench async --device cuda --model /tmp/relayrl-gpu/demo/sft_model \
        2>&1 | tee "$out/async.log" | tail -8
fi
