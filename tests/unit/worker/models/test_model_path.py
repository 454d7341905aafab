"""One rule tells a local model from a Hub id (worker/model_path.py), and every reader of
a `--model` value uses it: the workers' resolve_model_path, `kvserve serve`'s check before
Ray starts (check_local_model) and the served model's default name (cluster/config.py).
No model is loaded: the files are empty stand-ins, read only for what they are."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import KVServeConfig
from worker.model_config import check_local_model
from worker.model_path import is_hub_id, local_model_path, resolve_model_path


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding a model directory, a .gguf file and a stray file."""
    (tmp_path / "models" / "Tiny").mkdir(parents=True)
    (tmp_path / "models" / "Small.Q4.gguf").write_bytes(b"")
    (tmp_path / "models" / "notes.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def served_name(model: str) -> str:
    return KVServeConfig.from_dict({"model": model}).model.resolved_name()


@pytest.mark.parametrize("model", ["models/Tiny", "models/Small.Q4.gguf", "./models/Tiny"])
def test_a_local_directory_or_gguf_file_is_local_however_spelled(here: Path, model: str) -> None:
    assert local_model_path(model) == Path(model)
    assert not is_hub_id(model)
    assert resolve_model_path(model) == Path(model)
    # Named after the directory or file, not the path as typed.
    assert served_name(model) == Path(model).name


def test_a_hub_id_is_neither_local_nor_path_like(here: Path) -> None:
    assert is_hub_id("org/Some-Model") and local_model_path("org/Some-Model") is None
    assert served_name("org/Some-Model") == "org/Some-Model"
    check_local_model("org/Some-Model")  # checked where it is downloaded, not here


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("models/Missing.gguf", "GGUF file 'models/Missing.gguf' not found"),
        ("./models/Missing", "model directory './models/Missing' not found"),
        ("models/notes.txt", "is a file, not a model directory or a .gguf file"),
    ],
)
def test_a_missing_or_wrong_local_path_fails_before_ray_starts(here: Path, model: str, message: str) -> None:
    """Never a download attempt: a path that is not a model is the operator's mistake."""
    assert not is_hub_id(model)
    for check in (resolve_model_path, check_local_model):
        with pytest.raises(FileNotFoundError, match=message):
            check(model)
