"""The record-level rules: what a record must be to apply, whatever the projection's state.

A record that breaks one raises `Rejected` with its dead-letter reason (`DLQ_REASONS` in
`_apply.py`): no value or no key, not a record of its topic (`read_record`, in
`schemas/_plain.py`, gives the reasons for bytes that do not decode), an invalid id, a key or
partition that is not its run's, or fields no writer makes (docs/decisions/0010-conflict-rules.md).
The state rules (seqs, ownership, snapshots, tool effects) come after these, in the applier.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from stepstream.erasure import (
    MAX_SEALED_TITLE_CHARS,
    ErasureError,
    is_sealed_text,
    sealed_chars,
    split_sealed_text,
)
from stepstream.errors import SchemaError
from stepstream.ids import MAX_ID_BYTES, OTHER_ID_FIELDS, check_record_ids, is_plain_id, is_run_id
from stepstream.media import is_media_uri
from stepstream.projector._batch import EVENTS, Rejected, RunKeys, SourceRecord
from stepstream.projector._usage import check_usage
from stepstream.schemas import (
    ARCHIVED_KEY,
    DECISIONS,
    DEFERRALS,
    EVENT_KINDS,
    MAX_NOTE_CHARS,
    MAX_TITLE_CHARS,
    RECORD_TYPES,
    RESOLUTIONS,
    RESUMED_BY_KEY,
    TITLE_KEY,
    TOOL_EFFECT_STATUSES,
    Fields,
    read_record,
)

_RESOLUTION_FIELDS = ('resolution', 'resolved_by', 'note', 'result')

# -- reading records into plain values ---------------------------------------------------------


_ENVELOPE_IDS = ('writer_id', 'conversation_id', 'agent_name', 'parent_run_id')
_CALL_IDS = ('tool_call_id', 'tool_name')
assert {*_ENVELOPE_IDS, *_CALL_IDS} == {*OTHER_ID_FIELDS, 'parent_run_id'}


def _ids_plainly_valid(fields: Fields, keys: RunKeys) -> bool:
    """The common case of `check_record_ids` (`is_plain_id`), without raising; False if unsure.

    The run id is checked against the key. A run's records share their envelope, so it is
    checked once per key and batch, and again only where it changes.
    """
    writer_id, conversation_id = fields['writer_id'], fields['conversation_id']
    agent_name, parent = fields['agent_name'], fields['parent_run_id']
    envelope = (writer_id, conversation_id, agent_name, parent)
    if envelope != keys.envelope:
        if not (
            is_plain_id(writer_id)
            and is_plain_id(conversation_id)
            and is_plain_id(agent_name)
            and (parent is None or is_run_id(parent))
        ):
            return False
        keys.envelope = envelope
    call, tool = fields['tool_call_id'], fields['tool_name']
    return (call is None or is_plain_id(call)) and (tool is None or is_plain_id(tool))


def check_record(source: SourceRecord, keys: RunKeys, topics: tuple[str, str], partitions: int) -> Fields:
    """The record's plain fields, or `Rejected` when it cannot apply whatever the state.

    `keys` are its key's (`RunKeys`, made once per key and batch); `topics` and `partitions`
    are the applier's, named in the reasons.
    """
    if source.value is None:
        raise Rejected('tombstone', 'a record with no value (a tombstone) on a log topic')
    if source.key is None:
        raise Rejected('no_key', 'a record with no key: log records are keyed by their run_id')
    if source.unreadable is not None:
        raise Rejected(source.unreadable.reason, str(source.unreadable))
    try:
        topic, record = read_record(source.value)
    except SchemaError as exc:
        raise Rejected(exc.reason, str(exc)) from None
    if topic != source.topic:
        raise Rejected('wrong_topic', f'a {RECORD_TYPES[topic]} on the {topics[source.topic]} topic')
    run_id = record['run_id']
    if not (keys.valid and run_id == keys.run_id and _ids_plainly_valid(record, keys)):
        try:
            check_record_ids(SimpleNamespace(**record))
        except ValueError as exc:
            raise Rejected('invalid_id', str(exc)) from None
    if run_id != keys.run_id:  # the key is UTF-8 of its run_id exactly when it decodes to it
        raise Rejected('wrong_key', f'record key {source.key[:300]!r} is not its run_id {run_id!r}')
    if keys.home != source.partition:
        raise Rejected(
            'wrong_partition',
            f'run {run_id!r} belongs in partition {keys.home} of {partitions}, not {source.partition}',
        )
    if record['seq'] < 0:
        raise Rejected('invalid', f'negative seq {record["seq"]}')
    if topic == EVENTS:
        _check_event(record)
    elif record['status'] not in TOOL_EFFECT_STATUSES:
        raise Rejected(
            'unknown_version', f'unknown tool effect status {record["status"]!r} (a newer writer?)'
        )
    else:
        _check_resolution(record)
        _check_deferral(record)
    return record


def _check_event(event: Fields) -> None:
    kind = event['kind']
    if kind not in EVENT_KINDS:
        raise Rejected('unknown_version', f'unknown event kind {kind!r} (a newer writer?)')
    if event['usage'] is not None or event['duration_us'] is not None or event['trace_id'] is not None:
        check_usage(event)
    if kind == 'run_resumed':
        _check_resumed(event)
    elif kind == 'conversation_marked':
        _check_marked(event)
    snap = event['snapshot']
    if (kind == 'snapshot_saved') != (snap is not None):
        raise Rejected('invalid', 'a snapshot payload belongs to snapshot_saved events, and only to them')
    if snap is None:
        return
    state, prefix_len, snapshot_seq = snap['state'], snap['prefix_len'], snap['snapshot_seq']
    if state not in ('complete', 'interrupted') or prefix_len < 0 or snapshot_seq < 0:
        raise Rejected('invalid', f'invalid snapshot header {state!r} {prefix_len} {snapshot_seq}')
    try:
        tail = json.loads(snap['messages'])
    except ValueError as exc:
        raise Rejected('invalid', f'snapshot messages are not JSON: {exc}') from None
    if not isinstance(tail, list):
        raise Rejected('invalid', 'snapshot messages are not a JSON list')
    bad = next((uri for uri in snap['media'] or () if not is_media_uri(uri)), None)
    if bad is not None:
        raise Rejected('invalid', f'snapshot media lists {bad[:100]!r}, which is not a media+sha256:// URI')


def _check_resumed(mark: Fields) -> None:
    """A `run_resumed` mark names the run that resumes its own, another valid run id."""
    resumer = mark['metadata'].get(RESUMED_BY_KEY)
    if resumer is None or not is_run_id(resumer) or resumer == mark['run_id']:
        raise Rejected(
            'invalid',
            f'a run_resumed mark must name the run that resumes its run in {RESUMED_BY_KEY!r}, '
            f'not {str(resumer)[:100]!r}',
        )


def _check_marked(mark: Fields) -> None:
    """A `conversation_marked` record names its conversation and gives a title, an archived flag, or both.

    A title has 1 to `MAX_TITLE_CHARS` characters, or is sealed (erasure on: at most
    `MAX_SEALED_TITLE_CHARS`); the flag is `true` or `false`.
    """
    title, archived = mark['metadata'].get(TITLE_KEY), mark['metadata'].get(ARCHIVED_KEY)
    if mark['conversation_id'] is None or (title, archived) == (None, None):
        raise Rejected(
            'invalid', 'a conversation mark names its conversation and gives a title or an archived flag'
        )
    if title is not None and is_sealed_text(title):
        if len(title) > MAX_SEALED_TITLE_CHARS:
            raise Rejected(
                'invalid', f'a sealed conversation title has at most {MAX_SEALED_TITLE_CHARS} characters'
            )
        try:
            split_sealed_text(title)
        except ErasureError as exc:
            raise Rejected('invalid', f'a sealed conversation title: {exc}') from None
    elif title is not None and not 0 < len(title) <= MAX_TITLE_CHARS:
        raise Rejected(
            'invalid', f'a conversation title has 1 to {MAX_TITLE_CHARS} characters, not {len(title)}'
        )
    if archived not in (None, 'true', 'false'):
        raise Rejected('invalid', f'{ARCHIVED_KEY} is true or false, not {archived[:100]!r}')


def _check_deferral(t: Fields) -> None:
    """A `deferred` transition says what it waits for, with JSON arguments and metadata (or sealed ones).

    No other transition has them, but an `approved` decision its arguments.
    """
    if t['status'] != 'deferred':
        approved = t['status'] == 'resolved' and t['resolution'] == 'approved'
        if t['deferral'] is not None or t['deferral_metadata'] is not None or (t['args'] and not approved):
            raise Rejected(
                'invalid',
                'deferral, args and deferral_metadata belong to deferred transitions only '
                '(and args to an approval too)',
            )
        if t['args'] is not None:
            _json_field(t, 'args', dict, 'an approval')
        return
    if t['deferral'] not in DEFERRALS:
        raise Rejected(
            'invalid', f'a deferred call waits for approval, question or external, not {t["deferral"]!r:.80}'
        )
    for name, want in (('args', dict), ('deferral_metadata', object)):
        if t[name] is not None:
            _json_field(t, name, want, 'a deferred call')


def _json_field(t: Fields, name: str, want: type, whose: str) -> None:
    if _sealed(t, name, whose):
        return
    try:
        value = json.loads(t[name])
    except ValueError:
        raise Rejected('invalid', f"{whose}'s {name} is not JSON") from None
    if not isinstance(value, want):
        raise Rejected('invalid', f"{whose}'s {name} is not a JSON object")


def _check_resolution(t: Fields) -> None:
    """A `resolved` transition names its resolution (or decision), operator and note; no other does."""
    if t['status'] != 'resolved':
        if any(t[name] is not None for name in _RESOLUTION_FIELDS):
            raise Rejected(
                'invalid', 'resolution, resolved_by, note and result belong to resolved transitions only'
            )
        return
    answer = t['resolution']
    if answer not in RESOLUTIONS and answer not in DECISIONS:
        raise Rejected(
            'invalid',
            f'a resolution is happened or did_not_happen, a decision approved, denied, returned or failed, '
            f'not {answer!r:.80}',
        )
    by, note = t['resolved_by'], t['note']
    if not by or len(by) > MAX_ID_BYTES or not by.isprintable():
        raise Rejected(
            'invalid', f'a resolution needs the operator who made it (resolved_by), got {by!r:.80}'
        )
    if answer in RESOLUTIONS:
        if not note or not note.strip() or len(note) > MAX_NOTE_CHARS:
            raise Rejected('invalid', f'a resolution needs a note of 1 to {MAX_NOTE_CHARS} characters')
        if t['result'] is not None:
            raise Rejected('invalid', 'result belongs to a returned decision only')
        return
    _check_decision(t, answer, note)


def _check_decision(t: Fields, decision: str, note: str | None) -> None:
    """A decision's note is optional; it carries what it decides and nothing else (schema v5)."""
    if note is not None and (not note.strip() or len(note) > MAX_NOTE_CHARS):
        raise Rejected('invalid', f"a decision's note, when given, is 1 to {MAX_NOTE_CHARS} characters")
    error, result = t['error'], t['result']
    says_why = decision in ('denied', 'failed')
    longest = sealed_chars(MAX_NOTE_CHARS) if _sealed(t, 'error', 'a decision') else MAX_NOTE_CHARS
    if says_why != (error is not None) or (error is not None and not 0 < len(error) <= longest):
        raise Rejected(
            'invalid',
            f'a denial or a failure carries its message (1 to {MAX_NOTE_CHARS} characters), '
            f'and no other decision does ({decision})',
        )
    if (decision == 'returned') != (result is not None):
        raise Rejected('invalid', f'a returned decision carries its result, and no other does ({decision})')
    if result is not None and not _sealed(t, 'result', 'a returned decision'):
        try:
            json.loads(result)
        except ValueError:
            raise Rejected('invalid', "a returned decision's result is not JSON") from None


def _sealed(t: Fields, name: str, whose: str) -> bool:
    """Whether `t[name]` is sealed (erasure on, decision 0033), checked well formed; it is not read."""
    if not is_sealed_text(t[name]):
        return False
    try:
        split_sealed_text(t[name])
    except ErasureError as exc:
        raise Rejected('invalid', f"{whose}'s {name}: {exc}") from None
    return True
