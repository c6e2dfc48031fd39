"""Reference stores made the way a migrating user made theirs, and the check that an import kept them.

`make_runs` runs real agents (`FunctionModel`) under pydantic-ai-harness's own `StepPersistence`
on its `SqliteStepStore` or `FileStepStore`: a run that calls a tool and answers with a text large
enough for both sides to move it to their media stores, one whose tool fails (the run fails, the
ledger says `failed`), a parent whose tool runs a child agent (lineage), an annotated call (its
idempotency key and summary) and an image in a prompt. `assert_imported` reads each run back from
the reference store and from stepstream's projection and compares them, with the differences the
import makes by design normalised (docs/migrating.md lists them).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    BinaryContent,
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai_harness.step_persistence import (
    FileStepStore,
    SqliteStepStore,
    StepPersistence,
    annotate_tool_effect,
)

from stepstream.readmodel import ProjectionReader
from stepstream.schemas import REFERENCE_EVENT_KINDS

LONG_ANSWER = 'the whole manual: ' + 'lorem ipsum ' * 7000
"""Above both sides' 64 KiB media threshold: the reference externalizes it, stepstream offloads it."""

REFERENCE_KINDS = REFERENCE_EVENT_KINDS

PNG = b'\x89PNG\r\n\x1a\n' + bytes(range(256)) * 300
"""An image above the media threshold, in a user prompt."""


def reference_store(kind: str, where: Path) -> Any:
    """A reference store of `kind` (`sqlite` or `file`) under `where`; its path is `store_path`."""
    if kind == 'sqlite':
        return SqliteStepStore(database=store_path(kind, where))
    return FileStepStore(store_path(kind, where))


def store_path(kind: str, where: Path) -> Path:
    """The file or directory `reference_store(kind, where)` writes."""
    return where / ('reference.db' if kind == 'sqlite' else 'reference')


def _returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [p for m in messages for p in getattr(m, 'parts', ()) if isinstance(p, ToolReturnPart)]


def _calls_then_answers(tool: str, args: dict[str, Any], answer: str) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if _returns(messages):
            return ModelResponse(parts=[TextPart(answer)])
        return ModelResponse(parts=[ToolCallPart(tool, args, tool_call_id=f'call-{tool}')])

    return FunctionModel(model)


async def make_runs(store: Any, *, tag: str = 'a') -> None:
    """Run the agents of the module docstring with the reference's capability on `store`."""

    def persistence(name: str, **options: Any) -> StepPersistence[Any]:
        return StepPersistence(
            store=store, agent_name=name, metadata={'tenant': 'acme', 'tag': tag}, **options
        )

    support = Agent(
        _calls_then_answers('lookup', {'q': 'manual'}, LONG_ANSWER), capabilities=[persistence('support')]
    )

    @support.tool_plain
    def lookup(q: str) -> str:
        return f'found {q}'

    await support.run('send me the manual', conversation_id=f'conv-{tag}')

    failing = Agent(
        _calls_then_answers('charge', {'cents': 500}, 'done'), capabilities=[persistence('billing')]
    )

    @failing.tool_plain
    def charge(cents: int) -> str:
        raise RuntimeError(f'card declined for {cents} cents')

    with contextlib.suppress(RuntimeError):
        await failing.run('charge me', conversation_id=f'conv-{tag}')

    child = Agent(
        _calls_then_answers('label', {'name': 'bug'}, 'labelled'), capabilities=[persistence('labeller')]
    )

    @child.tool
    async def label(ctx: RunContext[None], name: str) -> str:
        await annotate_tool_effect(store, ctx, idempotency_key=f'label-{name}', effect_summary='adds a label')
        return f'labelled {name}'

    parent = Agent(
        _calls_then_answers('delegate', {'task': 'triage'}, 'triaged'), capabilities=[persistence('triage')]
    )

    @parent.tool_plain
    async def delegate(task: str) -> str:
        result = await child.run(f'do {task}')
        return result.output

    await parent.run('triage issue 7', conversation_id=f'conv-{tag}-triage')

    viewer = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[TextPart('a chart')])),
        capabilities=[persistence('viewer')],
    )
    await viewer.run(['what is this?', BinaryContent(PNG, media_type='image/png')])


