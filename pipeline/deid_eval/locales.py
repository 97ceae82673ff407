"""Text recall across locales, fonts and scan conditions, on values the detector was never tuned on.

Faker (the ``eval`` extra; a corpus generator, never a detector) makes names, phones,
IBANs, cards, e-mails, addresses, dates of birth and national ids for ``LOCALES`` (14),
each put in one of several English sentences (the documents the product sees mix
languages; the NER model is English). Titles and degrees that Faker adds to names ("Frau",
"Dott.", "B.Sc.") are printed but are not part of the entity: they identify no one.

- ``eval_locales_text`` checks the sentences as born-digital text, alone, through
  ``detect_batch`` (a value is found when detected spans cover 90 % of its characters).
- ``eval_locales_ocr`` prints the same kind of lines on A4 pages in ``FONTS`` (four TrueType
  faces with every Latin letter: DejaVu Sans, Serif, Sans Mono, Liberation Serif), half of
  the pages "scanned" (rasterised, rotated, blurred, noised, JPEG) like the rest of
  deid-eval, reads them back with the product's own ``PdfTextOperator`` (poppler +
  tesseract) and de-identifies them with ``TextPiiOperator``; scoring is by word boxes
  (``text.score_text``). Chinese names are printed romanised there (``romanized_name``):
  the product's OCR reads Latin script only (tesseract ``eng``); Han names in text layers
  are in the born-digital check.

Both report recall per kind, per locale, per font and per scan condition.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from modalign.pipeline.deid_eval.common import need as _need, pct as _pct
from modalign.pipeline.deid_eval.text import (DIRECT, LINES_PER_PAGE, _Line, ocr_documents,
                                              render_text_pdfs, score_text)
from modalign.schemas.policy import DeidPolicy

LOCALES = ("de_DE", "no_NO", "zh_CN", "en_IE", "fr_FR", "es_ES", "pl_PL", "tr_TR", "it_IT", "nl_NL", "pt_BR",
           "en_IN", "en_GB", "en_US")
TEMPLATES: dict[str, tuple[str, ...]] = {
    "person": ("The report was signed by {v} on Monday.", "Please forward the minutes to {v}.",
               "{v} joined the project team last spring.", "Contact person: {v}"),
    "phone": ("Please call {v} tomorrow.", "Tel.: {v}", "You can reach the office on {v} until five.",
              "Mobile {v} (after 6 pm)"),
    "iban": ("Transfer the refund to IBAN {v} by Friday.", "Account: {v}", "Bank details {v}, reference 2291."),
    "card": ("Card on file: {v}", "The payment with card {v} failed."),
    "email": ("Write to {v} for details.", "E-mail: {v}", "cc {v} on the next reply"),
    "address": ("The parcel goes to {v}.", "Address: {v}", "She moved to {v} in 2019."),
    "date_of_birth": ("Date of birth: {v}", "born on {v} in the city hospital", "DOB {v}"),
    "national_id": ("National ID {v} was checked at the desk.", "ID number: {v}", "Tax id {v} is on file."),
}
FILLER = ("The meeting moved to the second floor.", "Invoice 2024-0117 was paid in full.",
          "Quarterly results are attached.", "The server restarts at 02:00 UTC.")
FONTS = (("DejaVuSans", "dejavu/DejaVuSans.ttf", 11.0), ("DejaVuSerif", "dejavu/DejaVuSerif.ttf", 11.0),
         ("DejaVuSansMono", "dejavu/DejaVuSansMono.ttf", 10.0),
         ("LiberationSerif", "liberation/LiberationSerif-Regular.ttf", 12.0))
FONT_DIR = Path("/usr/share/fonts/truetype")


def _titles(fake: Any) -> set[str]:
    """The name prefixes and suffixes of ``fake``'s locale (Frau, Dott., B.Sc. ...)."""
    out: set[str] = set()
    for provider in fake.providers:
        for attr in dir(provider):
            if attr.startswith(("prefixes", "suffixes")) and isinstance(getattr(provider, attr), (tuple, list, dict)):
                out.update(str(x) for x in getattr(provider, attr))
    return out


