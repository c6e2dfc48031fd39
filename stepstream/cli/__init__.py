"""The `stepstream` command and what only it uses: the demo, the stack supervisor and the text renderers.

This package sits at the top of the import graph: it may import every other part, none imports it.
"""

from stepstream.cli._main import main

__all__ = ['main']
