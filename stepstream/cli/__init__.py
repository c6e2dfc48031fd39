"""The `stepstream` command and what only it uses: the demo, the stack supervisor and the text renderers.

This package sits at the top of the import graph: it may import every other part, none imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.lazy import lazy_exports

if TYPE_CHECKING:
    from stepstream.cli._main import main

_WHERE = {
    'main': 'stepstream.cli._main',
}
"""Where each public name lives: imported on first use, so a command pays only for what it uses."""

__all__ = [
    'main',
]

__getattr__ = lazy_exports(__name__, _WHERE)
