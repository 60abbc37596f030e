"""The binding that docs/architecture.md walks through (examples/array_binding.py) works, and the
walk-through shows its code as it is.

The claim it stands for: a new binding is an adapter, its collectives written the kit's way, and an
optimizer over hora.binding.batched. The example binds Python's ``array.array``; here it runs on 2
real workers and every collective is checked against NumPy.
"""

from __future__ import annotations

import array
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hora
from hora.binding import Adapter
from hora.compression import Compression
from hora.errors import UnsupportedOperationError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "array_binding.py"
if str(EXAMPLE.parent) not in sys.path:  # the workers get this sys.path from hora.run
    sys.path.insert(0, str(EXAMPLE.parent))

import array_binding as ab  # noqa: E402


def _job() -> dict:
    ab.init()
    try:
        return _checks()
    finally:
        ab.shutdown()


def _checks() -> dict:
    r, n = ab.rank(), ab.size()
    out: dict = {}

    x = array.array("f", [r + 1.0, 2.0 * r, -1.5])
    mean = ab.allreduce(x)
    total = ab.allreduce(x, op=ab.Sum)
    out["allreduce"] = (mean.typecode, list(mean), list(total), list(x))

    y = array.array("d", [float(r), 10.0])
    returned = ab.allreduce_(y, op=ab.Sum)
    out["allreduce_"] = (returned is y, list(y))

    handle = ab.allreduce_async(array.array("i", [r, 7]), op=ab.Max, name="walkthrough.max")
    while not ab.poll(handle):
        pass
    out["async"] = list(ab.synchronize(handle))

    grouped = ab.grouped_allreduce([array.array("h", [r, 1]), array.array("d", [0.5 * r])], op=ab.Sum)
    out["grouped"] = [(g.typecode, list(g)) for g in grouped]

    gathered = ab.allgather(array.array("B", [r] * (r + 1)))
    out["allgather"] = (gathered.typecode, list(gathered))

    z = array.array("q", [r * 100, r])
    out["broadcast_"] = list(ab.broadcast_(z, root_rank=n - 1))

    refused = []
    for bad in ([1.0, 2.0], array.array("Q", [1])):
        try:
            ab.allreduce(bad)
        except (TypeError, UnsupportedOperationError) as exc:
            refused.append(type(exc).__name__)
    out["refused"] = (refused, list(ab.allreduce(array.array("b", [1]), op=ab.Sum)))  # nothing left pending

    weight = array.array("d", [1.0, -2.0])
    opt = ab.DistributedOptimizer(ab.SGD([weight], lr=0.5))
    grad = array.array("d", [float(r + 1), float(3 * r)])
    opt.step([grad])
    half = ab.DistributedOptimizer(ab.SGD([array.array("d", [0.0])], lr=1.0), name="half",
                                   compression=Compression.fp16)
    g16 = array.array("d", [1.0 / 3.0 + r])
    half.step([g16])
    out["optimizer"] = (list(weight), list(grad), list(g16), list(half.optimizer.params[0]))

    return out


@pytest.fixture(scope="module")
def ranks2() -> list[dict]:
    return hora.run(_job, np=2)


def test_the_example_module_is_an_adapter() -> None:
    assert isinstance(ab, Adapter)


def test_allreduce_returns_a_new_array_and_keeps_the_input_2ranks(ranks2) -> None:
    inputs = np.array([[1.0, 0.0, -1.5], [2.0, 2.0, -1.5]], np.float32)
    for out in ranks2:
        typecode, mean, total, kept = out["allreduce"]
        assert typecode == "f"
        assert mean == list(inputs.mean(axis=0)) and total == list(inputs.sum(axis=0))
    assert [out["allreduce"][3] for out in ranks2] == [list(inputs[0]), list(inputs[1])]


def test_in_place_async_grouped_gather_and_broadcast_2ranks(ranks2) -> None:
    for out in ranks2:
        assert out["allreduce_"] == (True, [1.0, 20.0])
        assert out["async"] == [1, 7]
        assert out["grouped"] == [("h", [1, 2]), ("d", [0.5])]
        assert out["allgather"] == ("B", [0, 1, 1])
        assert out["broadcast_"] == [100, 1]


def test_what_the_engine_cannot_take_is_refused_before_anything_is_submitted_2ranks(ranks2) -> None:
    for out in ranks2:
        assert out["refused"] == (["TypeError", "UnsupportedOperationError"], [2])


def test_the_optimizer_steps_with_averaged_gradients_2ranks(ranks2) -> None:
    half_sent = (np.float16(1.0 / 3.0).astype(np.float32) + np.float16(4.0 / 3.0).astype(np.float32)) / 2
    for out in ranks2:
        weight, grad, g16, stepped = out["optimizer"]
        assert grad == [1.5, 1.5]  # the gradients themselves now hold the average
        assert weight == [1.0 - 0.5 * 1.5, -2.0 - 0.5 * 1.5]
        assert g16 == pytest.approx([float(half_sent)], rel=1e-3) and g16 != [5.0 / 6.0]  # through float16
        assert stepped == [-g16[0]]


def test_the_example_trains_under_hora_run() -> None:
    run = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(EXAMPLE)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert sorted(line.split(":", 1)[1] for line in run.stdout.splitlines() if "weight" in line) == \
        ["rank 0 of 2: weight 3.000000", "rank 1 of 2: weight 3.000000"]


def test_the_walkthrough_shows_the_example_as_it_is() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("### Adding a binding: a walk-through", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 3, "the walk-through shows the adapter, a collective and the optimizer"
    source = EXAMPLE.read_text(encoding="utf-8")
    for block in blocks:
        assert block in source, f"docs/architecture.md's walk-through differs from {EXAMPLE.name}:\n{block}"
