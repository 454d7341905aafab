"""Runs inside the Helm tool venv (scripts/helm_tools.sh), never inside the project venv.

It drives a real Helm v4 engine (the `helm-python-sdk` wheel: Helm's Go SDK as a shared
library) and the offline Kubernetes schemas of `kubernetes-validate`. The tests in
tests/helm/ call it as a subprocess with a JSON list of jobs on stdin and read a JSON list
of results from stdout, so that the project venv needs neither package.

Jobs:
  {"op": "render", "chart": DIR, "values": {...}, "release": NAME, "namespace": NS}
      -> {"ok": true, "manifests": {template_path: text}} | {"ok": false, "error": str}
         Values are validated against values.schema.json first (as `helm install` and
         `helm template` do), then the templates are rendered. "skip_schema": true
         renders a copy of the chart without values.schema.json (Helm's render enforces
         it), to test the templates' own `fail` checks.
  {"op": "lint", "chart": DIR, "values": {...}, "strict": bool}
      -> {"ok": true, "report": {...}}
  {"op": "validate", "documents": [manifest, ...], "kube_version": "1.33.0"}
      -> {"ok": true, "results": [{"kind", "name", "schema", "errors": [str]}]}
         Built-in kinds: kubernetes-validate, strict (unknown fields are errors).
         RayService / ServiceMonitor: the vendored schemas in tests/data/, closed the
         same way, with $refs into the Kubernetes definitions.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).resolve().parents[1] / "data"
CUSTOM_SCHEMAS = {
    ("ray.io/v1", "RayService"): DATA / "kuberay" / "rayservice-v1.schema.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): DATA / "prometheus-operator" / "servicemonitor-v1.schema.yaml",
}


def render(job: dict[str, Any]) -> dict[str, Any]:
    import helm_python as helm

    values = job.get("values") or {}
    chart_dir = job["chart"]
    if job.get("skip_schema"):
        # Helm's render enforces values.schema.json itself: render a copy without it.
        tmp = tempfile.mkdtemp(prefix="kvserve-chart-")
        chart_dir = shutil.copytree(chart_dir, os.path.join(tmp, os.path.basename(chart_dir)))
        os.remove(os.path.join(chart_dir, "values.schema.json"))
    try:
        with helm.Chart.load(chart_dir) as chart:
            if not job.get("skip_schema"):
                chart.validate_schema(values)
            manifests = chart.render(
                values, name=job.get("release", "kvserve"), namespace=job.get("namespace", "default"),
                is_install=True,
            )
    except helm.HelmError as e:
        return {"ok": False, "error": str(e), "error_type": type(e).__name__}
    finally:
        if job.get("skip_schema"):
            shutil.rmtree(os.path.dirname(chart_dir), ignore_errors=True)
    return {"ok": True, "manifests": manifests}


def lint(job: dict[str, Any]) -> dict[str, Any]:
    import helm_python as helm

    report = helm.lint(
        job["chart"], job.get("values") or None, strict=bool(job.get("strict", True)),
        namespace=job.get("namespace", "default"), kube_version=job.get("kube_version"),
    )
    return {"ok": True, "report": report}


def _close(schema: Any) -> Any:
    """additionalProperties: false on every object schema that lists properties (unless it
    is marked open, or already says what extra keys may be)."""
    if isinstance(schema, dict):
        out = {k: _close(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.pop("x-kvserve-open", False):
            out["additionalProperties"] = False
        out.pop("x-kvserve-open", None)
        return out
    if isinstance(schema, list):
        return [_close(v) for v in schema]
    return schema


_VALIDATORS: dict[tuple[str, str], Any] = {}


def _custom_validator(key: tuple[str, str], kube_version: str) -> Any:
    if key not in _VALIDATORS:
        import jsonschema
        from kubernetes_validate import utils as kv
        from referencing import Registry, Resource

        version = [v for v in kv.all_versions() if kv.major_minor(v) <= kv.major_minor(kube_version)][-1]
        definitions = kv.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
        registry = Resource.from_contents(definitions) @ Registry()
        schema = _close(yaml.safe_load(CUSTOM_SCHEMAS[key].read_text()))
        _VALIDATORS[key] = jsonschema.Draft202012Validator(schema, registry=registry)
    return _VALIDATORS[key]


def validate(job: dict[str, Any]) -> dict[str, Any]:
    from kubernetes_validate import utils as kv

    kube_version = job.get("kube_version", "1.33.0")
    results = []
    for doc in job["documents"]:
        key = (doc.get("apiVersion", ""), doc.get("kind", ""))
        name = (doc.get("metadata") or {}).get("name", "")
        errors: list[str] = []
        if key in CUSTOM_SCHEMAS:
            validator = _custom_validator(key, kube_version)
            for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
                path = ".".join(str(p) for p in err.absolute_path)
                errors.append(f"{path}: {err.message}")
            schema = f"vendored {CUSTOM_SCHEMAS[key].relative_to(DATA)}"
        else:
            try:
                version = kv.validate(copy.deepcopy(doc), kube_version, strict=True)
                schema = f"kubernetes {version} (strict)"
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(f"{path}: {e.message}")
                schema = f"kubernetes {e.version} (strict)"
            except kv.SchemaNotFoundError as e:
                errors.append(f"no schema: {e.message}")
                schema = "none"
        results.append({"kind": key[1], "apiVersion": key[0], "name": name, "schema": schema, "errors": errors})
    return {"ok": True, "results": results}


OPS = {"render": render, "lint": lint, "validate": validate}


def main() -> int:
    jobs = json.load(sys.stdin)
    results = []
    for job in jobs:
        try:
            results.append(OPS[job["op"]](job))
        except Exception as e:  # reported to the test, which shows it
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}", "error_type": "runner"})
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
