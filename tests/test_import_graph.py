"""hora's modules import each other without circles.

The graph is read from the source with ``ast``, so imports inside functions count too: a circle hidden
behind a function-level import still ties the two modules together, and it is what makes a change in
one break the other at a distance. ``from hora.pkg import name`` is an arrow to ``hora.pkg.name``
when that is a module (importing a submodule is not a dependency on its package's other contents),
and to ``hora.pkg`` otherwise. Third-party imports are not part of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hora

SOURCE = Path(hora.__file__).resolve().parent


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def import_graph(root: Path = SOURCE) -> dict[str, set[str]]:
    """Each hora module and the hora modules it imports (anywhere in its body)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        name, is_package = _module_name(path, root)
        files[name] = (path, is_package)

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in files.items():
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                          for alias in node.names]
            else:
                continue
            for dotted in wanted:
                if dotted == "hora" or dotted.startswith("hora."):
                    target = resolve(dotted)
                    if target is not None and target != name:
                        targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_finds_a_circle_through_a_function_level_import(tmp_path):
    package = tmp_path / "hora"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from hora.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("import hora.a\n")
    (package / "d.py").write_text("from hora import sub\nimport numpy\n")  # the package itself: no circle
    graph = import_graph(package)
    assert graph["hora.a"] == {"hora.sub.b"} and graph["hora.sub.b"] == {"hora.c"}
    assert graph["hora.d"] == {"hora.sub"}
    assert circles(graph) == [["hora.a", "hora.c", "hora.sub.b"]]


def test_no_two_hora_modules_import_each_other_even_through_others():
    found = circles(import_graph())
    assert not found, "import circles (break each by moving the shared part down a layer):\n" + "\n".join(
        " -> ".join(component) for component in found)


#: A subpackage that is another package's face: ``hora.tensorflow.keras`` is Horovod's spelling of
#: ``hora.keras`` (it re-exports it), so it belongs to that package, not to the one it sits in.
FACES = {"hora.tensorflow.keras": "hora.keras"}


def package_of(module: str) -> str:
    """The top-level package of hora that ``module`` is part of (``hora`` itself for the package face)."""
    for face, owner in FACES.items():
        if module == face or module.startswith(face + "."):
            return owner
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen a package at a time (an arrow between two packages, never to itself)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = package_of(module)
        packages.setdefault(mine, set()).update(package_of(t) for t in targets if package_of(t) != mine)
    return packages


def test_the_package_view_keeps_faces_with_their_owner():
    graph = {"hora.a.x": {"hora.b.y"}, "hora.b.y": {"hora.tensorflow.keras"},
             "hora.tensorflow.keras.callbacks": {"hora.keras.callbacks"}, "hora.keras.callbacks": {"hora.a"}}
    assert package_graph(graph) == {"hora.a": {"hora.b"}, "hora.b": {"hora.keras"}, "hora.keras": {"hora.a"}}
    assert circles(package_graph(graph)) == [["hora.a", "hora.b", "hora.keras"]]


def test_no_two_hora_packages_import_each_other_even_through_others():
    # Two packages that need each other are one component in two places: a change in either breaks the
    # other, and neither can be read (or layered) alone. Break a circle by moving the shared module to
    # the package both stand on.
    found = circles(package_graph(import_graph()))
    assert not found, "package circles:\n" + "\n".join(" -> ".join(component) for component in found)
