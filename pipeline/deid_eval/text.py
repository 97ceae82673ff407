"""Text: a labelled OCR set, read by the product's own PDF path and scored by word boxes."""

from __future__ import annotations

import io
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from modalign.pipeline.deid_eval.common import need as _need, pct as _pct
from modalign.schemas.errors import DependencyMissingError
from modalign.schemas.policy import DeidPolicy

DPI = 200
PAGE_W_PT, PAGE_H_PT = 595.28, 841.89  # A4 portrait
LINES_PER_PAGE = 34
DIRECT = ("person", "email", "phone", "card", "iban")  # the direct identifiers
WORD_ON_ENTITY = 0.5  # fraction of a word's box area on an entity box that makes it the entity's word

GIVEN = (
    "Julia Peter Anna Marcus Clara Thomas Sarah David Elena Jonas Fatima Wei Priya Carlos Sofia Oliver Hannah "
    "Lukas Emma Ahmed Siobhan Kwame Aoife Tariq Ngozi Rosalind Mateo Yara Lorenzo Freya Oskar Amara Callum "
    "Niamh Rhys Soren Beatrix Cormac Delphine Emeka Idris Keiko Leif Mirela Nuno Piotr Radhika Ulrike Vikram "
    "Zoltan"
).split()
SURNAMES = (
    "Hartmann Whitfield Okafor Nakamura Kowalski Fitzgerald Lindqvist Moreau Castillo Brennan Achterberg "
    "Delacroix Gallagher Petrov Haddad Novak Schneider Bianchi Oyelaran Thorsen Vasquez McAllister Abernathy "
    "Quinlan Rasmussen Ferreira Yilmaz Adeyemi Kapoor Lefebvre Sato Brandt Duarte Ellison Forsyth Whitaker "
    "Lindgren Osei Marchetti Kaminski"
).split()
DOMAINS = ("example.com", "example.org", "mail.example.net", "acme-corp.co.uk", "firma.de", "example.io")
STREETS_EN = ("Baker Street", "High St", "Oak Avenue", "Maple Drive", "Station Road", "Church Lane",
              "Pennsylvania Avenue NW", "Elm Court", "Victoria Road", "Kings Way")
STREETS_DE = ("Hauptstraße", "Berliner Straße", "Goethestr.", "Lindenallee", "Bahnhofstraße", "Am Alten Weg")
UK_TOWNS = (("London", "NW1 6XE"), ("Manchester", "M1 1AE"), ("Leeds", "LS1 4AP"), ("Bristol", "BS1 5TR"),
            ("London", "SW1A 2AA"), ("Cardiff", "CF10 1EP"))
US_CITIES = (("Springfield", "IL", "62704"), ("Austin", "TX", "78701"), ("Denver", "CO", "80202"),
             ("Portland", "OR", "97205"), ("Boston", "MA", "02108"))
DE_CITIES = (("10115", "Berlin"), ("80331", "München"), ("50667", "Köln"), ("20095", "Hamburg"), ("04109", "Leipzig"))
HONORIFICS = ("Dr.", "Ms.", "Mr.", "Prof.")
MONTHS = ("January February March April May June July August September October November December").split()

ENTITY_TEMPLATES: dict[str, tuple[str, ...]] = {
    # {x} is the entity of the key's kind; {person2}/{email}/{phone} add a second entity
    "person": (
        "Contact {x} for the delivery schedule.", "Account holder: {x}", "Please ask {x} about the new rota.",
        "{x} approved the budget on 12 March 2024.", "Minutes taken by {x}; reviewed by {person2}.",
        "The report was prepared by {x} last week.", "Signed: {x}, Head of Procurement",
        "Call {x} on {phone} after 3 pm.", "Contact {x} at {email} or {phone}.", "Meeting with {x} moved to Thursday.",
    ),
    "email": ("E-mail: {x}", "Send the signed copy to {x} by Monday.", "Questions go to {x} please.",
              "Reply-To: {x}"),
    "phone": ("Phone: {x}", "Support line {x} (Mon-Fri)", "Mobile {x}, office hours only.", "Tel. {x}"),
    "card": ("Card on file: {x} (exp 09/27)", "Payment by card {x} was declined.", "Refund issued to card {x}."),
    "iban": ("Refund to IBAN {x} by Friday.", "IBAN: {x}", "Salary account {x} confirmed."),
    "address": ("Registered address: {x}", "Ship to {x}", "Office moved to {x} in May.", "Anschrift: {x}"),
    "date_of_birth": ("Date of birth: {x}", "DOB {x}, verified by passport.", "Born on {x} in a small town."),
    "national_id": ("SSN: {x}", "National Insurance number {x}", "Social security no. {x} on the form."),
    "ip": ("Login from {x} was blocked.", "Server {x} restarted at 02:00.", "Client IP {x} hit the rate limit."),
}
QUOTA = {"person": 80, "email": 42, "phone": 42, "card": 28, "iban": 28, "address": 28, "date_of_birth": 22,
         "national_id": 22, "ip": 18}
