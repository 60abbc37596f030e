"""Finding a shared library that NVIDIA ships as a pip wheel (``nvidia/<part>/lib/<file>``), or elsewhere."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

from hora import config


def candidates(knob: str, wheel_part: str, names: tuple[str, ...]) -> list[str]:
    """Paths to try in order: the ``knob``'s path (``HORA_<KNOB>``), the NVIDIA wheel's copy, then the
    system loader's names."""
    override = config.get(knob)
    paths = [override] if override else []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / wheel_part / "lib" / names[0]
        if lib.exists():
            paths.append(str(lib))
    return paths + list(names)


def load_first(paths: list[str], what: str, env: str) -> tuple[ctypes.CDLL | None, str]:
    """The first of ``paths`` that loads and where it came from, or ``(None, reason)``."""
    failures = []
    for path in paths:
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            failures.append(f"{path}: {exc}")
    return None, (f"no {what} found (install it with pip install \"hora[cuda]\", or set {env}); tried "
                  + "; ".join(failures))
