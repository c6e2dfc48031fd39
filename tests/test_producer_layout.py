"""The write side's modules import each other one way; `EventLog` leaves media to the capability (issue 48).

Every import counts here, unlike the `circle` rule of tools/limits.py (which follows the imports
Python runs): those under `if TYPE_CHECKING:` and those inside functions too, so no producer
module needs another that needs it back, however the circle would be closed.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PRODUCER = Path(__file__).resolve().parents[1] / 'producer'
PACKAGE = 'stepstream.producer'


def imported(module: Path) -> set[str]:
    """The modules of stepstream that `module` imports anywhere in it (dotted names).

    `from package import name` imports `package.name` when that is a module, else `package`.
    """
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            for alias in node.names:
                submodule = node.module == PACKAGE and (PRODUCER / f'{alias.name}.py').exists()
                names.add(f'{node.module}.{alias.name}' if submodule else node.module)
    return {name for name in names if name.startswith('stepstream')}


def producer_imports() -> dict[str, set[str]]:
    """Per producer module (`_log`, `__init__`, ...), the producer modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in PRODUCER.glob('*.py'):
        needed = set()
        for name in imported(path):
            if name == PACKAGE:
                needed.add('__init__')
            elif name.startswith(f'{PACKAGE}.'):
                needed.add(name.split('.')[2])
        graph[path.stem] = needed - {path.stem}
    return graph


def test_no_producer_module_imports_one_that_imports_it_back() -> None:
    graph = producer_imports()
    assert '_capability' not in graph['_current']
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle


def test_the_event_log_does_not_import_the_media_store() -> None:
    assert not {name for name in imported(PRODUCER / '_log.py') if name.startswith('stepstream.media')}
