"""The projection read through the reference's store protocol (`ReferenceStore`), against the reference.

Each scenario runs one agent twice: with pydantic-ai-harness's own `StepPersistence` over its
`InMemoryStepStore`, and with ours over an `InMemoryLog` projected by the same rules as the
projector's. Every read method of the reference's `StepStore` (and `list_snapshots`) must answer
the same on both, times and per-run ids aside (`reference_runs.normalised`); the differences that
remain are listed in `KNOWN`, each with its reason (docs/migrating.md). Then the reference's own
`inspect_recovery`, `continue_run`, `fork_run` and `ConversationSearch(SnapshotHistorySource(...))`
run unchanged against the store. Fast tier; tests/test_reference_store_e2e.py runs a scenario on
the brokers.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai_harness.conversation_search import ConversationSearch, SnapshotHistorySource
from pydantic_ai_harness.conversation_search._source import SnapshotStore
from pydantic_ai_harness.step_persistence import StepPersistence as ReferencePersistence
from pydantic_ai_harness.step_persistence import StepStore, continue_run, fork_run
from pydantic_ai_harness.step_persistence.recovery import inspect_recovery

from stepstream.errors import ReadOnlyStore
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.readmodel import ProjectionReader
from stepstream.reference import EFFECT_STATUS, EVENT_KIND, ReferenceStore
from stepstream.schemas import EVENT_KINDS, TOOL_EFFECT_STATUSES

from memory_projection import MemoryProjection
from reference_runs import KNOWN, OPTIONS, SCENARIOS, Scenario, differences, normalised, reads, run_reference

pytestmark = pytest.mark.fast


async def run_ours(scenario: Scenario) -> tuple[ReferenceStore, MemoryProjection]:
    """`scenario` run with stepstream's capability, read through a `ReferenceStore`."""
    log = InMemoryLog()
    await scenario(StepPersistence(log=log, **OPTIONS))
    projection = MemoryProjection(log)
    await projection.wait_for()
    assert projection.dead == []
    return ReferenceStore(ProjectionReader.of(projection)), projection


@pytest.mark.parametrize('name', sorted(SCENARIOS))
async def test_every_read_answers_as_the_reference_store_does(name: str) -> None:
    scenario, calls = SCENARIOS[name]
    reference = await run_reference(scenario)
    store, _ = await run_ours(scenario)
    run_ids = tuple(run.run_id for run in await reference.list_runs())
    assert run_ids == tuple(run.run_id for run in await store.list_runs())
    assert 'run-1' in run_ids and len(run_ids) == (2 if name == 'delegating' else 1)
    if name == 'delegating':
        assert [run.run_id for run in await store.list_runs(parent_run_id='run-1')] == ['child-1']
    for run_id in run_ids:
        theirs = await reads(reference, run_id, calls)
        ours = await reads(store, run_id, calls)
        found = differences(theirs, ours, run_ids)
        unexpected = [d for d in found if d.split(':', 1)[0] not in KNOWN.get(name, set())]
        assert unexpected == [], f'{run_id}: ' + '\n'.join(unexpected)
        assert theirs['get_run'] is not None and theirs['list_events'], 'the scenario wrote the run'


async def test_the_known_differences() -> None:
    """The interrupted run's differences are the ones `KNOWN` says, and nothing else in those reads."""
    scenario, calls = SCENARIOS['interrupted']
    theirs = await reads(await run_reference(scenario), 'run-1', calls)
    store, _ = await run_ours(scenario)
    ours = await reads(store, 'run-1', calls)
    latest_theirs, latest_ours = (
        theirs['latest_snapshot(include_interrupted)'],
        ours['latest_snapshot(include_interrupted)'],
    )
    assert (latest_theirs.state, latest_theirs.step_index, latest_theirs.idempotency_key) == (
        'interrupted',
        1,
        '1:1:interrupted',
    )
    assert (latest_ours.state, latest_ours.step_index, latest_ours.idempotency_key) == (
        'interrupted',
        0,
        '1:0:interrupted',
    )
    assert normalised(latest_theirs.messages) == normalised(latest_ours.messages)
    failed_theirs, failed_ours = theirs['list_events'][-1], ours['list_events'][-1]
    assert (failed_theirs.kind, failed_ours.kind) == ('run_failed', 'run_failed')
    assert failed_theirs.error == 'CancelledError()' and failed_ours.error.endswith('(CancelledError())')
    assert normalised(theirs['list_events'][:-1]) == normalised(ours['list_events'][:-1])