FILLER = (
    "The quarterly revenue grew by {n2} percent in Europe.", "Invoice 2024-{n4} is due on {d} {M} 2025.",
    "Order total: EUR {n4},{n2}.50 including VAT.", "Version {n1}.{n1}.{n1} of the Analytics Platform ships in Q3.",
    "Meeting room {n1}.{n2}, Building C, Central Campus.", "Project Phoenix kickoff is scheduled for Monday.",
    "Shipment ID {n5}-{n4} left the warehouse on time.", "Northwind Traders GmbH renewed the support contract.",
    "The Finance Committee approved the Capital Expenditure Plan.", "Reference number {n4}-{n4}-{n2} applies to all claims.",
    "Temperature stayed between {n2} and {n2} degrees all week.", "Next review: 2025-{mm}-{dd}, owner: Operations Team.",
    "Downtime window 02:00-04:00 UTC on Sunday.", "Customer Satisfaction Survey results are attached.",
    "Model ABX-{n4} replaces the older ABX-{n4} units.", "London Office and Berlin Office share the same roadmap.",
    "Tickets {n4} to {n4} were closed in {M}.", "Release Notes for Version {n1} cover Security Updates.",
    "Storage and network upgrades start next month.", "Vendor contracts were renewed for two years.",
    "The board meets again on {d} {M} 2025 in Frankfurt.", "Headcount rose from {n3} to {n3} people.",
)


@dataclass
class LabelledEntity:
    kind: str
    value: str
    page: int
    box: tuple[float, float, float, float]  # pixels at DPI, page image coordinates
    scanned: bool
    font: str


@dataclass
class _Line:
    segments: list[tuple[str, str | None]]  # (text, kind or None)


def _luhn_complete(prefix: str, length: int, rng: np.random.Generator) -> str:
    body = prefix + "".join(str(rng.integers(10)) for _ in range(length - len(prefix) - 1))
    for check in "0123456789":
        digits = [int(c) for c in body + check]
        total = 0
        for i, d in enumerate(reversed(digits)):
            if i % 2 == 1:
                d = d * 2 - 9 if d * 2 > 9 else d * 2
            total += d
        if total % 10 == 0:
            return body + check
    raise AssertionError("unreachable")


def _iban(country: str, bban: str) -> str:
    digits = "".join(str(int(c, 36)) for c in bban + country + "00")
    check = 98 - int(digits) % 97
    raw = f"{country}{check:02d}{bban}"
    return " ".join(raw[i:i + 4] for i in range(0, len(raw), 4))


