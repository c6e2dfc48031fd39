"""What the run page answers at a glance: how long each step took, what it cost, what each tool got and gave.

The page is drawn from the API's own shapes (`Run`, `Event`, `ToolEffect`) plus the latest
snapshot's messages (for tool arguments and results), so it shows nothing the API does not.
Spans are placed on the run's own clock: milliseconds since its `run_started`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation

from pydantic_ai.messages import BaseToolCallPart, BaseToolReturnPart, ModelMessage, RetryPromptPart

from stepstream.schemas import PARENT_CALL_KEY
from stepstream.serve._models import Event, Run, ToolEffect
from stepstream.serve._views import ItemView, items_of, pretty


@dataclass
class ToolIO:
    """A tool call's arguments and what it returned (or the retry it asked for), from a snapshot."""

    args: str | None = None
    result: list[ItemView] = field(default_factory=list)
    retried: bool = False
    """The body asked the model to retry (`ModelRetry`): `result` is that message."""


@dataclass
class Delegate:
    """A child run on the call that started it (or that ran when it started), and how many calls may have."""

    run: Run
    calls: int
    """1: this call started it (named by the child, or the only call running); more: it started
    while this call and others ran (parallel calls) and names none of them."""


@dataclass
class Span:
    """One bar of the waterfall: a model request or a tool call."""

    kind: str
    """`model` or `tool`."""
    label: str
    start_ms: float
    """Milliseconds after the run started."""
    duration_ms: float | None
    """None while it has not ended (in flight, or never to end: its process died)."""
    status: str
    """`completed`, `failed`, `deferred` (a call that waits for a decision or a result), or for a call
    without an end its effect's doubt (`in_flight`, ...), for a request without one `in_flight`
    while its run is live, else `no_answer`."""
    seq: int
    step_index: int
    tool_call_id: str | None = None
    model_name: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_usd: str | None = None
    error: str | None = None
    io: ToolIO | None = None
    effect: ToolEffect | None = None
    ended_at_ms: float | None = None
    """Where the event that ended it stands on the run's clock (None: no end recorded)."""
    delegates: list[Delegate] = field(default_factory=list)
    """The child runs this call started, or that started while it ran (`link_delegates`)."""
    left: float = 0.0
    """Where the bar starts, in thousandths of the run's span (for the SVG's `x`)."""
    width: float = 0.0


@dataclass
class Totals:
    """The run's figures: duration, tokens, cost, and the time in model requests and tools."""

    duration_ms: float | None
    input_tokens: int
    output_tokens: int
    cost_usd: str | None
    unpriced_requests: int
    model_requests: int
    model_ms: float
    tool_calls: int
    """The calls that ended (their time is `tool_ms`)."""
    tool_failures: int
    tool_ms: float
    in_doubt: int = 0
    """Calls that started and never ended, their run not live (`unknown_after_crash`)."""
    in_flight: int = 0
    """Calls that started and have not ended yet, their run live."""
    resolved: int = 0
    """Calls that never ended, which an operator resolved (`happened` or `did_not_happen`)."""


def totals(run: Run, now: datetime, effects: list[ToolEffect]) -> Totals:
    """The run's totals (a running run's duration is up to `now`), with its calls that did not end."""
    u = run.usage
    return Totals(
        duration_ms=duration_ms(run, now),
        input_tokens=u.input_tokens,
        output_tokens=u.output_tokens,
        cost_usd=u.cost_usd,
        unpriced_requests=u.unpriced_requests,
        model_requests=u.model_requests,
        model_ms=u.model_request_us / 1000,
        tool_calls=u.tool_calls,
        tool_failures=u.tool_call_failures,
        tool_ms=u.tool_call_us / 1000,
        in_doubt=sum(e.unknown_after_crash for e in effects),
        in_flight=sum(e.in_flight for e in effects),
        resolved=sum(e.status == 'resolved' for e in effects),
    )


def duration_ms(run: Run, now: datetime) -> float | None:
    """From `run_started` to the run's end (or `now` while it runs); None without a start or an end.

    A stale run has no end and is not running on (its writer stopped speaking): no duration.
    """
    if run.started_at is None or (run.ended_at is None and run.status == 'stale'):
        return None
    end = run.ended_at or now
    return max((end - run.started_at).total_seconds() * 1000, 0.0)


