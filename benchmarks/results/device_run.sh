#!/usr/bin/env bash
# The whole device check as ONE short run, for a session that is lent an H200 (15 minutes
# of device time in all): the GPU unit tests (compiled Triton kernel in bf16 against the
# torch backend, CUDA-graph replay against eager), then `python -m benchmarks.gpu`.
# Everything goes to $OUT/gpu-<date>.txt (the device tool brings $OUT back); copy it here.
#
#   run(command="bash benchmarks/results/device_run.sh", timeout_s=600)
#
# The device image has torch, triton, transformers, safetensors and pytest; kvserve's GPU
# path needs nothing else (no Ray, no Redis).
set -o pipefail
export PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results}/gpu-$(date -u +%Y%m%d).txt"
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/unit/test_triton_paged.py tests/unit/test_cuda_graphs.py tests/unit/test_attention.py 2>&1 | tee -a "$out"
timeout 390 python3 -m benchmarks.gpu 2>&1 | tee -a "$out"
