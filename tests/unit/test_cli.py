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
    assert data["http"] == {"host": "0.0.0.0", "port": 8001}
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
