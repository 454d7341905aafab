#!/usr/bin/env bash
# Runs a benchmark and keeps its raw log under benchmarks/results/, headed by what a reader
# needs to judge the figures: the command, the date, the machine (nproc, CPU model, memory,
# load), the commit (and whether the tree was dirty), the Python and torch versions.
#
#   bash scripts/record_benchmark.sh NAME python -m benchmarks.disagg --quick
#   -> benchmarks/results/NAME-YYYY-MM-DD-HHMM.txt (stdout and stderr, in order)
set -uo pipefail
cd "$(dirname "$0")/.."
name="$1"; shift
log="benchmarks/results/${name}-$(date -u +%Y-%m-%d-%H%M).txt"
# The versions are read from the benchmark's own interpreter when the command names one.
if [[ -n "${PYTHON:-}" ]]; then python="$PYTHON"
elif [[ "$(basename "$1")" == python* ]]; then python="$1"
else python=.venv/bin/python
fi
{
    echo "command: $*"
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "commit: $(git rev-parse HEAD)"
    changed=$(git status --short --untracked-files=no -- . ':!benchmarks/results' | tr '\n' ' ')
    echo "uncommitted changes: ${changed:-none}"
    echo "machine: nproc $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/Mem:/ {print $2 " GiB RAM"}')"
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "python: $($python --version 2>&1), torch $($python -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    echo "---"
} > "$log"
start=$(date +%s)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$@" >> "$log" 2>&1
rc=$?
{
    echo "---"
    echo "exit status: $rc; wall time: $(( $(date +%s) - start )) s; load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
} >> "$log"
echo "$log"
exit $rc
