"""tools/limits.py, the size and import limits of issue 34, on small package trees made for each rule.

Each rule fires on a tree that breaks it and stays quiet on one that keeps it; each exemption
works; the baseline is a ratchet (a violation it lacks, a size above it and an entry that no longer
occurs fail; a smaller size passes with a hint; `--update-baseline` only shrinks it).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.fast, pytest.mark.once]

PYPROJECT = """\
[tool.setuptools]
package-dir = { "" = "." }
packages = ["pkg", "pkg.sub", "pkg.other"]
"""
"""Three packages, two of them in top-level folders of their own linked from pkg/, as stepstream's are."""


def _load() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / 'tools' / 'limits.py'
    spec = importlib.util.spec_from_file_location('stepstream_tools_limits', path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


limits = _load()


def tree(root: Path, files: dict[str, str]) -> Path:
    """A repository under `root`: the pyproject, empty `__init__.py`s, then `files` (dedented)."""
    (root / 'pyproject.toml').write_text(PYPROJECT)
    for folder in ('pkg', 'sub', 'other'):
        (root / folder).mkdir(exist_ok=True)
        (root / folder / '__init__.py').write_text('')
    for folder in ('sub', 'other'):
        if not (root / 'pkg' / folder).is_symlink():
            (root / 'pkg' / folder).symlink_to(Path('..') / folder)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def entries(root: Path) -> list[str]:
    """The baseline lines the code under `root` would have."""
    return [violation.entry for violation in limits.check(root).violations]


def function(name: str, lines: int, indent: str = '') -> str:
    """A function of exactly `lines` lines, from its `def` to its last line."""
    body = ''.join(f'{indent}    x{i} = {i}\n' for i in range(lines - 2))
    return f'{indent}def {name}():\n{body}{indent}    return None\n'


def run(root: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The script's exit status and what it printed."""
    status = limits.main(['--root', str(root), *args])
    return status, capsys.readouterr().out


# --- sizes ---------------------------------------------------------------------------------------


def test_a_module_over_500_lines(tmp_path: Path) -> None:
    tree(tmp_path, {'sub/fits.py': 'x = 1\n' * 500, 'sub/big.py': 'x = 1\n' * 501})
    assert entries(tmp_path) == ['module-lines sub/big.py 501']


def test_a_function_over_80_lines_counted_from_def_without_decorators(tmp_path: Path) -> None:
    decorated = '@staticmethod\n@staticmethod\n' + function('fits', 80)
    tree(tmp_path, {'pkg/m.py': decorated + function('long', 81)})
    assert entries(tmp_path) == ['function-lines pkg/m.py:long 81']


def test_methods_and_nested_functions_are_named_by_their_path(tmp_path: Path) -> None:
    source = (
        'class Box:\n' + function('method', 81, '    ') + function('outer', 3) + function('inner', 81, '    ')
    )
    tree(tmp_path, {'pkg/m.py': source})
    assert entries(tmp_path) == [
        'function-lines pkg/m.py:Box.method 81',
        'function-lines pkg/m.py:outer 84',
        'function-lines pkg/m.py:outer.inner 81',
    ]


def test_a_class_over_400_lines(tmp_path: Path) -> None:
    body = ''.join(function(f'm{i}', 57, '    ') for i in range(7))  # 399 lines
    tree(
        tmp_path, {'pkg/fits.py': f'class Fits:\n{body}', 'pkg/large.py': f'class Large:\n{body}    y = 1\n'}
    )
    assert entries(tmp_path) == ['class-lines pkg/large.py:Large 401']


# --- exemptions ----------------------------------------------------------------------------------


def test_exemptions_on_the_def_line_above_it_or_above_its_decorators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    on_line = function('on_line', 90).replace('():', '():  # limits: table -- one line per field', 1)
    above = '# limits: generated -- written by gen.py\n' + function('above', 90)
    decorated = '# limits: table — the codec table\n@staticmethod\n' + function('decorated', 90)
    tree(tmp_path, {'pkg/m.py': on_line + above + decorated})
    assert entries(tmp_path) == []
    status, out = run(tmp_path, '--update-baseline', capsys=capsys)
    assert status == 0
    status, out = run(tmp_path, '-v', capsys=capsys)
    assert status == 0
    assert 'pkg/m.py:1: function on_line (90 lines) exempt: one line per field' in out
    assert 'function above (90 lines) exempt: written by gen.py' in out
    assert 'function decorated (90 lines) exempt: the codec table' in out


def test_a_module_exemption_covers_the_module_and_what_is_in_it(tmp_path: Path) -> None:
    header = '"""Generated."""\n# limits: module -- generated from the Avro schemas\n'
    tree(tmp_path, {'pkg/generated.py': header + function('long', 90) + 'x = 1\n' * 500})
    assert entries(tmp_path) == []


def test_a_module_exemption_after_the_header_does_not_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = 'x = 1\n' * 20 + '# limits: module -- too late\n'
    tree(tmp_path, {'pkg/m.py': source})
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert 'pkg/m.py:21: `# limits: module` goes in the first 10 lines' in out


@pytest.mark.parametrize(
    ('comment', 'error'),
    [
        ('# limits: table', 'an exemption says why'),
        ('# limits: because -- it is long', "unknown exemption 'because'"),
    ],
)
def test_an_exemption_without_a_reason_or_kind_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], comment: str, error: str
) -> None:
    tree(tmp_path, {'pkg/m.py': f'{comment}\n' + function('long', 90)})
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert error in out


