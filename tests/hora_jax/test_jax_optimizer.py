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
    ]


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
                                     "passes2.average.jit", "passes2.sum.eager"])
def test_two_workers_match_one_worker_on_the_whole_batch_2ranks(ranks2, section):
    _check(ranks2, section)


def test_fp16_compression_close_to_one_worker_2ranks(ranks2):
    _check(ranks2, "fp16", rtol=5e-3, atol=5e-4)


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