def _entity_value(kind: str, rng: np.random.Generator, names: list[str]) -> str:
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    if kind == "person":
        first, last = pick(GIVEN), pick(SURNAMES)
        form = rng.random()
        if form < 0.12:
            name = f"{pick(HONORIFICS)} {first} {last}"
        elif form < 0.22:
            name = f"{first} {chr(65 + int(rng.integers(26)))}. {last}"
        else:
            name = f"{first} {last}"
        names.append(name)
        return name
    if kind == "email":
        first, last = pick(GIVEN).lower(), pick(SURNAMES).lower()
        local = pick((f"{first}.{last}", f"{first[0]}{last}", f"{first}_{last}{int(rng.integers(10, 99))}"))
        return f"{local}@{pick(DOMAINS)}"
    if kind == "phone":
        d = lambda n: "".join(str(rng.integers(10)) for _ in range(n))  # noqa: E731
        return pick((
            f"+44 20 7946 {d(4)}", f"+49 30 {d(4)} {d(4)}", f"(415) 555-{d(4)}", f"212-555-{d(4)}",
            f"020 7946 {d(4)}", f"07700 900{d(3)}", f"+1 312 555 {d(4)}", f"+33 1 42 {d(2)} {d(2)} {d(2)}",
        ))
    if kind == "card":
        scheme = rng.integers(3)
        if scheme == 0:
            n = _luhn_complete("4", 16, rng)
        elif scheme == 1:
            n = _luhn_complete(str(51 + int(rng.integers(5))), 16, rng)
        else:
            n = _luhn_complete(pick(("34", "37")), 15, rng)
            return f"{n[:4]} {n[4:10]} {n[10:]}"
        return " ".join(n[i:i + 4] for i in range(0, 16, 4))
    if kind == "iban":
        d = lambda n: "".join(str(rng.integers(10)) for _ in range(n))  # noqa: E731
        country = pick(("DE", "GB", "FR", "NL"))
        bban = {"DE": lambda: d(18), "GB": lambda: pick(("WEST", "NWBK", "BARC")) + d(14),
                "FR": lambda: d(10) + "0" + d(10) + d(2), "NL": lambda: pick(("ABNA", "RABO", "INGB")) + d(10)}[country]()
        return _iban(country, bban)
    if kind == "address":
        form = rng.integers(3)
        num = int(rng.integers(1, 250))
        if form == 0:
            town, pc = pick(UK_TOWNS)
            return f"{num} {pick(STREETS_EN[:6])}, {town} {pc}"
        if form == 1:
            city, st, zp = pick(US_CITIES)
            return f"{num} {pick(STREETS_EN[6:])}, {city}, {st} {zp}"
        plz, city = pick(DE_CITIES)
        return f"{pick(STREETS_DE)} {num}, {plz} {city}"
    if kind == "date_of_birth":
        y, m, day = int(rng.integers(1940, 2005)), int(rng.integers(1, 13)), int(rng.integers(1, 29))
        return pick((f"{day:02d}/{m:02d}/{y}", f"{day} {MONTHS[m - 1]} {y}", f"{y}-{m:02d}-{day:02d}",
                     f"{MONTHS[m - 1]} {day}, {y}", f"{day:02d}.{m:02d}.{y}"))
    if kind == "national_id":
        if rng.random() < 0.5:
            area = int(rng.integers(1, 899))
            area = 667 if area == 666 else area
            return f"{area:03d}-{int(rng.integers(1, 100)):02d}-{int(rng.integers(1, 10000)):04d}"
        first, second = pick("ABCEGHJKLMNPRSTWXYZ"), pick("ABCEGHJKLMNPRSTWXYZ")
        prefix = first + second
        if prefix in ("BG", "GB", "KN", "NK", "NT", "TN", "ZZ"):
            prefix = "AB"
        digits = "".join(str(rng.integers(10)) for _ in range(6))
        return f"{prefix} {digits[:2]} {digits[2:4]} {digits[4:]} {pick('ABCD')}"
    if kind == "ip":
        return ".".join(str(int(rng.integers(1, 255))) for _ in range(4))
    raise KeyError(kind)


def _filler(rng: np.random.Generator) -> str:
    t = FILLER[int(rng.integers(len(FILLER)))]
    out = t
    for key, fn in (("{n1}", lambda: str(rng.integers(1, 10))), ("{n2}", lambda: str(rng.integers(10, 99))),
                    ("{n3}", lambda: str(rng.integers(100, 999))), ("{n4}", lambda: str(rng.integers(1000, 9999))),
                    ("{n5}", lambda: str(rng.integers(10000, 99999))), ("{d}", lambda: str(rng.integers(1, 29))),
                    ("{M}", lambda: MONTHS[int(rng.integers(12))]), ("{mm}", lambda: f"{int(rng.integers(1, 13)):02d}"),
                    ("{dd}", lambda: f"{int(rng.integers(1, 29)):02d}")):
        while key in out:
            out = out.replace(key, fn(), 1)
    return out


