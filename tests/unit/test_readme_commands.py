"""Every `kvserve` command README.md shows runs as written.

The commands are read out of README.md itself (code spans and blocks), so a command added
there is checked here without editing this file. What "runs" means per command:
- `serve ...`: the CLI parses it and builds the config, the Serve application and every
  worker's engine config; on a simulated device the worker replica itself is built and
  serves a request (where `kvserve serve --device sim:h200 --model-shape llama-3-8b` once
  crashed every replica). Placeholder paths (/path/to/...) are parsed, not loaded.
- `simulate ...` and `config`: run, exit 0.
- commands that talk to a running server (`complete`, `status`): parsed.
"""
from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path

import pytest

from cluster.cli import build_parser, config_from_args, main

ROOT = Path(__file__).resolve().parents[2]
_CODE = re.compile(r"```[a-z]*\n(.*?)```|`([^`]+)`", re.DOTALL)
_COMMAND = re.compile(r"(?:\.venv/bin/)?kvserve ((?:serve|simulate|config|complete|status)\b.*)")
# Paths the reader fills in (a checkpoint, their own config file): parsed, not loaded.
_PLACEHOLDERS = ("/path/to/", "/models/", "kvserve.yaml")


def readme_commands() -> list[str]:
    """Each `kvserve ...` command in README.md's code (a span may wrap over two lines). A
    bare `kvserve complete` in prose names the command; it is not one to run."""
    commands: list[str] = []
    for block, span in _CODE.findall((ROOT / "README.md").read_text()):
        lines = block.splitlines() if block else [" ".join(span.split())]
        for line in lines:
            for part in line.split("&&"):
                match = _COMMAND.search(part.strip())
                if match is None:
                    continue
                command = match.group(1).strip().rstrip(";")
                if command != "complete" and command not in commands:
                    commands.append(command)
    return commands


def test_the_readme_shows_the_commands_this_file_checks() -> None:
    commands = readme_commands()
    assert "serve" in commands  # the quick start's `kvserve serve`
    assert any(c.startswith("simulate") for c in commands)
    assert any("--tensor-parallel-size" in c for c in commands)


@pytest.mark.parametrize("command", readme_commands())
def test_a_readme_command_runs_as_written(command: str) -> None:
    argv = shlex.split(command)
    if argv[0] == "serve":
        _check_serve(argv)
    elif argv[0] in ("simulate", "config"):
        assert main(argv) == 0
    else:
        build_parser().parse_args(argv)


def _check_serve(argv: list[str]) -> None:
    from cluster.app import build_app

    argv = [_glob(a) for a in argv]  # the venv's python3.X, as the shell would expand it
    args = build_parser().parse_args(argv)
    if any(p in " ".join(argv) for p in _PLACEHOLDERS):
        return
    config = config_from_args(args)
    build_app(config)
    engine = config.engine_config()
    if engine.model.device.startswith("sim:"):
        _serve_one_request(config)


def _glob(arg: str) -> str:
    if "*" not in arg:
        return arg
    found = sorted(ROOT.glob(arg))
    if not found:
        pytest.skip(f"{arg} is not installed here (scripts/test.sh installs it)")
    return str(found[0])


def _serve_one_request(config: object) -> None:
    from worker.api import GenerateRequest, SamplingParams
    from worker.serving.replica import WorkerReplica

    replica = WorkerReplica(config.engine_config())  # type: ignore[attr-defined]

    async def one() -> list[int]:
        request = GenerateRequest("readme", list(range(5, 21)), SamplingParams(max_tokens=4, ignore_eos=True))
        return [t async for out in replica.generate(request) for t in out.new_token_ids]  # type: ignore[union-attr]

    try:
        assert len(asyncio.run(one())) == 4
    finally:
        replica.engine.shutdown()