def tool_io(messages: list[ModelMessage]) -> dict[str, ToolIO]:
    """Each tool call's arguments and result in a history, by tool_call_id."""
    found: dict[str, ToolIO] = {}
    for message in messages:
        for part in message.parts:
            if isinstance(part, BaseToolCallPart):
                found.setdefault(part.tool_call_id, ToolIO()).args = pretty(part.args_as_dict())
            elif isinstance(part, BaseToolReturnPart):
                found.setdefault(part.tool_call_id, ToolIO()).result = items_of(part.content)
            elif isinstance(part, RetryPromptPart) and part.tool_name is not None:
                io = found.setdefault(part.tool_call_id, ToolIO())
                content = part.content if isinstance(part.content, str) else pretty(part.content)
                io.result, io.retried = [ItemView('text', content)], True
    return found


IN_DOUBT = 'unknown_after_crash'
"""The status of a call's bar that started and will never end: its run is not live."""
NO_ANSWER = 'no_answer'
"""The status of a model request's bar that started and will never end: its run is not live."""
NEVER_ENDS = frozenset({IN_DOUBT, 'resolved', NO_ANSWER})
"""The statuses of a bar without an end that will get none: in doubt, resolved by an operator, or a
model request its run stopped waiting for."""

TOOL_ENDS = {
    'tool_call_completed': 'completed',
    'tool_call_failed': 'failed',
    'tool_call_deferred': 'deferred',
}
"""The events that end a tool call's bar, and the status each gives it."""


def waterfall(
    run: Run, events: list[Event], effects: dict[str, ToolEffect], io: dict[str, ToolIO], now: datetime
) -> list[Span]:
    """The run's model requests and tool calls as bars on its own clock, in the order they started."""
    if run.started_at is None:
        return []
    origin = run.started_at

    def ms(ts: datetime) -> float:
        return max((ts - origin).total_seconds() * 1000, 0.0)

    spans: list[Span] = []
    open_requests: dict[int, Span] = {}
    open_calls: dict[str, Span] = {}
    for ev in events:
        if ev.kind == 'model_request_started':
            span = Span('model', 'model request', ms(ev.timestamp), None, 'in_flight', ev.seq, ev.step_index)
            open_requests[ev.step_index] = span
            spans.append(span)
        elif ev.kind in ('model_request_completed', 'model_request_failed'):
            took = ev.duration_us / 1000 if ev.duration_us is not None else None
            found = open_requests.pop(ev.step_index, None)
            if found is None:  # no start recorded: place it by its end and duration
                start = ms(ev.timestamp) - (took or 0.0)
                found = Span('model', 'model request', max(start, 0.0), None, '', ev.seq, ev.step_index)
                spans.append(found)
            found.duration_ms = took if took is not None else ms(ev.timestamp) - found.start_ms
            found.status = 'completed' if ev.kind == 'model_request_completed' else 'failed'
            found.error = ev.error
            if ev.usage is not None:
                found.model_name = ev.usage.model_name
                found.label = ev.usage.model_name or 'model request'
                found.input_tokens, found.output_tokens = ev.usage.input_tokens, ev.usage.output_tokens
                found.cost_usd = ev.usage.cost_usd
        elif ev.kind == 'tool_call_started' and ev.tool_call_id is not None:
            span = _tool_span(ev, ms(ev.timestamp), effects, io)
            open_calls[ev.tool_call_id] = span
            spans.append(span)
        elif ev.kind in TOOL_ENDS and ev.tool_call_id is not None:
            call = open_calls.pop(ev.tool_call_id, None)
            if call is None and ev.kind == 'tool_call_deferred':  # deferred before it ran: an approval
                call = _tool_span(ev, ms(ev.timestamp), effects, io)
                spans.append(call)
            if call is None:
                continue
            took = ev.duration_us / 1000 if ev.duration_us is not None else None
            call.duration_ms = took if took is not None else ms(ev.timestamp) - call.start_ms
            call.ended_at_ms = ms(ev.timestamp)
            call.status = TOOL_ENDS[ev.kind]
            call.error = ev.error
    if run.status != 'running':  # a request its run stopped waiting for gets no answer now
        for request in open_requests.values():
            request.status = NO_ANSWER
    never = any(s.duration_ms is None and s.status in NEVER_ENDS for s in spans)
    _place(spans, duration_ms(run, now) or 0.0, open_tail=never)
    return spans


