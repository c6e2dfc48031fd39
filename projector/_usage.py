"""A step event's schema v3 fields (usage, durations, trace context): bounds and sums.

What values a record may carry there, and how a run's sums grow with them. The bounds keep the
sums exact and in range whatever the log holds: `check_usage` sends a record outside them to the
DLQ (`invalid`), and `add_usage` adds an accepted one to its run's sums, in any order with the
same result.
"""

from __future__ import annotations

import re
from decimal import Context, Decimal, InvalidOperation

from stepstream.projector._batch import Rejected
from stepstream.schemas import Fields
from stepstream.storage import RunState

TIMED_KINDS = frozenset(
    {'model_request_completed', 'model_request_failed', 'tool_call_completed', 'tool_call_failed'}
)
"""The kinds that may carry a `duration_us` (schema v3)."""

MAX_COUNT = 1 << 40
"""The most tokens, requests or microseconds one event may report: more is a garbled record, and
per-run sums of values below it stay far inside a signed 64-bit integer (Parquet, DuckDB)."""

MAX_COST_USD = Decimal(10**9)
"""The most one model request may cost: more is a garbled record."""

_COST_PLACES = 30
"""The most decimal places a cost may have: with them, `_SUMS` adds costs exactly."""
_SUMS = Context(prec=200)

_TOKEN_FIELDS = ('input_tokens', 'output_tokens', 'cache_read_tokens', 'cache_write_tokens', 'requests')
_HEX_ID = {'trace_id': re.compile(r'[0-9a-f]{32}'), 'span_id': re.compile(r'[0-9a-f]{16}')}


def check_usage(event: Fields) -> None:
    """The schema v3 fields: where they may appear and what values a sum can take."""
    kind, usage, duration = event['kind'], event['usage'], event['duration_us']
    if usage is not None:
        if kind != 'model_request_completed':
            raise Rejected('invalid', f'usage belongs to model_request_completed events, not {kind}')
        for name in _TOKEN_FIELDS:
            if not 0 <= usage[name] < MAX_COUNT:
                raise Rejected('invalid', f'usage {name} {usage[name]} is outside [0, {MAX_COUNT})')
        cost = usage['cost_usd']
        if cost is not None and _cost(cost) is None:
            raise Rejected(
                'invalid', f'usage cost_usd {cost[:100]!r} is not a decimal in [0, {MAX_COST_USD}]'
            )
    if duration is not None:
        if kind not in TIMED_KINDS:
            raise Rejected('invalid', f'duration_us belongs to model request and tool call ends, not {kind}')
        if not 0 <= duration < MAX_COUNT:
            raise Rejected('invalid', f'duration_us {duration} is outside [0, {MAX_COUNT})')
    for name, pattern in _HEX_ID.items():
        value = event[name]
        if value is not None and pattern.fullmatch(value) is None:
            raise Rejected('invalid', f'{name} {value[:100]!r} is not {pattern.pattern} (W3C trace context)')


def _cost(text: str) -> Decimal | None:
    """A cost as the log carries it (decimal text), or None when it is not one we can sum."""
    if len(text) > 64:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite() or not 0 <= value <= MAX_COST_USD or value.as_tuple().exponent < -_COST_PLACES:  # type: ignore[operator]
        return None
    return value


def add_usage(run: RunState, event: Fields) -> None:
    """Add a model request's or a tool call's end to the run's sums (commutative: order is moot).

    Costs are summed as decimals, exactly (no rounding: a checked cost is below `MAX_COST_USD`
    with at most `_COST_PLACES` places, far inside the sum's precision), so every order of one
    run's events gives the same total.
    """
    sums, kind, duration = run.usage, event['kind'], event['duration_us']
    if kind.startswith('model_request'):
        if kind == 'model_request_completed':
            sums['model_requests'] = sums.get('model_requests', 0) + 1
            usage = event['usage']
            if usage is not None:
                for name in _TOKEN_FIELDS:
                    if usage[name]:
                        sums[name] = sums.get(name, 0) + usage[name]
            cost = None if usage is None or usage['cost_usd'] is None else _cost(usage['cost_usd'])
            if cost is None:
                sums['unpriced_requests'] = sums.get('unpriced_requests', 0) + 1
            else:
                total = cost if run.cost_usd is None else _SUMS.add(Decimal(run.cost_usd), cost)
                run.cost_usd = format(total, 'f')
        if duration is not None:
            sums['model_request_us'] = sums.get('model_request_us', 0) + duration
        return
    sums['tool_calls'] = sums.get('tool_calls', 0) + 1
    if kind == 'tool_call_failed':
        sums['tool_call_failures'] = sums.get('tool_call_failures', 0) + 1
    if duration is not None:
        sums['tool_call_us'] = sums.get('tool_call_us', 0) + duration
