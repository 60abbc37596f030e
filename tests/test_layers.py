"""hora's imports point down the layers that docs/architecture.md lists, never up.

The table under "Module to layer" in docs/architecture.md is the design of record; this test reads it
from there, so the document and the check cannot drift apart. Each row names a layer (bottom first)
and the modules in it, as dotted prefixes: a module belongs to the row with the longest prefix that
matches it. Every hora module must be in some row (a new module gets its place when it is written),
and an import may stay within its layer or go to a lower one. Circles within a layer are
tests/test_import_graph.py's subject.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_import_graph import import_graph

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def layer_table(text: str) -> list[tuple[str, list[str]]]:
    """[(layer name, [module prefixes])], bottom layer first, from the document's table."""
    section = text.split("### Module to layer", 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].isdigit():
            continue
        rows.append((cells[1], re.findall(r"`(hora[\w.]*)`", cells[2])))
    return rows


def layer_of(module: str, prefixes: dict[str, int]) -> int | None:
    best = None
    for prefix in prefixes:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    return None if best is None else prefixes[best]


def _prefixes() -> tuple[list[tuple[str, list[str]]], dict[str, int]]:
    table = layer_table(ARCHITECTURE.read_text())
    assert len(table) >= 5, f"no layer table found in {ARCHITECTURE}"
    prefixes: dict[str, int] = {}
    for level, (_, modules) in enumerate(table):
        for prefix in modules:
            assert prefix not in prefixes, f"{prefix} is listed in two layers"
            prefixes[prefix] = level
    return table, prefixes


def test_every_module_has_a_layer() -> None:
    _, prefixes = _prefixes()
    missing = sorted(m for m in import_graph() if layer_of(m, prefixes) is None)
    assert not missing, f"modules in no row of the layer table in docs/architecture.md: {missing}"


def test_no_import_goes_up_a_layer() -> None:
    table, prefixes = _prefixes()
    upward = []
    for module, targets in sorted(import_graph().items()):
        here = layer_of(module, prefixes)
        for target in sorted(targets):
            there = layer_of(target, prefixes)
            if here is not None and there is not None and there > here:
                upward.append(f"{module} ({table[here][0]}) imports {target} ({table[there][0]})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_the_table_reader_follows_the_longest_prefix() -> None:
    text = ("### Module to layer\n\n| layer | name | modules |\n| --- | --- | --- |\n"
            "| 0 | base | `hora.errors`, `hora.runner.hosts` |\n| 1 | launcher | `hora.runner` |\n\n## Next\n")
    table = layer_table(text)
    assert table == [("base", ["hora.errors", "hora.runner.hosts"]), ("launcher", ["hora.runner"])]
    prefixes = {"hora.errors": 0, "hora.runner.hosts": 0, "hora.runner": 1}
    assert layer_of("hora.runner.hosts", prefixes) == 0
    assert layer_of("hora.runner.launching.job", prefixes) == 1
    assert layer_of("hora.runnerx", prefixes) is None
