#!/usr/bin/env bash
# The learner's GPU figures in one go, for a lent GPU machine (no Ray or vLLM there): the wheels it lacks come
# along in .whl/ (deepspeed, pydantic and their small dependencies; see docs/gpu_learner.md). Every part has its
# own time limit, so a slow one cannot take the rest with it; all output goes to $OUT/gpu_figures.log.
#
#   bash benchmarks/gpu_figures.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_figures}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=/tmp/relayrl_gpu_model  # the 1.5B folder, built once (32k context) and reused by the parts below
exec > >(tee "$OUT/gpu_figures.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -E "Warning|warn\(|Loading weights|^\s*$|USDT"
  echo "=== $name: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
}

# 1. Issue 9's goal: 32k responses, attention kept or recomputed under checkpointing; one profiled step each.
part "32k keep-attention on/off" 200 python3 benchmarks/long_cot_gpu.py --lengths 32768 --paths new \
  --keep-attention on,off --model-dir $MODEL --profile
# 2. Model-FLOP utilisation at 8k: four samples per step (one per micro-batch), checkpointing off and on.
part "8k MFU" 120 python3 benchmarks/long_cot_gpu.py --lengths 8192 --paths new --new-grad-ckpt off,on \
  --samples 4 --model-dir $MODEL
# 3. torch's fused AdamW (learner.fused_adamw) at both lengths.
part "fused AdamW 32k" 90 python3 benchmarks/long_cot_gpu.py --lengths 32768 --paths new --model-dir $MODEL \
  --set learner.fused_adamw=true
part "fused AdamW 8k" 80 python3 benchmarks/long_cot_gpu.py --lengths 8192 --paths new --new-grad-ckpt off \
  --samples 4 --model-dir $MODEL --set learner.fused_adamw=true
# 4. The ppo row: a learner rank and a critic rank on the GPU.
part "ppo preset" 120 python3 benchmarks/gpu_presets.py --presets ppo --configs ''
# 5. The learner's peak GPU memory with the in-learner reference against reference workers.
part "reference memory" 150 python3 benchmarks/reference_memory.py --part learner --gpu --shape 1.5b \
  --out "$OUT/reference_memory.json"
