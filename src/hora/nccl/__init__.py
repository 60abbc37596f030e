"""NCCL for CUDA tensors: hora's device-memory transport (``pip install "hora[cuda]"``).

CPU tensors keep the built-in transports; a CUDA tensor whose path is "device" (see
:mod:`hora.nccl.path`) is reduced by NCCL on the GPU, on hora's own CUDA stream. The modules:

- :mod:`hora.nccl.library`: the NCCL library (the ``nvidia-nccl-cu12`` wheel's ``libnccl.so.2``) through ctypes;
- :mod:`hora.nccl.cudart`: the few CUDA runtime calls hora needs (streams, events, copies), the seam tests drive;
- :mod:`hora.nccl.device_tensor`: any framework's CUDA tensor as a device buffer (DLPack, ``__cuda_array_interface__``);
- :mod:`hora.nccl.path`: the per-tensor choice between the device path and the host path;
- :mod:`hora.nccl.fusion`: the device fusion buffer's layout;
- :mod:`hora.nccl.communicators`: one NCCL communicator per process set, its unique id sent through the rendezvous;
- :mod:`hora.nccl.ops`: the collectives, ordered after the framework's stream with events;
- :mod:`hora.nccl.dispatch`: the engine's negotiated items run on the device.
"""

from hora.nccl.library import NcclUnavailable, nccl_status, nccl_version

__all__ = ["NcclUnavailable", "nccl_status", "nccl_version"]
