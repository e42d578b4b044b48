#!/usr/bin/env bash
# Runs a pip command, retrying when the network cuts a download off. torch from PyPI brings about
# 3 GB of NVIDIA wheels; a connection that drops mid-file made a whole CI run fail before this.
# Usage: scripts/pip-retry.sh PIP ARGS...   e.g. scripts/pip-retry.sh build-venv/bin/pip install torch
#        or scripts/pip-retry.sh python3 -m pip download ...
set -uo pipefail
pip="$1"; shift
# pip resumes an interrupted download from where it stopped, this many times per file (default 5).
export PIP_RESUME_RETRIES="${PIP_RESUME_RETRIES:-25}"
export PIP_DEFAULT_TIMEOUT="${PIP_DEFAULT_TIMEOUT:-60}"
attempts="${K3_PIP_ATTEMPTS:-4}"
for ((i = 1; i <= attempts; i++)); do
  "$pip" "$@" && exit 0
  rc=$?
  if ((i < attempts)); then
    echo "k3: '$(basename "$pip") $*' failed (exit $rc), attempt $i of $attempts; retrying in $((20 * i)) s" >&2
    sleep $((20 * i))
  else
    echo "k3: '$(basename "$pip") $*' failed (exit $rc) after $attempts attempts" >&2
  fi
done
exit "$rc"
