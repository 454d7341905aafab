#!/usr/bin/env bash
# Installs the tools the Helm chart tests (tests/helm/) use into their own venv, apart from
# the project's .venv:
#   helm-python-sdk      a real Helm v4 engine (Helm's Go SDK built as a shared library,
#                        shipped in the wheel): renders, lints and schema-checks the chart
#                        offline, no helm binary and no cluster needed
#   kubernetes-validate  the Kubernetes OpenAPI schemas, offline (+ jsonschema, referencing)
# Idempotent: a second run with the same pins returns at once.
# Usage: bash scripts/helm_tools.sh            (venv: .cache/helm-venv, or $KVSERVE_HELM_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSERVE_HELM_VENV:-.cache/helm-venv}"
pins=(helm-python-sdk==0.2.2 kubernetes-validate==1.37.0)
stamp="$venv/.kvserve-helm-tools"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${pins[*]}" ]; then
    exit 0
fi
# helm-python-sdk needs Python >= 3.10; take the first interpreter that qualifies.
python=""
for candidate in python3 python3.12 python3.11 python3.13 python3.10; do
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        python="$candidate"
        break
    fi
done
if [ -z "$python" ]; then
    echo "helm_tools.sh: no Python >= 3.10 found for the Helm tool venv" >&2
    exit 1
fi
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "${pins[@]}"
"$venv/bin/python" -c 'import helm_python, kubernetes_validate, jsonschema, referencing; print("helm tools: Helm", helm_python.helm_sdk_version(), "| kubernetes-validate", kubernetes_validate.__version__ if hasattr(kubernetes_validate, "__version__") else "")'
echo "${pins[*]}" > "$stamp"
