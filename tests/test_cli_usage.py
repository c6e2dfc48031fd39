"""The command line before it reaches a service: help, version, secrets, exit codes, and what it
says when the broker address is wrong (no broker needed, so this module runs once)."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest

from stepstream import Settings
from stepstream.cli._main import _parser

pytestmark = pytest.mark.once

STEPSTREAM = str(Path(sys.executable).parent / 'stepstream')


async def run(*args: str, env: dict[str, str] | None = None, cwd: Path) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        STEPSTREAM,
        *args,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f'{name} {k}': v for k, v in subparsers(sub).items()})
    return found


@pytest.mark.fast
def test_every_command_and_flag_says_what_it_is_for() -> None:
    commands = subparsers(_parser())
    assert not [name for name in commands if name.startswith('_')]  # nothing internal to stumble on
    for name, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f'{name} {action.option_strings or action.dest} has no help'


@pytest.mark.broker
async def test_version_and_help(tmp_path: Path) -> None:
    code, out, _ = await run('--version', cwd=tmp_path)
    assert code == 0 and out.startswith('stepstream ')
    code, out, _ = await run('--help', cwd=tmp_path)
    assert code == 0 and 'stack' in out and 'Exit codes' in out and 'demo-delegate' not in out


@pytest.mark.broker
async def test_a_usage_error_names_the_subcommand_and_the_closest_flag(tmp_path: Path) -> None:
    code, _, err = await run('runs', '--statu', 'stale', cwd=tmp_path)
    assert code == 2 and err.startswith('usage: stepstream runs ')
    assert (
        'stepstream runs: error: unrecognized arguments: --statu stale (--statu: did you mean --status?)'
        in err
    )
    code, _, err = await run('runs', '--bogus', cwd=tmp_path)
    assert code == 2 and 'stepstream runs: error: unrecognized arguments: --bogus' in err


@pytest.mark.broker
async def test_the_secret_key_is_never_a_flag(tmp_path: Path) -> None:
    code, _, err = await run('runs', '--s3-secret-access-key', 'hunter2', cwd=tmp_path)
    assert code == 2 and 'unrecognized arguments' in err
    assert '--s3-secret-access-key' not in (await run('runs', '--help', cwd=tmp_path))[1]
    secret = tmp_path / 'secret'
    secret.write_text('from-a-file\n')
    from_env = Settings.from_env({'STEPSTREAM_S3_SECRET_ACCESS_KEY_FILE': str(secret)})
    assert from_env.media.s3_secret_access_key is not None
    assert from_env.media.s3_secret_access_key.get_secret_value() == 'from-a-file'
    assert 'from-a-file' not in repr(from_env)
    with pytest.raises(ValueError, match=r'STEPSTREAM_S3_SECRET_ACCESS_KEY_FILE=.* cannot be read'):
        Settings.from_env({'STEPSTREAM_S3_SECRET_ACCESS_KEY_FILE': str(tmp_path / 'missing')})


@pytest.mark.broker
async def test_a_wrong_broker_address_says_what_is_wrong(tmp_path: Path) -> None:
    async def attempt(servers: str) -> str:
        env = {'STEPSTREAM_BOOTSTRAP_SERVERS': servers, 'STEPSTREAM_ACK_TIMEOUT_S': '2'}
        code, _, err = await run('topics', 'ensure', env=env, cwd=tmp_path)
        assert code == 3, err
        assert 'within' not in err and 'Unable connect' not in err  # one message, ours
        return err

    assert "the host name 'no-such-host.invalid' does not resolve" in await attempt(
        'no-such-host.invalid:9092'
    )

    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    assert f'nothing listens on 127.0.0.1:{port} (connection refused)' in await attempt(f'127.0.0.1:{port}')

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b'HTTP/1.1 400 Bad Request\r\n\r\n')
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http, '127.0.0.1', 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        err = await attempt(f'127.0.0.1:{port}')
    assert f'the service on 127.0.0.1:{port} accepts connections but does not answer a Kafka request' in err


@pytest.mark.broker
async def test_a_stack_dir_that_holds_no_running_stack_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    """`--stack-dir` names a place: missing, or no stack there, is exit 2 with the path and the fix,
    never the projection of whatever folder the command runs in (issue 51)."""
    (tmp_path / '.stepstream' / 'projection').mkdir(parents=True)  # a checkout's own, not to be read
    missing = tmp_path / 'does-not-exist'
    code, out, err = await run('runs', '--stack-dir', str(missing), cwd=tmp_path)
    assert (code, out) == (2, '')
    assert f'no stack is running under {missing} (no such folder)' in err
    assert f'`stepstream stack up --stack-dir {missing}`' in err
    stopped = tmp_path / 'stopped'
    (stopped / 'projection').mkdir(parents=True)
    code, _, err = await run('events', 'some-run', f'--stack-dir={stopped}', cwd=tmp_path)
    assert code == 2 and 'no stack was started there' in err
    assert f'read its projection as it stands with --db-path {stopped / "projection"}' in err


@pytest.mark.broker
async def test_no_projection_at_the_default_path_says_it_is_the_default_and_how_to_point_elsewhere(
    tmp_path: Path,
) -> None:
    code, out, err = await run('runs', cwd=tmp_path)
    assert (code, out) == (2, '')
    assert 'no projection at .stepstream/projection, the default --db-path' in err and str(tmp_path) in err
    assert '--db-path DIR (or STEPSTREAM_DB_PATH)' in err and '`stepstream stack up`' in err
    code, _, err = await run('runs', '--db-path', str(tmp_path / 'elsewhere'), cwd=tmp_path)
    assert code == 2 and f'no projection at {tmp_path / "elsewhere"}' in err and 'default' not in err
