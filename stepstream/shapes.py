"""A record's fields declared once: what each means (its docstring) and where it is not shown.

A read-side record (`RunRecord`, `ToolEffectRecord`, `StepEvent`, ...) is a dataclass whose
attribute docstrings explain its fields, the way `Settings` explains its settings. The views that
show it derive from it: the API's response models (`stepstream.serve`, their OpenAPI descriptions
from these docstrings), the Parquet tables (`stepstream.analytics`) and the CLI's JSON
(`stepstream.console`). A field is shown by every view unless its declaration says otherwise with
`internal(why)`: then no view shows it, and the reason stays beside the field. A view that shows
a field differently (the export counts `gaps` as `missing_seqs`) says so in its own declaration.

This module imports nothing heavy: the CLI reads records without Pydantic.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

_INTERNAL = 'stepstream.internal'
"""The field metadata key that marks a field no view shows; its value says why."""


def internal(why: str) -> Mapping[str, str]:
    """Field metadata: no view shows this field (`why` says what it is for instead).

    `field(default=-1, metadata=internal('what a resolution answers; resolves_seq shows it'))`.
    """
    if not why:
        raise ValueError('say why a field is internal')
    return {_INTERNAL: why}


def is_internal(field: dataclasses.Field[Any]) -> bool:
    """Whether the record declares `field` internal (shown by no view)."""
    return _INTERNAL in field.metadata


def shown_fields(record: type) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of the dataclass `record` that its views show, in declaration order."""
    return tuple(f for f in dataclasses.fields(record) if not is_internal(f))


def plain_type(annotation: Any) -> Any:
    """A field's type as the views show it: a `Literal` as `str`, in a union too (`T | None`)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return str
    if origin in (Union, types.UnionType):
        return Union[tuple(plain_type(a) for a in args)]  # noqa: UP007 (built from a tuple)
    return annotation


_DOCS: dict[type, dict[str, str]] = {}


def field_docs(cls: type) -> dict[str, str]:
    """Each attribute's docstring in the class body of `cls`, whitespace folded to single spaces.

    The string literal right after an annotated attribute is its docstring (PEP 257's attribute
    docstrings; Sphinx and Pydantic's `use_attribute_docstrings` read them the same way). Only
    `cls`'s own body is read, not its bases'. Read from the source, once per class.
    """
    if cls in _DOCS:
        return _DOCS[cls]
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = ' '.join(following.value.value.split())
    _DOCS[cls] = docs
    return docs
