"""Comparing a binding's public signatures with Horovod's, written as text (``name(a, b=1)``).

Shared by the API tests of every binding (tests/hora_torch/test_torch_api.py,
tests/hora_tensorflow/test_tf_api.py). hora may add parameters only at the end, each with a default and
named in the test's allowed extras, so that every Horovod call, positional or keyword, still means
the same.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from hora.basics import ProcessSet

# ---- "Every binding" ----------------------------------------------------------------------------

EVERY_BINDING = [
    "init(comm=None, process_sets=None)",
    "shutdown()",
    "is_initialized()",
    "size()",
    "rank()",
    "local_size()",
    "local_rank()",
    "cross_size()",
    "cross_rank()",
    "is_homogeneous()",
    "mpi_built()",
    "mpi_enabled()",
    "gloo_built()",
    "gloo_enabled()",
    "nccl_built()",
    "ccl_built()",
    "ddl_built()",
    "cuda_built()",
    "rocm_built()",
    "mpi_threads_supported()",
    "start_timeline(file_path, mark_cycles=False)",
    "stop_timeline()",
    # Horovod 0.28's parameter is named process_set in both (its prose says ranks_or_set and ps).
    "add_process_set(process_set)",
    "remove_process_set(process_set)",
]

REDUCE_OPS = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}  # Horovod's values


def parse(spec: str, namespace: dict[str, Any]) -> tuple[str, list[tuple[str, object]]]:
    """``name(a, b=1)`` -> ("name", [("a", EMPTY), ("b", 1)]); defaults evaluated in ``namespace``."""
    fn = ast.parse(f"def {spec}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args
    assert not args.kwonlyargs and not args.vararg and not args.kwarg and not args.posonlyargs
    names = [a.arg for a in args.args]
    defaults = [inspect.Parameter.empty] * (len(names) - len(args.defaults)) + [
        eval(compile(ast.Expression(d), "<spec>", "eval"), dict(namespace)) for d in args.defaults
    ]
    return fn.name, list(zip(names, defaults))


def same_default(actual: object, expected: object) -> bool:
    if expected is inspect.Parameter.empty or isinstance(expected, (type, ProcessSet)):
        return actual is expected
    return type(actual) is type(expected) and actual == expected


def check(name: str, actual: inspect.Signature, expected: list[tuple[str, object]],
          allowed_extras: set[str] = frozenset()) -> None:
    """Horovod's parameters first, in order, with its defaults; then only allowed extras with defaults."""
    params = list(actual.parameters.values())
    assert [p.name for p in params[: len(expected)]] == [n for n, _ in expected], f"{name}: {actual}"
    for p, (pname, default) in zip(params, expected):
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}({pname}) is {p.kind}"
        assert same_default(p.default, default), f"{name}({pname}={p.default!r}), Horovod: {default!r}"
    for p in params[len(expected):]:
        assert p.name in allowed_extras, f"{name}: unexpected extra parameter {p.name} in {actual}"
        assert p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        assert p.default is not inspect.Parameter.empty, f"{name}: extra parameter {p.name} needs a default"
