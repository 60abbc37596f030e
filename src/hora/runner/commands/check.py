"""What ``hora check`` (and ``hora run --check-build``) reports.

The first thing to ask when a job misbehaves is "what is installed, and what is configured?". This
module answers both as plain lines of text: versions, which transports this machine can run (and
why not, for those it cannot), which frameworks are importable, and every knob's effective value with
where it came from. Framework versions are read from package metadata, so the check does not pay for
importing torch or TensorFlow.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys

from hora import config
from hora.errors import ConfigError
from hora.version import __version__

# Registry names in hora.transport and how to present them.
_TRANSPORT_LABELS = {"tcp": "tcp ring"}
# module -> the distributions that may provide it (TensorFlow ships as tensorflow or tensorflow-cpu, ...)
_FRAMEWORKS = (("torch", ("torch",)), ("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu",
                                                      "tensorflow-macos", "tf-nightly")),
               ("keras", ("keras",)), ("jax", ("jax",)), ("mpi4py", ("mpi4py",)), ("cupy", ("cupy",)))


def _package_version(module: str, distributions: str | tuple[str, ...]) -> str | None:
    """Installed version of a package, or None when it is not importable."""
    if importlib.util.find_spec(module) is None:
        return None
    for distribution in (distributions,) if isinstance(distributions, str) else distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def transport_lines() -> list[str]:
    """One line per transport in hora's registry: ``yes`` only when this machine can run it (what the
    transport itself needs: mpi4py and an MPI library, a writable /dev/shm), otherwise ``no (why)``.
    A registered transport is not a usable one, and a job on one that is not fails on every rank."""
    try:
        from hora.transport import TRANSPORTS, unavailable_reason
    except Exception as exc:  # a broken install is exactly what check must show
        return [f"tcp ring: no (hora.transport does not import: {exc})"]
    lines = []
    for name in sorted(TRANSPORTS):
        try:
            why = unavailable_reason(name)
        except Exception as exc:  # a failing check is itself the answer
            why = f"its check failed: {exc}"
        lines.append(f"{_TRANSPORT_LABELS.get(name, name)}: {'yes' if why is None else f'no ({why})'}")
    return lines


def config_lines() -> list[str]:
    """``name = value`` for every knob, marking those set in the environment (and invalid ones)."""
    environ = config.environ_copy()
    lines = []
    for entry in config.KNOBS:
        source = ""
        if config.is_set(entry.name, environ):
            source = f"  (from {entry.env if entry.env in environ else entry.alias})"
        try:
            value = config.get(entry.name, environ)
        except ConfigError as exc:
            lines.append(f"{entry.name}: INVALID: {exc}")
            continue
        if entry.name == "secret" and value is not None:
            value = "<set>"  # never print the job secret
        lines.append(f"{entry.name} = {value!r}{source}")
    return lines


def binding_lines() -> list[str]:
    """Which hora bindings this install can offer (their framework is importable), without importing it."""
    bindings = [("hora.torch", "torch"), ("hora.tensorflow", "tensorflow"), ("hora.keras", "keras")]
    return ["hora (NumPy)"] + [name for name, module in bindings if importlib.util.find_spec(module) is not None]


def nccl_lines() -> list[str]:
    """Whether CUDA tensors can use NCCL here, and why not (no library, no driver, no GPU, HORA_NCCL=off);
    then which NCCL and CUDA runtime files were loaded, or every place tried (:mod:`hora.nccl.loader`)."""
    try:
        from hora.nccl.library import decode_version, library_path, nccl_status, nccl_version
        from hora.nccl.loader import report_lines as library_lines
        from hora.nccl.path import parse_mode

        code = nccl_version()
        usable, why = nccl_status()
        found = library_lines(decode_version(code) if code else None)
    except Exception as exc:  # a broken install is exactly what check must show
        return [f"NCCL (GPU tensors): no (hora.nccl does not load: {exc})"]
    try:
        mode = parse_mode(config.get("nccl"))
    except ValueError as exc:
        return [f"NCCL (GPU tensors): HORA_NCCL is invalid: {exc}"]
    if library_path() is None:
        why = "no NCCL library found: the places tried are below"
    built = f"NCCL {decode_version(code)}, nccl_built() == {code}" if code else "not installed, nccl_built() == 0"
    lines = [f"NCCL (GPU tensors): {built}; usable: {'yes' if usable and mode != 'off' else 'no'} ({why})"]
    lines += [f"  {line}" for line in found]
    if mode == "off":
        lines.append("  HORA_NCCL=off: CUDA tensors are copied through host memory")
    elif not usable:
        lines.append("  CUDA tensors: copied through host memory to the transports above")
    else:
        lines.append(f"  CUDA tensors: reduced by NCCL on the device (HORA_NCCL={mode})")
    return lines


def report_lines() -> list[str]:
    """The whole report, ready to print."""
    lines = [
        f"hora {__version__}",
        f"Python {platform.python_version()} ({sys.executable})",
        f"Platform {platform.platform()}",
    ]
    numpy_version = _package_version("numpy", "numpy")
    lines.append(f"numpy {numpy_version or 'not installed (hora needs it)'}")
    lines.append("")
    lines.append("Available transports:")
    lines += ["  " + line for line in transport_lines()]
    lines += ["  " + line for line in nccl_lines()]
    lines.append("")
    lines.append("Available frameworks:")
    for module, distributions in _FRAMEWORKS:
        version = _package_version(module, distributions)
        lines.append(f"  {module}: {version if version else 'no'}")
    lines.append(f"  bindings: {', '.join(binding_lines())}")
    lines.append("")
    lines.append("Configuration (HORA_* variables, or the HOROVOD_* aliases):")
    lines += ["  " + line for line in config_lines()]
    return lines
