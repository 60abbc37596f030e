"""Which path a tensor takes: NCCL on the device, or a copy through host memory to the CPU transports.

The choice is made per tensor, so a job may mix CUDA and CPU tensors (and CUDA tensors NCCL cannot
carry). It depends only on facts every rank sees the same way when it runs the same script (the
tensor's device and dtype, the op, the ``HORA_NCCL`` setting and whether NCCL loads here), and the
path is part of the negotiated signature, so a rank that chose differently fails negotiation with
a message rather than hanging.

``HORA_NCCL`` (``HOROVOD_NCCL``): ``auto`` (default: CUDA tensors use NCCL when it is usable, else
the host path), ``off`` (always the host path), ``require`` (a CUDA tensor that cannot use NCCL is
an error naming why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hora.nccl.device_tensor import DL_CUDA, DL_CUDA_MANAGED
from hora.nccl.library import nccl_dtype
from hora.transport.base import ReduceOp

DEVICE = "device"
HOST = "host"
MODES = ("auto", "off", "require")


class NcclRequired(RuntimeError):
    """``HORA_NCCL=require`` and this tensor cannot take the device path."""


@dataclass(frozen=True)
class PathChoice:
    """The path and the reason, for logs, ``hora check`` and error messages."""

    path: str
    reason: str


def parse_mode(text: str) -> str:
    value = text.strip().lower()
    aliases = {"1": "auto", "on": "auto", "true": "auto", "0": "off", "false": "off", "no": "off"}
    value = aliases.get(value, value)
    if value not in MODES:
        raise ValueError(f"expected one of {', '.join(MODES)}, got {text!r}")
    return value


def choose_path(device: tuple[int, int], dtype: np.dtype, op: ReduceOp | None, mode: str,
                nccl_ready: Callable[[], tuple[bool, str]], scaled: bool = False) -> PathChoice:
    """The path for one tensor.

    ``device`` is its ``(DLPack device type, id)`` (see :func:`hora.nccl.device_tensor.device_of`);
    ``op`` the reduction for allreduce/reducescatter, None for the others; ``nccl_ready`` says
    whether the device path can run in this process (called only for CUDA tensors, so CPU jobs
    never load NCCL); ``scaled`` whether a prescale or postscale other than 1 applies.
    """
    if device[0] not in (DL_CUDA, DL_CUDA_MANAGED):
        return PathChoice(HOST, "CPU tensor: the built-in transports")
    reason = _device_refusal(dtype, op, mode, nccl_ready, scaled)
    if reason is None:
        return PathChoice(DEVICE, "CUDA tensor: NCCL on the device")
    if mode == "require":
        raise NcclRequired(f"HORA_NCCL=require, but this CUDA tensor cannot use NCCL: {reason}")
    return PathChoice(HOST, f"CUDA tensor through host memory: {reason}")


def _device_refusal(dtype: np.dtype, op: ReduceOp | None, mode: str,
                    nccl_ready: Callable[[], tuple[bool, str]], scaled: bool) -> str | None:
    if mode == "off":
        return "HORA_NCCL=off"
    if op is not None and ReduceOp(op) == ReduceOp.ADASUM:
        return "Adasum runs on the host path"
    try:
        nccl_dtype(dtype)
    except TypeError as exc:
        return str(exc)
    if op is not None and np.dtype(dtype) == np.bool_ and ReduceOp(op) in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return "a Sum of booleans would overflow NCCL's uint8"
    if scaled and op is not None and ReduceOp(op) not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return f"NCCL scales only Sums, not {ReduceOp(op).name}"
    if op is not None and np.dtype(dtype).kind in "iu" and (scaled or ReduceOp(op) == ReduceOp.AVERAGE):
        return "NCCL would scale integers by a rounded integer factor (Average or prescale/postscale)"
    ready, why = nccl_ready()
    return None if ready else f"NCCL unusable ({why})"
