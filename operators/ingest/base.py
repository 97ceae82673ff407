"""What an ingest operator receives and yields.

Ingest operators turn one source into event tables on the session clock. They run inside
the ingest worker; their output may hold raw payload (pixels, OCR text) only until the
de-identification operators of ``modalign.operators.deid`` have replaced it, in the same process.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa

from modalign.operators.align.clock import SessionClock
from modalign.operators.base import C, Operator
from modalign.schemas.manifest import SourceSpec


@dataclass(frozen=True)
class SourceContext:
    """One source of one session, resolved to a local file.

    ``reader``: when set, decoders read the source's bytes through it (a
    ``schemas.files.SeekableHashingReader`` hashes them on the way) instead of opening ``path``."""

    session_id: str
    spec: SourceSpec
    path: Path
    uri: str
    version: str
    reader: Any = field(default=None, compare=False, repr=False)
    window: Any = None  # a ``video.VideoRange``: decode only that stretch of the video (None: all of it)

    @property
    def clock(self) -> SessionClock:
        return SessionClock.from_mapping(self.spec.clock)


def event_id(session_id: str, source_id: str, kind: str, index: int) -> str:
    """Deterministic event id: stable across runs for the same session and source."""
    return f"{session_id}/{source_id}/{kind}/{index}"


class SourceOperator(Operator[C]):
    """Reads one source and yields event tables in bounded batches."""

    modality: ClassVar[str]

    @abstractmethod
    def read(self, source: SourceContext) -> Iterator[pa.Table]:
        """Yield event tables (schema: ``output_schema``) in session-time order.

        Raises ``modalign.schemas.errors.InputError`` (with a reason code) for bad input.
        """

    @abstractmethod
    def output_schema(self) -> pa.Schema:
        """Schema of the tables ``read`` yields."""
