"""The documentation site (mkdocs.yml, docs/) builds cleanly and covers every page and public name.

``mkdocs build --strict`` turns every warning (a broken link, a page left out of the nav, a docstring
griffe cannot parse) into a failure. The API reference is read from src/ statically, so the build needs
only the docs tools (``pip install mkdocs mkdocs-material "mkdocstrings[python]"``), no framework.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read mkdocs.yml")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src"
MKDOCS_YML = ROOT / "mkdocs.yml"

# API page -> the packages it documents with ``::: package`` blocks.
API_PAGES = {
    "api/hora.md": "hora",
    "api/torch.md": "hora.torch",
    "api/tensorflow.md": "hora.tensorflow",
    "api/keras.md": "hora.keras",
    "api/jax.md": "hora.jax",
    "api/mxnet.md": "hora.mxnet",
    "api/lightning.md": "hora.lightning",
    "api/ray.md": "hora.ray",
    "api/spark.md": "hora.spark",
}
# A documented name each API page must show (proof that griffe found the package's members).
API_PAGE_NAMES = {
    "api/hora.md": ["allreduce", "broadcast_object", "init"],
    "api/torch.md": ["allreduce", "DistributedOptimizer", "broadcast_parameters", "TorchState"],
    "api/tensorflow.md": ["allreduce", "DistributedGradientTape"],
    "api/keras.md": ["allreduce", "BroadcastGlobalVariablesCallback"],
    "api/jax.md": ["allreduce", "DistributedOptimizer"],
    "api/mxnet.md": ["allreduce", "DistributedTrainer"],
    "api/lightning.md": ["HoraStrategy"],
    "api/ray.md": ["RayExecutor", "ElasticRayExecutor"],
    "api/spark.md": ["run_elastic", "TorchEstimator"],
}


def _nav_pages(nav) -> list[str]:
    """Every page path (``x.md``) named anywhere in a mkdocs nav."""
    pages = []
    if isinstance(nav, str):
        if not re.match(r"^[a-z]+://", nav):
            pages.append(nav)
    elif isinstance(nav, list):
        for item in nav:
            pages.extend(_nav_pages(item))
    elif isinstance(nav, dict):
        for value in nav.values():
            pages.extend(_nav_pages(value))
    return pages


def _config() -> dict:
    # mkdocs.yml is kept free of ``!!python/...`` tags, so that the safe loader reads it.
    return yaml.safe_load(MKDOCS_YML.read_text(encoding="utf-8"))


def _doc_pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def test_every_docs_page_is_in_the_nav() -> None:
    config = _config()
    assert config["docs_dir"] == "docs"
    assert config["theme"]["name"] == "material"
    nav = _nav_pages(config["nav"])
    missing = [page for page in _doc_pages() if page not in nav]
    assert not missing, f"pages under docs/ missing from mkdocs.yml's nav: {missing}"
    dangling = [page for page in nav if not (DOCS / page).is_file()]
    assert not dangling, f"mkdocs.yml's nav names pages that do not exist: {dangling}"
    for page in API_PAGES:
        assert page in nav


# --- the API pages list every public name -----------------------------------------------------------
# Some packages build ``__all__`` at run time (``list(_common) + [...]``) or have none, and griffe reads
# source statically, so their API pages list members by hand; these checks keep those lists honest.


def _module_file(module: str) -> Path:
    path = SRC.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _common_names() -> list[str]:
    return _literal_all(_module_file("hora.binding.common_api"))


def _literal_all(path: Path) -> list[str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no literal __all__")


def _eval_all(node: ast.expr, aliases: dict[str, list[str]]) -> list[str]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_all(node.left, aliases) + _eval_all(node.right, aliases)
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "list" and len(node.args) == 1:
        return _eval_all(node.args[0], aliases)
    if isinstance(node, ast.Name):
        return aliases[node.id]
    return list(ast.literal_eval(node))


def public_names(package: str) -> set[str]:
    """A package's public names as ``from package import *`` would see them, read from its source.

    ``__all__`` when the package defines one (``__all__`` of hora.binding.common_api spliced in where it is
    named); otherwise every public name it imports from hora or defines, plus hora.binding.common_api's names
    for ``from hora.binding.common_api import *``, plus ``run`` where the package serves it lazily.
    """
    tree = ast.parse(_module_file(package).read_text(encoding="utf-8"))
    aliases: dict[str, list[str]] = {}
    names: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hora":
                for alias in node.names:
                    if alias.name == "*":
                        names.update(_common_names() if node.module == "hora.binding.common_api" else [])
                    elif alias.name == "__all__":
                        aliases[alias.asname or alias.name] = _literal_all(_module_file(node.module))
                    else:
                        names.add(alias.asname or alias.name)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports
                visit(node.body)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(_eval_all(node.value, aliases))
    return {name for name in names if not name.startswith("_")}


def _page_blocks(page: str) -> dict[str, dict]:
    """The ``::: identifier`` blocks of an API page, each with its (YAML) options."""
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = {}
    for match in re.finditer(r"^::: *(\S+)\n((?:(?:[ \t]+.*)?\n)*)", text, re.M):
        options = yaml.safe_load(textwrap.dedent(match.group(2))) or {}
        blocks[match.group(1)] = options.get("options", {}) or {}
    return blocks


def _members(package: str, blocks: dict[str, dict]) -> set[str]:
    """The names a page's ``::: package`` block lists (griffe follows a literal ``__all__`` when none)."""
    members = blocks[package].get("members")
    if members is None or members is True:
        return set(_literal_all(_module_file(package)))
    return set(members)


