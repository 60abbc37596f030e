"""Every framework binding is built from one kit, ``hora.binding``, under the same names.

A binding converts its framework's tensors to the engine's NumPy buffers and back (the adapter:
``check_dtype``, ``to_host``, ``new_like``, ``write_into``, the same names in every binding), and
hands out one kind of handle with one ``poll``/``synchronize`` pair. Read from the source with
``ast``, so that the rule is checked for every binding whether or not its framework is installed
(MXNet lives in a venv of its own); where a framework is importable, the objects are compared too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import hora
from hora.binding import Adapter, ConvertingHandle, poll, synchronize

SOURCE = Path(hora.__file__).resolve().parent

#: Each framework binding's adapter module (its tensors module) and its collectives module.
ADAPTERS = {
    "torch": "hora.torch.tensors",
    "mxnet": "hora.mxnet.tensors",
    "jax": "hora.jax.arrays",
    "tensorflow": "hora.tensorflow.tensors",
}
HANDLE_BINDINGS = {"torch": "hora.torch.mpi_ops", "mxnet": "hora.mxnet.mpi_ops", "jax": "hora.jax.mpi_ops"}
BINDING_PACKAGES = ("torch", "mxnet", "jax", "tensorflow", "keras")


def _tree(module: str) -> ast.Module:
    path = SOURCE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _functions(module: str) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in _tree(module).body if isinstance(node, ast.FunctionDef)}


def _protocol_methods() -> dict[str, int]:
    """The adapter's operations and how many positional arguments each takes."""
    methods = {}
    for name, member in inspect.getmembers(Adapter, inspect.isfunction):
        if not name.startswith("_"):
            methods[name] = len(inspect.signature(member).parameters) - 1  # less self
    return methods


def test_the_adapter_protocol_has_the_four_operations() -> None:
    assert _protocol_methods() == {"check_dtype": 1, "to_host": 1, "new_like": 2, "write_into": 2}


@pytest.mark.parametrize("framework", sorted(ADAPTERS))
def test_every_binding_implements_the_adapter_under_the_same_names(framework: str) -> None:
    module = ADAPTERS[framework]
    functions = _functions(module)
    for name, positional in _protocol_methods().items():
        assert name in functions, f"{module} does not define the adapter's {name}()"
        args = functions[name].args
        params = args.posonlyargs + args.args
        required = len(params) - len(args.defaults)
        assert required <= positional <= len(params), (
            f"{module}.{name} takes {len(params)} positional arguments ({required} required); the adapter "
            f"calls it with {positional}")


@pytest.mark.parametrize("framework", sorted(ADAPTERS))
def test_an_importable_binding_is_an_adapter_at_run_time(framework: str) -> None:
    pytest.importorskip(framework)
    assert isinstance(importlib.import_module(ADAPTERS[framework]), Adapter)


@pytest.mark.parametrize("framework", sorted(HANDLE_BINDINGS))
def test_poll_and_synchronize_are_the_kits(framework: str) -> None:
    module = HANDLE_BINDINGS[framework]
    own = sorted(set(_functions(module)) & {"poll", "synchronize"})
    assert not own, f"{module} defines its own {own}: re-export hora.binding's"
    imported = {alias.asname or alias.name for node in _tree(module).body
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hora.binding")
                for alias in node.names}
    assert {"poll", "synchronize"} <= imported, f"{module} does not take poll/synchronize from hora.binding"


@pytest.mark.parametrize("framework", sorted(HANDLE_BINDINGS))
def test_an_importable_binding_reexports_the_same_objects(framework: str) -> None:
    pytest.importorskip(framework)
    package = importlib.import_module(f"hora.{framework}")
    assert package.poll is poll and package.synchronize is synchronize
    mpi_ops = importlib.import_module(HANDLE_BINDINGS[framework])
    handles = [obj for name, obj in vars(mpi_ops).items()
               if name.endswith("Handle") and inspect.isclass(obj) and obj.__module__ == mpi_ops.__name__]
    assert handles and all(issubclass(h, ConvertingHandle) for h in handles), handles


