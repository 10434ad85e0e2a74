#!/usr/bin/env bash
# The first run on a GPU node (docs/gpu.md, "Your first GPU run"): 20 steps of the Qwen2.5-1.5B one-node config
# with vLLM's INFO logs, then a report in the run folder (RUN_DIR/gpu_smoke_report.md, cli/gpu_report.py): vLLM's
# startup lines, seconds per weight version, the weight-sync check's largest gap, the trained samples' token
# versions, tokens per second. The console log is kept as RUN_DIR/smoke.log.
#
#   deploy/gpu_smoke.sh MODEL_DIR [RUN_DIR] [section.key=value ...]
#
# MODEL_DIR: a local Hugging Face folder of Qwen2.5-1.5B-Instruct (config.json, weights, tokenizer).
# RUN_DIR:   default runs/gpu_smoke_<date>_<time>. Further arguments override the config (as `relayrl train`).
# RELAYRL_SMOKE_CONFIG picks another config (default deploy/configs/qwen2.5-1.5b_1node.yaml, 8 GPUs); VENV the venv.
# Exit status: the training run's (the report is written whatever it was, from what the run logged).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
MODEL_DIR=$1
shift
RUN_DIR=runs/gpu_smoke_$(date +%Y%m%d_%H%M%S)
if [ $# -ge 1 ] && [ "${1#*=}" = "$1" ]; then  # a second argument without '=' is the run folder
  RUN_DIR=$1
  shift
fi
CONFIG=${RELAYRL_SMOKE_CONFIG:-deploy/configs/qwen2.5-1.5b_1node.yaml}
VENV=${VENV:-.venv}
PY=$VENV/bin/python

if [ ! -x "$PY" ]; then
  echo "gpu_smoke: no $PY; install for the GPU first: RELAYRL_DEVICE=gpu make install (docs/gpu.md)" >&2
  exit 2
fi
# the CUDA stack, and a GPU it can use, before anything starts (a CPU venv would train on CPU)
if ! cuda=$("$PY" -c "import torch; v = torch.version.cuda; assert v and torch.cuda.is_available(), v; \
print(v, torch.cuda.device_count())" 2>&1); then
  echo "gpu_smoke: $PY's torch cannot use CUDA (torch.version.cuda: ${cuda##*AssertionError: }; nvidia-smi shows" \
       "the driver). Install the CUDA stack into a fresh venv: VENV=.venv-gpu RELAYRL_DEVICE=gpu make install," \
       "then VENV=.venv-gpu deploy/gpu_smoke.sh ..." >&2
  exit 2
fi
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "gpu_smoke: $MODEL_DIR holds no config.json; pass a local Hugging Face folder of the model" >&2
  exit 2
fi

mkdir -p "$RUN_DIR"
{ nvidia-smi || echo "nvidia-smi failed: is the NVIDIA driver (580 or newer) installed?"; } \
  >"$RUN_DIR/nvidia-smi.txt" 2>&1
echo "gpu_smoke: CUDA ${cuda% *}, ${cuda#* } GPUs; $CONFIG, 20 steps, model $MODEL_DIR," \
     "run folder $RUN_DIR (console: $RUN_DIR/smoke.log)"

status=0
# vLLM's INFO lines reach the console through every actor (cluster/ray_setup.py driver_log_level); a short
# held-out evaluation before and after keeps the smoke run at minutes
VLLM_LOGGING_LEVEL=INFO "$PY" -m cli.main train --config "$CONFIG" --output-dir "$RUN_DIR" \
  model.path="$MODEL_DIR" train.steps=20 train.eval_every=0 train.save_every=0 data.num_eval_prompts=128 \
  weight_sync.verify_every=1 "$@" 2>&1 | tee "$RUN_DIR/smoke.log" || status=${PIPESTATUS[0]}

"$PY" -m cli.gpu_report "$RUN_DIR" --log "$RUN_DIR/smoke.log" || echo "gpu_smoke: no report (see above)" >&2
exit "$status"
