"""Keras 2 (``tf_keras``, under ``TF_USE_LEGACY_KERAS=1``): Horovod's Keras 2 optimizer wrapper.

Keras 2 has two optimizer families, and hora wraps both as Horovod does:

- ``tf_keras.optimizers.legacy.*`` (OptimizerV2): ``minimize`` and ``model.fit`` go through
  ``_compute_gradients``, which returns the gradients averaged across ranks (Horovod's hook;
  ``get_gradients`` too, for graph-mode code);
- ``tf_keras.optimizers.*`` (the newer optimizers): ``compute_gradients``, which ``minimize`` and
  ``model.fit`` call, does the same.

Horovod's Keras 2 tests (and scripts written against them) call ``_compute_gradients(loss,
var_list, grad_loss=None, tape=None)`` directly, whichever family the optimizer is; the newer family
has no such method of its own, so the wrapper supplies it there.

``apply_gradients`` reduces gradients that did not come through those (a custom loop's own
``tape.gradient``): Horovod leaves them unreduced there, which silently trains each rank on its own
data; hora reduces them once, wherever they enter. The reduction is hora.tensorflow's (one op in the
step Keras compiles; dense gradients in flat buckets of :mod:`hora.binding.gradient_buckets`, one engine
request each; IndexedSlices gathered, or densified with ``sparse_as_dense``). Variables given to
``register_local_var`` keep their own gradient on each rank.

Local aggregation over ``backward_passes_per_step`` follows the helper Horovod picks when the
optimizer is wrapped: while executing eagerly (every TensorFlow 2 program, also when the steps later
run inside ``tf.function``) :class:`EagerAggregation`, Horovod's eager helper; in a TensorFlow 1
graph hora.tensorflow's graph aggregator, Horovod's graph helper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import tf_keras

from hora import basics, horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.compression import Compression
from hora.keras_wrapper import as_instance_of
from hora.tensorflow.aggregation import V1GradientAggregator, dense_for_aggregation
from hora.tensorflow.gradients import GradientAllreducer, ReducesGradients

NEW = tf_keras.optimizers.Optimizer
LEGACY = tf_keras.optimizers.legacy.Optimizer


def is_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a Keras 2 optimizer (either family)."""
    return isinstance(optimizer, (NEW, LEGACY))


