"""Run as a child process by test_decisions_processes.py: resume a decided run from the projection on disk.

Its own interpreter, log and reader: it shares nothing with the process that paused the run or the
ones that decided it but the log and the projection. Prints the resumed run's answer.
"""

from __future__ import annotations

import asyncio
import sys

from stepstream import Settings
from stepstream.producer import EventLog
from stepstream.readmodel import ProjectionReader

from deferred_runs import resume


async def main(run_id: str, resumed_run_id: str) -> None:
    settings = Settings.from_env()
    async with (
        ProjectionReader.open(settings.projection.db_path) as reader,
        EventLog(settings, create_topics=False) as log,
    ):
        print(await resume(log, reader, run_id, resumed_run_id), flush=True)


if __name__ == '__main__':
    asyncio.run(main(sys.argv[1], sys.argv[2]))
