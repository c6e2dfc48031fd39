"""Run as a child process by test_projector_crash.py: `stepstream projector`, each shard commit
announced in a file, so the test can aim a SIGKILL between a batch's staging and its commit.

Before a transaction commits, `b` is appended to `$STEPSTREAM_TEST_BATCH_MARKS`, and `e` once
it has; the child then waits a little before committing, so that the window is wide enough for
the test to see. A kill landing after a `b` and before its `e` is a kill in the middle of a
batch: staged, with its offsets, and not committed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from stepstream.cli import main
from stepstream.storage import ShardTransaction

MARKS = os.environ['STEPSTREAM_TEST_BATCH_MARKS']
_commit = ShardTransaction.commit


def _mark(what: str) -> None:
    with open(MARKS, 'a') as marks:
        marks.write(what + '\n')


def announced_commit(self: ShardTransaction, **options: Any) -> int:
    _mark('b')
    time.sleep(0.05)
    count = _commit(self, **options)
    _mark('e')
    return count


ShardTransaction.commit = announced_commit  # type: ignore[method-assign]

if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
