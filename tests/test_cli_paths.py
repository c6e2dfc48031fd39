"""Every flag that names a place is checked before any work: a missing path, or a file where a
folder is wanted, is exit 2 naming the flag, the path and what to give instead (issue 51)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from stepstream.cli._common import program
from stepstream.cli._main import main

pytestmark = pytest.mark.fast


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working folder, no stack in it, no STEPSTREAM_* variable: only the flags count."""
    for variable in [v for v in os.environ if v.startswith('STEPSTREAM_')]:
        monkeypatch.delenv(variable)
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'a-file').write_text('not a folder')
    (tmp_path / 'empty').mkdir()
    return tmp_path


Case = Callable[[Path], tuple[list[str], list[str]]]
"""The folder -> (argv, what the error must say)."""

CASES: dict[str, Case] = {
    'rebuild --like missing': lambda d: (
        ['rebuild', '--into', str(d / 'new'), '--like', str(d / 'missing')],
        [f'--like {d / "missing"}: no such folder', 'the folder of a projection whose options to copy'],
    ),
    'rebuild --like not a projection': lambda d: (
        ['rebuild', '--into', str(d / 'new'), '--like', str(d / 'empty')],
        [f'--like {d / "empty"} holds no projection'],
    ),
    'rebuild --into a file': lambda d: (
        ['rebuild', '--into', str(d / 'a-file')],
        [f'--into {d / "a-file"} is a file, not a folder', 'a new or empty folder'],
    ),
    'rebuild --into a missing folder': lambda d: (
        ['rebuild', '--into', str(d / 'typo' / 'new')],
        [f'--into {d / "typo" / "new"}: the folder {d / "typo"} does not exist; create it first'],
    ),
    'verify a missing projection': lambda d: (
        ['verify', str(d / 'missing'), str(d / 'empty')],
        [f'verify LEFT {d / "missing"}: no such folder', 'give two projection folders'],
    ),
    'verify a folder with no projection': lambda d: (
        ['verify', str(d / 'empty'), str(d / 'missing')],
        [f'verify LEFT {d / "empty"} holds no projection'],
    ),
    'export --out in a missing folder': lambda d: (
        ['export', '--out', str(d / 'typo' / 'out')],
        [f'--out {d / "typo" / "out"}: the folder {d / "typo"} does not exist', 's3://BUCKET/PREFIX'],
    ),
    'export --out a file': lambda d: (
        ['export', '--out', str(d / 'a-file')],
        [f'--out {d / "a-file"} is a file, not a folder'],
    ),
    '--db-path missing': lambda d: (
        ['runs', '--db-path', str(d / 'missing')],
        [
            f'no projection at {d / "missing"} (--db-path or STEPSTREAM_DB_PATH): no such folder',
            '--stack-dir',
        ],
    ),
    'audit verify --trusted-keys missing': lambda d: (
        ['audit', 'verify', '--all', '--trusted-keys', str(d / 'keys')],
        [f'--trusted-keys {d / "keys"}: no such file or folder', 'a PEM file, or a folder of .pem files'],
    ),
    'audit verify --checkpoint missing': lambda d: (
        ['audit', 'verify', '--all', '--trusted-keys', str(d / 'a-file'), '--checkpoint', str(d / 'cp')],
        [f'--checkpoint {d / "cp"}: no such file', '`stepstream audit checkpoint --out FILE`'],
    ),
    'audit key --new in a missing folder': lambda d: (
        ['audit', 'key', '--new', str(d / 'typo' / 'key.pem')],
        [f'--new {d / "typo" / "key.pem"}: the folder {d / "typo"} does not exist'],
    ),
    'audit key --new over a file': lambda d: (
        ['audit', 'key', '--new', str(d / 'a-file')],
        [f'--new {d / "a-file"} exists; it is never written over'],
    ),
    'stack up --stack-dir in a missing folder': lambda d: (
        ['stack', 'up', '--stack-dir', str(d / 'typo' / '.stepstream')],
        [f'--stack-dir {d / "typo" / ".stepstream"}: the folder {d / "typo"} does not exist'],
    ),
    'demo --stack-dir a file': lambda d: (
        ['demo', '--stack-dir', str(d / 'a-file')],
        [f'--stack-dir {d / "a-file"} is a file, not a folder', 'give a folder to keep the stack in'],
    ),
    '--ssl-cafile missing': lambda d: (
        [
            'runs',
            '--security-protocol',
            'SSL',
            '--ssl-cafile',
            str(d / 'ca.pem'),
            '--db-path',
            str(d / 'empty'),
        ],
        [f'--ssl-cafile (STEPSTREAM_SSL_CAFILE) {d / "ca.pem"}: no such file', "brokers' certificates"],
    ),
    '--s3-cafile a folder': lambda d: (
        ['runs', '--s3-endpoint', 'https://s3.example', '--s3-cafile', str(d / 'empty')],
        [f'--s3-cafile (STEPSTREAM_S3_CAFILE) {d / "empty"} is a folder, not a file'],
    ),
    '--schema-registry-cafile missing': lambda d: (
        [
            'runs',
            '--schema-registry-url',
            'https://registry.example',
            '--schema-registry-cafile',
            str(d / 'ca.pem'),
        ],
        [f'--schema-registry-cafile (STEPSTREAM_SCHEMA_REGISTRY_CAFILE) {d / "ca.pem"}: no such file'],
    ),
}


@pytest.mark.parametrize('case', CASES)
def test_a_flag_naming_a_missing_or_wrong_place_is_a_usage_error_saying_so(
    case: str, here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, said = CASES[case](here)
    before = sorted(here.rglob('*'))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == '' and 'Traceback' not in err
    for words in said:
        assert words in err, err
    assert sorted(here.rglob('*')) == before  # nothing made on the way


def test_a_checkpoint_goes_into_an_existing_folder(
    here: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(['audit', 'key', '--new', str(here / 'key.pem')]) == 0  # a place that is right works
    assert (here / 'key.pem').stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv('STEPSTREAM_SIGNING_KEY_FILE', str(here / 'key.pem'))
    capsys.readouterr()
    assert main(['audit', 'checkpoint', '--out', str(here / 'typo' / 'cp.json')]) == 2
    assert (
        f'--out {here / "typo" / "cp.json"}: the folder {here / "typo"} does not exist'
        in capsys.readouterr().err
    )
    assert main(['audit', 'checkpoint', '--out', str(here / 'a-file')]) == 2
    assert f'--out {here / "a-file"} exists; it is never written over' in capsys.readouterr().err


def test_a_printed_command_is_typed_as_this_program_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make run` prints commands to paste: `stepstream` when the PATH finds this very program,
    else its path (`.venv/bin/stepstream` from the checkout), never a name the shell cannot find."""
    bin_dir = tmp_path / '.venv' / 'bin'
    bin_dir.mkdir(parents=True)
    me = bin_dir / 'stepstream'
    me.write_text('#!/bin/sh\n')
    me.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert program(str(me), path='/usr/bin') == '.venv/bin/stepstream'  # not on the PATH
    assert program('.venv/bin/stepstream', path='/usr/bin') == '.venv/bin/stepstream'
    assert program(str(me), path=str(bin_dir)) == 'stepstream'  # an activated venv
    other = tmp_path / 'elsewhere'
    other.mkdir()
    monkeypatch.chdir(other)
    assert program(str(me), path='/usr/bin') == str(me)  # outside the folder: the whole path
    assert program('/x/stepstream/cli/__main__.py') == 'stepstream'  # python -m stepstream.cli
