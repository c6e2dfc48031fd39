"""`import_store`: a reference store's runs appended to the log, each once, by its own writer.

What is on the log already is read from the projection (`ProjectionReader.get_run`): a run it
does not know is written whole; a run it knows from the importer's writer for that run
(`import_writer_id`) is finished if records are missing (an import that was interrupted) and
left alone if not; a run it knows from any other writer is skipped, never merged. Each run is
read and checked whole before any of its records is sent, so a damaged record stops the import
with nothing of its run written, and every run before it is complete on the log. No Kafka
transaction is needed: a record sent twice is the same writer's at the same `seq`, which the
projector ignores (decision 0060).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from stepstream.importer._writing import RunImport
from stepstream.producer import Redaction, StepLog
from stepstream.signing import Signer

if TYPE_CHECKING:
    from stepstream.importer._stores import SourceStore
    from stepstream.media import MediaStore
    from stepstream.readmodel import ProjectionReader

CONCURRENT_RUNS = 16
"""Runs written at once: each waits for the broker at its end, and their partitions differ."""


@dataclass(slots=True)
class ImportReport:
    """What an import read, wrote and skipped."""

    store: str
    runs_read: int = 0
    """Runs read from the store, checked whole."""
    records_read: int = 0
    """The store's records of those runs: run records, events, snapshots and ledger records."""
    runs_written: int = 0
    """Runs written whole by this import."""
    runs_finished: int = 0
    """Runs an earlier, interrupted import had begun, finished by this one."""
    records_written: int = 0
    """Records this import appended (signed heads not counted)."""
    runs_already_imported: int = 0
    """Runs an earlier import wrote whole: nothing written."""
    runs_expired: int = 0
    """Runs the projection dropped by its retention policy: on the log already, not written again."""
    skipped: dict[str, str | None] = field(default_factory=dict)
    """Runs on the log from another writer (run id -> that writer): skipped, not merged."""

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON values."""
        return asdict(self)

    def text(self) -> str:
        """The report as the command prints it."""
        lines = [
            f'read {self.runs_read} run(s), {self.records_read} record(s) from {self.store}',
            f'wrote {self.records_written} record(s): {self.runs_written} run(s) whole, '
            f'{self.runs_finished} run(s) finished from an earlier import',
            f'skipped {self.runs_already_imported} run(s) imported before, '
            f'{len(self.skipped)} run(s) on the log from another writer'
            + (f', {self.runs_expired} run(s) the retention policy dropped' if self.runs_expired else ''),
        ]
        lines += [f'  {run_id}: written by {writer}' for run_id, writer in sorted(self.skipped.items())[:20]]
        if len(self.skipped) > 20:
            lines.append(f'  ... and {len(self.skipped) - 20} more (--json lists them all)')
        return '\n'.join(lines)


async def import_store(
    store: SourceStore,
    log: StepLog,
    reader: ProjectionReader | None,
    *,
    media_store: MediaStore | None = None,
    redaction: Redaction | None = None,
    concurrency: int = CONCURRENT_RUNS,
) -> ImportReport:
    """Append every run of `store` to `log` that is not on it yet; the report of what was done.

    `reader` is the projection of `log` (None: nothing is on the log yet, every run is written).
    `media_store` takes the snapshots' large values, as the capability's does (None: no value
    may reach the log's threshold, and erasure must be off); `redaction` defaults to the log's
    settings' policy; a signing key in the log's settings signs each run's head. Raises
    `DamagedStore` for a record that cannot be read, once the runs before it are on the log
    (`DamagedStore.report` says what was done).
    """
    settings = log.settings
    redact = redaction if redaction is not None else Redaction.from_settings(settings)
    key = settings.security.signing_key
    signer = Signer.from_secret(key) if key is not None else None
    label = redact.label
    report = ImportReport(store=store.name)
    running: set[asyncio.Task[None]] = set()
    try:
        for run_id in store.run_ids():
            run = await store.read_run(run_id)
            report.runs_read += 1
            report.records_read += run.records
            job = RunImport(
                log,
                run,
                media_store=media_store,
                threshold_bytes=settings.media.media_threshold_bytes,
                redaction=redact,
                signer=signer,
                label=label,
                store=store.name,
            )
            on_log = await _on_log(job, reader, report)
            if on_log is None:
                continue
            if len(running) >= concurrency:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running -= done
                for task in done:
                    task.result()
            running.add(asyncio.create_task(_write(job, on_log, report)))
    except BaseException as exc:
        await asyncio.gather(*running, return_exceptions=True)  # the runs in flight end whole
        exc.report = report  # type: ignore[attr-defined]
        raise
    for outcome in await asyncio.gather(*running, return_exceptions=True):
        if isinstance(outcome, BaseException):
            outcome.report = report  # type: ignore[attr-defined]
            raise outcome
    return report


async def _on_log(job: RunImport, reader: ProjectionReader | None, report: ImportReport) -> set[int] | None:
    """The seqs of the run the log holds already, or None when nothing is to be written."""
    if reader is None:
        return set()
    known = await reader.get_run(job.writer.run_id)
    if known is None:
        if await reader.expired(job.writer.run_id) is not None:  # on the log, dropped by retention
            report.runs_expired += 1
            return None
        return set()
    if known.registration_id != job.writer.writer_id:
        report.skipped[job.writer.run_id] = known.registration_id
        return None
    missing = {seq for low, high in known.gaps for seq in range(low, high + 1)}
    held = set(range(known.last_seq + 1)) - missing
    if held >= set(range(job.count)):
        report.runs_already_imported += 1
        return None
    return held


async def _write(job: RunImport, held: set[int], report: ImportReport) -> None:
    sent = await job.write(held.__contains__)
    report.records_written += sent
    if held:
        report.runs_finished += 1
    else:
        report.runs_written += 1