async def test_what_has_no_counterpart_reads_as_the_reference_records_it() -> None:
    """A waiting run reads completed, its deferred call started (unresolved); our extra kinds are left out."""
    store, projection = await run_ours(SCENARIOS['waiting'][0])
    reader = projection.reader()
    assert (await reader.get_run('run-1')).status == 'waiting'  # type: ignore[union-attr]
    our_kinds = [e.kind for e in await reader.list_events('run-1')]
    assert 'run_waiting' in our_kinds and 'tool_call_deferred' in our_kinds and 'snapshot_saved' in our_kinds
    kinds = [e.kind for e in await store.list_events(run_id='run-1')]
    assert kinds[-1] == 'run_completed' and not {'run_waiting', 'tool_call_deferred', 'snapshot_saved'} & set(
        kinds
    )
    export = await store.get_tool_effect(run_id='run-1', tool_call_id='call-export')
    assert export is not None and (export.status, export.ended_at) == ('started', None)
    assert [e.tool_call_id for e in await store.list_unresolved_tool_effects(run_id='run-1')] == [
        'call-export'
    ]
    run = await store.get_run(run_id='run-1')
    assert run is not None and run.metadata == {'team': 'billing'}  # no `stepstream.*` keys
    # KNOWN: we keep the waiting run's final history (what resumes it), the reference none.
    final = await store.latest_snapshot(run_id='run-1', include_interrupted=True)
    assert final is not None and final.state == 'interrupted'
    assert await store.latest_snapshot(run_id='run-1') is None
    theirs = await run_reference(SCENARIOS['waiting'][0])
    assert await theirs.latest_snapshot(run_id='run-1', include_interrupted=True) is None
    assert not hasattr(run, 'status')


def test_every_kind_and_status_of_ours_has_its_mapping() -> None:
    from pydantic_ai_harness.step_persistence import EventKind, ToolEffectStatus

    assert set(EVENT_KIND) == EVENT_KINDS
    assert set(EFFECT_STATUS) | {'resolved'} == TOOL_EFFECT_STATUSES
    assert {k for k in EVENT_KIND.values() if k is not None} == set(EventKind.__args__)
    assert set(EFFECT_STATUS.values()) == set(ToolEffectStatus.__args__)


async def test_the_references_helpers_run_unchanged() -> None:
    """`inspect_recovery`, `continue_run` and `fork_run` answer from our store as from theirs."""
    for name in ('tools', 'failing tool', 'interrupted'):
        scenario, _ = SCENARIOS[name]
        theirs = await run_reference(scenario)
        store, _ = await run_ours(scenario)
        assert isinstance(store, StepStore)
        mine, expected = (
            await inspect_recovery(store=store, run_id='run-1'),
            await inspect_recovery(store=theirs, run_id='run-1'),
        )
        if name == 'interrupted':  # the rescue snapshot's step (KNOWN)
            assert (mine.latest.step_index, expected.latest.step_index) == (0, 1)  # type: ignore[union-attr]
            mine.latest.step_index = 1  # type: ignore[union-attr]
            mine.latest.idempotency_key = expected.latest.idempotency_key  # type: ignore[union-attr]
        assert normalised(mine, run_ids=('run-1',)) == normalised(expected, run_ids=('run-1',)), name
        for helper in (continue_run, fork_run):
            for interrupted in (False, True):
                try:
                    want: Any = normalised(
                        await helper(theirs, run_id='run-1', include_interrupted=interrupted)
                    )
                except LookupError as exc:
                    want = type(exc)
                try:
                    got: Any = normalised(
                        await helper(store, run_id='run-1', include_interrupted=interrupted)
                    )
                except LookupError as exc:
                    got = type(exc)
                assert got == want, (name, helper.__name__, interrupted)
    store, _ = await run_ours(SCENARIOS['failing tool'][0])
    report = await inspect_recovery(store=store, run_id='run-1')
    assert report.settled is None and report.latest is not None and report.latest.state == 'interrupted'
    assert (report.completed_tools, report.failed_tools) == (('lookup',), ('charge',))
    with pytest.raises(LookupError, match='no continuable snapshot'):
        await continue_run(store, run_id='run-1')


