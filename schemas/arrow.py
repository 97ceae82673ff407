"""Derive Arrow schemas from pydantic row models: one declaration per output table.

A row model's field annotations give both validation (pydantic) and the Arrow column type:
``int`` is int64, ``float`` float64, ``str`` string, ``bool`` bool, ``bytes`` binary,
``list[X]`` a list, a ``StrEnum`` string, a nested ``BaseModel`` a struct, ``X | None`` a nullable column.
Where the default mapping is not what we store (float32 vectors, int32 counters), the
field says so with ``Annotated[..., Arrow(pa.float32())]``.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Union, get_args, get_origin

import pyarrow as pa
from pydantic import BaseModel


@dataclass(frozen=True)
class Arrow:
    """Annotation marker: store this field with an explicit Arrow type."""

    type: pa.DataType


_SCALARS: dict[Any, pa.DataType] = {
    int: pa.int64(),
    float: pa.float64(),
    str: pa.string(),
    bool: pa.bool_(),
    bytes: pa.binary(),
}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"only X | None unions map to Arrow, not {tp!r}")
    return tp, False


def arrow_type(tp: Any) -> pa.DataType:
    """Arrow type of one annotation (without nullability)."""
    if get_origin(tp) is typing.Annotated:
        base, *meta = get_args(tp)
        for m in meta:
            if isinstance(m, Arrow):
                return m.type
        return arrow_type(base)
    tp, _ = _unwrap_optional(tp)
    if get_origin(tp) is typing.Annotated:
        return arrow_type(tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):  # stored as its string value
        return pa.string()
    origin = get_origin(tp)
    if origin in (list, tuple):
        (item,) = get_args(tp)[:1]
        return pa.list_(arrow_type(item))
    if origin is dict:
        k, v = get_args(tp)
        return pa.map_(arrow_type(k), arrow_type(v))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return pa.struct(_fields(tp))
    if typing.get_origin(tp) is typing.Literal:
        return pa.string()
    raise TypeError(f"no Arrow mapping for {tp!r}")


def _nullable(tp: Any) -> bool:
    if get_origin(tp) is typing.Annotated:
        tp = get_args(tp)[0]
    return _unwrap_optional(tp)[1]


def _fields(model: type[BaseModel]) -> list[pa.Field]:
    hints = typing.get_type_hints(model, include_extras=True)
    out = []
    for name, info in model.model_fields.items():
        tp = hints[name]
        meta = {"doc": info.description} if info.description else None
        out.append(pa.field(name, arrow_type(tp), nullable=_nullable(tp), metadata=meta))
    return out


@lru_cache(maxsize=None)
def arrow_schema(model: type[BaseModel]) -> pa.Schema:
    """The Arrow schema of a row model; field docs travel as field metadata."""
    doc = (model.__doc__ or "").strip().split("\n")[0]
    return pa.schema(_fields(model), metadata={"table": getattr(model, "TABLE", model.__name__), "doc": doc})


def rows_to_table(model: type[BaseModel], rows: list[dict[str, Any]]) -> pa.Table:
    """Build a table of ``model`` from plain dict rows (validated by Arrow's type checks)."""
    return pa.Table.from_pylist(rows, schema=arrow_schema(model))


def empty_table(model: type[BaseModel]) -> pa.Table:
    return arrow_schema(model).empty_table()


def bool_mask(values: Any) -> pa.BooleanArray:
    """A boolean Arrow array of ``values`` (a sequence of bools), built from its bits.

    ``pa.array`` would do, but its first call loads pyarrow's pandas shim, which imports pandas
    (0.4-0.6 s) in a process that never uses it; ``modalign lineage erase`` is a command whose
    latency is a target."""
    import numpy as np

    bits = np.asarray(values, dtype=bool)
    return pa.Array.from_buffers(pa.bool_(), len(bits), [None, pa.py_buffer(np.packbits(bits, bitorder="little"))])
