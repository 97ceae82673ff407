"""Text PII recall across locales, on values the detector was never tuned on.

``python benchmarks/pii_locales.py [--per-kind 40] [--seed 7]``

Faker (eval extra) makes names, phones, IBANs, addresses, dates of birth, national ids and
e-mails for 14 locales; each value is put in one of several English sentences (the detector's
NER model is English, as in the documents the product sees) and the sentence goes through
``detect_batch`` alone, as born-digital text (no rendering or OCR: that is deid-eval's part).
A value counts as found when spans of any kind cover at least 90 % of its characters (what
matters is that it is removed, not what it is called). Prints recall per kind and locale, and
a few misses per kind so the failure classes are visible. Measures only: nothing is tuned here.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict

LOCALES = ["de_DE", "no_NO", "zh_CN", "en_IE", "fr_FR", "es_ES", "pl_PL", "tr_TR", "it_IT", "nl_NL", "pt_BR",
           "en_IN", "en_GB", "en_US"]

TEMPLATES = {
    "person": ["The report was signed by {v} on Monday.", "Please forward the minutes to {v}.",
               "{v} joined the project team last spring.", "Contact person: {v}"],
    "phone": ["Please call {v} tomorrow.", "Tel.: {v}", "You can reach the office on {v} until five.",
              "Mobile {v} (after 6 pm)"],
    "iban": ["Transfer the refund to IBAN {v} by Friday.", "Account: {v}", "Bank details {v}, reference 2291."],
    "address": ["The parcel goes to {v}.", "Address: {v}", "She moved to {v} in 2019."],
    "date_of_birth": ["Date of birth: {v}", "born on {v} in the city hospital", "DOB {v}"],
    "national_id": ["National ID {v} was checked at the desk.", "ID number: {v}", "Tax id {v} is on file."],
    "email": ["Write to {v} for details.", "E-mail: {v}", "cc {v} on the next reply"],
}


def value(fake, kind: str) -> str | None:
    """One value of ``kind`` in the locale of ``fake`` (None when the locale has no such provider)."""
    try:
        if kind == "person":
            return fake.name()
        if kind == "phone":
            return fake.phone_number()
        if kind == "iban":
            return fake.iban()
        if kind == "address":
            return ", ".join(line.strip() for line in fake.address().splitlines())
        if kind == "date_of_birth":
            d = fake.date_of_birth(minimum_age=18, maximum_age=90)
            return random.choice([d.strftime("%d.%m.%Y"), d.strftime("%Y-%m-%d"), d.strftime("%d/%m/%Y"),
                                  d.strftime("%d %B %Y")])
        if kind == "national_id":
            return fake.ssn()
        if kind == "email":
            return fake.email()
    except AttributeError:
        return None
    return None


def found(start: int, end: int, spans) -> bool:
    covered = set()
    for s in spans:
        covered.update(range(max(s.start, start), min(s.end, end)))
    return len(covered) >= 0.9 * (end - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-kind", type=int, default=40, help="values per kind and locale")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    try:
        from faker import Faker
    except ImportError:
        print("needs faker: pip install -e '.[eval]'", file=sys.stderr)
        return 2
    from modalign.operators.deid.recognisers import detect_batch

    random.seed(args.seed)
    hits: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    misses: dict[str, list[str]] = defaultdict(list)
    started = time.perf_counter()
    for loc in LOCALES:
        fake = Faker(loc)
        fake.seed_instance(args.seed)
        for kind, templates in TEMPLATES.items():
            for _ in range(args.per_kind):
                v = value(fake, kind)
                if not v:
                    break
                t = random.choice(templates)
                text = t.format(v=v)
                start = t.index("{v}")
                ok = found(start, start + len(v), detect_batch([text])[0])
                cell = hits[(kind, loc)]
                cell[0] += ok
                cell[1] += 1
                if not ok and len(misses[kind]) < 8:
                    misses[kind].append(f"{loc}: {v}")
    elapsed = time.perf_counter() - started

    kinds = list(TEMPLATES)
    print("| kind | all | " + " | ".join(LOCALES) + " |")
    print("| --- " * (len(LOCALES) + 2) + "|")
    for kind in kinds:
        cells = [hits[(kind, loc)] for loc in LOCALES]
        k, n = sum(c[0] for c in cells), sum(c[1] for c in cells)
        row = [f"{c[0] / c[1]:.0%}" if c[1] else "-" for c in cells]
        print(f"| {kind} | **{k / n:.1%}** ({n}) | " + " | ".join(row) + " |")
    direct = [hits[(k, loc)] for k in ("person", "phone", "iban", "email", "national_id") for loc in LOCALES]
    print(f"\ndirect identifiers (person, phone, iban, email, national_id): "
          f"{sum(c[0] for c in direct) / sum(c[1] for c in direct):.1%} recall; {elapsed:.0f} s")
    for kind in kinds:
        if misses[kind]:
            print(f"missed {kind}: " + "; ".join(misses[kind]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
