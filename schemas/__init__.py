"""The wire contract: Avro schemas, the record types and their codec."""

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports
from stepstream.schemas._codec import (
    MAGIC,
    SCHEMA_DIR,
    STEP_EVENT_SCHEMA,
    TOOL_EFFECT_SCHEMA,
    SchemaVersion,
    chain_hash,
    decode,
    encode,
    encode_with_fastavro,
    load_schema_versions,
    record_body,
    schema_of,
)
from stepstream.schemas._confluent import (
    CONFLUENT_MAGIC,
    confluent_schema_id,
    from_confluent,
    subject_of,
    to_confluent,
    version_of_schema,
)

if TYPE_CHECKING:
    from stepstream.schemas._patch import (
        MessageState,
        apply_patch,
        message_json,
        message_state,
        patch_json,
        stamp_changes,
        stamps_since,
    )
    from stepstream.schemas._plain import RECORD_TYPES, STEP_EVENTS, TOOL_EFFECTS, Fields, read_record
from stepstream.schemas._types import (
    EVENT_KINDS,
    MAX_NOTE_CHARS,
    RESOLUTIONS,
    RUN_STATUSES,
    TOOL_EFFECT_STATUSES,
    UNCHAINED_KINDS,
    ContinuableSnapshot,
    EffectResolution,
    EventKind,
    LogRecord,
    ModelUsage,
    Resolution,
    RunRecord,
    RunStatus,
    RunUsage,
    SnapshotDelta,
    SnapshotState,
    StepEvent,
    ToolEffectRecord,
    ToolEffectStatus,
    ToolEffectTransition,
    record_maker,
)

__all__ = [
    'CONFLUENT_MAGIC',
    'EVENT_KINDS',
    'MAGIC',
    'MAX_NOTE_CHARS',
    'RECORD_TYPES',
    'RESOLUTIONS',
    'RUN_STATUSES',
    'SCHEMA_DIR',
    'STEP_EVENTS',
    'STEP_EVENT_SCHEMA',
    'TOOL_EFFECTS',
    'TOOL_EFFECT_SCHEMA',
    'TOOL_EFFECT_STATUSES',
    'UNCHAINED_KINDS',
    'ContinuableSnapshot',
    'EffectResolution',
    'EventKind',
    'Fields',
    'LogRecord',
    'MessageState',
    'ModelUsage',
    'Resolution',
    'RunRecord',
    'RunStatus',
    'RunUsage',
    'SchemaVersion',
    'SnapshotDelta',
    'SnapshotState',
    'StepEvent',
    'ToolEffectRecord',
    'ToolEffectStatus',
    'ToolEffectTransition',
    'apply_patch',
    'chain_hash',
    'confluent_schema_id',
    'decode',
    'encode',
    'encode_with_fastavro',
    'from_confluent',
    'load_schema_versions',
    'message_json',
    'message_state',
    'patch_json',
    'read_record',
    'record_body',
    'record_maker',
    'schema_of',
    'stamp_changes',
    'stamps_since',
    'subject_of',
    'to_confluent',
    'version_of_schema',
]


__getattr__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            (
                'MessageState',
                'apply_patch',
                'message_json',
                'message_state',
                'patch_json',
                'record_maker',
                'stamp_changes',
                'stamps_since',
            ),
            'stepstream.schemas._patch',
        ),
        **dict.fromkeys(
            ('RECORD_TYPES', 'STEP_EVENTS', 'TOOL_EFFECTS', 'Fields', 'read_record'),
            'stepstream.schemas._plain',
        ),
    },
)
"""`_patch` needs Pydantic AI: its names are imported on first use, so reading records does not.
`_plain` (the projector's fast read) builds its Avro readers when imported: only its users pay."""