def test_an_exemption_on_no_definition_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree(tmp_path, {'pkg/m.py': 'x = 1\n# limits: table -- nothing here\n\ny = 2\n'})
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert 'pkg/m.py:2: the exemption belongs on a def or class line' in out


# --- private imports -----------------------------------------------------------------------------


def test_private_imports_across_packages_in_every_form(tmp_path: Path) -> None:
    tree(
        tmp_path,
        {
            'sub/_a.py': 'A = 1\n',
            'sub/_b.py': 'B = 1\n',
            'sub/_c.py': 'C = 1\n',
            'sub/_d.py': 'D = 1\n',
            'sub/public.py': 'P = 1\n',
            'pkg/_base.py': 'X = 1\n',
            'other/m.py': """\
                from typing import TYPE_CHECKING

                from pkg.sub._a import A
                from pkg.sub import _b
                from pkg.sub import public

                if TYPE_CHECKING:
                    from pkg.sub._c import C


                def later():
                    import pkg.sub._d
            """,
            'sub/uses_parent.py': 'from .._base import X\n',
            'sub/sibling.py': 'from pkg.sub._a import A\nfrom . import _b\n',
        },
    )
    assert entries(tmp_path) == [
        'private-import other/m.py -> pkg.sub._a',
        'private-import other/m.py -> pkg.sub._b',
        'private-import other/m.py -> pkg.sub._c',
        'private-import other/m.py -> pkg.sub._d',
        'private-import sub/uses_parent.py -> pkg._base',
    ]


def test_a_lazy_map_naming_another_packages_private_module(tmp_path: Path) -> None:
    lazy_init = """\
        from stepstream.lazy import lazy_exports

        __getattr__ = lazy_exports(__name__, {'A': 'pkg.sub._a', 'Mine': 'pkg.other._mine'})
    """
    tree(tmp_path, {'sub/_a.py': 'A = 1\n', 'other/_mine.py': 'Mine = 1\n', 'other/__init__.py': lazy_init})
    assert entries(tmp_path) == ['private-import other/__init__.py -> pkg.sub._a']


# --- circles -------------------------------------------------------------------------------------


def test_a_circle_at_module_level(tmp_path: Path) -> None:
    tree(
        tmp_path,
        {
            'pkg/a.py': 'from pkg import b\n',
            'pkg/b.py': 'import pkg.c\n',
            'pkg/c.py': 'from pkg.a import *\n',
        },
    )
    assert entries(tmp_path) == ['circle pkg.a pkg.b pkg.c']


def test_imports_that_do_not_run_at_import_close_no_circle(tmp_path: Path) -> None:
    tree(
        tmp_path,
        {
            'pkg/a.py': 'from pkg import b\n',
            'pkg/b.py': """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from pkg.a import A


                def later():
                    from pkg.a import A
            """,
        },
    )
    assert entries(tmp_path) == []


def test_a_package_and_its_modules_are_a_circle_only_if_a_module_imports_the_package(
    tmp_path: Path,
) -> None:
    files = {
        'sub/__init__.py': 'from pkg.sub._x import X\nfrom pkg.sub._y import Y\n',
        'sub/_x.py': 'from pkg.sub._y import Y\nX = 1\n',
        'sub/_y.py': 'from . import _z\nY = 1\n',
        'sub/_z.py': 'Z = 1\n',
    }
    tree(tmp_path, files)
    assert entries(tmp_path) == []
    tree(tmp_path, {**files, 'sub/_z.py': 'from pkg.sub import X\n'})
    assert entries(tmp_path) == ['circle pkg.sub pkg.sub._x pkg.sub._y pkg.sub._z']


