"""The binding kit: what every framework binding (hora.torch, hora.tensorflow, hora.jax, hora.mxnet) is
built from, so that a new binding is an adapter and an optimizer.

- :mod:`hora.binding.adapter`: the :class:`Adapter` protocol, the four operations on a framework's
  tensors (``check_dtype``, ``to_host``, ``new_like``, ``write_into``) that each binding's tensors
  module defines under these names, and the handles' finishing functions built on it;
- :mod:`hora.binding.handle`: the handle the ``_async`` collectives return and Horovod's ``poll`` and
  ``synchronize``, which every binding re-exports.

and the helpers the bindings' optimizers and faces share, none tied to a framework:

- :mod:`hora.binding.common_api`: the lifecycle, topology, reduce ops, process sets and errors every
  binding re-exports under Horovod's names;
- :mod:`hora.binding.batched`: many tensors reduced as grouped collectives in one submission;
- :mod:`hora.binding.gradient_buckets`: the plan of gradient buckets (one engine request each);
- :mod:`hora.binding.shard_plan`: contiguous, byte-balanced shards of parameters for sharded
  optimizer state.

The Keras helpers (:mod:`hora.keras_wrapper`, :mod:`hora.elastic_variables`) stay beside the bindings:
on the JAX backend they reach :mod:`hora.jax`, which stands on this kit.

The collectives themselves are :mod:`hora.collectives` (on NumPy buffers, and on device buffers for
NCCL), and the argument rules :mod:`hora.horovod_args`: a binding converts and calls them.
"""

from __future__ import annotations

from hora.binding.adapter import (
    Adapter as Adapter,
    new_each as new_each,
    new_one as new_one,
    write_each as write_each,
    write_one as write_one,
)
from hora.binding.handle import (
    ConvertingHandle as ConvertingHandle,
    as_is as as_is,
    poll as poll,
    synchronize as synchronize,
)
