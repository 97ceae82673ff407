"""Word lists the person-name rules consult: given names of many countries, common English words.

Sits under ``modalign.operators.deid.recognisers``: a capitalised pair is taken as a name when
its first word is a given name of some country (``given_names``), and a NER guess is kept
only when it looks like a name rather than a heading or a product ("License", "Output
Formats", "Cover Texts"), which is judged with ``common_words``.

- Given names: Jörg Michael's ``nam_dict.txt`` (GNU FDL), about 48,000 first names with
  frequencies for 55 countries (Europe, Turkey, India, China and Korea romanised, Japan,
  Arabic countries ...), as shipped inside the ``gender-guesser`` wheel (read as a data
  file; its code is not imported). Names that are also common lowercase English words
  ("Will", "Grace", "Max", "Mark") are left out unless the curated list in
  ``names.GIVEN_NAMES`` has them, so "Max Depth" is not a person.
- Common words: the system word list (Debian ``wamerican``, ``/usr/share/dict/words``;
  another list via ``MODALIGN_WORDLIST``): its lowercase entries are the language's common
  words; capitalised entries (proper nouns) are not used.

Both load once per process; a missing list raises DependencyMissingError naming the package,
never a silent weaker detector (the detector name records both lists' sizes).
"""

from __future__ import annotations

import importlib.util
import os
import unicodedata
from functools import lru_cache
from pathlib import Path

from modalign.schemas.errors import DependencyMissingError

WORDLIST_ENV = "MODALIGN_WORDLIST"
DEFAULT_WORDLIST = Path("/usr/share/dict/words")
# Letters NFKD does not decompose, folded as a reader (or OCR) would: Øyvind -> oyvind
_FOLD = str.maketrans({"ø": "o", "Ø": "o", "æ": "ae", "Æ": "ae", "œ": "oe", "Œ": "oe", "ß": "ss", "ł": "l",
                       "Ł": "l", "đ": "d", "Đ": "d", "ð": "d", "þ": "th", "ı": "i", "ŀ": "l"})


def fold(word: str) -> str:
    """Casefolded, accents and special letters removed: ``Øyvind`` and ``Oyvind`` -> ``oyvind``."""
    if word.isascii():  # most words: nothing to translate or decompose (the lists' 150,000 folds at start-up)
        return word.casefold()
    decomposed = unicodedata.normalize("NFKD", word.translate(_FOLD))
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()


def _nam_dict() -> Path:
    from modalign.operators.dependencies import PACKAGES

    spec = importlib.util.find_spec("gender_guesser")  # locates the package without running its code
    if spec is None or not spec.submodule_search_locations:
        raise PACKAGES["gender_guesser"].error()
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "nam_dict.txt"
    if not path.is_file():
        raise PACKAGES["gender_guesser"].error(f"given-name list {path} of gender-guesser")
    return path


@lru_cache(maxsize=1)
def common_words() -> frozenset[str]:
    """Lowercase entries of the system word list (casefolded, NFC)."""
    path = Path(os.environ.get(WORDLIST_ENV) or DEFAULT_WORDLIST)
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").split()
    except OSError:
        raise DependencyMissingError(f"English word list {path} (Debian package wamerican, or set {WORDLIST_ENV})",
                                     apt="wamerican") from None
    # casefolded, accents kept: "Hövel" is no "hovel" (a text that lost its accents reads as the word)
    words = frozenset(unicodedata.normalize("NFC", w).casefold() for w in lines if w[:1].islower() and "'" not in w)
    if len(words) < 1000:
        raise DependencyMissingError(f"English word list {path} has only {len(words)} lowercase words",
                                     apt="wamerican")
    return words


@lru_cache(maxsize=1)
def all_given_names() -> frozenset[str]:
    """``fold``-ed given names of ``nam_dict.txt`` (each part of a compound such as ``Jing+Bin``),
    common English words included (Amber, Mason, Will)."""
    names: set[str] = set()
    with _nam_dict().open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("#") or len(line) < 4:
                continue
            field = line[3:29].strip()
            if line[:1] == "=":  # "=  Abby Abigail": a short form and its long form
                parts = field.split()
            else:
                parts = field.replace("+", " ").replace("-", " ").split()
            for p in parts:
                k = fold(p)
                if len(k) >= 2 and k.isalpha():
                    names.add(k)
    return frozenset(names)


@lru_cache(maxsize=1)
def given_names() -> frozenset[str]:
    """``all_given_names`` that are not common English words, plus the curated ``names.GIVEN_NAMES``."""
    from modalign.operators.deid.names import GIVEN_NAMES

    common = {fold(w) for w in common_words()}
    return frozenset({k for k in all_given_names() if k not in common} | {fold(n) for n in GIVEN_NAMES})


def is_given_name(word: str) -> bool:
    """Whether ``word`` (any case, accents optional) is a given name that is not a common word;
    a hyphenated word is one when a part is (``Eivind-Rune``, ``Jean-Baptiste``)."""
    names = given_names()
    key = fold(word.strip(".,;:'’"))
    return key in names or ("-" in key and any(part in names for part in key.split("-") if part))


def is_a_given_name_at_all(word: str) -> bool:
    """Whether ``word`` is in the given-name list even if it is also a common word (Amber, Mason)."""
    return fold(word.strip(".,;:'’")) in all_given_names()


def is_common_word(word: str) -> bool:
    """Whether ``word`` is a common lowercase English word (``Document``, ``License``, ``Format``)."""
    return unicodedata.normalize("NFC", word.strip(".,;:'’")).casefold() in common_words()


def lexicon_version() -> str:
    """``names=<n>,words=<n>``: goes into the detector name, so a different list shows in lineage."""
    return f"names={len(given_names())},words={len(common_words())}"
