"""Local gradient aggregation for ``tf.compat.v1.train`` optimizers (``backward_passes_per_step > 1``).

Horovod's semantics, built from TensorFlow ops so that the same code runs in a TensorFlow 1 graph
(``Session.run`` of ``minimize``'s op), inside ``tf.function`` and eagerly (Horovod refuses eager):

- each call of ``compute_gradients`` adds this pass's gradients to per-variable accumulators and
  advances a counter; on the k-th pass the accumulated sums are reduced across ranks (divided by k
  with ``average_aggregated_gradients``), the counter goes back to 0, and those reduced sums are
  returned; on the other passes this pass's own gradients are returned unchanged;
- ``apply_gradients`` applies only when the counter is 0 (right after a reduction); otherwise it
  only advances ``global_step`` if one was given, as Horovod does.

The accumulators and the counter are created once per graph (eagerly when the call is traced into a
``tf.function``), outside any control flow, in ``LOCAL_VARIABLES``: ``broadcast_global_variables``
leaves them alone, and a TensorFlow 1 script initialises them with
``tf.compat.v1.local_variables_initializer()`` (``MonitoredTrainingSession`` does that itself).
Every rank runs the same passes, so every rank takes the same branch: the reduction is a collective
only on the k-th pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

Reduce = Callable[[list, list], list]  # (gradients, variables) -> gradients reduced across ranks



def dense_for_aggregation(grad: Any, sparse_as_dense: bool) -> Any:
    """A gradient fit for a local running sum: IndexedSlices only densified, and only when asked (Horovod's rule)."""
    if isinstance(grad, tf.IndexedSlices):
        if not sparse_as_dense:
            raise ValueError("IndexedSlices gradients cannot be aggregated locally with backward_passes_per_step "
                             "> 1 unless sparse_as_dense=True (as in Horovod)")
        return tf.convert_to_tensor(grad)
    return grad

class V1GradientAggregator:
    """Sums gradients locally over ``backward_passes_per_step`` passes, then reduces them once."""

    def __init__(self, backward_passes_per_step: int, average_aggregated_gradients: bool, sparse_as_dense: bool,
                 reduce: Reduce, name: str) -> None:
        self.passes = int(backward_passes_per_step)
        self.average = bool(average_aggregated_gradients)
        self.sparse_as_dense = sparse_as_dense
        self.reduce = reduce
        self.name = name
        self._state: dict[Any, tuple[tf.Variable, list]] = {}
        self._last: tuple[tf.Variable, list] | None = None

    # ---- variables --------------------------------------------------------------------------------

    def _dense(self, grad: Any) -> Any:
        return dense_for_aggregation(grad, self.sparse_as_dense)

    def _variables_for(self, grads: Sequence[Any], variables: Sequence[Any]) -> tuple[tf.Variable, list]:
        """The counter and one accumulator per non-None gradient, made once per graph and variable list."""
        with tf.init_scope():
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            key = (graph, tuple(id(v) for v in variables), tuple(g is None for g in grads))
            state = self._state.get(key)
            if state is None:
                local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
                scope = f"{self.name}_aggregation"
                counter = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, collections=local,
                                                name=f"{scope}/counter")
                accumulators: list[Any] = []  # None for a None gradient
                for i, (g, v) in enumerate(zip(grads, variables)):
                    if g is None:
                        accumulators.append(None)
                        continue
                    shape = v.shape if v.shape.is_fully_defined() else g.shape
                    if not shape.is_fully_defined():
                        raise ValueError(f"backward_passes_per_step > 1 needs variables of known shape; "
                                         f"{getattr(v, 'name', v)} has shape {shape}")
                    accumulators.append(tf.compat.v1.Variable(tf.zeros(shape, g.dtype), trainable=False,
                                                              collections=local, name=f"{scope}/{i}"))
                state = (counter, accumulators)
                self._state[key] = state
        self._last = state
        return state

    # ---- the two halves of minimize ---------------------------------------------------------------

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list:
        """This pass's gradients added to the sums; the reduced sums on every k-th pass."""
        grads = [None if g is None else self._dense(g) for g in grads]
        variables = list(variables)
        counter, accumulators = self._variables_for(grads, variables)
        present = [i for i, g in enumerate(grads) if g is not None]

        def clear():
            return tf.group(*[accumulators[i].assign(tf.zeros_like(accumulators[i])) for i in present])

        cleared = tf.cond(tf.equal(counter.read_value(), 0), clear, tf.no_op)
        with tf.control_dependencies([cleared]):
            added = [accumulators[i].assign_add(grads[i]) for i in present]
        with tf.control_dependencies(added):
            counted = counter.assign_add(1)

        def reduce_sums():
            sums = [accumulators[i].read_value() for i in present]
            reduced = self.reduce(sums, [variables[i] for i in present])
            with tf.control_dependencies([r for r in reduced if r is not None]):
                reset = counter.assign(0)
            with tf.control_dependencies([reset]):
                if self.average:
                    return [r / tf.cast(self.passes, r.dtype) for r in reduced]
                return [tf.identity(r) for r in reduced]

        def this_pass():
            return [tf.identity(grads[i]) for i in present]

        with tf.control_dependencies([counted]):
            chosen = tf.cond(tf.equal(counter.read_value(), self.passes), reduce_sums, this_pass)
        if not isinstance(chosen, (list, tuple)):
            chosen = [chosen]
        out: list = [None] * len(grads)
        for i, g in zip(present, chosen):
            out[i] = g
        return out

    def apply_gradients(self, apply: Callable[[], Any], grads: Sequence[Any], global_step: Any = None) -> Any:
        """Run ``apply`` right after a reduction; otherwise only advance ``global_step``."""
        if self._last is None:
            raise RuntimeError("apply_gradients with backward_passes_per_step > 1 needs the gradients from this "
                               "optimizer's compute_gradients (or minimize)")
        counter = self._last[0]

        def skip():
            if global_step is None:
                return tf.no_op()
            return tf.group(global_step.assign_add(tf.ones([], global_step.dtype.base_dtype)))

        def run_apply():
            return tf.group(apply())

        deps = [g for g in grads if isinstance(g, tf.Tensor)]
        with tf.control_dependencies(deps):
            return tf.cond(tf.equal(counter.read_value(), 0), run_apply, skip)