def _template_line(template: str, kind: str, rng: np.random.Generator, names: list[str]) -> _Line:
    parts: list[tuple[str, str | None]] = []
    rest = template
    while rest:
        i = rest.find("{")
        if i < 0:
            parts.append((rest, None))
            break
        if i:
            parts.append((rest[:i], None))
        j = rest.index("}", i)
        slot = rest[i + 1:j]
        k = {"x": kind, "person2": "person", "email": "email", "phone": "phone"}[slot]
        value = _entity_value(k, rng, names)
        title, sep, rest_name = value.partition(" ")
        if k == "person" and title in HONORIFICS:  # the title is not personal data: not part of the entity
            parts.append((title + sep, None))
            value = rest_name
        parts.append((value, k))
        rest = rest[j + 1:]
    return _Line(parts)


def make_text_corpus(seed: int = 0, quota: dict[str, int] | None = None) -> list[list[_Line]]:
    """Pages of lines (entity lines from templates until each kind's quota is met, plus filler)."""
    rng = np.random.default_rng(seed)
    quota = dict(QUOTA if quota is None else quota)
    counts = {k: 0 for k in quota}
    names: list[str] = []
    lines: list[_Line] = []
    order = [k for k, n in quota.items() for _ in range(n)]
    rng.shuffle(order)
    for kind in order:
        if counts[kind] >= quota[kind]:
            continue
        templates = ENTITY_TEMPLATES[kind]
        line = _template_line(templates[int(rng.integers(len(templates)))], kind, rng, names)
        for _, k in line.segments:
            if k is not None and k in counts:
                counts[k] += 1
        lines.append(line)
        if rng.random() < 0.45:
            lines.append(_Line([(_filler(rng), None)]))
    pages = [lines[i:i + LINES_PER_PAGE] for i in range(0, len(lines), LINES_PER_PAGE)]
    return pages


FONTS = (("Helvetica", 11.0), ("Times-Roman", 12.0), ("Courier", 10.0))


def render_text_pdfs(pages: list[list[_Line]], out_dir: Path, scanned_every: int = 3, seed: int = 0,
                     files: int = 2, fonts: tuple[tuple[str, float], ...] = FONTS,
                     scanned_pages: set[int] | None = None) -> tuple[list[Path], list[LabelledEntity], list[dict]]:
    """Write the pages as ``files`` PDFs (page i -> file i % files); entity boxes in DPI pixels.

    Page i is set in ``fonts[i % len(fonts)]`` (registered reportlab font names and sizes).
    Every ``scanned_every``-th page (or the pages in ``scanned_pages``) is a "scan":
    rasterised, rotated by up to 0.6 degrees, noised, JPEG-compressed and embedded as an
    image-only page.
    """
    _need("reportlab", "reportlab")
    from reportlab.pdfbase.pdfmetrics import stringWidth
    from reportlab.pdfgen.canvas import Canvas

    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    scale = DPI / 72.0
    entities: list[LabelledEntity] = []
    meta: list[dict] = []
    vector_pages: list[tuple[int, Path]] = []
    per_page_entities: dict[int, list[LabelledEntity]] = {}
    for p, lines in enumerate(pages):
        font, size = fonts[p % len(fonts)]
        scanned = (p in scanned_pages if scanned_pages is not None
                   else scanned_every > 0 and p % scanned_every == scanned_every - 1)
        path = out_dir / f"page-{p:03d}.pdf"
        c = Canvas(str(path), pagesize=(PAGE_W_PT, PAGE_H_PT), invariant=1)
        y = PAGE_H_PT - 64
        ents = []
        for line in lines:
            text = "".join(t for t, _ in line.segments)
            fs = size
            while stringWidth(text, font, fs) > PAGE_W_PT - 110 and fs > 8:
                fs -= 0.5
            c.setFont(font, fs)
            c.drawString(56, y, text)
            x = 56.0
            for seg, kind in line.segments:
                w = stringWidth(seg, font, fs)
                if kind is not None:
                    box = (x * scale, (PAGE_H_PT - y - 0.78 * fs) * scale, (x + w) * scale,
                           (PAGE_H_PT - y + 0.24 * fs) * scale)
                    ents.append(LabelledEntity(kind, seg, p, box, scanned, font))
                x += w
            y -= 20.5
        c.showPage()
        c.save()
        if scanned:
            ents = _scan_page(path, ents, rng)
        per_page_entities[p] = ents
        vector_pages.append((p, path))
        meta.append({"page": p, "font": font, "scanned": scanned, "entities": len(ents)})
    # merge single pages into `files` documents (page order kept within each)
    docs = []
    for f in range(files):
        idx = [p for p, _ in vector_pages if p % files == f]
        if not idx:
            continue
        doc = out_dir / f"ocr-set-{f}.pdf"
        _merge_pdfs([out_dir / f"page-{p:03d}.pdf" for p in idx], doc)
        for local, p in enumerate(idx):
            for e in per_page_entities[p]:
                entities.append(LabelledEntity(e.kind, e.value, p, e.box, e.scanned, e.font))
            meta[p]["doc"], meta[p]["doc_page"] = doc.name, local
        docs.append(doc)
    return docs, entities, meta


def _merge_pdfs(parts: list[Path], out: Path) -> None:
    exe = shutil.which("pdfunite")
    if exe is None:
        raise DependencyMissingError("poppler's pdfunite", apt="poppler-utils")
    if len(parts) == 1:
        shutil.copyfile(parts[0], out)
        return
    subprocess.run([exe, *map(str, parts), str(out)], check=True, capture_output=True, timeout=120)


def _scan_page(path: Path, ents: list[LabelledEntity], rng: np.random.Generator) -> list[LabelledEntity]:
    """Rasterise ``path`` at DPI, rotate slightly, add noise and JPEG artefacts; rewrite as image-only."""
    import cv2
    from pdf2image import convert_from_path
    from PIL import Image
    from reportlab.lib.utils import ImageReader
    from reportlab.pdfgen.canvas import Canvas

    img = np.asarray(convert_from_path(str(path), dpi=DPI, grayscale=True, timeout=120)[0], dtype=np.float32)
    h, w = img.shape
    angle = float(rng.uniform(-0.6, 0.6))
    m = cv2.getRotationMatrix2D((w / 2, h / 2), angle, 1.0)
    img = cv2.warpAffine(img, m, (w, h), flags=cv2.INTER_LINEAR, borderValue=255.0)
    img = cv2.GaussianBlur(img, (0, 0), 0.7)
    img = 0.88 * img + 22 + rng.normal(0.0, 11.0, img.shape)  # grey paper, sensor noise
    speckle = rng.random(img.shape) < 0.0003
    img[speckle] = rng.uniform(0, 90, int(speckle.sum()))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=65)
    buf.seek(0)
    c = Canvas(str(path), pagesize=(PAGE_W_PT, PAGE_H_PT), invariant=1)
    c.drawImage(ImageReader(buf), 0, 0, width=PAGE_W_PT, height=PAGE_H_PT)
    c.showPage()
    c.save()
    out = []
    for e in ents:
        x0, y0, x1, y1 = e.box
        corners = np.array([[x0, y0, 1], [x1, y0, 1], [x0, y1, 1], [x1, y1, 1]]) @ m.T
        out.append(LabelledEntity(e.kind, e.value, e.page, (corners[:, 0].min(), corners[:, 1].min(),
                                                        corners[:, 0].max(), corners[:, 1].max()), True, e.font))
    return out


