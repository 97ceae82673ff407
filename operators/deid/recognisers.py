"""Personal-data detection in text: the recognisers behind ``find_pii`` and ``detect_batch``.

Data flow: called by ``modalign.operators.deid.text`` (OCR blocks of PDF pages, before they
are pseudonymised) and ``modalign.operators.deid.frame_text`` (text read in video frames);
what it finds is replaced there. Pure functions over strings: spans in, nothing logged.

Detection (``find_pii``, ``detect_batch``) runs one recogniser per kind and resolves
overlaps (the more specific, checksummed kind wins; a name or address keeps its parts
outside the winner). Recognisers in this module: e-mail (also ``x AT y.org`` and OCR-split
``julia.fischer @example. com``), phone (numbering plans of ``PHONE_REGIONS`` via
libphonenumber), IBAN (ISO 13616 mod-97 and country length, ``O`` for ``0`` tolerated),
payment card (Luhn and issuer prefix, stray dots between digit groups), IPv4/IPv6 (not
versions or OIDs) and dates of birth. In their own modules: ``names`` (spaCy NER judged by
name lists, and rules), ``addresses`` and ``national_ids``. Scores are in ``spans.SCORES``.

Precision trade-offs (measured by ``modalign.pipeline.deid_eval``):

- ``person``: the context rules (score 0.65) also hit organisations in the same position
  ("Meeting with Deutsche Bahn", "Apple Music reported"), except pairs holding a common
  organisation/document word ("Operations Team"), after "the", or before a company suffix;
  a capitalised pair of uncommon words (0.55) also hits product names. Set
  ``min_scores.person`` to 0.7 to switch both off.
- ``address``: see ``addresses``. Score 0.6, the lowest: raise ``min_scores.address`` above
  it to switch it off.
- ``date_of_birth``: only a date (numeric, ISO, or with a month name of English, German,
  French, Spanish, Italian, Portuguese, Dutch, Polish, Turkish or the Scandinavian languages)
  whose preceding 40 characters (one line break at most) hold a birth cue in one of them:
  born, DOB, date of birth, Geburtsdatum, née le, fecha de nacimiento, nato il, data
  urodzenia, doğum tarihi, født ... A birth date without a
  cue (a bare column of dates) is missed; other dates near a cue ("born in 1980, joined
  on 3 May 2015") are hit.
- ``national_id``: see ``national_ids``.

``normalise`` gives the canonical form of an entity value (what a pseudonym is keyed on).
Nothing here logs text, and errors never carry it.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from functools import lru_cache
from typing import Iterable, Mapping

from modalign.operators.deid.addresses import find_addresses
from modalign.operators.deid.name_lexicon import is_common_word, lexicon_version
from modalign.operators.deid.names import repair, find_person_spans, load_nlp, ocr_name_key
from modalign.operators.deid.national_ids import find_national_ids
from modalign.operators.deid.spans import SCORES, PiiSpan


RULES_VERSION = "regex@4"  # 2: phones by numbering plans; 3: name lexicons, no versions as IPs; 4: product terms

KINDS = ("person", "email", "phone", "iban", "card", "ip", "address", "date_of_birth", "national_id")
# On overlap the more specific (checksummed) recogniser wins.
_PRIORITY = {"iban": 0, "card": 1, "email": 2, "national_id": 3, "ip": 4, "phone": 5, "date_of_birth": 6,
             "address": 7, "person": 8}
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
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}[\dOQDSIlBZ]{2}(?:(?:[ \t\n]|\.[ ]?)?[A-Z0-9]){10,32}")
# what OCR reads for the digits of the check digits (which are always two digits)
_CHECK_DIGITS = str.maketrans("OQDSIlBZ", "00051182")
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
        # as read; then with OCR's letters for digits undone in the check digits (O Q D for 0, S for 5,
        # I l for 1, B for 8, Z for 2); then O for 0 everywhere after them
        check = raw[2:4].translate(_CHECK_DIGITS)
        variants = (raw, raw[:2] + check + raw[4:], raw[:2] + check + raw[4:].replace("O", "0"))
        hit = next((n for compact in dict.fromkeys(variants) for n in lengths
                    if n <= len(compact) and iban_valid(compact[:n])), None)
        if hit is None and want:
            # checksum right, length off the registry (a mistyped or made-up bank code): still one, ending
            # where a token of the text ends ("...432319\nID number" is not "...432319ID")
            ends = [n for n in range(len(raw), 14, -1) if n == len(raw) or not text[pos[n - 1] + 1].isalnum()]
            hit = next((n for compact in dict.fromkeys(variants) for n in ends
                        if n != want and iban_valid(compact[:n], registered_length=False)), None)
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
def _find_national_ids(text: str) -> Iterable[PiiSpan]:
    for s, e in find_national_ids(text):
        yield PiiSpan(s, e, "national_id", SCORES["national_id"])


def _find_addresses(text: str) -> Iterable[PiiSpan]:
    for s, e in find_addresses(text):
        yield PiiSpan(s, e, "address", SCORES["address"])


_MONTHS = (
    r"Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|"
    r"Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?|Januar|Februar|März|Mai|Juni|Juli|Oktober|Dezember|"
    # fr, es, it, pt, nl, pl (genitive), tr, nb/da, sv: in lower case too ("3 mars 1986", "14 de marzo de 1986")
    r"(?i:janvier|février|fevrier|mars|avril|juin|juillet|août|aout|septembre|octobre|novembre|décembre|decembre|"
    r"enero|febrero|marzo|abril|mayo|junio|julio|agosto|septiembre|setiembre|octubre|noviembre|diciembre|"
    r"gennaio|febbraio|aprile|maggio|giugno|luglio|settembre|ottobre|dicembre|"
    r"janeiro|fevereiro|março|maio|junho|julho|setembro|outubro|dezembro|"
    r"januari|februari|maart|mei|augustus|mai|"
    r"stycznia|lutego|marca|kwietnia|maja|czerwca|lipca|sierpnia|września|października|listopada|grudnia|"
    r"ocak|şubat|mart|nisan|mayıs|haziran|temmuz|ağustos|eylül|ekim|kasım|aralık|"
    r"januar|februar|juni|juli|oktober|desember|mars|maj|augusti)"
)
_DATE = re.compile(
    r"(?<![\w.])(?:"
    r"\d{1,2}[./-]\d{1,2}[./-](?:\d{4}|\d{2})"  # 14/03/1986, 14.03.86, 3-14-1986
    r"|\d{4}-\d{2}-\d{2}"  # 1986-03-14
    rf"|\d{{1,2}}(?:st|nd|rd|th|er|º)?\.?[ ]+(?:de[ ]+)?(?:{_MONTHS})\.?,?[ ]+(?:de[ ]+)?\d{{4}}"  # 14 March 1986, 14 de marzo de 1986
    rf"|(?:{_MONTHS})\.?[ ]+\d{{1,2}}(?:st|nd|rd|th)?,?[ ]+\d{{4}}"  # March 14, 1986
    r")(?![\w]|[./-]\d)"
)
_DOB_CUE = re.compile(
    r"(?:\bborn\b|\bd\.?\s?o\.?\s?b\b\.?|date\s+of\s+birth|birth\s*date|birthday|\bgeb(?:oren|urtsdatum)?\b\.?|"
    # fr, es, it, pt, nl, pl, tr, nb/da/sv
    r"\bn[ée]e?\s+le\b|date\s+de\s+naissance|fecha\s+de\s+nacimiento|\bnacid[oa]\b|data\s+di\s+nascita|"
    r"\bnat[oa]\s+il\b|data\s+de\s+nascimento|\bnascid[oa]\b|geboortedatum|\bgeboren\b|data\s+urodzenia|"
    r"\burodzon[ya]\b|doğum\s+tarihi|\bfødselsdato\b|\bfødt\b|\bfödd\b|födelsedatum)",
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


@lru_cache(maxsize=1)
def detector_name() -> str:
    """``spacy-en_core_web_sm@<model version>+regex@4+names=<n>,words=<n>``, recorded in every deid header."""
    nlp = load_nlp()
    return f"spacy-en_core_web_sm@{nlp.meta.get('version', '?')}+{RULES_VERSION}+{lexicon_version()}"


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
        for i, found in find_person_spans(texts, idx).items():
            results[i].extend(found)
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
        return ocr_name_key(repair(v)[0])
    if kind == "email":
        return re.sub(r"\s+", "", v).casefold()
    if kind == "phone":
        digits = re.sub(r"\D", "", v.replace("(0)", ""))
        return ("+" if v.lstrip().startswith("+") else "") + digits
    if kind == "iban":
        compact = re.sub(r"\W", "", v).upper()
        return compact[:2] + compact[2:4].translate(_CHECK_DIGITS) + compact[4:]
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
