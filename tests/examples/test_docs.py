"""The API references document every public name, with the signature the code has.

docs/torch-api.md covers hora.torch; docs/tensorflow-api.md covers hora.tensorflow, hora.keras and
hora.keras.callbacks (names a binding lists in ``__all__``).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")


def _public_names(module) -> list[str]:
    return sorted(name for name, value in vars(module).items()
                  if not name.startswith("_") and not isinstance(value, types.ModuleType)
                  and not (name == "annotations" and type(value).__name__ == "_Feature"))


def _as_written(obj) -> str:
    """The signature as the doc spells it: no annotations, defaults as a user writes them."""
    from hora.basics import global_process_set
    from hora.compression import Compression

    nones = {Compression.none}
    if "hora.torch" in sys.modules:
        nones.add(sys.modules["hora.torch"].Compression.none)
    parts = []
    for param in inspect.signature(obj).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            parts.append(("*" if param.kind is param.VAR_POSITIONAL else "**") + param.name)
            continue
        if param.default is inspect.Parameter.empty:
            parts.append(param.name)
            continue
        default = param.default
        if default is global_process_set:
            text = "global_process_set"
        elif default in nones:
            text = "Compression.none"
        elif param.name == "op" and isinstance(default, int):
            import hora as hvd
            text = next(n for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product") if getattr(hvd, n) == default)
        else:
            text = repr(default)
        parts.append(f"{param.name}={text}")
    return "(" + ", ".join(parts) + ")"


def _documented(text: str) -> dict[str, list[str]]:
    """name -> every ``name(...)`` signature written in backticks in the doc."""
    found: dict[str, list[str]] = {}
    for name, args in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)(\([^`]*\))`", text):
        found.setdefault(name, []).append(args)
    return found


def _check_documented(doc: str, modules: list) -> None:
    with open(os.path.join(DOCS, doc), encoding="utf-8") as f:
        text = f.read()
    documented = _documented(text)
    names = [(m, n) for m in modules for n in (sorted(m.__all__) if hasattr(m, "__all__") else _public_names(m))]
    missing = [name for _, name in names if f"`{name}" not in text]
    assert not missing, f"not in docs/{doc}: {missing}"
    wrong = {}
    for module, name in names:
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType) or not callable(obj) or (
                isinstance(obj, type) and issubclass(obj, BaseException) and name != "HostsUpdatedInterrupt"):
            continue
        if name in ("Compression",):  # a namespace of compressors, documented by its members
            continue
        expected = _as_written(obj)
        if expected not in documented.get(name, []):
            wrong[f"{module.__name__}.{name}"] = (expected, documented.get(name))
    assert not wrong, f"signatures in docs/{doc} differ from the code: " + "; ".join(
        f"{name}: code {exp}, doc {doc}" for name, (exp, doc) in wrong.items())


def test_every_public_name_is_documented_with_its_signature():
    hvd = pytest.importorskip("hora.torch")
    _check_documented("torch-api.md", [hvd])


def test_every_tensorflow_and_keras_name_is_documented_with_its_signature():
    pytest.importorskip("tensorflow")
    import hora.keras
    import hora.keras.callbacks
    import hora.tensorflow

    _check_documented("tensorflow-api.md", [hora.tensorflow, hora.keras, hora.keras.callbacks])
