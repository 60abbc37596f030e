"""hora's variables are read in one place, hora.config, so each is documented, parsed and validated once.

The rule is read from the source with ``ast``: outside ``hora/config.py`` no module may read a ``HORA_*``
or ``HOROVOD_*`` variable from ``os.environ`` (a subscript, ``.get``/``.pop``/``.setdefault``, an
``in`` test) or through ``os.getenv``. Setting one for a child process (a dict passed to a launcher)
is not a read and stays allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hora

SOURCE = Path(hora.__file__).resolve().parent
PREFIXES = ("HORA_", "HOROVOD_")


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def _names_hora_variable(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(PREFIXES)


def environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Each read of a HORA_/HOROVOD_ variable from the process environment: (line, variable)."""
    found = []
    for node in ast.walk(tree):
        key: ast.AST | None = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (_is_environ(func.value) and func.attr in ("get", "pop", "setdefault")) or (
                    func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os"):
                key = node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if _names_hora_variable(key):
            assert isinstance(key, ast.Constant)
            found.append((node.lineno, key.value))
    return found


def test_the_rule_sees_every_kind_of_read():
    code = ("import os\n"
            "a = os.environ['HORA_A']\n"
            "b = os.environ.get('HOROVOD_B')\n"
            "c = os.getenv('HORA_C', '1')\n"
            "d = 'HORA_D' in os.environ\n"
            "os.environ['HORA_E'] = '1'\n"  # a write: allowed
            "f = os.environ.get('PATH')\n")  # not hora's
    assert environment_reads(ast.parse(code)) == [(2, "HORA_A"), (3, "HOROVOD_B"), (4, "HORA_C"), (5, "HORA_D")]


def test_no_module_but_config_reads_a_hora_variable_from_the_environment():
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path == SOURCE / "config.py":
            continue
        for line, name in environment_reads(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(SOURCE.parent)}:{line} reads {name}")
    assert not offenders, ("read these through hora.config (add a Knob), not os.environ:\n"
                           + "\n".join(offenders))