def ocr_documents(docs: list[Path], meta: list[dict]) -> list[Any]:
    """OCR each document with the real PdfTextOperator (documents in parallel threads).

    Returns one pyarrow table per page, in global page order (``page_index`` rewritten
    to the global page number).
    """
    import pyarrow as pa

    from modalign.operators.ingest.base import SourceContext
    from modalign.operators.ingest.pdf import PdfTextOperator
    from modalign.schemas.manifest import SourceSpec

    def read(doc: Path) -> list[Any]:
        op = PdfTextOperator()
        spec = SourceSpec(id=doc.stem, uri=doc.name, modality="pdf")
        ctx = SourceContext(session_id="deid-eval", spec=spec, path=doc, uri=str(doc), version="eval")
        return list(op.read(ctx))

    with ThreadPoolExecutor(max_workers=max(1, len(docs))) as pool:
        per_doc = dict(zip([d.name for d in docs], pool.map(read, docs)))
    tables: dict[int, Any] = {}
    for m in meta:
        for t in per_doc.get(m["doc"], []):
            if t.num_rows and t.column("page_index")[0].as_py() == m["doc_page"]:
                i = t.schema.get_field_index("page_index")
                t = t.set_column(i, t.schema.field(i), pa.array([m["page"]] * t.num_rows, t.schema.field(i).type))
                tables[m["page"]] = t
    return [tables[p] for p in sorted(tables)]


def _overlap_fraction(word: tuple[float, float, float, float], box: tuple[float, float, float, float]) -> float:
    ix = max(0.0, min(word[2], box[2]) - max(word[0], box[0]))
    iy = max(0.0, min(word[3], box[3]) - max(word[1], box[1]))
    area = max(1.0, (word[2] - word[0]) * (word[3] - word[1]))
    return ix * iy / area


def score_text(entities: list[LabelledEntity], deid_tables: list[Any]) -> dict:
    """Entity-level recall per kind, false-positive runs, precision and F2 (see module doc)."""
    by_page: dict[int, list[LabelledEntity]] = {}
    for e in entities:
        by_page.setdefault(e.page, []).append(e)
    found: dict[int, bool] = {}
    fp_runs = 0
    fp_words = 0
    fp_kinds: dict[str, int] = {}
    ent_ids = {id(e): i for i, e in enumerate(entities)}
    words_on: dict[int, list[bool]] = {i: [] for i in range(len(entities))}
    for table in deid_tables:
        page = table.column("page_index")[0].as_py()
        ents = by_page.get(page, [])
        for words in table.column("words").to_pylist():
            run_open = False
            for w in words or []:
                wb = (w["x0"], w["y0"], w["x1"], w["y1"])
                owners = [e for e in ents if _overlap_fraction(wb, e.box) >= WORD_ON_ENTITY]
                for e in owners:
                    words_on[ent_ids[id(e)]].append(w["entity"] is not None)
                if w["entity"] is not None and not owners:
                    touching = [e for e in ents if _overlap_fraction(wb, e.box) > 0.0]
                    if not touching:  # a rewritten word on no entity at all
                        fp_words += 1
                        if not run_open:
                            fp_runs += 1
                            fp_kinds[w["entity"]] = fp_kinds.get(w["entity"], 0) + 1
                        run_open = True
                        continue
                run_open = False
    per_kind: dict[str, dict[str, float]] = {}
    scanned_hits = [0, 0]
    missed_examples: list[str] = []
    for i, e in enumerate(entities):
        hit = bool(words_on[i]) and all(words_on[i])
        found[i] = hit
        k = per_kind.setdefault(e.kind, {"n": 0, "found": 0})
        k["n"] += 1
        k["found"] += hit
        if e.scanned:
            scanned_hits[0] += hit
            scanned_hits[1] += 1
        if not hit and len(missed_examples) < 12:
            missed_examples.append(f"{e.kind}:{'unread' if not words_on[i] else 'partial'}:{e.font}"
                                   f"{':scan' if e.scanned else ''}")
    for k in per_kind.values():
        k["recall"] = k["found"] / k["n"] if k["n"] else float("nan")
    tp = sum(found.values())
    n = len(entities)
    recall = tp / n if n else float("nan")
    precision = tp / (tp + fp_runs) if tp + fp_runs else float("nan")
    direct_n = sum(per_kind[k]["n"] for k in DIRECT if k in per_kind)
    direct_found = sum(per_kind[k]["found"] for k in DIRECT if k in per_kind)
    direct_recall = direct_found / direct_n if direct_n else float("nan")
    f2 = 5 * precision * recall / (4 * precision + recall) if precision + recall else 0.0
    direct_f2 = 5 * precision * direct_recall / (4 * precision + direct_recall) if precision + direct_recall else 0.0
    return {
        "entities": n, "found": tp, "recall": recall, "direct_entities": direct_n, "direct_recall": direct_recall,
        "false_positive_runs": fp_runs, "false_positive_words": fp_words, "false_positive_kinds": fp_kinds,
        "precision": precision, "f2": f2, "direct_f2": direct_f2, "per_kind": per_kind,
        "scanned_recall": scanned_hits[0] / scanned_hits[1] if scanned_hits[1] else float("nan"),
        "missed": missed_examples, "hits": [found[i] for i in range(n)],
    }


