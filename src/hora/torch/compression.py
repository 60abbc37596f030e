"""Gradient compression applied around a collective, as in horovod.torch.

``hora.torch.Compression`` is the one :mod:`hora.compression` namespace every binding uses, so
``Compression.fp16`` casts torch tensors exactly as it casts TensorFlow or Keras ones. This module
keeps Horovod's import path (``from horovod.torch.compression import Compression``).
"""

from __future__ import annotations

from hora.compression import BF16Compressor, Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
