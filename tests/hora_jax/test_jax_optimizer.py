"""hora.jax.DistributedOptimizer (optax) on 2 real workers against 1 worker on the whole batch.

Each rank trains a small MLP for 20 steps on its half of every batch through DistributedOptimizer, in
a jitted train step (gradients averaged in a host callback) and eagerly; the reference is plain optax
on the whole batch in the same process. SGD with momentum and Adam must match within float32
tolerance; op=Sum, gradient_predivide_factor, backward_passes_per_step and fp16 compression are checked
against their own references. The digits example must reach 95% under ``hora run -np 2``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from jax_job import JAX_ENV, JobResults, run_job
from job_env import clean_env

pytestmark = pytest.mark.timeout(300)

STEPS = 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job() -> list:
    import jax
    import jax.numpy as jnp
    import optax

    import hora.jax as hvd

    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(0)
    per_rank, k_max = 8, 2
    xs = rng.normal(size=(STEPS, k_max, n * per_rank, 5)).astype(np.float32)
    ys = rng.normal(size=(STEPS, k_max, n * per_rank, 1)).astype(np.float32)
    key1, key2 = jax.random.split(jax.random.PRNGKey(r))  # different per rank: broadcast_parameters fixes it
    params = {"w1": jax.random.normal(key1, (5, 8)) * 0.5, "b1": jnp.zeros(8, jnp.float32),
              "w2": jax.random.normal(key2, (8, 1)) * 0.5}
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    params = hvd.broadcast_parameters(params, root_rank=0)

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    grad_fn = jax.grad(loss_fn)
    mine = slice(r * per_rank, (r + 1) * per_rank)

    def train(tx, jit: bool, passes: int = 1):
        state = tx.init(params)
        p = params

        def step(p, state, x, y):
            updates, state = tx.update(grad_fn(p, x, y), state, p)
            return optax.apply_updates(p, updates), state

        step = jax.jit(step) if jit else step
        for s in range(STEPS):
            for micro in range(passes):
                p, state = step(p, state, xs[s, micro, mine], ys[s, micro, mine])
        return jax.tree_util.tree_map(np.asarray, p)

    def reference(tx, passes: int = 1, grad_scale: float = 1.0):
        state = tx.init(params)
        p = params
        for s in range(STEPS):
            x = xs[s, :passes].reshape(-1, 5)
            y = ys[s, :passes].reshape(-1, 1)
            g = jax.tree_util.tree_map(lambda v: v * grad_scale, grad_fn(p, x, y))
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return jax.tree_util.tree_map(np.asarray, p)

    def case(make, jit=True, passes=1, grad_scale=1.0, **kwargs):
        return lambda: {"got": train(hvd.DistributedOptimizer(make(), backward_passes_per_step=passes, **kwargs),
                                     jit, passes),
                        "want": reference(make(), passes, grad_scale),
                        "initial_broadcast": jax.tree_util.tree_map(np.asarray, params)}

    sgd = lambda: optax.sgd(0.1, momentum=0.9)  # noqa: E731
    adam = lambda: optax.adam(0.01)  # noqa: E731
    return [
        ("sgd.jit", case(sgd)),
        ("sgd.eager", case(sgd, jit=False)),
        ("adam.jit", case(adam)),
        ("adam.eager", case(adam, jit=False)),
        ("sum", case(sgd, grad_scale=float(n), op=hvd.Sum)),
        ("predivide", case(adam, gradient_predivide_factor=2.0)),
        ("passes2.average.jit", case(sgd, passes=2, average_aggregated_gradients=True)),
        ("passes2.sum.eager", case(adam, jit=False, passes=2, grad_scale=2.0)),
        ("fp16", case(sgd, compression=hvd.Compression.fp16)),
        ("sharded.adam.jit", case(adam, shard_optimizer_state=True)),
        ("sharded.sgd.eager", case(sgd, jit=False, shard_optimizer_state=True)),
        ("sharded.passes2.average.jit", case(adam, passes=2, average_aggregated_gradients=True,
                                             shard_optimizer_state=True)),
        ("sharded.passes2.sum.eager", case(sgd, jit=False, passes=2, grad_scale=2.0, shard_optimizer_state=True)),
        ("sharded.state", lambda: _sharded_state(hvd, optax, params)),
        ("sharded.mixed_dtypes", lambda: _sharded_mixed_dtypes(hvd, optax)),
        ("sharded.checkpoint", lambda: _sharded_checkpoint(hvd, optax)),
    ]


def _elements(tree) -> int:
    import jax

    return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(tree))


def _sharded_state(hvd, optax, params) -> dict:
    """What each rank holds: Adam's state for its own leaves only; a broadcast of it is refused."""
    import jax

    sharded = hvd.DistributedOptimizer(optax.adam(0.01), shard_optimizer_state=True).init(params)
    whole = hvd.DistributedOptimizer(optax.adam(0.01)).init(params)
    sizes = [int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params)]
    try:
        hvd.broadcast_optimizer_state(sharded, root_rank=0)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return {"owned": list(sharded.leaves), "sizes": sizes, "sharded_elements": _elements(sharded),
            "whole_elements": _elements(whole), "refusal": refusal}


