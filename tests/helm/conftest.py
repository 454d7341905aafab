"""Session fixtures for the Helm chart tests; the helpers live in tests/helm/chart.py.

Without the Helm tool venv (`bash scripts/helm_tools.sh`) every test here skips with that
reason; with KVSERVE_REQUIRE_HELM=1 (CI) it fails instead.
"""
from __future__ import annotations

from typing import Any

import pytest

from tests.helm.chart import (
    CHART, KUBE_VERSION, NAMESPACE, SCENARIOS, Rendered, render_job, require_helm, run_jobs, with_api_keys,
)


@pytest.fixture(scope="session")
def rendered() -> dict[str, Rendered]:
    """Every scenario rendered, linted (strict) and its manifests validated."""
    require_helm()
    jobs = []
    scenarios = {name: with_api_keys(values) for name, values in SCENARIOS.items()}
    for values in scenarios.values():
        jobs.append(render_job(values))
        jobs.append({"op": "lint", "chart": str(CHART), "values": values, "strict": True, "namespace": NAMESPACE,
                     "kube_version": f"v{KUBE_VERSION}"})
    results = run_jobs(jobs)
    out: dict[str, Rendered] = {}
    for i, (name, values) in enumerate(scenarios.items()):
        render_result, lint_result = results[2 * i], results[2 * i + 1]
        assert render_result["ok"], f"scenario {name!r} failed to render: {render_result.get('error')}"
        assert lint_result["ok"], f"scenario {name!r}: lint could not run: {lint_result.get('error')}"
        out[name] = Rendered(values, render_result["manifests"], lint_result["report"])
    validation_jobs = [{"op": "validate", "documents": r.docs, "kube_version": KUBE_VERSION} for r in out.values()]
    for r, result in zip(out.values(), run_jobs(validation_jobs)):
        assert result["ok"], result.get("error")
        r.validation = result["results"]
    return out


@pytest.fixture(scope="session")
def render_errors() -> Any:
    """`render_errors(list_of_(values, skip_schema), bare=False) -> list of error messages (None:
    rendered)`; bare: the values as given, without tests/helm/chart.py's API key Secret."""
    require_helm()

    def run(cases: list[tuple[dict[str, Any], bool]], bare: bool = False) -> list[str | None]:
        results = run_jobs([render_job(values, skip_schema, bare) for values, skip_schema in cases])
        return [None if r["ok"] else r["error"] for r in results]

    return run
