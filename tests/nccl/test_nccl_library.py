"""The NCCL library as installed here: version, unique id, ``nccl_built()`` and ``hora check``'s NCCL lines.

When libnccl is not installed (CI installs only the small CUDA runtime wheel, not the 350 MB NCCL
one) the real-library tests skip and the "not installed" reporting is what is checked.
"""

from __future__ import annotations

import numpy as np
import pytest

import hora
from hora.nccl import cudart, library
from hora.runner.commands import check
from hora.transport.base import ReduceOp

pytestmark = pytest.mark.timeout(60)

HAVE_NCCL = library.nccl_version() > 0
needs_nccl = pytest.mark.skipif(not HAVE_NCCL, reason="libnccl is not installed (pip install nvidia-nccl-cu12, "
                                                      "or set HORA_NCCL_LIBRARY)")


def test_version_decoding():
    assert library.decode_version(23203) == "2.32.3"
    assert library.decode_version(21805) == "2.18.5"
    assert library.decode_version(2708) == "2.7.8"  # the pre-2.9 encoding


def test_dtype_and_op_mapping():
    assert library.nccl_dtype(np.dtype(np.float32)) == library.DataType.FLOAT32
    assert library.nccl_dtype("bfloat16") == library.DataType.BFLOAT16
    with pytest.raises(TypeError, match="int16"):
        library.nccl_dtype(np.dtype(np.int16))
    assert library.nccl_op(ReduceOp.PRODUCT) == library.RedOp.PROD
    with pytest.raises(ValueError, match="ADASUM"):
        library.nccl_op(ReduceOp.ADASUM)


def test_nccl_built_matches_the_library():
    assert hora.nccl_built() == library.nccl_version()
    assert isinstance(hora.nccl_built(), int)


@needs_nccl
def test_real_library_version_and_unique_id_without_a_gpu():
    nccl = library.Nccl()
    assert nccl.version() == library.nccl_version() >= 21800
    first, second = nccl.unique_id(), nccl.unique_id()
    assert len(first) == library.UNIQUE_ID_BYTES and first != second
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.comm_init_rank(2, b"short", 0)


def test_status_and_check_lines_say_why():
    usable, why = library.nccl_status()
    lines = "\n".join(check.report_lines())
    assert "NCCL (GPU tensors):" in lines
    if not HAVE_NCCL:
        assert not usable and "no NCCL library found" in why
        assert "copied through host memory" in lines and "no NCCL library found" in lines
    else:
        assert f"NCCL {library.decode_version(library.nccl_version())}" in why
        assert f"nccl_built() == {library.nccl_version()}" in lines
    cuda_ok, cuda_why = cudart.cuda_status()
    if not cuda_ok:
        assert "usable: no" in lines or not HAVE_NCCL
        assert cuda_why  # never empty: says no runtime, no driver or no device


def test_cuda_runtime_reports_why_it_is_unusable_here():
    usable, why = cudart.cuda_status()
    if usable:
        pytest.skip("a CUDA device is visible: nothing to explain")
    assert any(text in why for text in ("no CUDA runtime library", "CUDA unusable", "CUDA sees no GPU"))


def test_check_reports_hora_nccl_setting(monkeypatch):
    monkeypatch.setenv("HORA_NCCL", "off")
    assert "  HORA_NCCL=off: CUDA tensors are copied through host memory" in check.nccl_lines()
    monkeypatch.setenv("HORA_NCCL", "sometimes")
    assert "HORA_NCCL is invalid: expected one of auto, off, require" in check.nccl_lines()[0]


def test_cuda_built_means_the_gpu_path_is_installed():
    assert hora.cuda_built() == (library.nccl_version() > 0 and cudart.runtime_installed())


def test_readiness_is_asked_once_per_process(monkeypatch):
    """Every CUDA tensor's path choice asks whether NCCL is ready: CUDA driver calls each time
    would sit on every gradient of every step, and the answer does not change."""
    from hora.nccl import context

    if context._backend_factory is not None:
        pytest.skip("a test backend is installed in this process")
    asked = []
    monkeypatch.setattr(library, "nccl_status", lambda: asked.append(1) or (False, "no GPU here"))
    context._real_status.cache_clear()
    try:
        assert [context.ready() for _ in range(3)] == [(False, "no GPU here")] * 3
        assert len(asked) == 1
    finally:
        context._real_status.cache_clear()
