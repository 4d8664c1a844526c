#!/usr/bin/env bash
# The CUDA paths on one GPU (docs/benchmarks.md, "GPU"). Logs go to $OUT (or ./gpu_out).
#   bash scripts/gpu_check.sh engine  # engine profile + engine vs HF generate, Qwen3-0.6B shape, bf16
#   bash scripts/gpu_check.sh rl      # the demo (SFT + async RL) on the GPU, then bench async with its model
#   bash scripts/gpu_check.sh fsdp    # FSDP2 with NCCL at world size 1 vs the single-process trainer
#   SMOLLM2=<.gguf or model dir> bash scripts/gpu_check.sh smollm2
#                                     # the SmolLM2 recipe on the GPU, FSDP2/NCCL and the engine on it
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
if [[ $stage == fsdp || $stage == all ]]; then
    $py -c "from relayrl.models.build import create_model_dir; from relayrl.tasks.registry import make_task; create_model_dir(__import__('pathlib').Path('/tmp/relayrl-small'), make_task('arithmetic'), 'small', seed=0, corpus_size=500)" >/dev/null
    timeout 200 $py scripts/fsdp_cuda_check.py /tmp/relayrl-small --steps 4 2>&1 | grep -v "it/s" | tee "$out/fsdp_small.log"
fi
if [[ $stage == smollm2 ]]; then
    model=$($py -c "from relayrl.models.gguf import resolve_model_path; print(resolve_model_path('${SMOLLM2:?SMOLLM2=<.gguf or model dir>}'))" | tail -1)
    echo "model: $model" | tee "$out/smollm2.txt"
    timeout 120 $py scripts/fsdp_cuda_check.py "$model" --steps 4 2>&1 | grep -v "it/s" | tee "$out/fsdp_smollm2.log"
    timeout 300 $py -m relayrl.cli train configs/smollm2.yaml model.path="$model" model.device=cuda \
        output_dir=/tmp/relayrl-gpu train.progress=false 2>&1 | grep -v "it/s" | tee "$out/recipe.log" | tail -25
    cp /tmp/relayrl-gpu/smollm2/metrics.jsonl "$out/recipe_metrics.jsonl" 2>/dev/null
    timeout 150 $py -m relayrl.cli bench engine --device cuda --model "$model" --dtype bfloat16 \
        --batches 8,64 --requests 64 --max-len 128 2>&1 | grep -v "it/s" | tee "$out/engine_smollm2.log" | tail -12
fi
