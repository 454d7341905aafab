#!/usr/bin/env bash
# The whole device check as ONE short run (a lent device machine, or any CUDA box): the
# tests marked `gpu` (attention backends, the compiled Triton kernel in bf16 against the
# torch backend, the sampler without host syncs, CUDA-graph replay against eager, and the
# engine's greedy outputs on CUDA against transformers'), then `python -m benchmarks.gpu`
# at a size that fits a few minutes. Logs go to $OUT (default ./gpu-check-out): the
# machine, the tests, the benchmark.
#
#   TESTS_S=150 BENCH_S=300 bash scripts/gpu_check.sh   # each stage's time limit
#
# Needs torch with CUDA, triton, transformers (the version pyproject.toml pins: an older
# one lacks what the peers configure) and the `redis` Python package (tests/conftest.py
# imports it); no Ray, no redis-server. A device image without them takes them as wheels
# (the device tool's README: pip install --target, PYTHONPATH).
set -uo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
# Only the files that hold `gpu` tests: collecting the others would need the serving stack.
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
  $(grep -rl "pytest.mark.gpu" tests --include="test_*.py" | sort) 2>&1 | tee "$OUT/tests.txt"
echo "tests exit status: $?" | tee -a "$OUT/tests.txt"
timeout "${BENCH_S:-300}" python3 -m benchmarks.gpu --requests 64 --concurrency 64 2>&1 | tee "$OUT/bench-gpu.txt"
echo "benchmarks.gpu exit status: $?" | tee -a "$OUT/bench-gpu.txt"
