"""Averaging a list of TensorFlow gradients across ranks, and ``DistributedGradientTape``.

:func:`allreduce_list` is what the tape, the optimizers on the TensorFlow backend and ``allreduce``
of an ``IndexedSlices`` all do: compress the dense gradients, reduce every gradient of the list in
one engine round (dense ones allreduced, in Horovod's groups if any, else, for the gradient
wrappers, flattened into buckets of :mod:`hora.binding.gradient_buckets` with one request each; sparse ones
gathered as values and indices, or densified with ``sparse_as_dense``), decompress. One op per list
keeps the ranks in step inside ``tf.function`` (see :mod:`hora.tensorflow.tensors`). A list of dense
GPU gradients goes to NCCL in place, with the same names and groups (:mod:`hora.tensorflow.device`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hora import basics, horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.binding import batched, gradient_buckets
from hora.compression import Compression
from hora.horovod_args import GradientReduction
from hora.tensorflow import device
from hora.tensorflow.tensors import collective_name, leading_unknown, run_numpy, to_tensor


def _plan_buckets(dense: dict[int, tf.Tensor], names: Sequence[str | None], reduction: GradientReduction,
                  compression) -> list[list[int]]:
    """Positions of ``dense`` that travel as flat buckets (:mod:`hora.binding.gradient_buckets`'s rule), in
    reverse list order (about the order backward produces them). Gradients of unknown static shape
    (and unnamed lists, whose ranks would not agree on a bucket's name) stay per tensor."""
    if not gradient_buckets.bucketable(reduction.op, compression) or any(n is None for n in names):
        return []
    cap = gradient_buckets.bucket_bytes()
    order = [i for i in reversed(list(dense)) if dense[i].shape.is_fully_defined()]
    sizes = [(dense[i].shape.num_elements() * dense[i].dtype.size, dense[i].dtype) for i in order]
    return [[order[k] for k in bucket] for bucket in gradient_buckets.plan(sizes, cap)]


def allreduce_list(grads: Sequence[Any], names: Sequence[str | None], reduction: GradientReduction,
                   groups: int | list[list[int]] | None = None, compression=Compression.none,
                   sparse_as_dense: bool = False, device_dense: str = "", device_sparse: str = "",
                   buckets: bool = False) -> list[Any]:
    """Reduce each gradient of ``grads`` across ranks; ``None`` stays ``None`` (and is not sent).

    ``groups`` are positions (see :func:`hora.horovod_args.group_positions`). IndexedSlices come
    back as IndexedSlices holding every rank's rows (values scaled as the op says), unless
    ``sparse_as_dense`` reduces them as dense tensors. With ``buckets`` (and no ``groups``), dense
    gradients are flattened into buckets (``tf.concat``), each reduced as one engine request and
    unpacked with ``tf.split``: bit-identical to reducing them one by one, at one submission per bucket.
    """
    grads = list(grads)
    if sparse_as_dense:
        with tf.device(device_sparse):
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    dense_at = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse_at = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    if not dense_at and not sparse_at:
        return grads
    if sparse_at:
        reduction.sparse_scale()  # refuses ops other than Sum and Average before any collective starts
    with tf.device(device_dense):
        dense = {i: to_tensor(grads[i], "gradient") for i in dense_at}
        plan = _plan_buckets(dense, names, reduction, compression) if buckets and groups is None else []
        in_bucket = {i for bucket in plan for i in bucket}
        loose = [i for i in dense_at if i not in in_bucket]
        packed = {i: compression.compress(dense[i]) for i in loose}
        flats = [compression.compress(tf.concat([tf.reshape(dense[i], [-1]) for i in bucket], 0)) for bucket in plan]
    inputs = [packed[i][0] for i in loose] + [flat for flat, _ in flats]
    dtypes = [t.dtype for t in inputs]
    shapes = [t.shape for t in inputs]
    for i in sparse_at:
        values, indices = to_tensor(grads[i].values, "gradient values"), grads[i].indices
        inputs += [values, indices]
        dtypes += [values.dtype, indices.dtype]
        shapes += [leading_unknown(values.shape), [None]]
    count = len(grads)
    # In a TensorFlow 1 graph, unnamed positions are named now, when the graph is built (see
    # hora.tensorflow.tensors.collective_name); elsewhere when the op runs (batched.start).
    base = collective_name(None, "HoraAllreduceGradients") if any(n is None for n in names) else None
    names = [f"{base}.{i}" if n is None and base is not None else n for i, n in enumerate(names)]
    # A bucket is one more position after the list's own, named after its first gradient.
    all_names = list(names) + [f"{names[bucket[0]]}.bucket{len(bucket)}" for bucket in plan]
    units = len(loose) + len(plan)

    def body(*arrays: Any) -> list[Any]:
        dense_arrays: list[Any] = [None] * (count + len(plan))
        sparse: list[Any] = [None] * count
        for k, i in enumerate(loose):
            dense_arrays[i] = arrays[k]
        for b in range(len(plan)):
            dense_arrays[count + b] = arrays[len(loose) + b]
        for k, i in enumerate(sparse_at):
            base = units + 2 * k
            sparse[i] = (arrays[base], arrays[base + 1])
        results = batched.start(dense_arrays, all_names, reduction, groups, sparse).wait()
        out = [results[i] for i in loose] + [results[count + b] for b in range(len(plan))]
        # The sparse scale depends on the world's size: read it each time the op runs, not when a
        # tf.function is traced, since a compiled step outlives an elastic reset to another size.
        scale = reduction.sparse_scale() if sparse_at else 1.0
        for i in sparse_at:
            values, indices = results[i]
            if scale != 1.0:
                values = values * np.asarray(scale, dtype=values.dtype)
            out += [values, indices]
        return out

    def on_device(*tensors: tf.Tensor) -> list[tf.Tensor] | None:
        """The dense gradients and buckets on NCCL, named and grouped as ``body`` sends them (a list with
        sparse gradients goes through the host as a whole)."""
        if sparse_at:
            return None
        dense_tensors: list[tf.Tensor | None] = [None] * (count + len(plan))
        for k, i in enumerate(loose):
            dense_tensors[i] = tensors[k]
        for b in range(len(plan)):
            dense_tensors[count + b] = tensors[len(loose) + b]
        results = device.reduce_gradients(dense_tensors, all_names, reduction, groups)
        if results is None:
            return None
        return [results[i] for i in loose] + [results[count + b] for b in range(len(plan))]

    recorded = base if base is not None else next((n for n in names if n is not None), None)
    outputs = run_numpy(body, inputs, dtypes, shapes, name="HoraAllreduceGradients", collective=recorded,
                        on_device=on_device)
    result = list(grads)
    with tf.device(device_dense):
        for k, i in enumerate(loose):
            result[i] = compression.decompress(outputs[k], packed[i][1])
        for b, bucket in enumerate(plan):
            flat = compression.decompress(outputs[len(loose) + b], flats[b][1])
            pieces = tf.split(flat, [dense[i].shape.num_elements() for i in bucket], 0)
            for i, piece in zip(bucket, pieces):
                result[i] = tf.reshape(piece, dense[i].shape)
    if sparse_at:
        with tf.device(device_sparse):
            for k, i in enumerate(sparse_at):
                values, indices = outputs[units + 2 * k: units + 2 * k + 2]
                result[i] = tf.IndexedSlices(values, indices, dense_shape=grads[i].dense_shape)
    return result


class GradientAllreducer:
    """Horovod's gradient-averaging options, bound once and applied to each list of gradients."""

    def __init__(self, prefix: str, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
                 sparse_as_dense: bool = False, op: int = Average, gradient_predivide_factor: float = 1.0,
                 groups: Any = None, process_set: ProcessSet = global_process_set) -> None:
        self.reduction = GradientReduction.create(op, gradient_predivide_factor, process_set)
        self.compression = horovod_args.check_compression(compression)
        self.prefix = prefix
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self.sparse_as_dense = sparse_as_dense
        self.groups = groups

    def __call__(self, grads: Sequence[Any], sources: Sequence[Any] | None = None) -> list[Any]:
        grads = list(grads)
        names = batched.gradient_names(self.prefix, len(grads))
        groups = horovod_args.group_positions(self.groups, sources)
        return allreduce_list(grads, names, self.reduction, groups, self.compression, self.sparse_as_dense,
                              self.device_dense, self.device_sparse, buckets=True)


def _source_key(source: Any) -> Any:
    """A hashable identity for a gradient source: TensorFlow's ``ref()``; Keras 3 variables have none,
    and live as long as their layer, so their ``id``."""
    return source.ref() if hasattr(source, "ref") else ("id", id(source))


class ReducesGradients:
    """What the TensorFlow gradient wrappers (the tape, the TensorFlow 1 optimizer) mix in: their
    allreducer, and the sources whose gradients stay on this rank (Horovod's
    ``register_local_source`` / ``register_local_var``, with ``scale_local_gradients``)."""

    _hora_allreducer: GradientAllreducer
    _hora_local: set  # refs of sources whose gradients stay on this rank
    _hora_local_scale: float | None  # what their gradients are multiplied by, if anything

    def _hora_bind(self, allreducer: GradientAllreducer, local: set, scale_local_gradients: bool,
                   process_set: ProcessSet) -> None:
        self._hora_allreducer = allreducer
        self._hora_local = set(local)
        self._hora_local_scale = 1.0 / process_set.size() if scale_local_gradients else None

    def _hora_keep_local(self, source) -> None:
        self._hora_local.add(_source_key(source))

    def _hora_reduce(self, grads: Sequence[Any], sources: Sequence[Any] | None) -> list[Any]:
        aligned = sources if sources is not None and len(sources) == len(grads) else None
        is_local = ([_source_key(s) in self._hora_local for s in aligned]
                    if aligned is not None and self._hora_local else [])
        return batched.reduce_keeping_local(self._hora_allreducer, grads, aligned, is_local, self._hora_local_scale)


class _DistributedGradientTape(ReducesGradients):
    """Mixed into the wrapped tape's own class (see :func:`DistributedGradientTape`)."""

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank: it is not reduced (with ``scale_local_gradients``,
        the default, it is divided by the process set's size, as Horovod does)."""
        self._hora_keep_local(source)

    def register_local_var(self, var) -> None:
        """The same as :meth:`register_local_source`, under the optimizers' name."""
        self._hora_keep_local(var)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The tape's gradients, averaged (or summed, ...) across ranks."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        return tf.nest.pack_sequence_as(grads, self._hora_reduce(tf.nest.flatten(grads), tf.nest.flatten(sources)))


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged across all ranks.

    The result is an instance of the tape's own class sharing its recording, so it is used exactly
    as the tape was (``with`` blocks already closed, ``watch``, persistent tapes). ``None``
    gradients stay ``None`` and are not sent: a variable must be connected to the loss on every
    rank or on none. Works eagerly and inside ``tf.function`` (not under XLA). Sources given to
    ``register_local_source`` keep their own gradient on each rank, divided by the process set's
    size when ``scale_local_gradients`` (as in Horovod).
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    groups = horovod_args.resolve_groups(num_groups, groups)
    basics.engine()  # fail early, with the init() message, when hora is not initialised
    allreducer = GradientAllreducer("DistributedGradientTape", device_dense, device_sparse, compression,
                                    sparse_as_dense, op, gradient_predivide_factor, groups, process_set)
    base = gradtape.__class__
    if isinstance(gradtape, _DistributedGradientTape):
        # wrapping twice would average twice: rewrap the plain tape's class
        base = next(c for c in base.__mro__ if issubclass(c, tf.GradientTape)
                    and not issubclass(c, _DistributedGradientTape))
    cls: type[object] = type(base.__name__, (_DistributedGradientTape, base), {"__module__": base.__module__})
    wrapped: Any = cls.__new__(cls)
    wrapped.__dict__.update(gradtape.__dict__)
    wrapped._hora_bind(allreducer, getattr(gradtape, "_hora_local", ()), scale_local_gradients, process_set)
    return wrapped


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` that keeps the gradients of ``local_layers`` on each rank.

    ``local_layers``: a Keras layer or a collection of them whose trainable weights each rank trains
    on its own (their gradients are not reduced; with ``scale_local_gradients`` they are divided by
    the process set's size, as in Horovod). Without it, the tape is a plain DistributedGradientTape.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    else:
        local_layers = list(local_layers)
        wrong = [type(layer).__name__ for layer in local_layers if not isinstance(layer, keras.layers.Layer)]
        if wrong:
            raise ValueError(f"local_layers must be Keras layers; got {', '.join(wrong)}")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape
