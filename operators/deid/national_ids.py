"""National identity numbers in text: the ``national_id`` recogniser.

Data flow: called by ``modalign.operators.deid.recognisers.detect_batch`` for every text
block; returns character spans, nothing is logged. Pure functions over strings.

- US SSN ``AAA-GG-SSSS`` / ``AAA GG SSSS`` (same separator twice; area 000, 666 and 900-999,
  group 00 and serial 0000 never issued, nor the advertised 078-05-1120 and 219-09-9999);
  nine bare digits only right after "SSN"/"social security"; US ITINs (9, then the IRS's
  group ranges).
- UK National Insurance numbers (two prefix letters by HMRC's rules, six digits, suffix
  A-D); other letters in that shape (placeholders such as ``ZZ``) only after an id word.
- Numbers with a check digit, by length: Norway fødselsnummer, Poland PESEL, Turkey T.C.
  Kimlik, Brazil CPF (11); Netherlands BSN (9); France NIR (15, Corsica's 2A/2B included);
  China resident id (18, last may be X); Spain DNI / NIE (8 digits and a letter); Italy
  codice fiscale (16). A bare digit run counts only after an identity word (``_ID_CUE``) or
  when written in its own format (CPF ``123.456.789-09``, an 18-digit Chinese id).

Any other 3-2-4 digit group is a false hit (order numbers in that shape are rare); ids of
other countries without such a structure are missed.
"""

from __future__ import annotations

import re
from typing import Iterable

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


def find_national_ids(text: str) -> Iterable[tuple[int, int]]:
    """``(start, end)`` of every national id in ``text`` (see the module docstring)."""
    for m in _SSN.finditer(text):
        if re.sub(r"\D", "", m.group(0)) not in _SSN_NOT_ISSUED:
            yield m.start(), m.end()
    for m in _SSN_BARE.finditer(text):  # nine bare digits only right after an SSN cue
        if _SSN_CUE.search(text[max(0, m.start() - 24):m.start()]) and m.group(0) not in _SSN_NOT_ISSUED:
            yield m.start(), m.end()
    for m in _NINO.finditer(text):
        yield m.start(), m.end()
    for m in _ITIN.finditer(text):
        yield m.start(), m.end()
    for m in _NINO_SHAPE.finditer(text):  # unallocated prefixes or suffixes (ZZ, TN: placeholders) labelled as an id
        if not _NINO.fullmatch(m.group(0)) and _ID_CUE.search(text, max(0, m.start() - 40), m.start()):
            yield m.start(), m.end()
    for m in _CODICE_FISCALE.finditer(text):
        if _codice_fiscale_ok(m.group(0)):
            yield m.start(), m.end()
    for m in _ID_NUMBER.finditer(text):
        raw = m.group(0)
        digits = re.sub(r"[ .\-/]", "", raw).upper()
        cued = bool(_ID_CUE.search(text, max(0, m.start() - 40), m.start()))
        structured = bool(re.fullmatch(r"\d{3}\.\d{3}\.\d{3}-\d{2}", raw)) or len(digits) == 18  # CPF as written; CN
        if (cued or structured) and any(check(digits) for check in _ID_CHECKS.get(len(digits), ())):
            yield m.start(), m.end()


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
