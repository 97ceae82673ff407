"""The detected-entity type and the recognisers' confidence scores (shared by every recogniser module)."""

from __future__ import annotations

from typing import NamedTuple

SCORES = {
    "iban": 0.99,  # mod-97 checksum + country length
    "card": 0.95,  # Luhn + issuer prefix
    "email": 0.95,
    "ip": 0.85,
    "phone": 0.7,
    "national_id": 0.9,  # SSN validity rules / NI prefix rules
    "date_of_birth": 0.8,  # a date with a birth cue before it
    "address": 0.6,  # street-type and postcode patterns: the least precise rule
    "person_ner": 0.85,
    "person_honorific": 0.8,
    "person_initial": 0.75,
    "person_context": 0.65,
    "person_gazetteer": 0.75,
    "person_propagated": 0.7,
    "person_pair": 0.55,  # two capitalised uncommon words, no other evidence
}


class PiiSpan(NamedTuple):
    """A detected entity: ``text[start:end]`` is of ``kind`` with confidence ``score``."""

    start: int
    end: int
    kind: str
    score: float
