"""The reference's store protocol over the projection: code written for pydantic-ai-harness reads stepstream.

`ReferenceStore(reader)` answers the read methods of pydantic-ai-harness's `StepStore` (and the
`list_snapshots` its stores have) with its own records, so its `inspect_recovery`, `continue_run`,
`fork_run` and `ConversationSearch(SnapshotHistorySource(store))` run against the projection
unchanged. It writes nothing. pydantic-ai-harness is imported only when a read answers
(`pip install --no-deps pydantic-ai-harness`): never a dependency of stepstream.

```python
from pydantic_ai_harness.step_persistence.recovery import inspect_recovery
from stepstream.readmodel import ProjectionReader
from stepstream.reference import ReferenceStore

async with ProjectionReader.from_settings(settings) as reader:
    report = await inspect_recovery(store=ReferenceStore(reader), run_id='support-0193...')
```

What maps to what, and what does not: docs/migrating.md and decision 0059.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.reference._convert import EFFECT_STATUS, EVENT_KIND, RESOLVED
    from stepstream.reference._store import ReferenceStore

_WHERE = {
    'EFFECT_STATUS': 'stepstream.reference._convert',
    'EVENT_KIND': 'stepstream.reference._convert',
    'RESOLVED': 'stepstream.reference._convert',
    'ReferenceStore': 'stepstream.reference._store',
}
"""Where each public name lives: imported on first use."""

__all__ = ['EFFECT_STATUS', 'EVENT_KIND', 'RESOLVED', 'ReferenceStore']

__getattr__ = lazy_exports(__name__, _WHERE)
