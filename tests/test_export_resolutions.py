"""The export's `resolutions` table: every decision on a deferred call, the one that stands and later ones.

Over the in-memory log and projection (the same reader the CLI's export reads); the table's doc
query and an operator's resolution on the brokers are tests/test_analytics.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_analytics import queries

from stepstream.producer import InMemoryLog, decision_for

from deferred_runs import run_until_waiting
from memory_projection import MemoryProjection

pytestmark = pytest.mark.fast


async def test_each_decision_is_a_row_and_a_later_one_reads_history(tmp_path: Path) -> None:
    duckdb = pytest.importorskip('duckdb')
    from stepstream.analytics import export_parquet

    log = InMemoryLog()
    projection = MemoryProjection(log)
    await run_until_waiting(log, 'x-1')
    await projection.wait_for()
    reader = projection.reader()
    refund = await reader.get_tool_effect('x-1', 'call-refund')
    export = await reader.get_tool_effect('x-1', 'call-export')
    assert refund is not None and export is not None
    writer = 'stepstream-serve@here:1'
    records = [
        decision_for(refund, decision='approved', operator='alice', writer_id=writer, args={'amount': 100}),
        decision_for(refund, decision='denied', operator='bob', writer_id=writer, message='no', note='late'),
        decision_for(
            export, decision='returned', operator='export-job', writer_id=writer, result={'rows': 3}
        ),
    ]
    await log.wait_acked([await log.append(r) for r in records])
    await projection.wait_for()

    out = tmp_path / 'analytics'
    report = await export_parquet(reader, str(out), log.settings)
    assert report.rows['resolutions'] == 3
    db = duckdb.connect()
    db.execute(queries()['views'].replace("'analytics/", f"'{out}/"))
    rows = db.execute(
        'SELECT tool_call_id, tool_name, agent_name, resolution, resolved_by, applied, args, result, '
        'error, note FROM resolutions ORDER BY resolved_at'
    ).fetchall()
    assert [r[:6] for r in rows] == [
        ('call-refund', 'refund', 'refunds', 'approved', 'alice', True),
        ('call-refund', 'refund', 'refunds', 'denied', 'bob', False),
        ('call-export', 'export', 'refunds', 'returned', 'export-job', True),
    ]
    assert json.loads(rows[0][6]) == {'amount': 100} and (rows[1][8], rows[1][9]) == ('no', 'late')
    assert json.loads(rows[2][7]) == {'rows': 3}
    answered = db.execute(
        'SELECT resolves_seq, writer_id FROM resolutions r JOIN tool_effects e USING (run_id, tool_call_id) '
        "WHERE r.resolution = 'approved'"
    ).fetchall()
    assert answered == [(refund.last_seq, writer)]  # it answers the call's `deferred` transition
    decided = db.execute(queries()['who_decided']).fetchall()
    assert [(who, what, n, history) for who, what, n, history, *_ in decided] == [
        ('alice', 'approved', 1, 0),
        ('bob', 'denied', 1, 1),
        ('export-job', 'returned', 1, 0),
    ]

    # Since that export, nothing changed: no row, and every table still opens (an empty file each).
    later = tmp_path / 'later'
    again = await export_parquet(reader, str(later), log.settings, since=str(out))
    assert set(again.rows.values()) == {0}
    empty = duckdb.connect()
    empty.execute(queries()['views'].replace("'analytics/", f"'{later}/"))
    assert empty.execute('SELECT count(*) FROM resolutions').fetchone() == (0,)
