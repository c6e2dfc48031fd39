"""Errors a user of stepstream can meet, each saying what happened and what to do."""

from __future__ import annotations


class StepStreamError(Exception):
    """Base class of every stepstream error."""


class StepStreamUnavailable(StepStreamError):
    """The Kafka cluster did not answer or did not acknowledge a write in time.

    Raised at durability points (a tool's `started` transition, a snapshot, the end of a run):
    the run fails rather than continue without its record.
    """


class RecordTooLarge(StepStreamError):
    """A record is still above the size limit after its large parts were moved to media."""


class MediaUnavailable(StepStreamError):
    """The media store (S3) could not be reached or refused the request."""


class SchemaError(StepStreamError):
    """Bytes that are not a stepstream record, or a record of an unknown schema.

    `reason` is the DLQ reason code: `not_a_record`, `unknown_version` or `corrupt`.
    """

    def __init__(self, message: str, *, reason: str = 'corrupt') -> None:
        super().__init__(message)
        self.reason = reason


class UsageError(StepStreamError):
    """A command or path was used wrongly (a file where a directory belongs, a missing projection).

    The CLI exits with code 2 for these.
    """


class ProjectionInUse(UsageError):
    """Another process holds the projection open for writing."""


class ProjectionMismatch(UsageError):
    """A projection was built from other topics, another cluster or with other options."""


class SecureConnectionError(StepStreamError):
    """Kafka refused the connection's security; the message names the setting to fix.

    An untrusted certificate, a refused password, a TLS client on a plaintext listener or the reverse.
    """


class AccessDenied(StepStreamError):
    """The broker's ACLs do not let this principal do what it asked (create, write, read, commit).

    The message names the principal, what was refused and the ACL or command that fixes it.
    """


class NotFound(StepStreamError, LookupError):
    """What was asked for (a run, a snapshot) is not in the projection.

    Every view of one run raises it for an unknown run id; the CLI exits with code 1.
    """


class BadCursor(NotFound):
    """A page's `after` that is no place in its listing: malformed, or naming nothing listed there.

    Not found, to the read model and the CLI (exit code 1); a bad parameter to the read service,
    which answers 400 (a 404 would say the run is not there: how a group's members decide whom
    to ask).
    """


class NotUnknown(StepStreamError):
    """An operator tried to resolve a tool effect that is not `unknown_after_crash` (any more).

    Only an effect whose side effect may or may not have happened needs an operator's answer;
    one that completed, failed or was resolved already keeps its status.
    """


class NotWaiting(StepStreamError):
    """A decision for a tool call that does not wait for one: unknown, not deferred, or decided already.

    The first decision in the log decides a deferred call; `decision` is the one that stands, when
    one does (a `ToolEffectRecord`'s `resolution`), so a caller can say what was decided and by whom.
    """

    def __init__(self, message: str, decision: object | None = None) -> None:
        super().__init__(message)
        self.decision = decision


class EffectInFlight(NotUnknown):
    """An operator tried to resolve a call that is still in flight: its run's writer is alive.

    The call may still end on its own; resolving it would race the tool. An operator who knows
    the process is gone (its writer still sends heartbeats, say, from a wedged event loop) can
    override with `force` (`stepstream resolve --force`, `"force": true` in the API).
    """


class SchemaRegistryError(StepStreamUnavailable):
    """The schema registry (`STEPSTREAM_SCHEMA_REGISTRY_URL`) did not answer, or refused a request.

    A record whose schema id the producer has not cached cannot be written without it: the record
    is kept and sent once the registry answers, and the durability point that waits for it fails
    with this error. The message names the registry, the setting and the registry's answer.
    `refused` tells a registry that answered no (an incompatible schema, a refused user) from
    one that did not answer.
    """

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class ReadOnlyStore(StepStreamError):
    """A write through `stepstream.reference.ReferenceStore`, which only reads the projection.

    Runs reach the log through their writer: stepstream's `StepPersistence` capability for new
    runs, `stepstream import` for the runs of an existing pydantic-ai-harness store.
    """


class ConversationLive(StepStreamError):
    """Continuing a conversation whose latest run is live: its writer is still at it.

    A second writer continuing from the same history would fork the conversation under it. The
    message names the run and its writer; `allow_live=True` continues anyway (decision 0062).
    """

    def __init__(self, message: str, run_id: str, writer: str | None) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.writer = writer
