"""Pseudonymisation of personal data in OCR text, inside the ingest worker.

Data flow: ``modalign.operators.ingest`` PDF render -> tesseract (blocks with word boxes) ->
**TextPiiOperator** -> page schedule and the aligner. OCR text never leaves the ingest
process un-replaced: this operator rewrites each block's ``text`` and ``words``. What
counts as personal data, and how it is found, is ``modalign.operators.deid.recognisers``
(``detect_batch``); this module decides what each entity becomes.

Replacement per entity kind (``TextPolicy.action_for``: ``actions[kind]``, else
``action``): ``pseudonymise`` -> ``<PERSON_3f9a1c2b>``, the first 8 hex digits of
HMAC-SHA256(tenant key, kind + normalised value): the same entity gives the same token
within a tenant, across documents; normalisation (``recognisers.normalise``) drops
whitespace and case, so ``J ulia Fischer`` and ``Julia Fischer`` share a token. ``hash``
-> all 64 hex digits of that HMAC (a join key without collisions). Keys come from
``modalign.operators.deid.keystore`` (deleting the key unlinks all tokens and hashes).
``mask`` -> ``<PERSON>``, ``drop`` -> ``""``, ``keep`` -> unchanged (detections are still
counted). Score thresholds: ``threshold_for(kind)``.

Nothing here logs text, and errors never carry it: messages name the event only.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pyarrow as pa
from pydantic import Field

from modalign.operators.base import OperatorConfig, TableOperator
from modalign.operators.deid.keystore import KeyStore
from modalign.operators.deid.name_lexicon import lexicon_version
from modalign.operators.deid.names import load_nlp, name_key
from modalign.operators.deid.recognisers import RULES_VERSION, PiiSpan, detect_batch, detector_name, normalise
from modalign.operators.deid.tokens import TOKEN_HEX
from modalign.schemas.errors import ComplianceError, InputError, ModalignError
from modalign.schemas.arrow import arrow_type
from modalign.schemas.policy import DEFAULT_POLICY_TAG, TextPolicy
from modalign.schemas.tables import DeidHeader, PiiCount

TEXT = "text"
WORDS = "words"
DEID = "deid"
PII_COUNTS = "pii_counts"
DEID_TYPE = arrow_type(DeidHeader)
PII_COUNTS_TYPE = arrow_type(list[PiiCount])


def pseudonym(key: bytes, kind: str, value: str) -> str:
    """``<KIND_xxxxxxxx>``: keyed, deterministic per (key, kind, normalised value)."""
    return f"<{kind.upper()}_{keyed_digest(key, kind, value)[:TOKEN_HEX]}>"


def keyed_digest(key: bytes, kind: str, value: str) -> str:
    """HMAC-SHA256(key, kind + normalised value) as 64 hex digits (the ``hash`` action's output)."""
    return hmac.new(key, f"{kind}\x1f{normalise(kind, value)}".encode(), hashlib.sha256).hexdigest()


KEYED_ACTIONS = frozenset({"pseudonymise", "hash"})


def replace_entity(action: str, kind: str, value: str, key: bytes | None) -> str:
    """What an entity's text becomes under ``action`` (``keep`` returns it unchanged)."""
    if action == "pseudonymise":
        return pseudonym(key, kind, value)  # type: ignore[arg-type]
    if action == "hash":
        return keyed_digest(key, kind, value)  # type: ignore[arg-type]
    if action == "mask":
        return f"<{kind.upper()}>"
    if action == "drop":
        return ""
    if action == "keep":
        return value
    raise ValueError(f"unknown text action {action!r}")


# --------------------------------------------------------------------------------------
# Operator
# --------------------------------------------------------------------------------------
class TextPiiConfig(OperatorConfig):
    text: TextPolicy = TextPolicy()
    policy_tag: str = DEFAULT_POLICY_TAG
    tenant: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    key_store_dir: Path | None = Field(None, description="pseudonym key vault; None: ~/.modalign/keys")


class TextPiiOperator(TableOperator[TextPiiConfig]):
    """Replace personal data in OCR blocks; adds ``deid`` and ``pii_counts``.

    Input: ``text`` (string) and optionally ``words`` (list<Word>) plus any other columns,
    which pass through. Output: the same columns with personal data replaced in ``text``
    and in ``words`` (a word overlapping an entity gets the text outside the entity plus,
    if the entity starts in it, the replacement; ``entity`` is set to the kind; boxes are
    kept), ``deid`` (method = the action, count = entities replaced) and ``pii_counts``,
    a list of ``{kind, count}`` sorted by kind: entities detected per kind (policy kinds at or above
    ``min_score``; for ``keep`` these are counted but not replaced). The tenant key is
    read from the vault on every call, so a key deleted mid-run is never used again.
    """

    kind = "text_pii"
    version = "0.2.0"
    config_model = TextPiiConfig

    def setup(self) -> None:
        self._store = KeyStore(self.config.key_store_dir)
        if "person" in self.config.text.entities:
            load_nlp()
        if {"person", "address"} & set(self.config.text.entities):
            lexicon_version()  # the word lists load here: a missing one fails the setup, not the first batch
        self._ready = True

    @property
    def detector(self) -> str:
        return detector_name() if "person" in self.config.text.entities else f"{RULES_VERSION}"

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        schema = input_schema
        for name in (DEID, PII_COUNTS):
            i = schema.get_field_index(name)
            if i >= 0:
                schema = schema.remove(i)
        return schema.append(pa.field(DEID, DEID_TYPE)).append(pa.field(PII_COUNTS, PII_COUNTS_TYPE))

    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        if TEXT not in table.column_names:
            raise InputError(f"text_pii needs a {TEXT!r} column", stage=self.kind, code="bad_batch")
        try:
            return self._process(table)
        except ModalignError:
            raise
        except Exception as exc:  # never let a message carrying text escape
            first = table.column("event_id")[0].as_py() if "event_id" in table.column_names and table.num_rows else None
            raise ComplianceError(
                f"text de-identification failed ({type(exc).__name__}) in the batch starting at event {first}; "
                "the batch is withheld",
                stage=self.kind,
            ) from None

    def _process(self, table: pa.Table) -> pa.Table:
        pol = self.config.text
        texts: list[str | None] = table.column(TEXT).to_pylist()
        has_words = WORDS in table.column_names
        words: list[list[dict] | None] = table.column(WORDS).to_pylist() if has_words else [None] * len(texts)
        # a block with words but no text is detected on its words joined by spaces
        probe = [t if t is not None else (" ".join(w["text"] for w in ws) if ws else None) for t, ws in zip(texts, words)]
        thresholds = {k: pol.threshold_for(k) for k in pol.entities}
        spans = detect_batch(probe, pol.entities, min_scores=thresholds)
        key = None
        if any(pol.action_for(s.kind) in KEYED_ACTIONS for sp in spans for s in sp):
            key = self._store.key(self.config.tenant)

        def replacement(text: str, s: PiiSpan) -> str:
            return replace_entity(pol.action_for(s.kind), s.kind, text[s.start : s.end], key)

        new_texts, new_words, headers, counts = [], [], [], []
        for t, ws, probe_t, sp in zip(texts, words, probe, spans):
            kinds = [s.kind for s in sp]
            counts.append([{"kind": k, "count": kinds.count(k)} for k in sorted(set(kinds))])
            replaced = [s for s in sp if pol.action_for(s.kind) != "keep"]
            if replaced and probe_t is not None:
                if t is not None:
                    out = t
                    for s in sorted(replaced, reverse=True):
                        out = out[: s.start] + replacement(t, s) + out[s.end :]
                    new_texts.append(out)
                else:
                    new_texts.append(None)
                new_words.append(_replace_words(probe_t, ws, replaced, lambda s: replacement(probe_t, s)) if ws else ws)
            else:
                new_texts.append(t)
                new_words.append(ws)
            methods = sorted({pol.action_for(s.kind) for s in sp}) or [pol.action]
            headers.append(
                {
                    "policy": self.config.policy_tag,
                    "method": "+".join(methods),
                    "detector": self.detector,
                    "count": len(replaced) if probe_t is not None else 0,
                    "threshold": pol.min_score,
                }
            )
        out = table
        i = out.schema.get_field_index(TEXT)
        out = out.set_column(i, out.schema.field(i), pa.array(new_texts, type=out.schema.field(i).type))
        if has_words:
            j = out.schema.get_field_index(WORDS)
            out = out.set_column(j, out.schema.field(j), pa.array(new_words, type=out.schema.field(j).type))
        for name in (DEID, PII_COUNTS):
            k = out.schema.get_field_index(name)
            if k >= 0:
                out = out.remove_column(k)
        out = out.append_column(pa.field(DEID, DEID_TYPE), pa.array(headers, type=DEID_TYPE))
        return out.append_column(pa.field(PII_COUNTS, PII_COUNTS_TYPE), pa.array(counts, type=PII_COUNTS_TYPE))


def _align_words(text: str, words: list[dict]) -> list[tuple[int, int] | None]:
    """Character span of each word in the block text (words are in reading order)."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for w in words:
        wt = w.get("text") or ""
        if not wt.strip():
            spans.append(None)
            continue
        pos = text.find(wt, cursor)
        if pos < 0:
            pos = text.find(wt)  # out-of-order word: first occurrence
        if pos < 0:
            spans.append(None)
            continue
        spans.append((pos, pos + len(wt)))
        cursor = pos + len(wt)
    return spans


def _replace_words(text: str, words: list[dict], spans: list[PiiSpan], repl) -> list[dict]:
    """Rewrite the words that overlap replaced entities; boxes and confidences are kept."""
    out = []
    keys = [(s, name_key(text[s.start : s.end])) for s in spans]
    for w, ws in zip(words, _align_words(text, words)):
        w = dict(w)
        if ws is None:
            # not locatable in the block text: blank it if it is part of any entity
            k = name_key(w.get("text") or "")
            hit = next((s for s, sk in keys if len(k) >= 2 and k in sk), None)
            if hit is not None:
                w["text"], w["entity"] = "", hit.kind
            out.append(w)
            continue
        a, b = ws
        hits = [s for s in spans if s.start < b and s.end > a]
        if not hits:
            out.append(w)
            continue
        pieces, pos = [], a
        for s in hits:
            if s.start > pos:
                pieces.append(text[pos : s.start])
            if s.start >= a:
                pieces.append(repl(s))
            pos = max(pos, s.end)
        if pos < b:
            pieces.append(text[pos:b])
        w["text"] = "".join(pieces)
        w["entity"] = hits[0].kind
        out.append(w)
    return out
