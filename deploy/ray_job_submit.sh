#!/usr/bin/env bash
# Submit a relayrl run to a running Ray cluster as a Ray job:
#   deploy/ray_job_submit.sh --config deploy/configs/qwen2.5-1.5b_2nodes.yaml model.path=/models/Qwen2.5-1.5B-Instruct
# Every argument goes to `relayrl train`. The repository (this working tree, without .venv, runs/ and caches)
# is uploaded as the job's working directory, so the code that runs is the code here; the cluster's nodes need
# the install (deploy/install.sh) for the packages. Inside the job the run joins the cluster through RAY_ADDRESS,
# which Ray sets for the job's driver.
#   RAY_DASHBOARD_ADDRESS  the head's dashboard (job API), default http://127.0.0.1:8265
#   RELAYRL_SUBMIT_ARGS    extra `ray job submit` options, e.g. "--no-wait --submission-id gsm8k-1"
#   RAY                    the ray command, default `ray` on PATH
#   RELAYRL_SUBMIT_WAIT_S  how long to keep submitting while a just-started head has no job agent yet (default 120)
set -euo pipefail
cd "$(dirname "$0")/.."
ADDRESS=${RAY_DASHBOARD_ADDRESS:-http://127.0.0.1:8265}
# `ray start` turns token authentication on when a token exists; `ray job submit` sends the token only when
# RAY_AUTH_MODE=token, so follow the same rule here (the token: RAY_AUTH_TOKEN or ~/.ray/auth_token).
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; }; then
  export RAY_AUTH_MODE=token
fi
RAY=${RAY:-ray}
# Uploads are capped (512 MiB); the virtual env, run folders and build outputs never belong in them.
RUNTIME_ENV='{"excludes": [".venv/", ".git", "runs/", ".cache/", "build/", ".whl/", "*.egg-info/", "**/__pycache__/", ".pytest_cache/"]}'
# A head that has just started answers before its job agent is up, and Ray refuses the job with "No available
# agent to submit job, please try again later": nothing was submitted, so submit again, within the wait.
# The output streams through as it comes (a whole run's logs); only the refusal's mark is kept aside.
NO_AGENT="No available agent to submit job"
deadline=$((SECONDS + ${RELAYRL_SUBMIT_WAIT_S:-120}))
refused=$(mktemp -u)
trap 'rm -f "$refused"' EXIT
while true; do
  rm -f "$refused"
  set +e
  # shellcheck disable=SC2086  # RELAYRL_SUBMIT_ARGS is a list of options
  "$RAY" job submit --address "$ADDRESS" --working-dir . --runtime-env-json "$RUNTIME_ENV" \
    ${RELAYRL_SUBMIT_ARGS:-} -- relayrl train "$@" 2>&1 |
    awk -v mark="$NO_AGENT" -v refused="$refused" '{ print; fflush() } index($0, mark) { printf "" > refused }'
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -eq 0 ] || [ ! -e "$refused" ]; then
    exit "$status"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "ray_job_submit.sh: the head at $ADDRESS still had no job agent after RELAYRL_SUBMIT_WAIT_S=${RELAYRL_SUBMIT_WAIT_S:-120} s; check its dashboard agent (ray status, its logs) or raise the wait" >&2
    exit "$status"
  fi
  echo "ray_job_submit.sh: the head's job agent is not up yet; submitting again in 2 s" >&2
  sleep 2
done
