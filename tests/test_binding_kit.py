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
