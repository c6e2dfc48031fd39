"""The console: what a terminal shows of the read model, each view's query and its text or JSON.

`show(name, args, reader, settings)` runs one view (`runs`, `tree`, `events`, `snapshot`,
`effects`, `unresolved`, `deferred`, `conversations`, `conflicts`); `timeline` puts a run's resolutions and
decisions among its events, for `events` and the explorer's run page. The CLI runs a view over a
projection it opens, the read service (`stepstream serve`) runs it for a CLI that asks over
HTTP; the renderers beside it
(tables, trees, histories, status) are shared by the CLI and the demo. Names are imported on
first use, so a CLI that only asks the service never loads the read model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.console._args import VIEW_HEADER, ViewArgs
    from stepstream.console._conversations import conversations
    from stepstream.console._fit import time_text
    from stepstream.console._render import (
        effects_table,
        events_table,
        runs_table,
        to_json,
        tree,
        waits_for,
    )
    from stepstream.console._status import preview_text, retention_text, status_json, status_text, sweep_text
    from stepstream.console._timeline import Answer, other_topic_seqs, seq_note, timeline
    from stepstream.console._views import VIEWS, runs_after, show

_RENDER = 'stepstream.console._render'
_STATUS = 'stepstream.console._status'
_WHERE = {
    'Answer': 'stepstream.console._timeline',
    'VIEW_HEADER': 'stepstream.console._args',
    'VIEWS': 'stepstream.console._views',
    'ViewArgs': 'stepstream.console._args',
    'conversations': 'stepstream.console._conversations',
    'effects_table': _RENDER,
    'events_table': _RENDER,
    'other_topic_seqs': 'stepstream.console._timeline',
    'preview_text': _STATUS,
    'retention_text': _STATUS,
    'runs_after': 'stepstream.console._views',
    'runs_table': _RENDER,
    'seq_note': 'stepstream.console._timeline',
    'show': 'stepstream.console._views',
    'status_json': _STATUS,
    'status_text': _STATUS,
    'sweep_text': _STATUS,
    'time_text': 'stepstream.console._fit',
    'timeline': 'stepstream.console._timeline',
    'to_json': _RENDER,
    'tree': _RENDER,
    'waits_for': _RENDER,
}

__all__ = [
    'VIEWS',
    'VIEW_HEADER',
    'Answer',
    'ViewArgs',
    'conversations',
    'effects_table',
    'events_table',
    'other_topic_seqs',
    'preview_text',
    'retention_text',
    'runs_after',
    'runs_table',
    'seq_note',
    'show',
    'status_json',
    'status_text',
    'sweep_text',
    'time_text',
    'timeline',
    'to_json',
    'tree',
    'waits_for',
]

__getattr__ = lazy_exports(__name__, _WHERE)
