"""The layers of stepstream's packages, held against every import the code has.

`make lint` and `make check` (tests/test_layers.py) run it: `.venv/bin/python tools/layers.py [-v]`.

Every import counts here, unlike the circle rule of tools/limits.py (which follows what Python runs):
at module level, inside functions and under `if TYPE_CHECKING:`, since each says that one module
needs another. An import of a name that a package's face hands on (its lazy map, or its own
imports) counts as an import of the module that defines the name. Two rules:

1. No circle between modules: no module needs itself through others.
2. The parts (a subpackage of `stepstream`, or one of its top-level modules) keep their layers:
   a part imports only parts on lower layers. The layers are the table of
   docs/decisions/0054-layers.md, read from there, so the text and the check cannot disagree.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import limits  # tools/ is not a package

ROOT = Path(__file__).resolve().parent.parent
DECISION = Path('docs/decisions/0054-layers.md')
ROW = re.compile(r'^\|\s*(\d+)\s*\|([^|]*)\|')


def needs(modules: dict[str, limits.Module]) -> dict[str, dict[str, int]]:
    """Each module's needs, every import counted: {importer: {module it needs: line}}."""
    graph: dict[str, dict[str, int]] = {}
    for name, module in modules.items():
        edges = graph.setdefault(name, {})
        for imported in limits.imports_of(module):
            for target in _targets(imported, modules):
                if target != name:
                    edges.setdefault(target, imported.line)
    return graph


def _targets(imported: limits.Imported, modules: dict[str, limits.Module]) -> list[str]:
    """The modules one import statement needs: a face's names resolved to where they are defined."""
    if imported.plain:
        return [imported.base] if imported.base in modules else []
    package = modules.get(imported.base)
    found = []
    for name in imported.names:
        if f'{imported.base}.{name}' in modules:
            found.append(f'{imported.base}.{name}')
        elif package is not None and name in package.lazy:
            found.append(package.lazy[name][0])
        elif package is not None:
            found.append(imported.base)
    return found


def part_of(module: str) -> str:
    """The part a module is in: `stepstream.projector._apply` -> `projector`; the face -> `stepstream`."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else parts[0]


def read_layers(path: Path) -> dict[str, int]:
    """Part -> layer, from the decision's table (`| layer | part, part |`, layer 1 at the bottom)."""
    layers = {}
    for line in path.read_text(encoding='utf-8').splitlines():
        match = ROW.match(line)
        if match:
            for part in re.findall(r'`([\w.]+)`', match.group(2)):
                layers[part] = int(match.group(1))
    return layers


def check(root: Path) -> list[str]:
    """What breaks the two rules, one line each (empty: the layers hold)."""
    modules, errors = limits.load_modules(root)
    graph = needs(modules)
    problems = [*errors]
    for circle in limits.circles(graph):
        problems.append(f'circle of modules: {" -> ".join([*circle, circle[0]])}')
    layers = read_layers(root / DECISION)
    for name in sorted({part_of(m) for m in modules} - set(layers)):
        problems.append(f'part {name!r} has no layer in {DECISION}: add it to the table')
    for importer, edges in sorted(graph.items()):
        mine = layers.get(part_of(importer))
        for target, line in sorted(edges.items()):
            theirs = layers.get(part_of(target))
            if mine is None or theirs is None or part_of(target) == part_of(importer):
                continue
            if theirs >= mine:
                where = f'{modules[importer].rel}:{line}'
                problems.append(
                    f'{where}: {part_of(importer)} (layer {mine}) imports {target} '
                    f'({part_of(target)}, layer {theirs}): a part imports only lower layers'
                )
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Print what breaks the layers; exit 1 if anything does."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--root', type=Path, default=ROOT, help='the repository (its pyproject.toml)')
    parser.add_argument('-v', action='store_true', help='print the parts and what each needs')
    args = parser.parse_args(argv)
    if args.v:
        modules, _ = limits.load_modules(args.root)
        parts: dict[str, set[str]] = {}
        for importer, edges in needs(modules).items():
            parts.setdefault(part_of(importer), set()).update(
                part_of(t) for t in edges if part_of(t) != part_of(importer)
            )
        for part, used in sorted(parts.items()):
            print(f'{part}: {", ".join(sorted(used))}')
    problems = check(args.root)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
