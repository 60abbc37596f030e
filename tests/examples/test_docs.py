"""docs/torch-api.md documents every public name of hora.torch, with the signature the code has."""

from __future__ import annotations

import inspect
import os
import re
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "torch-api.md")


def _public_names(module) -> list[str]:
    return sorted(name for name, value in vars(module).items()
                  if not name.startswith("_") and not isinstance(value, types.ModuleType)
                  and not (name == "annotations" and type(value).__name__ == "_Feature"))


def _as_written(obj) -> str:
    """The signature as the doc spells it: no annotations, defaults as a user writes them."""
    from hora.basics import global_process_set
    from hora.torch.compression import Compression

    parts = []
    for param in inspect.signature(obj).parameters.values():
        if param.default is inspect.Parameter.empty:
            parts.append(param.name)
            continue
        default = param.default
        if default is global_process_set:
            text = "global_process_set"
        elif default is Compression.none:
            text = "Compression.none"
        elif param.name == "op" and isinstance(default, int):
            import hora.torch as hvd
            text = next(n for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product") if getattr(hvd, n) == default)
        else:
            text = repr(default)
        parts.append(f"{param.name}={text}")
    return "(" + ", ".join(parts) + ")"


def _documented() -> dict[str, list[str]]:
    """name -> every ``name(...)`` signature written in backticks in the doc."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    found: dict[str, list[str]] = {}
    for name, args in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)(\([^`]*\))`", text):
        found.setdefault(name, []).append(args)
    return found


def test_every_public_name_is_documented_with_its_signature():
    hvd = pytest.importorskip("hora.torch")
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    documented = _documented()
    missing = [name for name in _public_names(hvd) if f"`{name}" not in text]
    assert not missing, f"not in docs/torch-api.md: {missing}"
    wrong = {}
    for name in _public_names(hvd):
        obj = getattr(hvd, name)
        if not callable(obj) or isinstance(obj, type) and issubclass(obj, BaseException) and name != "HostsUpdatedInterrupt":
            continue
        if name in ("Compression",):  # a namespace of compressors, documented by its members
            continue
        expected = _as_written(obj)
        if expected not in documented.get(name, []):
            wrong[name] = (expected, documented.get(name))
    assert not wrong, "signatures in docs/torch-api.md differ from the code: " + "; ".join(
        f"{name}: code {exp}, doc {doc}" for name, (exp, doc) in wrong.items())
