"""Logging for long-running services: a lost broker is one line when lost and one when back.

A Kafka client retries every few milliseconds while its broker is away and logs every attempt
(about 1,100 lines in 25 s); an operator needs to know that the broker went, that the service is
retrying, and when it came back. A client also warns about things that are not a lost broker
(a group rebalancing, a coordinator still loading): those say what they are.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger('stepstream.service')


class BrokerLossLog(logging.Filter):
    """A handler filter that folds Kafka client warnings and errors into state changes.

    A client warning is held until the service has asked the broker (`checked`): if the broker
    answers, the warning is passed on as the client said it (a rebalance, a coordinator that is
    still loading), with a count of the like lines folded meanwhile; if it does not, the broker is
    lost, and one line says so until it answers again.

    ```python
    handler.addFilter(loss := BrokerLossLog(settings.kafka.bootstrap_servers))
    ...
    if loss.pending:
        loss.checked(await broker_answers(settings))
    ```
    """

    def __init__(self, servers: str, *, client_logger: str = 'aiokafka') -> None:
        super().__init__()
        self.servers = servers
        self.client_logger = client_logger
        self._held: logging.LogRecord | None = None
        self._lost_since: float | None = None
        self._folded = 0

    @property
    def lost(self) -> bool:
        """Whether the broker did not answer when last asked after a client warning."""
        return self._lost_since is not None

    @property
    def pending(self) -> bool:
        """Whether a client warning waits for the broker to be asked (or the broker is lost)."""
        return self._held is not None or self._lost_since is not None

    def filter(self, record: logging.LogRecord) -> bool:
        """Let everything through except the client's warnings, which wait for `checked`."""
        if record.levelno < logging.WARNING or not record.name.startswith(self.client_logger):
            return True
        if self._held is None and self._lost_since is None:
            self._held, self._folded = record, 0
        else:
            self._folded += 1
        return False

    def checked(self, answers: bool) -> None:
        """Record whether the broker answered when asked; logs one line for a change of state."""
        held, self._held = self._held, None
        if answers:
            if self._lost_since is not None:
                log.warning(
                    'Kafka at %s answers again after %.0fs; %d client messages were folded into these lines',
                    self.servers,
                    time.monotonic() - self._lost_since,
                    self._folded,
                )
                self._lost_since = None
            elif held is not None:
                folded = f' ({self._folded} more client messages folded)' if self._folded else ''
                log.log(held.levelno, 'Kafka client: %s%s', held.getMessage(), folded)
        elif self._lost_since is None:
            self._lost_since = time.monotonic()
            cause = f' ({held.getMessage()})' if held is not None else ''
            log.warning('lost Kafka at %s%s; retrying, and quiet until it is back', self.servers, cause)

    def summary(self) -> str | None:
        """One line on the current loss, or None if the broker is not lost."""
        if self._lost_since is None:
            return None
        return (
            f'Kafka at {self.servers} has been away for {time.monotonic() - self._lost_since:.0f}s '
            f'({self._folded} client messages folded)'
        )
