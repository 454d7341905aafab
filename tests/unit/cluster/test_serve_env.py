"""The environment kvserve gives Ray Serve's processes (cluster/serve_env.py)."""
from __future__ import annotations

from cluster.serve_env import DIRECT_INGRESS_ENV, THROUGHPUT_OPTIMIZED_ENV, controller_options, job_runtime_env, serve_process_env


def test_throughput_optimized_by_default() -> None:
    assert serve_process_env({}) == {THROUGHPUT_OPTIMIZED_ENV: "1", DIRECT_INGRESS_ENV: "0"}


def test_an_operators_explicit_choice_wins() -> None:
    environ = {THROUGHPUT_OPTIMIZED_ENV: "0", DIRECT_INGRESS_ENV: "1", "RAY_SERVE_LOG_TO_STDERR": "1", "UNRELATED": "x"}
    assert serve_process_env(environ) == {THROUGHPUT_OPTIMIZED_ENV: "0", DIRECT_INGRESS_ENV: "1",
                                          "RAY_SERVE_LOG_TO_STDERR": "1"}


def test_job_and_controller_carry_the_same_mode() -> None:
    job = job_runtime_env({"PYTHONPATH": "/src"}, environ={})
    mode = {THROUGHPUT_OPTIMIZED_ENV: "1", DIRECT_INGRESS_ENV: "0"}
    assert job == {"env_vars": {**mode, "PYTHONPATH": "/src"}}
    assert controller_options({}) == {"runtime_env": {"env_vars": mode}}
    # The caller's own variables win over the mode's.
    assert job_runtime_env({THROUGHPUT_OPTIMIZED_ENV: "0"}, environ={})["env_vars"][THROUGHPUT_OPTIMIZED_ENV] == "0"
