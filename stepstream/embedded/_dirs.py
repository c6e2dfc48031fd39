"""The directories one `EmbeddedStack` runs in: its data dir (locked while it runs) and its sockets."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import IO

from stepstream.embedded._processes import lock_dir

SUBDIRS = ('seaweedfs', 'seaweedfs-logs', 'tmp')
"""The sub-directories of `data_dir` made before the children start."""

_MAX_SOCKET_PATH = 100
"""Unix socket paths are limited to ~107 bytes; a deep data_dir gets a short temp dir instead."""


class StackDirs:
    """The data directory of a stack (the one asked for, or a temporary one) and its socket dir.

    `prepare()` creates them and locks `data_dir` (`stack.lock`), so two stacks never share one;
    `release()` unlocks it and removes the temporary directories. Both run under the stack's lock.
    """

    def __init__(self, requested: Path | None) -> None:
        self.requested = requested
        self.data_dir: Path | None = requested
        self.socket_dir: Path | None = None
        self._temp_dirs: list[Path] = []
        self._lock: IO[str] | None = None

    @property
    def temporary(self) -> bool:
        """Whether `data_dir` is a temporary directory, which `release()` removes (logs and all)."""
        return self.requested is None

    def prepare(self) -> None:
        """Create (or make temporary) `data_dir` and its sub-directories, lock it, pick `socket_dir`."""
        if self.requested is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix='stepstream-stack-'))
            self._temp_dirs.append(self.data_dir)
        else:
            self.data_dir = self.requested
            self.data_dir.mkdir(parents=True, exist_ok=True)
        data = self.data_dir
        self._lock = lock_dir(data)
        for sub in SUBDIRS:
            (data / sub).mkdir(parents=True, exist_ok=True)
        run = data / 'run'
        if len(os.fsencode(run / 'filer.sock')) <= _MAX_SOCKET_PATH:
            run.mkdir(exist_ok=True)
            self.socket_dir = run
        else:
            self.socket_dir = Path(tempfile.mkdtemp(prefix='ss-'))
            self._temp_dirs.append(self.socket_dir)

    def release(self) -> None:
        """Unlock `data_dir` and remove the temporary directories; idempotent."""
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None
        while self._temp_dirs:
            shutil.rmtree(self._temp_dirs.pop(), ignore_errors=True)
        if self.requested is None:
            self.data_dir = None
