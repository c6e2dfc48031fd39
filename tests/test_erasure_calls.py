"""Erasure of a deferred call's content: its arguments and metadata, and its decisions' (decision 0033).

With erasure on, the `deferred` transition's `args` and `deferral_metadata`, and a decision's
`args`, `result` and message are sealed with the conversation's key, as a snapshot's content is: the
log and the projection never hold them in plaintext, a reader with the keys shows them opened, and
after `stepstream forget` they read as erased, in the live projection and in a rebuild alike, and
the run does not resume.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import httpx
import pytest
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.tools import ToolApproved
from test_conversation_index import sealed_log

from stepstream.console._deferred import waiting_json, waiting_table
from stepstream.console._render import ledger
from stepstream.erasure import ContentErased, ErasureError, is_sealed_text
from stepstream.producer import decide_deferred_call
from stepstream.producer._memory import InMemoryLog
from stepstream.readmodel import ProjectionReader, resume_run
from stepstream.schemas import MAX_NOTE_CHARS
from stepstream.serve import Source, create_app
from stepstream.serve._models import Deferred, ToolEffect

from deferred_runs import EXPORT_METADATA, REFUND_ARGS, run_until_waiting
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast

RUN, STILL_WAITING = 'run-sealed-calls', 'run-still-waiting'
CONVERSATION = f'conv-{RUN}'  # what `run_until_waiting` runs it in
CHANGED_ARGS = {'amount': 60, 'reason': 'half of it, agreed on the phone'}
ANSWER = 'the visa card ending 4242'
FAILURE = 'é' * MAX_NOTE_CHARS  # the longest message, every character two bytes: sealed, it still fits
PLAINTEXTS = [b'charged twice', b'export-7', b'which card', b'agreed on the phone', b'visa card']
PLAINTEXTS.append(FAILURE[:16].encode())


def _plaintext_in(log: InMemoryLog) -> list[bytes]:
    return [text for r in log.records for text in PLAINTEXTS if text in r.value]


async def test_a_deferred_calls_content_is_sealed_opened_by_readers_and_erased_by_forget() -> None:
    log, keys = sealed_log()
    await run_until_waiting(log, RUN)
    await run_until_waiting(log, STILL_WAITING)  # erased while its calls wait
    projection = MemoryProjection(log)
    await projection.wait_for()
    reader = ProjectionReader(projection.shard, keys=keys)

    # The readers show the content opened: the call, the deferred listing, the API's models.
    refund = await reader.get_tool_effect(RUN, 'call-refund')
    assert refund is not None and refund.args is not None and json.loads(refund.args) == REFUND_ARGS
    assert not refund.content_erased and ToolEffect.of(refund).args == refund.args
    waiting = {w.effect.tool_call_id: w for w in await reader.list_waiting() if w.effect.run_id == RUN}
    assert set(waiting) == {'call-refund', 'call-ask', 'call-export'}
    export = waiting['call-export'].effect
    assert export.deferral_metadata is not None and json.loads(export.deferral_metadata) == EXPORT_METADATA
    assert Deferred.of(waiting['call-export']).deferral_metadata == export.deferral_metadata
    # A reader without keys reads them as stored: sealed.
    keyless = await ProjectionReader(projection.shard).get_tool_effect(RUN, 'call-refund')
    assert keyless is not None and is_sealed_text(keyless.args)

    # Decisions with content are sealed with the conversation's key, which must be named.
    with pytest.raises(ValueError, match='conversation_id'):
        await decide_deferred_call(log, refund, decision='approved', operator='alice', writer_id='t', args={})
    decide = {'operator': 'alice', 'writer_id': 'test@here:1', 'conversation_id': CONVERSATION}
    await decide_deferred_call(log, refund, decision='approved', args=CHANGED_ARGS, **decide)
    await decide_deferred_call(log, waiting['call-ask'].effect, decision='returned', result=ANSWER, **decide)
    await decide_deferred_call(log, export, decision='failed', message=FAILURE, **decide)
    await projection.wait_for()
    assert projection.dead == []
    assert _plaintext_in(log) == [] and not any(
        text in value for _, value in projection.shard.logical_items() for text in PLAINTEXTS
    )
    decided = await reader.get_tool_effect(RUN, 'call-refund')
    assert decided is not None and decided.resolution is not None and decided.resolution.args is not None
    assert json.loads(decided.resolution.args) == CHANGED_ARGS and decided.resolutions == [decided.resolution]
    keyless_decision = await ProjectionReader(projection.shard).get_tool_effect(RUN, 'call-refund')
    assert keyless_decision is not None and keyless_decision.resolution is not None
    assert is_sealed_text(keyless_decision.resolution.args)
    with pytest.raises(ErasureError, match=r"tool call 'call-refund'.*STEPSTREAM_ERASURE_KEY"):
        await resume_run(ProjectionReader(projection.shard), RUN)
    results = (await resume_run(reader, RUN)).deferred_tool_results
    assert results.approvals == {'call-refund': ToolApproved(override_args=CHANGED_ARGS)}
    assert results.calls['call-ask'] == ANSWER
    failure = results.calls['call-export']
    assert isinstance(failure, ModelRetry) and failure.message == FAILURE

    for conversation in (CONVERSATION, f'conv-{STILL_WAITING}'):  # `stepstream forget` of each
        for key in keys.of_conversation(conversation):  # a tombstone for each key
            keys._apply(key.record_key(), None)
    rebuilt = MemoryProjection(log)
    await rebuilt.wait_for()
    assert list(rebuilt.shard.logical_items()) == list(projection.shard.logical_items())
    for shard in (projection.shard, rebuilt.shard):  # the live projection, and a rebuild from the log
        erased_reader = ProjectionReader(shard, keys=keys)
        effects = {e.tool_call_id: e for e in await erased_reader.list_tool_effects(RUN)}
        assert not effects['call-lookup'].content_erased  # a call that ran holds no sealed content
        for call in ('call-refund', 'call-ask', 'call-export'):
            erased = effects[call]
            assert erased.content_erased and (erased.args, erased.deferral_metadata) == (None, None)
            assert erased.resolution is not None and erased.resolutions == [erased.resolution]
            opened = erased.resolution
            assert (opened.args, opened.result, opened.error) == (None, None, None)
            assert opened.resolution in ('approved', 'returned', 'failed')  # the structure stays
            assert ToolEffect.of(erased).content_erased
        assert await erased_reader.get_tool_effect(RUN, 'call-refund') == effects['call-refund']
        with pytest.raises(ContentErased, match=r"tool call 'call-(refund|ask|export)'.*erased"):
            await resume_run(erased_reader, RUN)
        # What waits reads as erased: the listing, the console's views, the API and its pages.
        still = await erased_reader.list_waiting()
        assert [w.effect.run_id for w in still] == [STILL_WAITING] * 3
        assert all(w.effect.content_erased and w.effect.args is None for w in still)
        now = datetime.now(UTC)
        assert waiting_table(still, now).count('(erased)') == 3
        assert all(c['content_erased'] and c['args'] is None for c in json.loads(waiting_json(still, now)))
        assert 'arguments (erased)' in ledger(await erased_reader.list_tool_effects(STILL_WAITING))
        assert 'its content erased' in ledger(list(effects.values()))
        assert all(Deferred.of(w).content_erased for w in still)
        source = Source(log.settings, erased_reader, None, log=log)
        transport = httpx.ASGITransport(app=create_app(source))
        async with httpx.AsyncClient(transport=transport, base_url='http://stepstream.test') as api:
            marked = '<span class="erased">content erased</span>'
            assert (await api.get('/deferred')).text.count(marked) == 3
            assert (await api.get(f'/runs/{STILL_WAITING}')).text.count(marked) == 3  # its deferred calls
            assert (await api.get(f'/runs/{RUN}')).text.count(marked) == 3  # its decisions, in the ledger
            listed = (await api.get('/api/deferred')).json()['calls']
            assert [(c['content_erased'], c['args']) for c in listed] == [(True, None)] * 3