async def test_conversation_search_reads_the_projection() -> None:
    """The reference's search over `SnapshotHistorySource(ReferenceStore(reader))` finds an earlier run."""
    log = InMemoryLog()
    await SCENARIOS['text'][0](StepPersistence(log=log, **OPTIONS))
    projection = MemoryProjection(log)
    await projection.wait_for()
    store = ReferenceStore(projection.reader())
    assert isinstance(store, SnapshotStore)
    source = SnapshotHistorySource(store)
    reference = SnapshotHistorySource(await run_reference(SCENARIOS['text'][0]))
    assert normalised(await source.run_history(run_id='run-1'), run_ids=('run-1',)) == normalised(
        await reference.run_history(run_id='run-1'), run_ids=('run-1',)
    )
    assert normalised(await source.list_runs()) == normalised(await reference.list_runs())

    answers: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if returns:
            answers.append(str(returns[-1].content))
            return ModelResponse(parts=[TextPart('ok')])
        return ModelResponse(parts=[ToolCallPart('search_conversation_history', {'query': 'parcel code'})])

    searcher = Agent(FunctionModel(model), capabilities=[ConversationSearch(source, scope='conversation')])
    await searcher.run('what was the parcel code?', conversation_id='conv-1')
    assert len(answers) == 1 and 'AX-17' in answers[0], answers


async def test_writes_are_refused_saying_how_to_write() -> None:
    store, _ = await run_ours(SCENARIOS['text'][0])
    run = await store.get_run(run_id='run-1')
    events = await store.list_events(run_id='run-1')
    snap = await store.latest_snapshot(run_id='run-1')
    assert run is not None and snap is not None
    from pydantic_ai_harness.step_persistence import ToolEffectRecord

    effect = ToolEffectRecord(tool_call_id='c', tool_name='t', run_id='run-1', status='started')
    for write, record in (
        (store.register_run, run),
        (store.append_event, events[0]),
        (store.save_snapshot, snap),
        (store.record_tool_effect, effect),
    ):
        with pytest.raises(ReadOnlyStore, match=r'StepPersistence .* `stepstream import`'):
            await write(record)  # type: ignore[operator]
    agent = Agent(FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('x')])))
    with pytest.raises(ReadOnlyStore, match=r'register_run \(run .new-run.\)'):
        await agent.run('hi', capabilities=[ReferencePersistence(store=store, run_id='new-run')])
    assert await store.get_run(run_id='new-run') is None


async def test_resolutions_read_as_the_nearest_reference_status() -> None:
    """An operator's `happened` reads completed, `did_not_happen` failed: neither is unresolved any more."""
    from stepstream.producer import resolve_tool_effect

    store, projection = await run_ours(SCENARIOS['interrupted'][0])
    reader = projection.reader()
    [stuck] = await reader.list_unresolved_tool_effects('run-1')
    assert [e.tool_call_id for e in await store.list_unresolved_tool_effects(run_id='run-1')] == ['call-1']
    await resolve_tool_effect(
        projection.log,
        stuck,
        resolution='did_not_happen',
        note='checked',
        operator='ops',
        writer_id='ops@here:1',
    )
    await projection.wait_for()
    effect = await store.get_tool_effect(run_id='run-1', tool_call_id='call-1')
    assert effect is not None and effect.status == 'failed' and effect.ended_at is not None
    assert await store.list_unresolved_tool_effects(run_id='run-1') == []


