"""Gradient compression, as ``horovod.mxnet.compression``: hora's one ``Compression`` namespace,
which casts NDArrays with ``astype`` (see :mod:`hora.compression`)."""

from __future__ import annotations

from hora.compression import Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