def _sharded_mixed_dtypes(hvd, optax) -> dict:
    """Leaves of three dtypes, so that the updates travel in one allgather per dtype: sharded and
    unsharded hora take the same steps, eagerly and under jit."""
    import jax
    import jax.numpy as jnp

    r = hvd.rank()
    params = {"a": jnp.linspace(-1.0, 1.0, 30, dtype=jnp.float32).reshape(5, 6),
              "b": jnp.linspace(0.5, 2.0, 7, dtype=jnp.float64),
              "c": jnp.linspace(-2.0, 0.0, 12, dtype=jnp.bfloat16).reshape(3, 4),
              "d": jnp.linspace(0.0, 3.0, 9, dtype=jnp.float32)}

    def loss(p):
        return (jnp.sum(jnp.sin(p["a"]) * (r + 1)) + jnp.sum(p["b"] ** 2) * (r + 2)
                + jnp.sum(p["c"].astype(jnp.float32) ** 3) + jnp.sum(jnp.cos(p["d"])) * (r + 1))

    def run(shard: bool, jit: bool) -> dict:
        tx = hvd.DistributedOptimizer(optax.adam(0.05), shard_optimizer_state=shard)
        state, p = tx.init(params), params

        def step(p, state):
            updates, state = tx.update(jax.grad(loss)(p), state, p)
            return optax.apply_updates(p, updates), state

        step = jax.jit(step) if jit else step
        for _ in range(10):
            p, state = step(p, state)
        return {k: np.asarray(v.astype(jnp.float64)) for k, v in p.items()}

    runs = {f"{'sharded' if shard else 'whole'}.{'jit' if jit else 'eager'}": run(shard, jit)
            for shard in (True, False) for jit in (True, False)}
    return {**runs, "initial": {k: np.asarray(v.astype(jnp.float64)) for k, v in params.items()}}


