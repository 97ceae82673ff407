"""Postal addresses in text, in the formats of many countries: the ``address`` recogniser.

Data flow: called by ``modalign.operators.deid.recognisers.detect_batch`` for every text
block; returns character spans, nothing is logged. Pure functions over strings.

An address is found from *anchors* and grown over its neighbouring comma-separated parts:

- **street anchors**: a house number with a street name whose type word is known in one of
  the supported languages, either before the name (``rue``/``avenue``/``boulevard``,
  ``Calle``/``Avenida``/``Ronda``, ``Via``/``Vicolo``/``Piazza``, ``Rua``/``Travessa``,
  ``ul.``/``al.``/``pl.``, ``Caddesi``/``Sokak`` after it) or as the end of one word
  (``Hauptstraße``, ``Sarastraat``, ``Floortjedreef``, ``Kirkeveien``, ``Storgatan``); English
  ``221B Baker Street``; Indian ``Bhatt Nagar``/``MG Marg``; Han-script addresses with a
  province/city and a road (``…省…市…路12号``). A prefix type that is also an English word
  (``Via``, ``Place``, ``Route``) counts only with a house number beside it.
- **postcode anchors**: a postcode of a known shape with its city: ``10115 Berlin`` (5
  digits), ``1012 TX Amsterdam``, ``02-931 Kwidzyn``, ``1250-096 Lisboa``, ``95896-935``,
  ``Nandyal-833788``, US ``City, ST 12345`` and UK ``London NW1 6XE``. Four bare digits and
  a city (``4833 Moen``, also a year and a place) count only right after a street part.
- **a street part and a postcode part** in consecutive comma-separated parts make an address
  whatever the street's type word (``Nygårdroa 1, 4833 Moen``).

Growth: to the right over house numbers, units (``Apt. 90``, ``Appartamento 9``), a
neighbourhood or city (capitalised words ending the part), province codes (``(VE)``,
``/ BA``) and postcodes; to the left over house numbers and units (``Studio 01k``,
``H.No. 97``, ``23/286``) and, before a postcode, the street line. A capitalised part joins
only if it ends at a comma, a full stop or the end of the line ("Hauptstraße 5, Anna Weber
called" stops after the 5).

Missed: addresses with neither a known street type nor a postcode ("Baker Street" alone),
PO boxes, a city alone. False hits: a number before a capitalised phrase ending in a street
word ("4 Project Way"), five digits before a capitalised noun that is no city.
"""

from __future__ import annotations

import re
from typing import Iterable

from modalign.operators.deid.name_lexicon import is_common_word

_UP = "A-ZÀ-ÖØ-ÞĀ-ſ"  # Latin capitals (Latin Extended-A mixes cases; the lower-case pattern requires a lower one)
_LO = "a-zß-öø-ÿĀ-ſ"
# a capitalised word ("Poirier-sur-Mer", "D'Ete", "St.", "'s-Heer", "'t Goy"), or an ordinal ("1ª Seção")
_WORD = rf"(?:(?:'s-|'t[ ])?[{_UP}][{_LO}{_UP}'’.-]*|\d{{1,2}}[ªº])"
_PARTICLE = r"(?:de|del|de la|di|da|do|dos|das|du|des|le|la|les|am|an|im|in der|van|von|y|e|sur|en|aan|op|'s)"
_NAME = rf"{_WORD}(?:[ ](?:{_PARTICLE}[ ])?{_WORD}){{0,3}}"  # 1-4 capitalised words, particles between
_HOUSE = r"\d{1,5}[A-Za-z]?(?:[/-]\d{1,5}[A-Za-z]?)?"  # 12, 12a, 22-15, 79/19