def test_no_binding_reimplements_a_handle() -> None:
    offenders = []
    for package in BINDING_PACKAGES:
        for path in sorted((SOURCE / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, ast.ClassDef):
                    own = sorted({m.name for m in node.body if isinstance(m, ast.FunctionDef)} & {"poll", "wait"})
                    if own:
                        offenders.append(f"{path.relative_to(SOURCE)}: {node.name} defines {own}")
    assert not offenders, ("handle classes outside hora.binding (subclass ConvertingHandle instead):\n"
                           + "\n".join(offenders))


def test_the_handle_lives_in_the_kit_only() -> None:
    assert not (SOURCE / "handles.py").exists(), "hora.handles moved to hora.binding"


#: The collectives modules whose ``_async`` forms pair with blocking forms, and the example binding
#: the architecture walk-through shows (it follows the same rule).
TRIO_MODULES = {**HANDLE_BINDINGS, "example": "examples/array_binding.py"}
#: ``_async`` forms Horovod gives no blocking partner (torch's sparse allreduce is only asynchronous).
NO_BLOCKING_PARTNER = {"sparse_allreduce_async"}
#: What a blocking form may take beyond its ``_async`` partner: Horovod's differentiable forms compress.
BLOCKING_ONLY_PARAMETERS = {"compression"}


def _trio_functions(module: str) -> dict[str, ast.FunctionDef]:
    if module.endswith(".py"):
        path = Path(__file__).resolve().parents[1] / module
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    return _functions(module)


def _parameters(function: ast.FunctionDef) -> list[tuple[str, str | None]]:
    """Each parameter's name and its default's source (None when it has none), in order."""
    args = function.args
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = [(a.arg, None if d is None else ast.unparse(d)) for a, d in zip(positional, defaults)]
    pairs += [(a.arg, None if d is None else ast.unparse(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return pairs


def _blocking_name(async_name: str) -> str:
    return async_name.replace("_async", "")


def _synchronized_calls(function: ast.FunctionDef) -> list[tuple[str, ast.Call]]:
    """The calls ``synchronize(f(...))`` in a function's body, with the name ``f``."""
    calls = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "synchronize" \
                and node.args and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Name):
            calls.append((node.args[0].func.id, node.args[0]))
    return calls


@pytest.mark.parametrize("binding", sorted(TRIO_MODULES))
def test_every_async_collective_has_a_blocking_form_taking_the_same_arguments(binding: str) -> None:
    """The one way a binding makes a collective's forms: the ``_async`` form is the implementation (and
    ``_async_`` the in-place one); the blocking form of the same name less ``_async`` takes the same
    arguments, in the same order, with the same defaults, and hands every one of them on when it waits
    on its partner. They are written out, not generated, so that their signatures and docstrings are
    static (the API reference, mypy, an editor); this test is what keeps the written-out forms one way."""
    functions = _trio_functions(TRIO_MODULES[binding])
    problems = []
    for name, async_form in sorted(functions.items()):
        if name.startswith("_") or "_async" not in name or name in NO_BLOCKING_PARTNER:
            continue
        blocking = functions.get(_blocking_name(name))
        if blocking is None:
            problems.append(f"{name} has no blocking form {_blocking_name(name)}")
            continue
        async_params = _parameters(async_form)
        blocking_params = [p for p in _parameters(blocking) if p[0] not in BLOCKING_ONLY_PARAMETERS]
        if blocking_params != async_params:
            problems.append(f"{blocking.name}{blocking_params} does not take {name}'s arguments {async_params}")
        for callee, call in _synchronized_calls(blocking):
            if callee.endswith(("_async", "_async_")):
                if callee != name and _blocking_name(callee) == blocking.name:
                    problems.append(f"{blocking.name} waits on {callee}, not {name}")
                if callee == name:
                    passed = [a.id for a in call.args if isinstance(a, ast.Name)]
                    passed += [k.value.id for k in call.keywords
                               if isinstance(k.value, ast.Name) and k.arg == k.value.id]
                    # A form that compresses hands on the compressed tensors in place of its first argument.
                    expected = async_params[1:] if len(_parameters(blocking)) > len(async_params) else async_params
                    dropped = [p for p, _ in expected if p not in passed]
                    if dropped:
                        problems.append(f"{blocking.name} does not hand {dropped} on to {name}")
    assert not problems, f"{TRIO_MODULES[binding]}:\n" + "\n".join(problems)