def link_delegates(run: Run, spans: list[Span], children: list[Run]) -> None:
    """Put each child run on the tool call of `spans` that started it.

    A child started inside one of the run's tool bodies names that call (`PARENT_CALL_KEY`) and is
    put on it alone. One that does not (started with an explicit parent, in another process, or
    written before the key existed) is placed by time, on each call whose span (from its start
    event to its end event, or open) holds the child's start; started while several calls ran
    (parallel calls) it is on each of them, said so; one whose clock puts it outside every call
    (another host's) is on none (the lineage lists it).
    """
    calls = [s for s in spans if s.kind == 'tool']
    by_id = {s.tool_call_id: s for s in calls if s.tool_call_id is not None}
    for child in children:
        named = by_id.get(child.metadata.get(PARENT_CALL_KEY, ''))
        if named is not None:
            named.delegates.append(Delegate(child, 1))
            continue
        if child.started_at is None or run.started_at is None:
            continue
        at = (child.started_at - run.started_at).total_seconds() * 1000
        during = [s for s in calls if s.start_ms <= at and (s.ended_at_ms is None or at <= s.ended_at_ms)]
        for call in during:
            call.delegates.append(Delegate(child, len(during)))


def siblings(run: Run, conversation: list[Run], children: list[Run]) -> list[Run]:
    """The other runs of the run's conversation: not the run itself, its parent, or its children."""
    apart = {run.run_id, run.parent_run_id, *(c.run_id for c in children)}
    return [r for r in conversation if r.run_id not in apart and r.parent_run_id != run.run_id]


def _tool_span(ev: Event, start_ms: float, effects: dict[str, ToolEffect], io: dict[str, ToolIO]) -> Span:
    """A tool call's bar from its first event: in flight (or in doubt) until an end says otherwise."""
    call = ev.tool_call_id or ''
    effect = effects.get(call)
    status = 'in_flight'
    if effect is not None and effect.unknown_after_crash:
        status = IN_DOUBT
    elif effect is not None and effect.status == 'resolved':  # never ended; an operator answered
        status = 'resolved'
    return Span(
        'tool',
        ev.tool_name or 'tool',
        start_ms,
        None,
        status,
        ev.seq,
        ev.step_index,
        tool_call_id=ev.tool_call_id,
        io=io.get(call),
        effect=effect,
    )


def json_text(text: str | None) -> str:
    """Stored JSON text (a deferred call's arguments, metadata) indented for a person; as is if not JSON."""
    if text is None:
        return '—'
    try:
        return pretty(json.loads(text))
    except ValueError:
        return text


OPEN_TAIL = 100.0
"""Thousandths of the waterfall's width kept past the run's last known moment when a call is in
doubt: its open bar runs into them, so one that started just before the crash is still seen."""


def _place(spans: list[Span], run_ms: float, *, open_tail: bool = False) -> None:
    """Each bar's offset and width in thousandths of the waterfall: an open bar runs to its right edge.

    The run's clock (its end, `now` while it runs, or its last known moment) fills the width, less
    `OPEN_TAIL` with `open_tail`.
    """
    total = max([run_ms, *(s.start_ms + (s.duration_ms or 0.0) for s in spans), 0.001])
    scale = (1000 - (OPEN_TAIL if open_tail else 0.0)) / total
    for s in spans:
        end = (s.start_ms + s.duration_ms) * scale if s.duration_ms is not None else 1000.0
        s.left = round(s.start_ms * scale, 2)
        s.width = round(max(end - s.left, 2.0), 2)  # a sliver stays visible


def money(cost_usd: str | None, unpriced: int = 0) -> str:
    """A cost for a person: `$0.0012`, `—` when nothing was priced, `+?` when some was not."""
    if cost_usd is None:
        return '—'
    try:
        value = Decimal(cost_usd)
    except InvalidOperation:
        return cost_usd
    return f'${value:.4f}' + ('+?' if unpriced else '')


def millis(value: float | None) -> str:
    """A duration for a person: `12.3 ms`, `1.45 s`, `2 min 5 s`; `—` when unknown."""
    if value is None:
        return '—'
    if value < 1000:
        return f'{value:.1f} ms'
    if value < 60_000:
        return f'{value / 1000:.2f} s'
    minutes, seconds = divmod(value / 1000, 60)
    return f'{minutes:.0f} min {seconds:.0f} s'