def _sharded_checkpoint(hvd, optax) -> dict:
    """A sharded Adam state consolidated after 5 steps at 2 ranks, then resharded at 2 ranks and at 1
    (a process set of one rank), each continuing 5 steps, against 10 unsharded steps."""
    import jax
    import jax.numpy as jnp

    r = hvd.rank()
    params = {"a": jnp.linspace(-1.0, 1.0, 30, dtype=jnp.float32).reshape(5, 6),
              "b": jnp.linspace(0.5, 2.0, 7, dtype=jnp.float32),
              "c": jnp.linspace(0.0, 3.0, 9, dtype=jnp.float32)}
    adam = optax.adam(0.05)

    def grads(p, rank: int):
        return jax.grad(lambda q: (jnp.sum(jnp.sin(q["a"]) * (rank + 1)) + jnp.sum(q["b"] ** 2) * (rank + 2)
                                   + jnp.sum(jnp.cos(q["c"])) * (rank + 1)))(p)

    def averaged(p, ranks):
        return jax.tree_util.tree_map(lambda *g: sum(g) / len(g), *[grads(p, q) for q in ranks])

    def steps(tx, state, p, count, mine):
        for _ in range(count):
            updates, state = tx.update(grads(p, mine), state, p)
            p = optax.apply_updates(p, updates)
        return state, p

    # the reference: one process, whole batches (the average of both ranks' gradients), 10 steps
    ref_state, ref = adam.init(params), params
    halfway = None
    for step in range(10):
        updates, ref_state = adam.update(averaged(ref, (0, 1)), ref_state, ref)
        ref = optax.apply_updates(ref, updates)
        if step == 4:
            halfway = (ref_state, ref)
    tx = hvd.DistributedOptimizer(adam, shard_optimizer_state=True)
    state, p = steps(tx, tx.init(params), params, 5, r)
    whole = hvd.consolidate_sharded_state(state, adam, p, root_rank=1)
    on_root = whole is not None
    whole = hvd.broadcast_object(whole, root_rank=1)
    leaves = lambda tree: [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]  # noqa: E731
    out = {"on_root": on_root, "consolidated": leaves(whole), "halfway_state": leaves(halfway[0]),
           "reference": leaves(ref)}
    # at 2 ranks again
    again, q = steps(tx, hvd.reshard_state(whole, adam, p), p, 5, r)
    out["resumed_at_2"] = leaves(q)
    # at 1 rank: a process set of this rank alone, the whole batch's gradients
    solos = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    try:
        solo = solos[r]
        one = hvd.DistributedOptimizer(adam, shard_optimizer_state=True, process_set=solo)
        alone = hvd.reshard_state(whole, adam, p, process_set=solo)
        out["owned_alone"] = list(alone.leaves)
        q1 = p
        for _ in range(5):
            updates, alone = one.update(averaged(q1, (0, 1)), alone, q1)
            q1 = optax.apply_updates(q1, updates)
        out["resumed_at_1"] = leaves(q1)
    finally:
        hvd.barrier()
        for solo in solos:
            hvd.remove_process_set(solo)
    out["owned_at_2"] = list(again.leaves)
    # backward_passes_per_step=2: the wrapper's AggregationState around the sharded state
    sharded2 = hvd.DistributedOptimizer(adam, shard_optimizer_state=True, backward_passes_per_step=2)
    whole2 = hvd.DistributedOptimizer(adam, backward_passes_per_step=2)
    s2, w2 = sharded2.init(params), whole2.init(params)
    for _ in range(3):  # one reduced step and one pass accumulated
        _, s2 = sharded2.update(grads(params, r), s2, params)
        _, w2 = whole2.update(grads(params, r), w2, params)
    consolidated2 = hvd.consolidate_sharded_state(s2, adam, params, root_rank=0)
    if consolidated2 is not None:
        out["passes2"] = {"type": type(consolidated2).__name__, "got": leaves(consolidated2), "want": leaves(w2),
                          "reshard": leaves(hvd.reshard_state(consolidated2.inner, adam, params)),
                          "own": leaves(s2.inner)}
    return out


@pytest.fixture(scope="module")
def ranks2() -> JobResults:
    return run_job(_job, np=2)