class EagerAggregation:
    """Local gradient aggregation with the semantics of Horovod's eager helper, which Horovod's Keras
    wrapper uses in every TensorFlow 2 program.

    Each pass adds its gradients to per-variable sums and counts; the pass that brings the count to
    ``passes`` reduces the sums across ranks, clears them and resets the count at once, so an
    infinite or NaN gradient of one cycle never reaches the next. The other passes return this rank's
    running sums (not reduced), and ``apply_gradients`` applies only right after a reduction, the
    other passes counting ``iterations`` alone. ``counter`` and ``locally_aggregated_grads`` carry
    the names of Horovod's helper because Horovod's tests read them. Ops, not Python branches, so the
    same code runs eagerly and inside the ``tf.function`` Keras compiles; the variables are made
    outside any function (``tf.init_scope``), once per model variable, and live outside the optimizer
    so saved optimizers load without hora.
    """

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool,
                 reduce: Callable[[list, list], list], name: str) -> None:
        self.passes, self.average, self.sparse_as_dense = passes, average, sparse_as_dense
        self.reduce, self.name = reduce, name
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name=f"{name}_aggregation_counter")
        self.locally_aggregated_grads: dict[Any, tf.Variable] = {}  # model variable's ref -> its running sum

    def _dense(self, grad: Any) -> Any:
        return dense_for_aggregation(grad, self.sparse_as_dense)

    def _sum_for(self, variable: Any, grad: Any) -> tf.Variable:
        total = self.locally_aggregated_grads.get(variable.ref())
        if total is None:
            shape = variable.shape if variable.shape.is_fully_defined() else grad.shape
            if not shape.is_fully_defined():
                raise ValueError(f"backward_passes_per_step > 1 needs variables of known shape; "
                                 f"{getattr(variable, 'name', variable)} has shape {shape}")
            with tf.init_scope():
                total = tf.Variable(tf.zeros(shape, grad.dtype), trainable=False,
                                    name=f"{self.name}_aggregated_grad")
            self.locally_aggregated_grads[variable.ref()] = total
        return total

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list:
        """This pass's gradients added to the sums: the running sums, or on every k-th pass the sums
        reduced across ranks (divided by k with ``average_aggregated_gradients``)."""
        grads = [None if g is None else self._dense(g) for g in grads]
        variables = list(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        sums = [self._sum_for(variables[i], grads[i]) for i in present]
        added = [total.assign_add(grads[i]) for total, i in zip(sums, present)]
        with tf.control_dependencies(added):
            running = [total.read_value() for total in sums]
            counted = self.counter.assign_add(1)

        def reduce_and_clear() -> list:
            reduced = self.reduce(running, [variables[i] for i in present])
            if self.average:
                reduced = [r / tf.cast(self.passes, r.dtype) for r in reduced]
            with tf.control_dependencies(reduced):
                cleared = [total.assign(tf.zeros_like(total)) for total in sums] + [self.counter.assign(0)]
            with tf.control_dependencies(cleared):
                return [tf.identity(r) for r in reduced]

        def keep_running() -> list:
            return [tf.identity(t) for t in running]

        with tf.control_dependencies([counted]):
            chosen = tf.cond(tf.equal(self.counter.read_value(), self.passes), reduce_and_clear, keep_running)
        if not isinstance(chosen, (list, tuple)):
            chosen = [chosen]
        out: list = [None] * len(grads)
        for i, g in zip(present, chosen):
            out[i] = g
        return out

    def apply_gradients(self, apply: Callable[[], Any], grads: Sequence[Any], iterations: Any) -> Any:
        """Run ``apply`` right after a reduction; otherwise only count ``iterations``."""

        def skip():
            return tf.group(iterations.assign_add(tf.ones([], iterations.dtype.base_dtype)))

        def run_apply():
            return tf.group(apply())

        deps = [g for g in grads if isinstance(g, tf.Tensor)]
        with tf.control_dependencies(deps):
            return tf.cond(tf.equal(self.counter.read_value(), 0), run_apply, skip)


def _tape_gradients(loss: Any, var_list: Any, grad_loss: Any, tape: Any) -> list[tuple[Any, Any]]:
    """(gradient, variable) pairs of ``loss`` the way Keras 2's legacy ``_compute_gradients`` makes
    them (a callable loss run under ``tape``, ``var_list`` flattened, ``grad_loss`` as the output
    gradient), for the newer family, whose ``compute_gradients`` takes no ``grad_loss``."""
    if not callable(loss) and tape is None:
        raise ValueError(f"`tape` is required when a `Tensor` loss is passed. Received: loss={loss}, tape={tape}.")
    tape = tape if tape is not None else tf.GradientTape()
    if callable(loss):
        with tape:
            if not callable(var_list):
                tape.watch(var_list)
            loss = loss()
            if callable(var_list):
                var_list = var_list()
    var_list = tf.nest.flatten(var_list)
    grads = tape.gradient(loss, var_list, output_gradients=grad_loss)
    return list(zip(grads, var_list))


class _DistributedKeras2Optimizer(ReducesGradients):
    """Mixed in before the wrapped tf_keras optimizer's class."""

    _hora_aggregator: EagerAggregation | V1GradientAggregator | None = None
    _hora_reduced_pending = False  # compute_gradients reduced the gradients apply_gradients will get

    @property
    def _agg_helper(self) -> EagerAggregation | V1GradientAggregator | None:
        """The local aggregation of ``backward_passes_per_step`` > 1 (None without): Horovod's
        attribute name, which Horovod's Keras tests read (``opt._agg_helper.counter``)."""
        return self._hora_aggregator

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: it is not reduced (with ``scale_local_gradients``,
        the default, it is divided by the process set's size, as Horovod does)."""
        self._hora_keep_local(var)

    def _hora_pairs(self, pairs: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        pairs = list(pairs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._hora_aggregator is not None:
            grads = self._hora_aggregator.compute_gradients(grads, variables)
        else:
            grads = self._hora_reduce(grads, variables)
        object.__setattr__(self, "_hora_reduced_pending", True)
        return list(zip(grads, variables))

    # the legacy family's hook (OptimizerV2), and Horovod's spelling for either family
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """The (gradient, variable) pairs of ``loss``, gradients averaged across ranks (with
        ``backward_passes_per_step`` > 1: summed locally, and reduced on every k-th pass)."""
        if isinstance(self, LEGACY):
            pairs = super()._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        else:
            pairs = _tape_gradients(loss, var_list, grad_loss, tape)
        return self._hora_pairs(pairs)

    def get_gradients(self, loss, params):
        """Graph-mode gradients of ``loss``, averaged across ranks (legacy optimizers)."""
        grads = super().get_gradients(loss, params)
        return [g for g, _ in self._hora_pairs(zip(grads, params))]

    # the newer family
    def compute_gradients(self, loss, var_list, tape=None):
        """The wrapped optimizer's (gradient, variable) pairs, gradients averaged across ranks."""
        return self._hora_pairs(super().compute_gradients(loss, var_list, tape=tape))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Apply gradients averaged across ranks (reducing them here unless compute_gradients did);
        with ``backward_passes_per_step`` > 1 only on every k-th pass, the others counting
        ``iterations`` alone, as in Horovod."""
        pairs = list(grads_and_vars)
        if not self._hora_reduced_pending:
            pairs = self._hora_pairs(pairs)
        object.__setattr__(self, "_hora_reduced_pending", False)
        if self._hora_aggregator is None:
            return super().apply_gradients(pairs, *args, **kwargs)
        build(self, [v for _, v in pairs])  # slots cannot be made inside the branch below
        return self._hora_aggregator.apply_gradients(
            lambda: super(_DistributedKeras2Optimizer, self).apply_gradients(pairs, *args, **kwargs),
            [g for g, _ in pairs], self.iterations)


def build(optimizer: Any, variables: Sequence[Any]) -> None:
    """Make ``optimizer``'s slots for ``variables`` now (Keras makes them on the first step)."""
    variables = list(variables)
    if not variables:
        return
    if isinstance(optimizer, LEGACY):
        with tf.init_scope():
            optimizer._create_all_weights(variables)
    elif not getattr(optimizer, "_built", False):
        with tf.init_scope():
            optimizer.build(variables)


def variables(optimizer: Any) -> list:
    """The optimizer's own state (iterations and slots), for broadcasts and elastic commits."""
    found = optimizer.variables() if isinstance(optimizer, LEGACY) else optimizer.variables
    return list(found)


def momentum_buffers(optimizer: Any) -> list:
    """A momentum optimizer's velocity variables (new SGD's ``momentums``, legacy slots ``momentum``)."""
    if isinstance(optimizer, LEGACY):
        return [slots["momentum"] for slots in optimizer._slots.values() if "momentum" in slots]
    return [b for b in getattr(optimizer, "momentums", None) or [] if b is not None]


def is_distributed(optimizer: Any) -> bool:
    return isinstance(optimizer, _DistributedKeras2Optimizer)


def wrap(optimizer: Any, in_place: bool, name: str | None = None, device_dense: str = "", device_sparse: str = "",
         compression=Compression.none, sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
         op: int = Average, backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
         groups: Any = None, process_set: ProcessSet = global_process_set,
         scale_local_gradients: bool = True) -> Any:
    """Make a tf_keras ``optimizer`` distributed: a new object sharing its state, or (``in_place``) itself.

    The result is an instance of a subclass named like the wrapped class, so ``isinstance`` checks
    and saved configs name the original class (files load without hora).
    """
    if not is_optimizer(optimizer):
        raise TypeError(f"under TF_USE_LEGACY_KERAS=1 hora.keras.DistributedOptimizer wraps a tf_keras optimizer "
                        f"(tf_keras.optimizers.* or tf_keras.optimizers.legacy.*), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    basics.engine()  # fail early, with the init() message, when hora is not initialised
    passes = horovod_args.backward_passes(backward_passes_per_step)
    base = type(optimizer)
    if issubclass(base, _DistributedKeras2Optimizer):  # wrapping twice would reduce twice
        base = next(c for c in base.__mro__[1:] if not issubclass(c, _DistributedKeras2Optimizer))
    prefix = name if name is not None else f"Distributed{base.__name__}"
    allreducer = GradientAllreducer(prefix, device_dense, device_sparse, compression, sparse_as_dense, op,
                                    gradient_predivide_factor, groups, process_set)
    cls = type(base.__name__, (_DistributedKeras2Optimizer, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    wrapped = as_instance_of(cls, optimizer, in_place)
    object.__setattr__(wrapped, "_hora_reduced_pending", False)
    wrapped._hora_bind(allreducer, getattr(optimizer, "_hora_local", ()), scale_local_gradients, process_set)
    if passes > 1:
        # Horovod decides by where the optimizer is wrapped, and so does hora: a TensorFlow 1 graph
        # gets the graph aggregator (its variables in that graph's LOCAL_VARIABLES).
        helper = EagerAggregation if tf.executing_eagerly() else V1GradientAggregator
        object.__setattr__(wrapped, "_hora_aggregator", helper(
            passes, bool(average_aggregated_gradients), sparse_as_dense, wrapped._hora_reduce, prefix))
    return wrapped


def legacy_classes() -> dict[str, type]:
    """``tf_keras.optimizers.legacy``'s classes by the names a saved optimizer config may use."""
    found: dict[str, type] = {}
    for cls in LEGACY.__subclasses__():
        if cls.__module__.startswith("tf_keras.src.optimizers.legacy"):
            found[cls.__name__] = cls
            found[cls.__name__.lower()] = cls
    return found
