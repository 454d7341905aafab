"""Triton for the kernels that use it (attention, MoE, fused layers, int4 GEMM): optional,
absent on CPU-only installs and bundled with CUDA torch builds. Each kernel module is
defined under `if triton is not None:` and says TRITON_IMPORT_ERROR when asked to run
without it."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except Exception as e:  # ImportError, or a broken install raising at import
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = f"{type(e).__name__}: {e}"


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes."""
    return 1 << max(0, (n - 1).bit_length())
