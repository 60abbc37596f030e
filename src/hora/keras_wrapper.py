"""Wrapping a Keras 3 optimizer so its updates use gradients averaged across ranks: the Keras code that
``hora.keras`` and ``hora.tensorflow`` share.

Both bindings wrap Keras optimizers (in TensorFlow 2.16+ ``tf.keras`` is Keras 3), so the wrapper
lives here, below both: each binding resolves Horovod's arguments and hands :func:`wrap` the
TensorFlow gradient reduction it has (``hora.keras`` only when Keras runs on TensorFlow), and
neither binding imports the other.

Keras 3 funnels every update through ``optimizer.apply(grads, variables)`` (``apply_gradients``
and ``model.fit``'s ``train_step`` both call it), so the wrapper overrides that one method: it
reduces the gradients, then lets the wrapped class apply them. On the TensorFlow backend the
reduction is one op that also runs inside the ``tf.function`` Keras compiles ``train_step`` into;
on other backends whose steps run eagerly (torch) the gradients pass through NumPy.

With ``backward_passes_per_step`` k > 1, gradients are summed locally in variables for k calls (or
averaged, with ``average_aggregated_gradients``), and every k-th call reduces the sum across ranks
and applies it; the calls in between only count the optimizer's ``iterations``, as in Horovod.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from hora import basics, horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.binding import batched
from hora.compression import Compression
from hora.horovod_args import GradientReduction

#: ``reducer(grads, sources)``: the gradients reduced across ranks (``sources``: their variables, or None).
Reducer = Callable[[Sequence[Any], Sequence[Any] | None], list[Any]]

LEGACY_KERAS_VARIABLE = "TF_USE_LEGACY_KERAS"


def refuse_sharded_state(shard_optimizer_state: bool) -> None:
    """hora.tensorflow's and hora.keras's answer to ``shard_optimizer_state=True``, refused on every rank
    before anything is reduced rather than ignored."""
    if shard_optimizer_state:
        raise ValueError("shard_optimizer_state=True is not built for TensorFlow and Keras optimizers: every rank "
                         "keeps the whole optimizer state here. hora shards optimizer state in hora.torch and "
                         "hora.jax (docs/memory.md); leave it False")


def uses_tf_keras() -> bool:
    """Whether this process runs Keras 2 (the ``tf_keras`` package) instead of Keras 3.

    The one place hora decides it, by TensorFlow's own rule: ``TF_USE_LEGACY_KERAS`` set to 1 or
    true makes ``tf.keras`` tf_keras, so hora's callbacks and models follow the same choice. It is
    fixed per process (TensorFlow reads it once), which is why tests set it in the workers' environment.
    """
    return os.environ.get(LEGACY_KERAS_VARIABLE, "") in ("1", "true", "True")


def keras_api() -> Any:
    """The Keras module this process uses: ``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``, else Keras 3."""
    if not uses_tf_keras():
        return keras
    try:
        import tf_keras
    except ImportError as exc:
        raise ImportError(f"{LEGACY_KERAS_VARIABLE}=1 asks for Keras 2, which needs the tf-keras package "
                          f"(pip install 'hora[tf-keras]', the release matching TensorFlow's)") from exc
    return tf_keras


def to_numpy(value: Any) -> np.ndarray:
    """A tensor, variable, array or number of either Keras as a NumPy array."""
    if uses_tf_keras() and hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # TensorFlow's
        return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


class _NumpyAllreducer:
    """The reduction for Keras backends that run the step eagerly: tensors to NumPy and back."""

    def __init__(self, prefix: str, compression, op: int, gradient_predivide_factor: float, groups: Any,
                 process_set: ProcessSet) -> None:
        self.reduction = GradientReduction.create(op, gradient_predivide_factor, process_set)
        self.prefix, self.compression, self.groups = prefix, compression, groups

    def __call__(self, grads: Sequence[Any], sources: Sequence[Any] | None) -> list[Any]:
        packed = [(None, None) if g is None else self.compression.compress(g) for g in grads]
        arrays = [None if c is None else np.asarray(keras.ops.convert_to_numpy(c)) for c, _ in packed]
        names = batched.gradient_names(self.prefix, len(arrays))
        groups = horovod_args.group_positions(self.groups, sources)
        results = batched.reduce_arrays(arrays, names, self.reduction, groups)
        return [None if r is None else self.compression.decompress(keras.ops.convert_to_tensor(r), ctx)
                for r, (_, ctx) in zip(results, packed)]


def make_reducer(tensorflow_reducer: Callable[..., Reducer] | None, prefix: str, device_dense: str,
                 device_sparse: str, compression, sparse_as_dense: bool, op: int, gradient_predivide_factor: float,
                 groups: Any, process_set: ProcessSet) -> Reducer:
    """The gradient reduction for the active Keras backend.

    On TensorFlow it is ``tensorflow_reducer`` (hora.tensorflow's, one op inside the compiled step),
    which the calling binding passes in: this module never imports hora.tensorflow.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        if tensorflow_reducer is None:
            raise RuntimeError("Keras runs on TensorFlow but no TensorFlow gradient reduction was given")
        return tensorflow_reducer(prefix, device_dense, device_sparse, compression, sparse_as_dense, op,
                                  gradient_predivide_factor, groups, process_set)
    if backend == "jax":
        from hora.jax.keras_reducer import JaxAllreducer  # inside jax.jit: one host callback per step

        return JaxAllreducer(prefix, compression, op, gradient_predivide_factor, groups, process_set)
    return _NumpyAllreducer(prefix, compression, op, gradient_predivide_factor, groups, process_set)


class _LocalAggregation:
    """Gradient sums kept across ``passes`` calls (Horovod's local gradient aggregation)."""

    def __init__(self, passes: int, average: bool) -> None:
        self.passes, self.average = passes, average
        self.counter: keras.Variable | None = None
        self.sums: list[keras.Variable] = []

    def build(self, variables: Sequence[keras.Variable]) -> None:
        # Held here, not as optimizer attributes: the optimizer's saved variables stay the wrapped
        # class's own, so checkpoints load with or without hora.
        self.counter = keras.Variable(0, dtype="int32", trainable=False, name="hora_aggregation_counter")
        self.sums = [keras.Variable(keras.ops.zeros(v.shape, v.dtype), trainable=False, name="hora_aggregated_grad")
                     for v in variables]

    def step(self, optimizer: Any, grads: list, variables: list, update: Callable[[list], None]) -> None:
        """Add ``grads`` to the sums; on every ``passes``-th call, ``update`` with the sums and reset."""
        counter = self.counter
        assert counter is not None, "build() comes before the first step"
        sums = [self.sums[optimizer._get_variable_index(v)] for v in variables]
        for total, grad in zip(sums, grads):
            if grad is not None:
                total.assign_add(keras.ops.convert_to_tensor(grad))  # IndexedSlices are summed densely
        counter.assign_add(1)

        def reduce_and_apply() -> None:
            values = [keras.ops.convert_to_tensor(s) if g is not None else None for s, g in zip(sums, grads)]
            if self.average:
                values = [v / self.passes if v is not None else None for v in values]
            update(values)
            for total in sums:
                total.assign(keras.ops.zeros(total.shape, total.dtype))
            counter.assign(0)

        def count_only() -> None:
            optimizer._iterations.assign_add(1)

        keras.ops.cond(keras.ops.equal(counter, self.passes), reduce_and_apply, count_only)


class _HoraSettings:
    """What the wrapper adds to the optimizer; a plain object, so Keras does not track it."""

    def __init__(self, reducer: Reducer, passes: int, average_aggregated: bool,
                 local_scale: float | None) -> None:
        self.reducer = reducer
        self.aggregation = _LocalAggregation(passes, average_aggregated) if passes > 1 else None
        self.local: dict[int, Any] = {}  # id -> variable registered with register_local_var (kept alive)
        self.local_scale = local_scale  # what local gradients are multiplied by (None: left as they are)

    def reduce(self, grads: list, variables: list) -> list:
        """``grads`` reduced across ranks, except those of local variables: this rank's own (scaled)."""
        is_local = [id(v) in self.local for v in variables] if self.local else []
        return batched.reduce_keeping_local(self.reducer, grads, variables, is_local, self.local_scale)


if TYPE_CHECKING:  # the class is mixed in before the wrapped optimizer's own (see wrap)
    from keras.optimizers import Optimizer as _OptimizerBase
else:
    _OptimizerBase = object


class _DistributedOptimizer(_OptimizerBase):
    """Mixed in before the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    _hora: _HoraSettings

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: it is not reduced (with ``scale_local_gradients``,
        the default, it is divided by the process set's size, as Horovod does). Register before the
        first step: a step already traced into a ``tf.function`` keeps the split it was traced with."""
        self._hora.local[id(var)] = var

    def build(self, variables):
        super().build(variables)
        if self._hora.aggregation is not None:
            self._hora.aggregation.build(variables)

    def apply(self, grads, trainable_variables=None):
        """Reduce ``grads`` across ranks (every ``backward_passes_per_step`` calls), then apply them."""
        grads = list(grads)
        if not grads:
            return None
        if trainable_variables is None:
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
            build_now(self, variables)  # as Keras does, but before any branch: variables cannot be made in one

        def update(values: list) -> None:
            reduced = self._hora.reduce(values, variables)
            super(_DistributedOptimizer, self).apply(reduced, None if trainable_variables is None else variables)

        if self._hora.aggregation is None:
            update(grads)
        else:
            self._hora.aggregation.step(self, grads, variables, update)
        return None


def build_now(optimizer: Any, variables: Sequence[Any]) -> None:
    """Build a Keras 3 optimizer that is not built yet for ``variables``, as Keras itself does on the
    first step (the same variables, in the same name scope, so saved optimizers keep their names).

    Keras creates an optimizer's slots lazily; code that must see them before the first step (a
    broadcast from the root, an elastic state's first commit) builds it here. Nothing happens when it
    is built already or there is nothing to build for.
    """
    if not optimizer.built and variables:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(variables))


