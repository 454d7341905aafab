#!/usr/bin/env bash
# Creates .venv and installs kvserve into it. Torch goes in FIRST, pinned, so that pip
# takes the CPU wheel on a CPU machine instead of resolving a multi-GB CUDA build.
# Usage: bash scripts/install.sh [extras]    e.g. bash scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
    .venv/bin/python -m pip install -q -e ".[$extras]"
else
    .venv/bin/python -m pip install -q -e .
fi
