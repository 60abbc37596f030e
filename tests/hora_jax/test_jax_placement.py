"""Where hora.jax's results land: where the input lived (the rule a GPU array's results follow too).

On 2 workers with two host devices each: an array placed on the second device comes back on it from
every collective (before, results went to the default device); an array replicated over both
devices comes back replicated over both; an array jax placed by default comes back uncommitted on the
default device, as before. GPU arrays themselves are covered in tests/nccl/test_nccl_jax_device.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from jax_job import JobResults, run_job

pytestmark = pytest.mark.timeout(120)


def _job() -> list:
    import jax
    import jax.numpy as jnp

    import hora.jax as hvd

    r, n = hvd.rank(), hvd.size()
    second = jax.devices()[1]

    def placed(results: dict) -> dict:
        return {key: (np.asarray(v), sorted(str(d) for d in v.devices()), v.committed) for key, v in results.items()}

    def on_second_device():
        x = jax.device_put(jnp.arange(4.0).reshape(n, 2) + r, second)
        return placed({
            "allreduce": hvd.allreduce(x, op=hvd.Sum),
            "grouped": hvd.grouped_allreduce([x, x], op=hvd.Sum)[1],
            "async": hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum)),
            "allgather": hvd.allgather(x),
            "broadcast": hvd.broadcast(x, root_rank=0),
            "alltoall": hvd.alltoall(x),
            "reducescatter": hvd.reducescatter(x, op=hvd.Sum),
            "broadcast_parameters": hvd.broadcast_parameters({"w": x}, root_rank=0)["w"],
        })

    def replicated():
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
        x = jax.device_put(jnp.ones(2) * r, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        return placed({"allreduce": hvd.allreduce(x, op=hvd.Sum)})

    def by_default():
        return placed({"allreduce": hvd.allreduce(jnp.ones(2) * r, op=hvd.Sum)})

    return [("on_second_device", on_second_device), ("replicated", replicated), ("by_default", by_default)]


@pytest.fixture(scope="module")
def job() -> JobResults:
    return run_job(_job, np=2)


def test_an_array_placed_on_a_device_comes_back_on_it_from_every_collective(job):
    base = np.arange(4.0).reshape(2, 2)
    total = 2 * base + 1
    for r in range(job.size):
        want = {"allreduce": total, "grouped": total, "async": total, "allgather": np.concatenate([base, base + 1]),
                "broadcast": base, "alltoall": np.stack([base[r], base[r] + 1]), "reducescatter": total[r:r + 1],
                "broadcast_parameters": base}
        got = job.get("on_second_device", r)
        assert sorted(got) == sorted(want)
        for key, (value, devices, committed) in got.items():
            assert devices == ["cpu:1"] and committed, (key, devices, committed)
            np.testing.assert_allclose(value, want[key], err_msg=key)


def test_a_replicated_array_comes_back_replicated_and_a_default_one_on_the_default_device(job):
    for r in range(job.size):
        value, devices, _ = job.get("replicated", r)["allreduce"]
        assert devices == ["cpu:0", "cpu:1"]
        np.testing.assert_allclose(value, np.ones(2))
        value, devices, committed = job.get("by_default", r)["allreduce"]
        assert devices == ["cpu:0"] and not committed
        np.testing.assert_allclose(value, np.ones(2))
