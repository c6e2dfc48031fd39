"""A clean install: building stepstream prints no packaging warnings, and the wheel holds its data.

`make run` and `make test` install the project editable (`pip install -e .`), the compose image
installs its wheel. Setuptools warns when a folder of data files inside a package is not declared
as a package, and notes a meta-path finder when the layout needs one; either is a wall of text a
new user reads before the demo. Both builds run here through the PEP 517/660 hooks, with every
warning shown, over a copy of the tracked tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.broker, pytest.mark.once]

ROOT = Path(__file__).resolve().parent.parent

DATA = (
    'stepstream/py.typed',
    'stepstream/schemas/avro/step_event.v6.avsc',
    'stepstream/serve/templates/run.html',
    'stepstream/embedded/kafka/pom.xml',
)
"""Data files the installed package needs (schemas, explorer templates, the embedded Kafka's pom)."""


def _tracked_copy(destination: Path) -> Path:
    """The files git tracks (and new ones it does not ignore), links kept as links."""
    listed = subprocess.run(
        ['git', 'ls-files', '-co', '--exclude-standard', '-z'], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split('\0')):
        source, target = ROOT / name, destination / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        else:
            shutil.copy2(source, target)
    return destination


def _build(tree: Path, hook: str, out: Path) -> tuple[str, Path]:
    """Run a setuptools build hook in `tree` with every warning shown: its output, and the wheel."""
    out.mkdir()
    code = f'import setuptools.build_meta as b; print(b.{hook}({str(out)!r}))'
    done = subprocess.run(
        [sys.executable, '-W', 'always', '-c', code], cwd=tree, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    return done.stderr, wheel


@pytest.mark.parametrize('hook', ['build_wheel', 'build_editable'])
def test_the_build_prints_no_warning(tmp_path: Path, hook: str) -> None:
    tree = _tracked_copy(tmp_path / 'tree')
    output, wheel = _build(tree, hook, tmp_path / 'dist')
    warnings = [line for line in output.splitlines() if 'Warning' in line or 'Editable installation' in line]
    assert warnings == [], '\n'.join(warnings)
    names = set(zipfile.ZipFile(wheel).namelist())
    if hook == 'build_wheel':
        assert set(DATA) <= names, sorted(set(DATA) - names)
        assert 'stepstream/producer/_capability.py' in names
    else:  # a .pth naming the tree: the links in stepstream/ make it the package, data and all
        pth = next(n for n in names if n.endswith('.pth'))
        assert zipfile.ZipFile(wheel).read(pth).decode().strip() == str(tree.resolve())
        assert all((tree / name).is_file() for name in DATA)
