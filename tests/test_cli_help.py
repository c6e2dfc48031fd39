"""What the command line prints before it does anything: a short usage error, a `--help` with the
settings in their own group, and `stepstream help settings` in full (issue 51)."""

from __future__ import annotations

import pytest

from stepstream.cli._main import main
from stepstream.settings import ENV_PREFIX, SECRET_FIELDS, SETTING_NAMES

pytestmark = pytest.mark.fast


def exits(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the command in this process up to argparse's exit: its code, stdout and stderr."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


@pytest.mark.parametrize(
    ('argv', 'error'),
    [
        (['replay'], 'stepstream replay: error: the following arguments are required: --agent'),
        (['runs', '--bogus'], 'stepstream runs: error: unrecognized arguments: --bogus'),
        (['events'], 'stepstream events: error: the following arguments are required: run_id'),
        (
            ['deferred', '--kind', 'nope'],
            "stepstream deferred: error: argument --kind: invalid choice: 'nope'",
        ),
        (
            ['conversation', 'title'],
            'stepstream conversation title: error: the following arguments are required',
        ),
        (
            ['stack', 'up', '--broker', 'nope'],
            'stepstream stack up: error: argument --broker: invalid choice',
        ),
        (['resolve'], 'stepstream resolve: error: the following arguments are required'),
    ],
)
def test_a_usage_error_is_the_commands_own_usage_and_the_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    code, out, err = exits(capsys, *argv)
    lines = err.splitlines()
    assert code == 2 and out == ''
    assert len(lines) <= 10, err
    assert lines[0].startswith(f'usage: stepstream {" ".join(a for a in argv if not a.startswith("-"))[:5]}')
    assert lines[-1].startswith(error)
    assert '[settings]' in err and '--bootstrap-servers' not in err and 'STEPSTREAM_' not in err


def test_help_lists_the_settings_in_their_own_group(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = exits(capsys, 'runs', '--help')
    assert code == 0
    usage, _, rest = out.partition('\n\n')
    assert '[settings]' in usage and '--db-path' not in usage
    groups = rest.split('\n\n')
    [settings] = [group for group in groups if group.startswith('settings (')]
    assert 'stepstream help settings' in settings.splitlines()[0]
    flags = {f'--{name.replace("_", "-")}' for name in SETTING_NAMES - SECRET_FIELDS}
    assert all(flag in settings for flag in flags)
    assert '--status' not in settings and '--bootstrap-servers' not in rest.replace(settings, '')


def test_help_settings_lists_every_setting_with_its_variable_and_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(['help', 'settings']) == 0
    out = capsys.readouterr().out
    for name in SETTING_NAMES:
        variable = ENV_PREFIX + name.upper()
        flag = f'--{name.replace("_", "-")}, {variable}  '
        [line] = [line for line in out.splitlines() if line.strip().startswith((f'{variable} or ', flag))]
        assert variable in line and '(default: ' in line
        if name in SECRET_FIELDS:
            assert '--' not in line and f'{variable}_FILE' in line  # a secret is never a flag
    assert '--db-path, STEPSTREAM_DB_PATH  (default: .stepstream/projection)' in out
    assert '--partitions, STEPSTREAM_PARTITIONS  (default: 6)' in out


def test_help_names_a_command_or_the_whole_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = exits(capsys, 'help', 'events')
    assert code == 0 and out.startswith('usage: stepstream events ') and "List a run's events" in out
    code, out, _ = exits(capsys, 'help')
    assert code == 0 and out.startswith('usage: stepstream ') and 'Exit codes' in out
    code, _, err = exits(capsys, 'help', 'nonsense')
    assert code == 2 and "invalid choice: 'nonsense'" in err