def aggregation_variables(optimizer: Any) -> list:
    """The variables hora's wrapper keeps beside ``optimizer.variables``: the local gradient sums and
    their counter of ``backward_passes_per_step`` > 1 (empty for other optimizers, or before building).

    They are training state like the optimizer's slots (a restored commit must not keep sums of steps
    it rolled back), but live outside the optimizer so that saved optimizers load without hora.
    """
    aggregation = getattr(getattr(optimizer, "_hora", None), "aggregation", None)
    if aggregation is None or aggregation.counter is None:
        return []
    return [aggregation.counter, *aggregation.sums]


def is_distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` came out of :func:`DistributedOptimizer` (or :func:`load_model`)."""
    return isinstance(optimizer, _DistributedOptimizer)


def distributed_class(base: type) -> type:
    """The wrapped class: named and placed like ``base``, so saved models record ``base`` and load anywhere."""
    if issubclass(base, _DistributedOptimizer):
        base = next(c for c in base.__mro__[1:] if not issubclass(c, _DistributedOptimizer))
    return type(base.__name__, (_DistributedOptimizer, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__})


def as_instance_of(cls: type[object], optimizer: Any, in_place: bool) -> Any:
    """``optimizer`` made an instance of its wrapped class ``cls``: itself (``in_place``, what
    ``load_model`` does), or a new object sharing its state (its ``__dict__``'s values)."""
    if in_place:
        optimizer.__class__ = cls
        return optimizer
    wrapped: Any = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    return wrapped


def wrap(optimizer: Any, in_place: bool, tensorflow_reducer: Callable[..., Reducer] | None,
         name: str | None = None, device_dense: str = "", device_sparse: str = "", compression=Compression.none,
         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: int = Average,
         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False, groups: Any = None,
         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> Any:
    """Make ``optimizer`` distributed: a new object sharing its state, or (``in_place``) itself.

    ``groups`` has been through :func:`hora.horovod_args.resolve_groups`; ``tensorflow_reducer``
    is the binding's TensorFlow gradient reduction (None where Keras does not run on TensorFlow).
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"hora.keras.DistributedOptimizer wraps a keras.optimizers.Optimizer, "
                        f"got {type(optimizer).__name__}")
    basics.engine()  # fail early, with the init() message, when hora is not initialised
    passes = horovod_args.backward_passes(backward_passes_per_step)
    if passes > 1 and keras.backend.backend() == "jax":
        # The local sums live in keras.Variables outside the optimizer's state, which Keras's JAX
        # trainer (a pure, jitted train_step) cannot update: refused rather than silently wrong.
        raise NotImplementedError("backward_passes_per_step > 1 is not supported on Keras's JAX backend yet; "
                                  "use hora.jax.DistributedOptimizer (optax) for local aggregation, or a larger batch")
    compression = horovod_args.check_compression(compression)
    if optimizer.gradient_accumulation_steps:
        raise ValueError("the optimizer accumulates gradients itself (gradient_accumulation_steps); use "
                         "backward_passes_per_step of DistributedOptimizer instead, so the sums are reduced")
    if (keras.mixed_precision.global_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        # compile() would wrap this optimizer in a LossScaleOptimizer, whose overflow check then runs
        # on each rank's own gradients before they are averaged: ranks would disagree on skipping a
        # step and fall out of step. Wrapped here, inside, the check sees the averaged gradients,
        # so every rank skips together (and compile leaves a LossScaleOptimizer alone).
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    cls = distributed_class(type(optimizer))
    prefix = name if name is not None else f"Distributed{cls.__name__}"
    reducer = make_reducer(tensorflow_reducer, prefix, device_dense, device_sparse, compression, sparse_as_dense, op,
                           gradient_predivide_factor, groups, process_set)
    wrapped = as_instance_of(cls, optimizer, in_place)
    local_scale = 1.0 / process_set.size() if scale_local_gradients else None
    object.__setattr__(wrapped, "_hora", _HoraSettings(reducer, passes, bool(average_aggregated_gradients),
                                                       local_scale))
    if wrapped.built and passes > 1:
        wrapped._hora.aggregation.build(list(wrapped._trainable_variables))
    return wrapped