_EN_TYPES = (
    r"Street|[Ss]tr[ec][es][tl]|St|Road|Rd|Avenue|Ave|Lane|Ln|Drive|Dr|Boulevard|Blvd|Court|Ct|Place|Pl|Way|Terrace|"
    r"Close|Crescent|Square|Sq|Parkway|Pkwy|Highway|Hwy|Gardens|Grove|Row|Mews|Hill|Circle|Cir|Trail|Walk|Parade|"
    r"Nagar|Marg|Colony|Chowk|Layout|Enclave|Path|Gali|Vihar|Bazar|Bagh"
)
# "221B Baker Street", "1600 Pennsylvania Avenue NW", "12-14 High St.", "23/286 Bhatt Nagar"
_STREET_EN = re.compile(
    rf"(?<![\w,])(?<!\d\.)\d{{1,5}}[A-Za-z]?(?:[-–/]\d{{1,5}}[A-Za-z]?)?,?[ ]+(?:{_WORD}[ ]+){{1,3}}"
    rf"(?:{_EN_TYPES})\b\.?(?:[ ]+(?:NW|NE|SW|SE|N|S|E|W)\b)?"
)
# The type word first: French, Spanish, Italian, Portuguese, Polish, Romanian ("Rua Gomes", "ul. Kołłątaja")
_PREFIX_TYPES = (
    r"[Rr]ue|[Aa]venue|[Aa]v\.|[Bb]oulevard|[Bb]d|[Aa]llée|[Ii]mpasse|[Cc]hemin|[Qq]uai|[Cc]ours|"
    r"Calle|C/|C\.|Callejón|Acceso|Barranco|Carrer|Avinguda|Plaça|Passeig|Rambla|Pasadizo|Cañada|Bajada|Subida|"
    r"Senda|Polígono|Avenida|Avda\.?|Paseo|Plaza|Camino|Carretera|Ronda|Cuesta|Vial|Travesía|Pasaje|Glorieta|"
    r"Urbanización|"
    r"Viale|Piazza|Piazzale|Corso|Vicolo|Strada|Incrocio|Contrada|Borgo|Rotonda|Canale|Lungomare|Largo|Via|"
    r"Rua|Travessa|Praça|Pátio|Largo|Área|Fazenda|Sítio|Chácara|Condomínio|Viela|Ladeira|Beco|Lagoa|Vereda|Trecho|"
    r"Núcleo|Alameda|Estrada|Rodovia|Conjunto|Favela|Quadra|Vila|Setor|Loteamento|Residencial|"
    r"ul\.|ulica|al\.|aleja|pl\.|plac|os\.|osiedle|Strada|Calea|Bulevardul|Aleea|"
    r"Place|Route|Avenue"
)
_STREET_PREFIX = re.compile(
    rf"(?<![\w])(?:(?P<num>{_HOUSE}),?[ ]+)?(?P<type>{_PREFIX_TYPES})[ ]+(?:{_PARTICLE}[ ]+){{0,2}}{_NAME}"
    rf"(?P<after>,?[ ]+(?:n[º°.][ ]?|nº[ ]?)?{_HOUSE}(?![\w.,]\d))?"
)
# The type word as the end of one word: German, Dutch, Scandinavian ("Oda-Preiß-Straße 1", "Sarastraat 9")
_SZ = "(?:ß|ss|B|ff|fs|f|8)"  # OCR reads ß as B, f, ff, fs or 8
_SUFFIX_TYPES = (
    f"stra{_SZ}e|str\\.|weg|allee|platz|gasse|ring|damm|ufer|chaussee|steig|pfad|markt|"
    "straat|laan|plein|gracht|dreef|singel|kade|hof|steeg|"
    "gate|gata|gaten|gatan|vei|veien|veg|vegen|vägen|väg|vej|vejen|stræde|bakken|stien|svingen|tunet|plass|plassen|"
    "allé|torget|gränd|stig"
)
_SUFFIX_WORDS = (f"Stra{_SZ}e|Str\\.|Weg|Allee|Platz|Gasse|Ring|Damm|Ufer|Chaussee|Straat|Laan|Plein|Gate|Vei|Veien|"
                 "Vej|Gatan")  # the type as a word of its own: "Karl-Marx-Allee 12a", "Berliner Straße 5"
_STREET_SUFFIX = re.compile(
    rf"(?<![\w])(?:[{_UP}][{_LO}]+(?:-[{_UP}][{_LO}]+)*(?:(?:{_SUFFIX_TYPES})|[- ](?:{_SUFFIX_WORDS}))"
    rf"|(?:[{_UP}][{_LO}]+[ ]){{1,2}}(?:{_SUFFIX_WORDS}))"
    rf"[ ]+{_HOUSE}(?![\w])"
)
# Turkish: "Atatürk Caddesi No: 12", "Gül Sokak 5"
_STREET_TR = re.compile(
    rf"(?<![\w])(?:{_WORD}[ ]){{1,3}}(?:Caddesi|Cad\.|Cd\.|Sokak|Sokağı|Sk\.|Bulvarı|Blv\.|Mahallesi|Mah\.)"
    rf"(?:[ ]+(?:No[:.]?[ ]*)?{_HOUSE})?"
)
# Han script: a province/city part and a road, with building numbers ("江苏省淑华市永川罗街I座")
_HAN = r"\u3400-\u9fff"
_STREET_HAN = re.compile(
    rf"(?:[{_HAN}]{{1,8}}(?:省|自治区|特别行政区|市|县|区|州|镇|乡)){{1,4}}[{_HAN}]{{0,10}}(?:路|街|道|巷|胡同|大道)"
    rf"(?:[\dA-Za-z]{{1,5}}(?:号|座|栋|楼|室|单元|幢))*(?:[ ]?\d{{6}}(?!\d))?"
)
# a street part of any type: name + house number, or house number + name (for the street+postcode rule)
_STREET_ANY = re.compile(rf"(?<![\w])(?:{_NAME}[ ]+{_HOUSE}|{_HOUSE},?[ ]+{_NAME})$")

_CITY = rf"(?:{_PARTICLE}[ ])?{_WORD}(?:[ ](?:{_PARTICLE}[ ]){{0,2}}{_WORD}){{0,2}}"
_EIRCODE = r"(?<![\w])[A-Z]\d{2}[ ]?[A-Z\d]{4}(?![\w])"
_POSTCODES = (
    # (shape, needs a street part before it)
    # DE FR ES IT TR (5 digits), BR 95896-935
    (re.compile(rf"(?<![\w.,-])(?:[A-Z]{{1,2}}-)?\d{{5}}(?:-\d{{3}})?,?[ ]+{_CITY}"), False),
    (re.compile(rf"(?<![\w.,-])\d{{4}}[ ]?[A-Z]{{2}}(?![\w]),?(?:[ ]+{_CITY})?"), False),  # NL 1012 TX
    (re.compile(rf"(?<![\w.,-])\d{{2}}-\d{{3}}[ ]+{_CITY}"), False),  # PL 02-931
    (re.compile(rf"(?<![\w.,-])\d{{4}}-\d{{3}}[ ]+{_CITY}"), False),  # PT 1250-096
    # IN PIN after its city: Nandyal-833788, Mumbai 307666 (not "W 223490")
    (re.compile(rf"(?<![\w.-]){_CITY}(?<=[{_LO}]{{2}})(?:[ ]?-[ ]?|[ ])\d{{6}}(?![\w])"), False),
    (re.compile(r"(?<![\w])(?:APO|FPO|DPO)[ ]+(?:AA|AE|AP)[ ]+\d{5}(?![\w])"), False),  # US military mail
    (re.compile(rf"(?<![\w.,-])\d{{8}}[ ]+{_CITY}"), True),  # BR 74833788
    (re.compile(rf"(?<![\w.,-])\d{{4}},?[ ]+{_CITY}"), True),  # NO DK CH AT BE AU: also "1998 Berlin"
    (re.compile(r"(?<![\w.,-])\d{5,6}(?![\w.,-]\d)"), True),  # ES "Córdoba, 47999", IT "30010,", CN
    (re.compile(_EIRCODE), True),  # IE Eircode F83 7022, T92 YRFD
)
_US_STATES = (
    "AL AK AZ AR CA CO CT DE DC FL GA HI ID IL IN IA KS KY LA ME MD MA MI MN MS MO MT NE NV NH NJ NM NY NC ND OH "
    "OK OR PA RI SC SD TN TX UT VT VA WA WV WI WY PR AS FM GU MH MP PW VI"
).split()
_US_CITY_ZIP = re.compile(
    rf"(?<![\w])(?:{_WORD}[ ]){{0,2}}{_WORD},[ ]*(?:{'|'.join(_US_STATES)})[ ]+\d{{5}}(?:-\d{{4}})?(?![\w-])"
)
_UK_POSTCODE = re.compile(r"(?<![\w])(?:[A-PR-UWYZ][A-HK-Y]?\d[A-Z\d]?)[ ]?\d[ABD-HJLNP-UW-Z]{2}(?![\w])")
_UK_TOWN = re.compile(rf"(?:{_WORD}[ ]){{1,2}}$")
_NOT_CITY = frozenset(
    "euro euros eur usd dollar dollars pfund stück units users items people pages words files rows records "
    "employees customers points votes tickets downloads views members visitors kunden mitarbeiter bytes kb mb gb "
    "hz khz mhz ms seconds minutes hours days years".split()
)

# Parts an address grows over (each one after ", " or " ")
_UNIT_WORD = (r"(?:Apt|Apartment|Appartamento|Appartement|Apto|Piso|Suite|Ste|Unit|Flat|Floor|Fl|Studio|Interno|Int|"
              r"Scala|Puerta|Escalera|Esc|Portal|Bajo|Bloco|Casa|Lote|H\.[ ]?No|House[ ]No|No|Nr|Nº|Bl|Blok|Daire|Kat|"
              r"Box|PSC|CMR)\.?:?")
_UNIT = rf"{_UNIT_WORD}[ ]*#?[ ]*[\w/-]{{1,6}}"
_GROW_RIGHT = re.compile(
    rf"(?:,[ ]*|[ ]+)(?:(?P<unit>{_UNIT})|(?P<num>{_HOUSE}|\d{{6}})(?![\w])|(?P<code>\([A-Z]{{2}}\)|/[ ]?[A-Z]{{2}}\b)"
    rf"|(?P<name>{_CITY})(?=[ ]*(?:,|\.(?:\s|$)|;|\)|\n|$|[ ]\(|[ ]/|[ ]\d)))"
)
_CITY_AFTER_POSTCODE = re.compile(rf"[ ]+(?P<name>{_CITY})")
# a unit or house number; or the unit's word alone when its number is the span's first part
_GROW_LEFT = re.compile(rf"(?<![\w])(?:(?:{_UNIT}|{_HOUSE})(?:,[ ]*|[ ]+)|{_UNIT_WORD}[ ]*#?[ ]*)$")
_GROW_LEFT_STREET = re.compile(rf"(?<![\w])(?:{_HOUSE},?[ ]+)?{_NAME}(?:[ ]+{_HOUSE})?,[ ]*$")


_GAP = re.compile(rf"(?:,?[ ]+(?:{_CITY}|{_HOUSE}))?,?[ ]*")


def _postcode_parts(text: str) -> Iterable[tuple[int, int, bool]]:
    """(start, end, needs_street) of every postcode anchor."""
    for pattern, needs_street in _POSTCODES:
        for m in pattern.finditer(text):
            words = re.findall(rf"[{_UP}{_LO}]+", m.group(0))
            if words and (words[-1].casefold() in _NOT_CITY or words[-1].isupper() and len(words[-1]) > 2
                          and not pattern.pattern.startswith(_EIRCODE)):
                continue
            yield m.start(), m.end(), needs_street
    for m in _US_CITY_ZIP.finditer(text):
        yield m.start(), m.end(), False
    for m in _UK_POSTCODE.finditer(text):
        compact = m.group(0).replace(" ", "")
        if len(compact) < 5 or not any(c.isdigit() for c in compact[:-3]):
            continue
        start = m.start()
        town = _UK_TOWN.search(text, max(0, start - 40), start)
        yield (town.start() if town else start), m.end(), False


