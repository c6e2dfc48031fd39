"""The layers of decision 0054 and the one shape of a package's public surface, held against the code.

tools/layers.py finds every circle between modules and every import of a part on the same or a
higher layer, every import counted (module level, inside functions, under `TYPE_CHECKING`); it is
proven here on small trees that break each rule, then run on stepstream itself. Every package's
face names its public surface the same way (`__all__`, `_WHERE`, `lazy_exports`), and the
docs/development.md's "Where the code lives" gives each package the layer the decision gives it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.fast, pytest.mark.once]

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    path = ROOT / 'tools' / 'layers.py'
    spec = importlib.util.spec_from_file_location('stepstream_tools_layers', path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


layers = _load()

LAYERS = """\
| layer | parts |
|---|---|
| 3 | `top`, `pkg` |
| 2 | `mid`, `side` |
| 1 | `ground` |
"""


def tree(root: Path, files: dict[str, str]) -> Path:
    """A repository: a package `pkg` with the subpackages `top`, `mid`, `side`; the decision; `files`."""
    (root / 'pyproject.toml').write_text(
        '[tool.setuptools]\npackage-dir = { "" = "." }\n'
        'packages = ["pkg", "pkg.top", "pkg.mid", "pkg.side"]\n'
    )
    for folder in ('pkg', 'pkg/top', 'pkg/mid', 'pkg/side'):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / '__init__.py').write_text('')
    (root / 'pkg' / 'ground.py').write_text('X = 1\n')
    decision = root / layers.DECISION
    decision.parent.mkdir(parents=True)
    decision.write_text(LAYERS)
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_a_tree_that_keeps_its_layers_passes(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            'pkg/top/_a.py': 'from pkg.mid._b import B\nfrom pkg.ground import X\n',
            'pkg/mid/_b.py': 'B = 1\n\ndef f():\n    from pkg.ground import X\n',
        },
    )
    assert layers.check(root) == []


def test_an_import_of_a_higher_or_the_same_layer_is_refused_even_under_type_checking(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            'pkg/mid/_b.py': (
                'from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.top._a import A\n'
            ),
            'pkg/top/_a.py': 'A = 1\n',
            'pkg/side/_c.py': 'def f():\n    from pkg.mid._b import f\n',
        },
    )
    problems = layers.check(root)
    assert len(problems) == 2
    assert 'mid (layer 2) imports pkg.top._a (top, layer 3)' in problems[0]
    assert 'side (layer 2) imports pkg.mid._b (mid, layer 2)' in problems[1]


def test_a_circle_closed_by_a_type_checking_import_is_found(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            'pkg/mid/_a.py': 'from pkg.mid._b import B\nA = 1\n',
            'pkg/mid/_b.py': (
                'from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.mid._a import A\nB = 1\n'
            ),
        },
    )
    assert layers.check(root) == ['circle of modules: pkg.mid._a -> pkg.mid._b -> pkg.mid._a']


def test_a_name_a_face_hands_on_counts_as_its_module_and_a_part_without_a_layer_is_named(
    tmp_path: Path,
) -> None:
    root = tree(
        tmp_path,
        {
            'pkg/mid/__init__.py': (
                "from pkg.lazy import lazy_exports\n_WHERE = {'B': 'pkg.mid._b'}\n"
                '__getattr__ = lazy_exports(__name__, _WHERE)\n'
            ),
            'pkg/mid/_b.py': 'B = 1\n',
            'pkg/lazy.py': 'def lazy_exports(*a):\n    pass\n',
            'pkg/ground.py': 'from pkg.mid import B\n',
        },
    )
    problems = layers.check(root)
    assert "part 'lazy' has no layer" in problems[0]
    assert 'ground (layer 1) imports pkg.mid._b (mid, layer 2)' in problems[1]


def test_stepstream_keeps_its_layers() -> None:
    assert layers.check(ROOT) == []


def _faces() -> list[tuple[str, Path]]:
    modules, _ = layers.limits.load_modules(ROOT)
    return [(name, ROOT / m.rel) for name, m in sorted(modules.items()) if m.is_package]


@pytest.mark.parametrize(('package', 'path'), _faces(), ids=[name for name, _ in _faces()])
def test_every_package_names_its_public_surface_one_way(package: str, path: Path) -> None:
    """`__all__` lists what `_WHERE` maps and the `TYPE_CHECKING` block imports; each name resolves."""
    module = importlib.import_module(package)
    body = ast.parse(path.read_text()).body
    if not any(isinstance(n, ast.ImportFrom | ast.Assign) for n in body):
        return  # a namespace without names of its own (templates, static files)
    allowed = ('__future__', 'typing', 'stepstream.lazy')
    direct = [n.module for n in body if isinstance(n, ast.ImportFrom) and n.module not in allowed]
    assert direct == [], f'{package}: imports only under TYPE_CHECKING; _WHERE says where each name lives'
    checked = {
        alias.asname or alias.name
        for n in body
        if isinstance(n, ast.If)
        for m in n.body
        if isinstance(m, ast.ImportFrom)
        for alias in m.names
    }
    where = module._WHERE
    assert set(module.__all__) == set(where) == checked, package
    for name, defined_in in where.items():
        assert getattr(module, name) is getattr(importlib.import_module(defined_in), name), name


def test_the_code_map_gives_each_package_the_layer_of_the_decision() -> None:
    decided = layers.read_layers(ROOT / layers.DECISION)
    page = (ROOT / 'docs' / 'development.md').read_text()
    section = page[page.index('## Where the code lives') :]
    rows = re.findall(r'^\| ([\d-]+) \| `stepstream\.(\w+)` \|', section, re.M)
    assert rows, 'the table of docs/development.md "Where the code lives"'
    assert {part: int(layer) for layer, part in rows} == {part: decided[part] for _, part in rows}
    packages = {name.split('.')[1] for name, _ in _faces() if name.count('.') == 1}
    assert packages <= {part for _, part in rows}
