"""attention_backend selection: auto = flash, else triton, else torch on CUDA; torch on CPU;
explicit choices insist. Availability is monkeypatched (no GPU needed)."""
from __future__ import annotations

import logging

import pytest
import torch

import worker.attention.flash as flash_module
import worker.attention.triton_paged as triton_module
from worker.attention import select_backend

CUDA = torch.device("cuda")  # only a device object: nothing runs on it


class _Fake:
    varlen = True

    def __init__(self, name: str) -> None:
        self.name = name


def _availability(monkeypatch: pytest.MonkeyPatch, flash: bool, triton: bool) -> None:
    monkeypatch.setattr(flash_module, "load_flash_backend",
                        lambda device: (_Fake("flash"), "vllm_flash_attn") if flash else (None, "no flash package"))
    monkeypatch.setattr(triton_module, "load_triton_backend",
                        lambda device: (_Fake("triton"), "triton 3.x") if triton else (None, "no triton"))


@pytest.mark.parametrize(("flash", "triton", "expected"), [
    (True, True, "flash"), (False, True, "triton"), (False, False, "torch"), (True, False, "flash"),
])
def test_auto_on_cuda_prefers_flash_then_triton_then_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, flash: bool, triton: bool, expected: str
) -> None:
    _availability(monkeypatch, flash, triton)
    with caplog.at_level(logging.INFO, logger="worker.attention"):
        backend = select_backend("auto", CUDA)
    assert backend.name == expected
    lines = [r.getMessage() for r in caplog.records if r.name == "worker.attention"]
    assert len(lines) == 1 and lines[0].startswith(f"attention backend: {expected}")
    if expected == "torch":
        assert "no flash package" in lines[0] and "no triton" in lines[0]


def test_auto_on_cpu_is_torch_even_when_triton_imports(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    _availability(monkeypatch, flash=True, triton=True)
    with caplog.at_level(logging.INFO, logger="worker.attention"):
        assert select_backend("auto", torch.device("cpu")).name == "torch"
    assert len([r for r in caplog.records if r.name == "worker.attention"]) == 1


def test_explicit_triton_insists(monkeypatch: pytest.MonkeyPatch) -> None:
    _availability(monkeypatch, flash=True, triton=False)
    with pytest.raises(RuntimeError, match="attention_backend=triton .* no triton"):
        select_backend("triton", CUDA)
    _availability(monkeypatch, flash=False, triton=True)
    assert select_backend("triton", CUDA).name == "triton"


def test_real_triton_loader_refuses_cpu() -> None:
    backend, why = triton_module.load_triton_backend(torch.device("cpu"))
    assert backend is None and "CUDA" in why


def test_every_backend_says_which_metadata_it_reads() -> None:
    from worker.attention.flash import FlashAttention
    from worker.attention.torch_paged import TorchPagedAttention

    assert TorchPagedAttention.varlen is False
    assert FlashAttention.varlen is True and triton_module.TritonPagedAttention.varlen is True