def value(fake: Any, kind: str, ocr: bool = False) -> tuple[str, str, str] | None:
    """``(before, entity, after)``: one value of ``kind`` in the locale of ``fake``; a name's
    titles go to ``before``/``after``. None when the locale has no such provider."""
    try:
        if kind == "person":
            name = fake.romanized_name() if ocr and hasattr(fake, "romanized_name") else fake.name()
            titles = _titles(fake)
            words = name.split()
            pre = []
            while words and words[0] in titles and len(words) > 2:  # leading titles only ("Frau", "Dr.")
                pre.append(words.pop(0))
            post = []
            while words and words[-1] in titles and len(words) > 2:
                post.insert(0, words.pop())
            return (" ".join(pre) + " " if pre else "", " ".join(words), " " + " ".join(post) if post else "")
        if kind == "phone":
            v = fake.phone_number()
        elif kind == "iban":
            v = fake.iban()
        elif kind == "card":
            v = fake.credit_card_number()
        elif kind == "address":
            v = ", ".join(line.strip() for line in fake.address().splitlines())
        elif kind == "date_of_birth":
            d = fake.date_of_birth(minimum_age=18, maximum_age=90)
            v = fake.random_element([d.strftime("%d.%m.%Y"), d.strftime("%Y-%m-%d"), d.strftime("%d/%m/%Y"),
                                     d.strftime("%d %B %Y")])
        elif kind == "national_id":
            v = fake.ssn()
        elif kind == "email":
            v = fake.email()
        else:
            return None
    except AttributeError:
        return None
    return ("", v, "")


def _sentences(locales: tuple[str, ...], per_kind: int, seed: int, ocr: bool) -> list[tuple[str, _Line]]:
    """``(locale, line)`` for every locale x kind x ``per_kind``; segments mark the entity."""
    faker = _need("faker", "faker==40.63.0")
    rnd = random.Random(seed)
    out = []
    for loc in locales:
        fake = faker.Faker(loc)
        fake.seed_instance(seed)
        for kind, templates in TEMPLATES.items():
            for _ in range(per_kind):
                v = value(fake, kind, ocr)
                if v is None or not v[1]:
                    break
                before_t, _, after_t = rnd.choice(templates).partition("{v}")
                segs = [(before_t + v[0], None), (v[1], kind), (v[2] + after_t, None)]
                out.append((loc, _Line([(t, k) for t, k in segs if t])))
    rnd.shuffle(out)
    return out


def _covered(start: int, end: int, spans) -> bool:
    covered: set[int] = set()
    for s in spans:
        covered.update(range(max(s.start, start), min(s.end, end)))
    return len(covered) >= 0.9 * (end - start)


def eval_locales_text(locales: tuple[str, ...] = LOCALES, per_kind: int = 40, seed: int = 7,
                      policy: DeidPolicy | None = None) -> dict:
    """Born-digital check: each sentence alone through ``detect_batch`` under the policy's thresholds."""
    from modalign.operators.deid.recognisers import detect_batch

    pol = (policy or DeidPolicy()).text
    hits: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    missed: dict[str, list[str]] = defaultdict(list)
    t0 = time.perf_counter()
    for loc, line in _sentences(locales, per_kind, seed, ocr=False):
        text = "".join(t for t, _ in line.segments)
        pos = 0
        spans = detect_batch([text], pol.entities, min_scores={k: pol.threshold_for(k) for k in pol.entities})[0]
        for seg, kind in line.segments:
            if kind is not None:
                ok = _covered(pos, pos + len(seg), spans)
                cell = hits[(kind, loc)]
                cell[0], cell[1] = cell[0] + ok, cell[1] + 1
                if not ok and len(missed[kind]) < 8:
                    missed[kind].append(f"{loc}: {seg}")
            pos += len(seg)
    return {"mode": "born-digital", "cells": {f"{k}|{loc}": v for (k, loc), v in hits.items()},
            "missed": dict(missed), "seconds": time.perf_counter() - t0, "locales": list(locales),
            **_totals(hits)}


def _totals(hits: dict[tuple[str, str], list[int]]) -> dict:
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for (kind, _), (k, n) in hits.items():
        by_kind[kind][0] += k
        by_kind[kind][1] += n
    direct = [sum(by_kind[k][i] for k in DIRECT if k in by_kind) for i in (0, 1)]
    return {"per_kind": {k: {"found": v[0], "n": v[1], "recall": v[0] / v[1]} for k, v in by_kind.items()},
            "direct_recall": direct[0] / direct[1] if direct[1] else float("nan"), "direct_n": direct[1]}


