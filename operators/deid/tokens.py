"""The keyed tokens text de-identification writes, apart from its models so that readers of
OUT (the lineage store, the subject registry) can find them without loading any.

- ``pseudonymise``: ``<KIND_xxxxxxxx>``, the kind in capitals and ``TOKEN_HEX`` hex digits of
  the keyed digest;
- ``hash``: the whole keyed digest, 64 hex digits.

A word may carry a token with punctuation around it (``(<PERSON_3f9a1c2b>,``): search, never
match the whole word.
"""

from __future__ import annotations

import re

TOKEN_HEX = 8
DIGEST_HEX = 64
TOKEN_PATTERN = rf"<[A-Z_]+_[0-9a-f]{{{TOKEN_HEX}}}>|\b[0-9a-f]{{{DIGEST_HEX}}}\b"  # Python and DuckDB (RE2) alike
TOKEN_RE = re.compile(TOKEN_PATTERN)


def tokens_in(text: str | None) -> list[str]:
    """The pseudonym and digest tokens in ``text``, in order (a kept or masked value has none)."""
    return TOKEN_RE.findall(text or "")