def _submodule_blocks(package: str, blocks: dict[str, dict]) -> set[str]:
    """Submodules documented in blocks of their own on the page (``::: hora.torch.elastic``)."""
    prefix = package + "."
    return {ident[len(prefix):] for ident in blocks if ident.startswith(prefix) and "." not in ident[len(prefix):]}


@pytest.mark.parametrize("page,package", sorted(API_PAGES.items()))
def test_api_page_lists_every_public_name(page: str, package: str) -> None:
    blocks = _page_blocks(page)
    assert package in blocks, f"docs/{page} has no '::: {package}' block"
    members = _members(package, blocks)
    documented = members | _submodule_blocks(package, blocks)
    public = public_names(package)
    # The names shared by every binding (hora.binding.common_api: init, rank, Average, ProcessSet, ...) are the
    # very same objects everywhere; the hora page documents them once and the others link to it.
    expected = public if package == "hora" else public - set(_common_names())
    missing = sorted(expected - documented)
    assert not missing, f"docs/{page} does not document {package}'s public names {missing}"
    unknown = sorted(members - public)
    assert not unknown, f"docs/{page} lists names {package} does not export: {unknown}"


# --- the build ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs tools are not installed: pip install mkdocs")
    pytest.importorskip("material", reason="the Material theme is not installed: pip install mkdocs-material")
    pytest.importorskip("mkdocstrings", reason='mkdocstrings is not installed: pip install "mkdocstrings[python]"')
    pytest.importorskip("mkdocstrings_handlers.python",
                        reason='the mkdocstrings python handler is not installed: pip install "mkdocstrings[python]"')
    site = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed ({proc.returncode}):\n{output[-8000:]}"
    warnings = [line for line in output.splitlines() if line.startswith("WARNING")]
    assert not warnings, "mkdocs build warned:\n" + "\n".join(warnings)
    return site


def _html_path(page: str) -> Path:
    """Where mkdocs (use_directory_urls) writes a page: x.md -> x/index.html, a/index.md -> a/index.html."""
    stem = Path(page).with_suffix("")
    return stem.parent / "index.html" if stem.name == "index" else stem / "index.html"


@pytest.mark.timeout(360)
def test_site_builds_strict_with_every_page(built_site: Path) -> None:
    assert (built_site / "index.html").is_file()
    for page in _nav_pages(_config()["nav"]):
        built = built_site / _html_path(page)
        assert built.is_file(), f"{page} was not built ({built} is missing)"


@pytest.mark.timeout(360)
@pytest.mark.parametrize("page", sorted(API_PAGE_NAMES))
def test_api_pages_document_hora_names(built_site: Path, page: str) -> None:
    html = (built_site / _html_path(page)).read_text(encoding="utf-8")
    package = API_PAGES[page]
    for name in API_PAGE_NAMES[page]:
        # mkdocstrings gives every documented object a heading whose id is its full path.
        assert re.search(rf'id="{re.escape(package)}(\.[A-Za-z_.]+)?\.{re.escape(name)}"', html), (
            f"the built {page} does not document {package}'s {name}")
    # Sphinx roles in docstrings (:func:`x`) render as their code span alone (scripts/mkdocs_hooks.py).
    stray = re.findall(r":(?:func|class|meth|mod|attr|data|exc|obj):<code>[^<]*", html)
    assert not stray, f"{page} shows Sphinx roles as text: {stray[:3]}"


def test_index_quick_start_is_the_readme_quick_start() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)```", quick, re.S)
    assert commands, "README.md's Quick start has no sh blocks"
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for command in commands:
        assert command in index, f"docs/index.md's quick start lacks README's command:\n{command}"