@dataclass
class OcrSet:
    """Rendered + OCRed labelled pages (cache this: OCR is the slow part)."""

    entities: list[LabelledEntity]
    tables: list[Any]  # raw OCR tables, one per page
    meta: list[dict]
    ocr_s: float
    pages: int = field(default=0)


def build_ocr_set(work_dir: Path, seed: int = 0, quota: dict[str, int] | None = None) -> OcrSet:
    work_dir = Path(work_dir)
    pages = make_text_corpus(seed, quota)
    docs, entities, meta = render_text_pdfs(pages, work_dir / "text", seed=seed)
    t0 = time.perf_counter()
    tables = ocr_documents(docs, meta)
    return OcrSet(entities, tables, meta, time.perf_counter() - t0, len(pages))


def eval_text(work_dir: Path, policy: DeidPolicy | None = None, ocr_set: OcrSet | None = None) -> dict:
    """De-identify the OCR set page by page with TextPiiOperator and score it."""
    from modalign.operators.deid.text import TextPiiConfig, TextPiiOperator

    policy = policy or DeidPolicy()
    ocr_set = ocr_set or build_ocr_set(work_dir)
    op = TextPiiOperator(TextPiiConfig(text=policy.text, policy_tag=policy.tag,
                                       key_store_dir=Path(work_dir) / "eval-keys"))
    t0 = time.perf_counter()
    out = [op.process(t) for t in ocr_set.tables]
    deid_s = time.perf_counter() - t0
    words = sum(len(ws or []) for t in ocr_set.tables for ws in t.column("words").to_pylist())
    report = score_text(ocr_set.entities, out)
    report.pop("hits")
    report.update(
        pages=ocr_set.pages, scanned_pages=sum(m["scanned"] for m in ocr_set.meta),
        fonts=sorted({m["font"] for m in ocr_set.meta}), ocr_s=ocr_set.ocr_s, deid_s=deid_s, words=words,
        policy=policy.tag,
    )
    return report


def render_text(t: dict) -> list[str]:
    """Markdown lines of ``eval_text``'s dict."""
    lines: list[str] = []
    lines += [
        "## Text (OCR)",
        f"{t['entities']} labelled entities on {t['pages']} pages ({t['scanned_pages']} scanned; fonts "
        f"{', '.join(t['fonts'])}), OCR {t['ocr_s']:.1f} s, PII {t['deid_s']:.2f} s for {t['words']} words.",
        "",
        "| figure | value | floor |", "| --- | --- | --- |",
        f"| recall, direct identifiers ({', '.join(DIRECT)}) | {_pct(t['direct_recall'])} | >= 95 % |",
        f"| recall, all entities | {_pct(t['recall'])} | |",
        f"| precision (false-positive runs: {t['false_positive_runs']}) | {_pct(t['precision'])} | |",
        f"| F2, all entities | {t['f2']:.3f} | >= 0.90 |",
        f"| recall on scanned pages | {_pct(t['scanned_recall'])} | |",
        "", "| kind | entities | found | recall |", "| --- | --- | --- | --- |",
    ]
    for k, v in sorted(t["per_kind"].items()):
        lines.append(f"| {k} | {v['n']} | {v['found']} | {_pct(v['recall'])} |")
    if t.get("missed"):
        lines += ["", "Missed (kind:why:font): " + ", ".join(t["missed"])]
    lines.append("")
    return lines