def _plain(metadata: dict[str, str], theirs: dict[str, str]) -> dict[str, str]:
    """Metadata without the keys stepstream adds (its redaction label, the import's marks): a key of
    the reference's own, even one named `stepstream.` (Hypothesis found it), stays."""
    return {k: v for k, v in metadata.items() if not k.startswith('stepstream.') or k in theirs}


async def assert_imported(store: Any, reader: ProjectionReader) -> int:
    """Each run of `store` reads back from `reader` as the reference store returns it; how many runs."""
    runs = await store.list_runs()
    for ref in runs:
        run_id = ref.run_id
        ours = await reader.get_run(run_id)
        assert ours is not None, run_id
        assert (ours.conversation_id, ours.parent_run_id, ours.agent_name, ours.started_at) == (
            ref.conversation_id,
            ref.parent_run_id,
            ref.agent_name,
            ref.started_at,
        )
        assert _plain(ours.metadata, ref.metadata) == ref.metadata
        assert ours.metadata.get('stepstream.imported_registration_id') == ref.registration_id
        assert ours.chain == 'intact' and not ours.conflicting_writers and not ours.gaps, ours

        ref_events = await store.list_events(run_id=run_id)
        events = [e for e in await reader.list_events(run_id) if e.kind in REFERENCE_KINDS]
        if not any(e.kind == 'run_started' for e in ref_events):  # the import starts the run itself
            assert events[0].kind == 'run_started'
            events = events[1:]
        assert [e.kind for e in events] == [e.kind for e in ref_events]
        for mine, theirs in zip(events, ref_events, strict=True):
            assert (mine.step_index, mine.tool_call_id, mine.tool_name, mine.error, mine.idempotency_key) == (
                theirs.step_index,
                theirs.tool_call_id,
                theirs.tool_name,
                theirs.error,
                theirs.idempotency_key,
            )
            if mine.kind == 'run_started':  # the run record's metadata and `started_at`
                assert _plain(mine.metadata, ref.metadata) == ref.metadata
                assert mine.timestamp == ref.started_at
            else:
                assert _plain(mine.metadata, theirs.metadata) == theirs.metadata
                assert mine.timestamp == theirs.timestamp

        ref_snapshots = await store.list_snapshots(run_id=run_id, include_interrupted=True)
        snapshots = await reader.list_snapshots(run_id, include_interrupted=True)
        assert [(s.step_index, s.state, s.timestamp, s.idempotency_key) for s in snapshots] == [
            (s.step_index, s.state, s.timestamp, s.idempotency_key) for s in ref_snapshots
        ]
        assert [s.messages for s in snapshots] == [s.messages for s in ref_snapshots]
        for include in (False, True):
            latest, ref_latest = (
                await reader.latest_snapshot(run_id, include),
                await store.latest_snapshot(run_id=run_id, include_interrupted=include),
            )
            assert (latest and latest.messages) == (ref_latest and ref_latest.messages)

        effects = {e.tool_call_id: e for e in await reader.list_tool_effects(run_id)}
        calls = set(effects) | {e.tool_call_id for e in ref_events if e.tool_call_id is not None}
        for call in calls:
            theirs = await store.get_tool_effect(run_id=run_id, tool_call_id=call)
            mine = effects.get(call)
            assert (mine is None) == (theirs is None), call
            if mine is not None and theirs is not None:
                assert (mine.tool_name, mine.status, mine.started_at, mine.ended_at) == (
                    theirs.tool_name,
                    theirs.status,
                    theirs.started_at,
                    theirs.ended_at,
                )
                assert (mine.idempotency_key, mine.effect_summary) == (
                    theirs.idempotency_key,
                    theirs.effect_summary,
                )
        unresolved = await store.list_unresolved_tool_effects(run_id=run_id)
        assert sorted(e.tool_call_id for e in effects.values() if e.status == 'started') == sorted(
            e.tool_call_id for e in unresolved
        )
    return len(runs)
