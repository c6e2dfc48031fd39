"""The reference's store protocol over a projection on the broker: a real `EventLog`, `Projector` and RocksDB.

Each scenario of tests/reference_runs.py runs with stepstream's capability on the broker and with
the reference's own over its `InMemoryStepStore`; a `ReferenceStore` over the projector's shards,
one over the projection opened from disk as another process opens it, and one over a read service
(`stepstream serve` on a port, with a token) answer every read alike, and as the reference's store
does (the differences tests/test_reference_store.py lists aside); the reference's
`inspect_recovery` and `continue_run` run on each unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_ai_harness.step_persistence import continue_run
from pydantic_ai_harness.step_persistence.recovery import inspect_recovery

from stepstream import Settings
from stepstream.errors import StepStreamUnavailable
from stepstream.producer import EventLog, StepPersistence
from stepstream.projector import Projector
from stepstream.readmodel import ProjectionReader
from stepstream.reference import ReferenceStore
from stepstream.serve import app_for, running

from reference_runs import KNOWN, OPTIONS, SCENARIOS, differences, normalised, reads, run_reference

pytestmark = pytest.mark.broker


@pytest.mark.parametrize('name', ['tools', 'failing tool', 'interrupted'])
async def test_the_projection_on_the_broker_answers_as_the_reference_store(
    name: str, settings: Settings, event_log: EventLog, projector: Projector, db_path: Path
) -> None:
    scenario, calls = SCENARIOS[name]
    await scenario(StepPersistence(log=event_log, **OPTIONS))
    await projector.wait_for(await event_log.flush())
    theirs = await run_reference(scenario)
    expected = await reads(theirs, 'run-1', calls)
    async with (
        ProjectionReader.open(db_path) as on_disk,  # as a process other than the projector's reads it
        running(app_for(settings.replace(serve_token='s3cret'), reader=on_disk), port=0) as service,
        ReferenceStore.served(service.url, token='s3cret') as served,  # as another host reads it
    ):
        stores = [ReferenceStore(ProjectionReader.of(projector)), ReferenceStore(on_disk), served]
        answers = [await reads(store, 'run-1', calls) for store in stores]
        assert answers[1] == answers[0] and answers[2] == answers[0]
        found = differences(expected, answers[0], ('run-1',))
        unexpected = [d for d in found if d.split(':', 1)[0] not in KNOWN.get(name, set())]
        assert unexpected == [], '\n'.join(unexpected)
        for store in stores:
            mine = await inspect_recovery(store=store, run_id='run-1')
            wanted = await inspect_recovery(store=theirs, run_id='run-1')
            assert (mine.completed_tools, mine.failed_tools) == (wanted.completed_tools, wanted.failed_tools)
            settled = await theirs.latest_snapshot(run_id='run-1')
            if settled is None:
                with pytest.raises(LookupError):
                    await continue_run(store, run_id='run-1')
            else:
                assert normalised(await continue_run(store, run_id='run-1')) == normalised(settled.messages)
        async with ReferenceStore.served(service.url, token='wrong') as refused:
            with pytest.raises(StepStreamUnavailable, match='answered 401'):
                await refused.get_run(run_id='run-1')