def eval_locales_ocr(work_dir: Path, locales: tuple[str, ...] = LOCALES, per_kind: int = 2, seed: int = 7,
                     policy: DeidPolicy | None = None) -> dict:
    """Printed and scanned pages in four fonts, read back by the product's OCR, de-identified, scored."""
    _need("reportlab", "reportlab")
    from reportlab.pdfbase import pdfmetrics
    from reportlab.pdfbase.ttfonts import TTFont

    from modalign.operators.deid.text import TextPiiConfig, TextPiiOperator
    from modalign.schemas.errors import DependencyMissingError

    policy = policy or DeidPolicy()
    fonts = []
    for name, rel, size in FONTS:
        path = FONT_DIR / rel
        if not path.is_file():
            raise DependencyMissingError(f"font {path}", apt="fonts-dejavu-core fonts-liberation")
        pdfmetrics.registerFont(TTFont(name, str(path)))
        fonts.append((name, size))
    work_dir = Path(work_dir) / "locales-ocr"
    items = _sentences(locales, per_kind, seed, ocr=True)
    rng = np.random.default_rng(seed)
    lines: list[_Line] = []
    locale_of: dict[str, str] = {}
    for loc, line in items:
        lines.append(line)
        for seg, kind in line.segments:
            if kind is not None:
                locale_of[seg] = loc
        if rng.random() < 0.3:
            lines.append(_Line([(FILLER[int(rng.integers(len(FILLER)))], None)]))
    per_page = LINES_PER_PAGE - 6  # room for the longer lines of long addresses
    pages = [lines[i:i + per_page] for i in range(0, len(lines), per_page)]
    # fonts cycle per page; every second page of each font is scanned
    docs, entities, meta = render_text_pdfs(pages, work_dir, scanned_every=0, seed=seed, files=2, fonts=tuple(fonts),
                                            scanned_pages={p for p in range(len(pages)) if (p // len(fonts)) % 2 == 1})
    t0 = time.perf_counter()
    tables = ocr_documents(docs, meta)
    ocr_s = time.perf_counter() - t0
    op = TextPiiOperator(TextPiiConfig(text=policy.text, policy_tag=policy.tag, key_store_dir=work_dir / "eval-keys"))
    out = [op.process(t) for t in tables]
    report = score_text(entities, out)
    hits = report.pop("hits")
    groups: dict[str, dict[str, list[int]]] = {"locale": defaultdict(lambda: [0, 0]), "font": defaultdict(lambda: [0, 0]),
                                               "scan": defaultdict(lambda: [0, 0])}
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    missed: list[str] = []
    for e, hit in zip(entities, hits):
        if e.kind not in DIRECT:
            continue
        for g, key in (("locale", locale_of.get(e.value, "?")), ("font", e.font),
                       ("scan", "scanned" if e.scanned else "printed")):
            groups[g][key][0] += hit
            groups[g][key][1] += 1
        cells[(e.kind, locale_of.get(e.value, "?"))][0] += hit
        cells[(e.kind, locale_of.get(e.value, "?"))][1] += 1
        if not hit and len(missed) < 16:
            missed.append(f"{e.kind}:{locale_of.get(e.value, '?')}:{e.font}{':scan' if e.scanned else ''}")
    report.update(mode="OCR", pages=len(pages), scanned_pages=sum(m["scanned"] for m in meta), ocr_s=ocr_s,
                  fonts=[f for f, _ in fonts], locales=list(locales), missed_direct=missed,
                  direct_by={g: {k: {"found": v[0], "n": v[1], "recall": v[0] / v[1]} for k, v in d.items()}
                             for g, d in groups.items()},
                  cells={f"{k}|{loc}": v for (k, loc), v in cells.items()})
    return report


def render_locales(text: dict | None, ocr: dict | None) -> list[str]:
    """Markdown lines of the two checks."""
    lines = ["## Text across locales (Faker values, never tuned on)"]
    if text:
        lines += ["", f"Born-digital sentences, {len(text['locales'])} locales: direct identifiers "
                  f"({', '.join(DIRECT)}) {_pct(text['direct_recall'])} of {text['direct_n']}.", "",
                  "| kind | recall | n |", "| --- | --- | --- |"]
        lines += [f"| {k} | {_pct(v['recall'])} | {v['n']} |" for k, v in sorted(text["per_kind"].items())]
    if ocr:
        lines += ["", f"Printed and scanned: {ocr['pages']} pages ({ocr['scanned_pages']} scanned), fonts "
                  f"{', '.join(ocr['fonts'])}, read by the product's OCR ({ocr['ocr_s']:.0f} s).", "",
                  "| figure | value | floor |", "| --- | --- | --- |",
                  f"| recall, direct identifiers | {_pct(ocr['direct_recall'])} | >= 98 % |",
                  f"| F2, direct identifiers | {ocr['direct_f2']:.3f} | >= 0.95 |",
                  f"| precision (false-positive runs: {ocr['false_positive_runs']}) | {_pct(ocr['precision'])} | |",
                  f"| recall, all kinds | {_pct(ocr['recall'])} | |", "",
                  "| direct identifiers by | group | found / n | recall |", "| --- | --- | --- | --- |"]
        for g, d in ocr["direct_by"].items():
            lines += [f"| {g} | {k} | {v['found']} / {v['n']} | {_pct(v['recall'])} |" for k, v in sorted(d.items())]
        lines += ["", "| kind | entities | recall |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['n']} | {_pct(v['recall'])} |" for k, v in sorted(ocr["per_kind"].items())]
        if ocr["missed_direct"]:
            lines += ["", "Missed direct identifiers (kind:locale:font): " + ", ".join(ocr["missed_direct"])]
    return lines + [""]
