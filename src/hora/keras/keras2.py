"""Keras 2 (``tf_keras``, under ``TF_USE_LEGACY_KERAS=1``): Horovod's Keras 2 optimizer wrapper.

Keras 2 has two optimizer families, and hora wraps both as Horovod does:

- ``tf_keras.optimizers.legacy.*`` (OptimizerV2): ``minimize`` and ``model.fit`` go through
  ``_compute_gradients``, which returns the gradients averaged across ranks (Horovod's hook;
  ``get_gradients`` too, for graph-mode code);
- ``tf_keras.optimizers.*`` (the newer optimizers): ``compute_gradients``, which ``minimize`` and
  ``model.fit`` call, does the same.

``apply_gradients`` reduces gradients that did not come through those (a custom loop's own
``tape.gradient``): Horovod leaves them unreduced there, which silently trains each rank on its own
data; hora reduces them once, wherever they enter. The reduction is hora.tensorflow's (one op in the
step Keras compiles; dense gradients in flat buckets of :mod:`hora.gradient_buckets`, one engine
request each; IndexedSlices gathered, or densified with ``sparse_as_dense``) and local
aggregation over ``backward_passes_per_step`` is hora.tensorflow's TensorFlow 1 aggregator (the
same semantics: sums in local variables, the k-th pass reduces and applies, the others only count
``iterations``). Variables given to ``register_local_var`` keep their own gradient on each rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
import tf_keras

from hora import basics, horovod_args
from hora.basics import Average, ProcessSet, global_process_set
from hora.compression import Compression
from hora.keras_wrapper import as_instance_of
from hora.tensorflow.aggregation import V1GradientAggregator
from hora.tensorflow.gradients import GradientAllreducer, ReducesGradients

NEW = tf_keras.optimizers.Optimizer
LEGACY = tf_keras.optimizers.legacy.Optimizer


def is_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a Keras 2 optimizer (either family)."""
    return isinstance(optimizer, (NEW, LEGACY))


class _DistributedKeras2Optimizer(ReducesGradients):
    """Mixed in before the wrapped tf_keras optimizer's class."""

    _hora_aggregator: V1GradientAggregator | None = None
    _hora_reduced_pending = False  # compute_gradients reduced the gradients apply_gradients will get

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

    # the legacy family (OptimizerV2)
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """The wrapped optimizer's (gradient, variable) pairs, gradients averaged across ranks."""
        return self._hora_pairs(super()._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape))

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
        object.__setattr__(wrapped, "_hora_aggregator", V1GradientAggregator(
            passes, average_aggregated_gradients, sparse_as_dense, wrapped._hora_reduce, prefix))
    return wrapped


def legacy_classes() -> dict[str, type]:
    """``tf_keras.optimizers.legacy``'s classes by the names a saved optimizer config may use."""
    found: dict[str, type] = {}
    for cls in LEGACY.__subclasses__():
        if cls.__module__.startswith("tf_keras.src.optimizers.legacy"):
            found[cls.__name__] = cls
            found[cls.__name__.lower()] = cls
    return found