def test_a_name_a_package_imports_lazily_is_an_import_of_its_module(tmp_path: Path) -> None:
    tree(
        tmp_path,
        {
            'sub/__init__.py': """\
                from stepstream.lazy import lazy_exports

                __getattr__ = lazy_exports(__name__, {**dict.fromkeys(('X',), 'pkg.sub._x')})
            """,
            'sub/_x.py': 'import pkg.other.m\nX = 1\n',
            'other/m.py': 'from pkg.sub import X\n',
        },
    )
    assert entries(tmp_path) == ['circle pkg.other.m pkg.sub._x']


# --- the baseline --------------------------------------------------------------------------------


def ratchet_tree(root: Path, lines: int) -> Path:
    """A tree with a long function and a private import across packages."""
    return tree(
        root, {'pkg/m.py': function('long', lines), 'sub/_a.py': '', 'other/m.py': 'import pkg.sub._a\n'}
    )


def test_the_baseline_excuses_what_it_lists_and_fails_on_growth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ratchet_tree(tmp_path, 100)
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert 'no baseline' in out
    assert 'pkg/m.py:1: function long has 100 lines (limit 80): new' in out
    assert 'other/m.py:1: imports pkg.sub._a, private to pkg.sub' in out

    status, out = run(tmp_path, '--update-baseline', capsys=capsys)
    assert status == 0
    baseline = (tmp_path / 'tools/limits-baseline.txt').read_text()
    assert 'only shrinks' in baseline and 'issue 34' in baseline
    assert baseline.endswith('function-lines pkg/m.py:long 100\nprivate-import other/m.py -> pkg.sub._a\n')
    assert run(tmp_path, capsys=capsys) == (0, '')

    ratchet_tree(tmp_path, 101)
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert 'function long has 101 lines (limit 80): grew, tools/limits-baseline.txt:8 says 100' in out
    status, out = run(tmp_path, '--update-baseline', capsys=capsys)
    assert status == 1
    assert 'grew from 100' in out
    assert 'function-lines pkg/m.py:long 100\n' in (tmp_path / 'tools/limits-baseline.txt').read_text()


def test_a_new_violation_fails_and_the_update_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ratchet_tree(tmp_path, 100)
    run(tmp_path, '--update-baseline', capsys=capsys)
    (tmp_path / 'pkg/n.py').write_text(function('another', 81))
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert (
        'pkg/n.py:1: function another has 81 lines (limit 80): new, not in tools/limits-baseline.txt' in out
    )
    status, out = run(tmp_path, '--update-baseline', capsys=capsys)
    assert status == 1
    assert 'the baseline only shrinks' in out


def test_a_shrunk_size_passes_with_a_hint_and_the_update_lowers_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ratchet_tree(tmp_path, 100)
    run(tmp_path, '--update-baseline', capsys=capsys)
    ratchet_tree(tmp_path, 90)
    status, out = run(tmp_path, capsys=capsys)
    assert status == 0
    assert 'tools/limits-baseline.txt:8: now 90: lower it from 100' in out
    assert run(tmp_path, '--update-baseline', capsys=capsys)[0] == 0
    assert 'function-lines pkg/m.py:long 90\n' in (tmp_path / 'tools/limits-baseline.txt').read_text()
    assert run(tmp_path, capsys=capsys) == (0, '')


def test_an_entry_that_no_longer_occurs_fails_until_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ratchet_tree(tmp_path, 100)
    run(tmp_path, '--update-baseline', capsys=capsys)
    ratchet_tree(tmp_path, 80)
    (tmp_path / 'other/m.py').write_text('import pkg.sub\n')
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert '`function-lines pkg/m.py:long 100` no longer occurs: remove it' in out
    assert '`private-import other/m.py -> pkg.sub._a` no longer occurs: remove it' in out
    assert run(tmp_path, '--update-baseline', capsys=capsys)[0] == 0
    assert run(tmp_path, capsys=capsys) == (0, '')
    assert not [
        line
        for line in (tmp_path / 'tools/limits-baseline.txt').read_text().splitlines()
        if line and line[0] != '#'
    ]


def test_a_malformed_baseline_line_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ratchet_tree(tmp_path, 50)
    (tmp_path / 'tools').mkdir()
    (tmp_path / 'tools/limits-baseline.txt').write_text('function-lines pkg/m.py:long\nsize pkg/m.py 3\n')
    status, out = run(tmp_path, capsys=capsys)
    assert status == 1
    assert 'tools/limits-baseline.txt:1: function-lines ends with its size in lines' in out
    assert "tools/limits-baseline.txt:2: unknown kind 'size'" in out
