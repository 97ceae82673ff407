"""The operator interface every stage implements, and the registry of operators.

An operator knows nothing about Ray: it maps Arrow tables (or a source) to Arrow tables,
so it is unit-testable in-process. ``pipeline/`` wires operators into actors and calls
``setup()`` once per actor (models, handles), then ``process()`` per batch.

Contract (checked for every registered operator by tests/unit/test_operator_contract.py):
``process`` never mutates its input, output matches ``output_schema`` and is deterministic.
A table operator that needs look-ahead across the tables of a stream (frame text) may hold
rows back: it returns them, in stream order, from a later ``process`` or from ``flush()``,
which the caller calls at the end of each stream; ``reset()`` drops carried state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

REGISTRY: dict[str, type["Operator"]] = {}


def all_operators() -> dict[str, type["Operator"]]:
    """Every operator of ``modalign.operators``, by kind (imports the operator modules, which
    load no model: heavy modules load in ``setup()``)."""
    import importlib
    import pkgutil

    import modalign.operators as package

    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
    return dict(REGISTRY)


class OperatorConfig(BaseModel):
    """Base of operator configs: typed, frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


C = TypeVar("C", bound=OperatorConfig)


class Operator(ABC, Generic[C]):
    """A named, versioned, configured transformation.

    Subclasses set ``kind`` (registry name), ``version`` (recorded in lineage) and
    ``config_model``; they load heavy modules in ``setup()``, never at import.
    """

    kind: ClassVar[str]
    version: ClassVar[str]
    config_model: ClassVar[type[OperatorConfig]]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not getattr(cls, "__abstractmethods__", None) and "kind" in cls.__dict__:
            if cls.kind in REGISTRY and REGISTRY[cls.kind] is not cls:
                raise TypeError(f"operator kind {cls.kind!r} registered twice")
            REGISTRY[cls.kind] = cls

    def __init__(self, config: C | None = None) -> None:
        self.config: C = config if config is not None else self.config_model()  # type: ignore[assignment]
        self._ready = False

    @property
    def tag(self) -> str:
        """``kind@version``, the string lineage records."""
        return f"{self.kind}@{self.version}"

    def setup(self) -> None:
        """Load models and open handles; called once per actor before the first batch."""
        self._ready = True

    def ensure_setup(self) -> None:
        if not self._ready:
            self.setup()
            self._ready = True


class TableOperator(Operator[C]):
    """An operator mapping one Arrow table to another."""

    @abstractmethod
    def process(self, table: pa.Table) -> pa.Table:
        """Return a new table; never mutate ``table`` or its buffers."""

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        """Schema of ``process``'s output for a given input schema (default: unchanged)."""
        return input_schema

    def flush(self, cut: bool = False) -> list[pa.Table]:
        """End of a stream: the rows still held back, in order (default: none are held).
        ``cut``: the stream goes on past the last row given (a video range that ends inside its
        overlap with the next), for an operator that treats a stream's last row apart."""
        return []

    def reset(self) -> None:
        """Forget what is carried between the tables of a stream (default: nothing is)."""