@pytest.mark.parametrize('name', sorted(SCENARIOS))
async def test_a_read_service_answers_as_the_projection_does(name: str) -> None:
    """`ReferenceStore.served(url)` asks `stepstream serve`'s API: the answers of the store in process."""
    import httpx

    from stepstream import Settings
    from stepstream.serve import app_for

    scenario, calls = SCENARIOS[name]
    store, projection = await run_ours(scenario)
    local = await reads(store, 'run-1', calls)
    transport = httpx.ASGITransport(app=app_for(Settings(), reader=projection.reader()))
    async with (
        httpx.AsyncClient(transport=transport, base_url='http://serve') as client,
        ReferenceStore.served('http://serve', client=client) as served,
    ):
        remote = await reads(served, 'run-1', calls)
        assert await served.get_run(run_id='no-such-run') is None
        assert await served.list_events(run_id='no-such-run') == []
        assert await served.latest_snapshot(run_id='no-such-run') is None
        report = await inspect_recovery(store=served, run_id='run-1')
        assert report.unresolved == tuple(local['list_unresolved_tool_effects'])
    assert differences(local, remote, ('run-1',)) == []
    assert local == remote  # not even a time differs


def test_the_reference_is_no_dependency_of_stepstream() -> None:
    """No module of stepstream imports pydantic-ai-harness when loaded (only the type checker, or a
    function that needs it, when called): it is a test extra, and a user's migration tool."""
    import ast
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    paths = sorted(
        Path(folder) / name
        for folder, _, names in os.walk(root / 'stepstream', followlinks=True)
        for name in names
        if name.endswith('.py')
    )
    assert root / 'stepstream' / 'reference' / '_store.py' in paths  # the walk follows the links
    for path in paths:
        tree = ast.parse(path.read_text(encoding='utf-8'))
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if (isinstance(block, ast.If) and ast.unparse(block.test) == 'TYPE_CHECKING')
            or isinstance(block, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or '']
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.startswith('pydantic_ai_harness') for n in names) and id(node) not in typing_only:
                found.append(f'{path.relative_to(root)}:{node.lineno}')
    assert found == []


async def test_without_the_reference_installed_a_read_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    class Missing:
        """A finder that has no pydantic-ai-harness, as an environment without it."""

        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name.split('.')[0] == 'pydantic_ai_harness':
                raise ModuleNotFoundError(f"No module named '{name}'")

    store, _ = await run_ours(SCENARIOS['text'][0])
    for name in [n for n in sys.modules if n.split('.')[0] == 'pydantic_ai_harness']:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, 'meta_path', [Missing(), *sys.meta_path])
    with pytest.raises(ImportError, match=r'pip install --no-deps pydantic-ai-harness'):
        await store.get_run(run_id='run-1')
    assert await store.reader.get_run('run-1') is not None  # our own reads need none of it


async def test_erased_content_is_never_handed_on_as_a_history() -> None:
    """A snapshot `stepstream forget` erased: left out of the list, and the latest raises `ContentErased`."""
    import dataclasses

    from stepstream.erasure import ContentErased

    store, projection = await run_ours(SCENARIOS['tools'][0])
    reader = projection.reader()
    kept = await reader.list_snapshots('run-1')
    erased = [dataclasses.replace(snap, messages=[], erased=True) for snap in kept]

    class Erased:
        """The reader as it reads once the conversation's key is destroyed."""

        def __getattr__(self, name: str) -> Any:
            return getattr(reader, name)

        async def list_snapshots(self, run_id: str, include_interrupted: bool = False) -> list[Any]:
            return erased

        async def latest_snapshot(self, run_id: str, include_interrupted: bool = False) -> Any:
            return erased[-1]

    assert len(await store.list_snapshots(run_id='run-1')) == len(kept) == 3
    over_erased = ReferenceStore(Erased())  # type: ignore[arg-type]
    assert await over_erased.list_snapshots(run_id='run-1') == []
    with pytest.raises(ContentErased, match=r"run 'run-1' .* was erased"):
        await continue_run(over_erased, run_id='run-1')
