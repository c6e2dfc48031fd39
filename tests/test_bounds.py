"""Every count a part is given (snapshots kept per run, batch sizes, partitions, record sizes, jobs) is a
positive int, or the part refuses it when it is made, saying which bound and what it got.

`max_snapshots_per_run=1.5` used to be taken, and then no snapshot was listed; a bool passed as an int.
The report of `inspect_recovery` answers by the reference's names as well as ours.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepstream.errors import UsageError
from stepstream.producer import InMemoryLog, StepPersistence
from stepstream.projector import Projector
from stepstream.projector._apply import Applier
from stepstream.readmodel import inspect_recovery
from stepstream.settings import MediaSettings, Settings, TopicSettings, check_count
from stepstream.storage import ShardSet

from memory_projection import MemoryProjection
from reference_runs import OPTIONS, SCENARIOS

pytestmark = pytest.mark.fast

BAD = [0, -1, 1.5, 2.0, True, False, '3', None]
"""Not a positive int: zero, negative, a float (even a whole one), a bool, text; None where one is needed."""


def makers(tmp_path: Path) -> dict[str, Callable[[Any], object]]:
    """Each bound, and what makes its part with a given value."""
    settings = Settings()
    topics = ('s.step-events', 's.tool-effects')
    return {
        'max_snapshots_per_run': lambda v: Projector(
            settings, db_path=tmp_path / 'p', max_snapshots_per_run=v
        ),
        'max_batch_records': lambda v: Projector(settings, db_path=tmp_path / 'p', max_batch_records=v),
        'partitions': lambda v: TopicSettings(partitions=v),
        'replication_factor': lambda v: TopicSettings(replication_factor=v),
        'media_threshold_bytes': lambda v: MediaSettings(media_threshold_bytes=v),
        'max_record_bytes': lambda v: InMemoryLog(max_record_bytes=v),
        'max_seq_jump': lambda v: Applier(topics, partitions=1, max_seq_jump=v),
    }


@pytest.mark.parametrize('bound', sorted(makers(Path('.'))))
@pytest.mark.parametrize('value', BAD, ids=repr)
def test_a_bound_that_is_not_a_positive_int_is_refused(bound: str, value: object, tmp_path: Path) -> None:
    if value is None and bound == 'max_snapshots_per_run':
        makers(tmp_path)[bound](value)  # None: keep every snapshot
        return
    with pytest.raises(ValueError, match=rf'{bound} must be a positive int.*, got {value!r}'):
        makers(tmp_path)[bound](value)


@pytest.mark.parametrize('value', [1.5, True, 0])
def test_the_snapshot_bound_is_refused_by_every_part_that_takes_it(value: object, tmp_path: Path) -> None:
    match = rf'max_snapshots_per_run must be a positive int or None, got {value!r}'
    with pytest.raises(ValueError, match=match):
        Applier(('a', 'b'), partitions=1, max_snapshots_per_run=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        ShardSet(tmp_path, Settings(), max_snapshots_per_run=value)  # type: ignore[arg-type]


async def test_a_rebuild_refuses_a_bad_count_as_a_usage_error(tmp_path: Path) -> None:
    from stepstream.projector import rebuild

    with pytest.raises(UsageError, match=r'--jobs must be a positive int, got 1\.5'):
        await rebuild(Settings(), tmp_path / 'p', jobs=1.5)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r'max_snapshots_per_run must be a positive int or None, got True'):
        await rebuild(Settings(), tmp_path / 'p', max_snapshots_per_run=True)


def test_a_good_bound_passes() -> None:
    for value in (1, 2, 10**9):
        check_count(value, 'n')
    check_count(None, 'n', optional=True)
    assert TopicSettings(partitions=1, replication_factor=1).partitions == 1
    assert Applier(('a', 'b'), partitions=1, max_snapshots_per_run=1, max_seq_jump=1).max_snapshots == 1


async def test_the_recovery_report_answers_by_the_references_names() -> None:
    log = InMemoryLog()
    await SCENARIOS['interrupted'][0](StepPersistence(log=log, **OPTIONS))
    projection = MemoryProjection(log)
    await projection.wait_for()
    report = await inspect_recovery(projection.reader(), run_id='run-1')
    assert report.latest is report.latest_snapshot and report.latest is not None
    assert report.latest.state == 'interrupted'
    assert report.settled is report.latest_complete_snapshot and report.settled is not None
    assert report.settled.state == 'complete'
    assert [e.tool_call_id for e in report.unresolved] == ['call-1']
    assert (report.completed_tools, report.failed_tools) == (['step'], [])
