"""Logging for long-running services: a lost broker is one line when lost and one when back.

A Kafka client retries every few milliseconds while its broker is away and logs every attempt
(about 1,100 lines in 25 s); an operator needs to know that the broker went, that the service is
retrying, and when it came back.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger('stepstream.service')


class BrokerLossLog(logging.Filter):
    """A handler filter that folds Kafka client warnings and errors into state changes.

    ```python
    handler.addFilter(loss := BrokerLossLog(settings.bootstrap_servers))
    ...
    if loss.lost and await broker_answers(settings):
        loss.back()
    ```
    """

    def __init__(self, servers: str, *, client_logger: str = 'aiokafka') -> None:
        super().__init__()
        self.servers = servers
        self.client_logger = client_logger
        self._lost_since: float | None = None
        self._folded = 0

    @property
    def lost(self) -> bool:
        """Whether the client has reported trouble since the broker was last known to answer."""
        return self._lost_since is not None

    def filter(self, record: logging.LogRecord) -> bool:
        """Let everything through except the client's warnings while the broker is lost."""
        if record.levelno < logging.WARNING or not record.name.startswith(self.client_logger):
            return True
        if self._lost_since is None:
            self._lost_since = time.monotonic()
            self._folded = 0
            log.warning(
                'lost Kafka at %s (%s); retrying, and quiet until it is back',
                self.servers,
                record.getMessage(),
            )
        else:
            self._folded += 1
        return False

    def back(self) -> None:
        """Record that the broker answers again (one line, with what was folded meanwhile)."""
        if self._lost_since is None:
            return
        log.warning(
            'Kafka at %s answers again after %.0fs; %d client messages were folded into these lines',
            self.servers,
            time.monotonic() - self._lost_since,
            self._folded,
        )
        self._lost_since = None

    def summary(self) -> str | None:
        """One line on the current loss, or None if the broker is not lost."""
        if self._lost_since is None:
            return None
        return (
            f'Kafka at {self.servers} has been away for {time.monotonic() - self._lost_since:.0f}s '
            f'({self._folded} client messages folded)'
        )
