"""Properties of a text block (``schemas.tables.TextQuality``), measured by the PDF ingest operator
on the words it extracted, before personal data is pseudonymised."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def ocr_confidence(words: Iterable[dict[str, Any]], extraction: str) -> float | None:
    """Mean tesseract confidence (0-100) of an OCR block's words; None for a text-layer block (its
    words are exact, their ``conf`` a constant 100) and for a block without words."""
    if extraction != "ocr":
        return None
    confs = [float(w["conf"]) for w in words]
    return sum(confs) / len(confs) if confs else None
