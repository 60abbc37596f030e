"""The cuda extra alone: NVIDIA's NCCL and CUDA runtime wheels, found and loaded by hora.nccl through
ctypes (plain ``python smoke_cuda.py``; ``hora check`` reports the same from the command line).

ncclGetVersion and ncclGetUniqueId need no GPU, so on a machine without one the library still proves
it loads and works; whether a device is usable is reported, with the reason, not required.
"""

from __future__ import annotations

from smoke_report import report  # this folder: on the path of a script run from it

from hora.nccl import cudart, library


def main() -> None:
    code = library.nccl_version()
    usable, why = library.nccl_status()
    unique_id = library.Nccl().unique_id() if code else b""
    report({
        "nccl_version_code": code, "nccl_version": library.decode_version(code) if code else None,
        "nccl_library": library.library_path(), "cudart_loads": cudart.runtime_installed(),
        "usable": usable, "why": why, "unique_id_bytes": len(unique_id),
    })


if __name__ == "__main__":
    main()
