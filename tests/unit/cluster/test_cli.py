"""The `kvserve` command line: parsing, config flags and errors (nothing is started)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster import cli


def test_config_command_prints_the_effective_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "--model", "/models/m", "--num-workers", "2", "--port", "8001", "--grpc-port", "9001", "--host", "0.0.0.0"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["model"]["path"] == "/models/m"
    assert data["workers"]["num_replicas"] == 2
    assert (data["http"]["host"], data["http"]["port"], data["http"]["direct_ingress"]) == ("0.0.0.0", 8001, None)
    assert data["grpc"]["port"] == 9001


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("http: {port: 7000}\nworkers: {num_replicas: 3}\n")
    args = cli.build_parser().parse_args(["serve", "--config", str(path), "--port", "7001"])
    config = cli.config_from_args(args)
    assert config.http.port == 7001 and config.workers.num_replicas == 3


def test_bad_config_exits_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("engine: {max_num_seq: 4}\n")
    assert cli.main(["config", "--config", str(path)]) == 2
    assert "did you mean 'max_num_seqs'" in capsys.readouterr().err


def test_serve_defaults() -> None:
    args = cli.build_parser().parse_args(["serve"])
    config = cli.config_from_args(args)
    assert (config.http.host, config.http.port, config.grpc.port) == ("127.0.0.1", 8000, 9000)
    assert config.model.resolved_name() == "kvserve-tiny"


def test_subcommands_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "serve" in out and "config" in out


def test_tensor_parallel_and_disaggregation_flags() -> None:
    args = cli.build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    config = cli.config_from_args(args)
    assert config.workers.tensor_parallel_size == 2 and config.disaggregation is None
    assert config.engine_config().model.tensor_parallel_size == 2

    args = cli.build_parser().parse_args(
        ["serve", "--disaggregate", "--tensor-parallel-size", "2", "--decode-workers", "3"]
    )
    d = cli.config_from_args(args).disaggregation
    assert d is not None
    assert (d.prefill.num_replicas, d.decode.num_replicas) == (1, 3)
    assert d.prefill.tensor_parallel_size == d.decode.tensor_parallel_size == 2
    # --prefill-workers alone implies --disaggregate
    args = cli.build_parser().parse_args(["config", "--prefill-workers", "2"])
    assert cli.config_from_args(args).disaggregation.prefill.num_replicas == 2


def test_disaggregate_copies_workers_and_gives_each_pool_its_autoscaling_role(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("workers: {num_cpus: 2, autoscaling: {min_replicas: 1, max_replicas: 3}}\n")
    args = cli.build_parser().parse_args(["serve", "--config", str(path), "--disaggregate"])
    config = cli.config_from_args(args)
    d = config.disaggregation
    assert d.prefill.num_cpus == d.decode.num_cpus == 2
    assert (d.prefill.autoscaling.role, d.decode.autoscaling.role) == ("prefill", "decode")
    assert d.decode.autoscaling.max_replicas == 3
    # a local cluster gets enough logical CPUs for both pools at their largest (+ ingress)
    assert cli.local_num_cpus(config) >= 3 * 2 * 2
    # a TP group's default is one CPU per rank
    args = cli.build_parser().parse_args(["serve", "--tensor-parallel-size", "4", "--num-workers", "3"])
    assert cli.local_num_cpus(cli.config_from_args(args)) >= 3 * 4


def test_bad_tensor_parallel_size_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "--tensor-parallel-size", "0"]) == 2
    assert "tensor_parallel_size must be >= 1" in capsys.readouterr().err


def test_a_command_whose_module_does_not_import_fails_loudly_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken install does not make a command vanish: it is listed, and running it says
    what did not import and what to install; the other commands still work."""
    # `None` in sys.modules makes importing that name raise ImportError (name set).
    monkeypatch.setitem(__import__("sys").modules, "cluster.bench_serve", None)
    parser = cli.build_parser()
    assert "bench" in parser.format_help()
    assert cli.main(["bench", "--num-prompts", "3"]) == 2
    err = capsys.readouterr().err
    assert "`kvserve bench` is unavailable" in err and "cluster.bench_serve" in err and "pip install -e ." in err
    assert cli.main(["config"]) == 0


def test_install_hints_name_the_distribution() -> None:
    from cluster.deps import install_hint, missing

    assert install_hint(ImportError("x", name="grpc")) == "pip install grpcio"
    assert install_hint(ImportError("x", name="yaml.loader")) == "pip install pyyaml"
    assert install_hint(ImportError("x", name="httpx")) == "pip install httpx"
    error = missing("the gRPC API", ModuleNotFoundError("No module named 'grpc'", name="grpc"))
    assert isinstance(error, ImportError) and str(error) == (
        "the gRPC API is unavailable: No module named 'grpc'. Install it: pip install grpcio"
    )