def _street_parts(text: str) -> Iterable[tuple[int, int, bool]]:
    """(start, end, numbered) of every street anchor; a type-first street without a house number
    ("Ronda Rousey", "Via Roma") is an address only with a postcode after it."""
    for m in _STREET_EN.finditer(text):
        yield m.start(), m.end(), True
    for m in _STREET_PREFIX.finditer(text):
        yield m.start(), m.end(), bool(m.group("num") or m.group("after"))
    for pattern in (_STREET_SUFFIX, _STREET_TR, _STREET_HAN):
        for m in pattern.finditer(text):
            yield m.start(), m.end(), True


def _grow(text: str, start: int, end: int) -> tuple[int, int]:
    """Extend an anchored span over its neighbouring address parts (see the module docstring)."""
    for _ in range(6):
        after_postcode = bool(re.search(r"(?:\d{4,}|[A-Z]\d{2}[ ]?[A-Z\d]{4})$", text[start:end]))
        m = _GROW_RIGHT.match(text, end)
        if m is None and after_postcode:  # the city after a postcode, whatever follows ("F83 7022 Caroline Ville in")
            m = _CITY_AFTER_POSTCODE.match(text, end)
        if m is None or "\n" in m.group(0)[:-1]:
            break
        if m.groupdict().get("name") and m.group("name").split()[-1].casefold() in _NOT_CITY:
            break
        end = m.end()
    for _ in range(3):
        m = _GROW_LEFT.search(text, max(0, start - 32), start)
        if m is None or "\n" in m.group(0):
            break
        start = m.start()
    return start, end


def _numbered_street_before(text: str, s: int) -> bool:
    """Whether "Name 12, " of any street type ends right before ``s`` (and is no "Chapter 12, ")."""
    m = _GROW_LEFT_STREET.search(text, max(0, s - 80), s)
    if m is None:
        return False
    part = _STREET_ANY.search(text[m.start():s].rstrip(", "))
    words = re.findall(rf"[{_UP}{_LO}]+", part.group(0)) if part else []
    return bool(words) and not is_common_word(words[0])


def find_addresses(text: str) -> list[tuple[int, int]]:
    """Sorted, non-overlapping ``(start, end)`` spans of postal addresses in ``text``."""
    spans: list[tuple[int, int]] = []
    unnumbered: list[tuple[int, int]] = []
    for s, e, numbered in sorted(_street_parts(text)):
        if numbered:
            spans.append(_grow(text, s, e))
        else:
            unnumbered.append((s, e))
    for s, e, needs_street in _postcode_parts(text):
        # an unnumbered type-first street up to two parts before ("Pátio Maitê da Cruz, Beija Flor, 24589215")
        street_start = next((us for us, ue in unnumbered if ue <= s and _GAP.fullmatch(text, ue, s)), None)
        if needs_street and street_start is None:
            # right after a street part: an anchored street that ends here, or "Name 12, " of any type
            if not (any(0 <= s - se <= 3 for _, se in spans) or _numbered_street_before(text, s)):
                continue
        for _ in range(2):  # the street line and the town before a postcode ("97 Lynda Bridge, Smithbury, W88 6FJ")
            m = _GROW_LEFT_STREET.search(text, max(0, s - 80), s)
            if m is None or "\n" in m.group(0):
                break
            s = m.start()
        if street_start is not None:
            s = min(s, street_start)
        spans.append(_grow(text, s, e))
    spans.sort()
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1] + 2 and re.fullmatch(r"[ ,]*", text[merged[-1][1]:max(s, merged[-1][1])]):
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    out = []
    for s, e in merged:  # no trailing separator; a full stop only after an abbreviation ("St.")
        while e > s and text[e - 1] in " ,;":
            e -= 1
        if text[e - 1] == "." and not re.search(r"(?<![\w])\w{1,3}\.$", text[s:e]):
            e -= 1
        out.append((s, e))
    return out
