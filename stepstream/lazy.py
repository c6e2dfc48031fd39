"""Public names imported on first use: what keeps a command from paying for modules it never needs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's `__getattr__` (PEP 562) that imports each name's module when the name is first used.

    ```python
    _WHERE = {'ProjectionReader': 'stepstream.readmodel._reader'}
    __getattr__ = lazy_exports(__name__, _WHERE)
    ```

    `stepstream runs` needs a reader, not Pydantic AI, pyarrow or FastAPI: each name is imported
    from its module on first use and kept in the package, so later uses cost nothing.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f'module {package!r} has no attribute {name!r}')
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
