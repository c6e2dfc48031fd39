"""Help that stays short where it must: a usage line without the shared settings, and `help settings`.

Every command takes the same settings flags (one per `Settings` field, decision 0055). Listed in each
usage line they made a usage error about forty lines long; so a usage line shows them as one
`[settings]`, `--help` lists them in their own group, and `stepstream help settings` lists each
with its variable, its default and what it is for.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from stepstream.cli._common import EXIT_OK

SETTINGS_TOPIC = 'settings'
"""`stepstream help settings`: every setting, its flag, variable and default."""

_SETTINGS = argparse.Action(option_strings=['settings'], dest='settings', nargs=0, required=False)
"""What a usage line shows in place of the settings flags (a stand-in, never parsed)."""


class ShortUsage(argparse.HelpFormatter):
    """A command's usage line with its own arguments, and `[settings]` for the shared settings flags."""

    def add_usage(
        self,
        usage: str | None,
        actions: Iterable[argparse.Action],
        groups: Iterable[Any],
        prefix: str | None = None,
    ) -> None:
        """The usage of `actions`, each settings flag left out and `[settings]` after `-h` instead."""
        from stepstream.settings import SETTING_NAMES

        listed = list(actions)
        own = [action for action in listed if action.dest not in SETTING_NAMES]
        if len(own) < len(listed):
            at = next((i + 1 for i, a in enumerate(own) if isinstance(a, argparse._HelpAction)), 0)
            own.insert(at, _SETTINGS)
        super().add_usage(usage, own, groups, prefix)


SETTINGS_GROUP = (
    'settings (each flag overrides its STEPSTREAM_* variable; defaults: `stepstream help settings`)'
)
"""The title of the settings flags' group in a command's `--help`."""


def add_help(sub: Any) -> None:
    """Declare `stepstream help [settings | COMMAND ...]`."""
    helper = sub.add_parser(
        'help',
        help="Show the settings every command takes (`help settings`), or a command's help (`help runs`).",
        description='`help settings`: every setting with its flag, its STEPSTREAM_* variable and its '
        "default; `help COMMAND`: that command's --help.",
    )
    helper.add_argument(
        'topic', nargs='*', metavar='TOPIC', help='`settings`, or a command (`runs`, `stack up`, ...)'
    )
    helper.set_defaults(helper=show_help)


def show_help(topic: Sequence[str], main: Callable[[Sequence[str]], int]) -> int:
    """`stepstream help TOPIC`: the settings in full, or the command's `--help` (through `main`)."""
    if list(topic) == [SETTINGS_TOPIC]:
        print(settings_text())
        return EXIT_OK
    return main([*topic, '--help'])  # argparse prints that help and exits 0 (an unknown command: 2)


def settings_text() -> str:
    """Every setting, by section: its flag and variable, its default, and what it is for.

    A secret has no flag (a command line shows in `ps` and in shell history): it is read from its
    variable, or from the file its `_FILE` variable names.
    """
    from stepstream.settings import ENV_PREFIX, FILE_SUFFIX, SECRET_FIELDS, SECTIONS
    from stepstream.shapes import field_docs

    lines = [
        'Every command takes these settings. Each is read from its STEPSTREAM_* variable (or, in a folder',
        'with a running stack, from the stack); a flag given on the command line wins.',
    ]
    for section, cls in SECTIONS.items():
        lines += ['', f'{section}: {(cls.__doc__ or "").strip().splitlines()[0]}']
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            variable = ENV_PREFIX + f.name.upper()
            if f.name in SECRET_FIELDS:
                how = f'{variable} or {variable}{FILE_SUFFIX} (a secret: no flag)'
            else:
                how = f'--{f.name.replace("_", "-")}, {variable}'
            lines.append(f'  {how}  (default: {_default(f)})')
            lines += textwrap.wrap(
                docs.get(f.name, ''), width=96, initial_indent=' ' * 6, subsequent_indent=' ' * 6
            )
    return '\n'.join(lines)


def _default(f: dataclasses.Field[Any]) -> str:
    """A field's default as a user would type it (`none` for unset)."""
    value = f.default if f.default is not dataclasses.MISSING else None
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    return 'none' if value is None else str(value)
