"""Whether the real-GPU tests of this folder can run here, and if not, the one line that says why."""

from __future__ import annotations

import pytest

from hora.nccl import cudart, library


def gpu_skip_reason() -> str | None:
    """None where CUDA sees a GPU and libnccl and torch's CUDA build are installed; else what is missing."""
    if not library.nccl_version():
        return "no GPU test: libnccl is not installed (pip install \"hora[cuda]\")"
    usable, why = cudart.cuda_status()
    if not usable:
        return f"no GPU test: {why}"
    try:
        import torch
    except ImportError:
        return "no GPU test: torch is not installed"
    if not torch.cuda.is_available():
        return "no GPU test: this torch build has no CUDA (torch.cuda.is_available() is False)"
    return None


_REASON = gpu_skip_reason()
#: Marks a test (or, as ``pytestmark``, a module) that needs the GPU.
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
