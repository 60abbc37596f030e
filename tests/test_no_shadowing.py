"""No file or folder of the test tree can stand in for a real package.

pytest puts each test folder on ``sys.path`` (no ``__init__.py``: rootdir-relative "prepend" import
mode), and a folder named like a package becomes an importable namespace package. Where the real
package is installed it wins; where it is missing, ``import ray`` found ``tests/ray``, so
``pytest.importorskip("ray")`` passed and the module then failed to collect instead of skipping.
Folders that test a framework's binding are therefore named ``hora_<framework>``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: The import names of everything hora or its test suite may use (pyproject.toml's dependencies and
#: extras, requirements/), whether or not this machine has them installed.
DECLARED = {
    "numpy", "ml_dtypes", "cloudpickle", "torch", "tensorflow", "tf_keras", "keras", "mpi4py", "nvidia",
    "yaml", "ray", "pyspark", "pyarrow", "pandas", "lightning", "pytorch_lightning", "lightning_fabric",
    "mxnet", "jax", "jaxlib", "optax", "sklearn", "scipy", "matplotlib", "pytest", "kubernetes_validate",
    "mkdocs", "material", "mkdocstrings", "coverage", "hora",
}


def _reserved_names() -> set[str]:
    installed = set(importlib.metadata.packages_distributions())
    return DECLARED | installed | set(sys.stdlib_module_names)


def _importable_children(folder: Path) -> list[tuple[str, Path]]:
    children = []
    for child in folder.iterdir():
        if child.name.startswith((".", "__")):
            continue
        if child.is_dir():
            children.append((child.name, child))
        elif child.suffix == ".py":
            children.append((child.stem, child))
    return children


def _clashes(root: Path) -> list[str]:
    reserved = _reserved_names()
    folders = [root, *(p for p in root.rglob("*") if p.is_dir() and "__pycache__" not in p.parts)]
    return sorted(str(path.relative_to(root)) for folder in folders
                  for name, path in _importable_children(folder) if name in reserved)


def test_no_test_folder_or_helper_module_is_named_like_a_package() -> None:
    clashes = _clashes(TESTS)
    assert not clashes, f"these would shadow a real package when it is not installed; rename them: {clashes}"


def test_the_guard_finds_a_folder_or_module_named_like_a_package(tmp_path: Path) -> None:
    (tmp_path / "hora_ray").mkdir()
    (tmp_path / "hora_ray" / "ray").mkdir()
    (tmp_path / "hora_ray" / "site.py").write_text("")
    (tmp_path / "torch").mkdir()
    (tmp_path / "helpers.py").write_text("")
    assert _clashes(tmp_path) == ["hora_ray/ray", "hora_ray/site.py", "torch"]