def _check(job: JobResults, section: str, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    first = job.get(section, 0)
    for r in range(job.size):
        got = job.get(section, r)
        for name in first["want"]:
            np.testing.assert_array_equal(got["initial_broadcast"][name], first["initial_broadcast"][name])
            np.testing.assert_allclose(got["got"][name], got["want"][name], rtol=rtol, atol=atol, err_msg=name)
            np.testing.assert_allclose(got["got"][name], first["got"][name], rtol=1e-6, atol=1e-7)
            assert not np.allclose(got["got"][name], got["initial_broadcast"][name]), f"{name} never moved"


@pytest.mark.parametrize("section", ["sgd.jit", "sgd.eager", "adam.jit", "adam.eager", "sum", "predivide",
                                     "passes2.average.jit", "passes2.sum.eager", "sharded.adam.jit",
                                     "sharded.sgd.eager", "sharded.passes2.average.jit",
                                     "sharded.passes2.sum.eager"])
def test_two_workers_match_one_worker_on_the_whole_batch_2ranks(ranks2, section):
    _check(ranks2, section)


def test_fp16_compression_close_to_one_worker_2ranks(ranks2):
    _check(ranks2, "fp16", rtol=5e-3, atol=5e-4)


def test_a_consolidated_sharded_state_is_the_unsharded_one_and_reshards_at_2_and_1_ranks_2ranks(ranks2):
    outs = ranks2.all("sharded.checkpoint")
    assert [out["on_root"] for out in outs] == [False, True]  # consolidated on root_rank only
    for out in outs:
        assert len(out["consolidated"]) == len(out["halfway_state"])  # count, mu (3 leaves), nu (3 leaves)
        for got, want in zip(out["consolidated"], out["halfway_state"]):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        for key in ("resumed_at_2", "resumed_at_1"):
            for got, want in zip(out[key], out["reference"]):
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=key)
        assert out["owned_alone"] == [0, 1, 2]  # one rank owns every leaf
    assert sorted(i for out in outs for i in out["owned_at_2"]) == [0, 1, 2]
    # with backward_passes_per_step=2 the consolidated state is the unsharded wrapper's, AggregationState and all
    passes2 = outs[0]["passes2"]
    assert passes2["type"] == "AggregationState"
    assert len(passes2["got"]) == len(passes2["want"])
    for got, want in zip(passes2["got"], passes2["want"]):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    for got, want in zip(passes2["reshard"], passes2["own"]):  # cut again at 2 ranks: rank 0's own shard
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_sharded_state_holds_each_ranks_own_leaves_only_2ranks(ranks2):
    """ZeRO stage 1: the ranks' shards are disjoint and cover every leaf, and each rank's Adam state is
    its own leaves' two moments (plus the step count), not the whole model's."""
    results = [ranks2.get("sharded.state", r) for r in range(ranks2.size)]
    sizes = results[0]["sizes"]
    owned = [i for result in results for i in result["owned"]]
    assert sorted(owned) == list(range(len(sizes))), owned
    assert all(result["owned"] for result in results), "a rank owns no leaf of a 3-leaf model at 2 ranks"
    scalars = results[0]["whole_elements"] - 2 * sum(sizes)
    for result in results:
        assert result["sharded_elements"] == 2 * sum(sizes[i] for i in result["owned"]) + scalars, result
        assert result["sharded_elements"] < result["whole_elements"]
        assert "sharded optimizer state" in result["refusal"], result["refusal"]


def test_sharded_state_takes_the_unsharded_steps_over_leaves_of_three_dtypes_2ranks(ranks2):
    for r in range(ranks2.size):
        runs = ranks2.get("sharded.mixed_dtypes", r)
        for mode in ("eager", "jit"):
            for name, want in runs[f"whole.{mode}"].items():
                np.testing.assert_allclose(runs[f"sharded.{mode}"][name], want, rtol=1e-6, atol=1e-7,
                                           err_msg=f"rank {r} {mode} {name}")
                assert not np.allclose(want, runs["initial"][name]), f"{name} never moved"


def test_jax_mnist_example_reaches_95_percent_on_2_workers():
    pytest.importorskip("sklearn")
    env = clean_env({**{k: v for k, v in JAX_ENV.items() if k != "XLA_FLAGS"}, "JAX_ENABLE_X64": "0",
                     "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "PYTHONUNBUFFERED": "1"})
    proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", "python", "examples/jax_mnist.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    found = re.search(r"^\[0\]<stdout>:Final test accuracy: ([0-9.]+)% after 10 epoch\(s\) on 2 worker\(s\)",
                      proc.stdout, re.MULTILINE)
    assert found, proc.stdout[-3000:]
    assert float(found.group(1)) >= 95.0, proc.stdout[-3000:]
