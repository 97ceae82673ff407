"""Text precision on real documents: software manuals installed from Debian packages.

Each manual's text layer is read by the product's own ``PdfTextOperator`` and de-identified
page by page by ``TextPiiOperator``, exactly as a run does. The labels below were made by
reading each manual (title and copyright pages, acknowledgements, references, the
spans the detector reported): the real people named in it and their e-mail addresses. The
detector was not tuned on these documents' text; the labels only judge its output.

Figures:

- **precision**: of all replaced spans, the share that are what they claim to be: a
  person's name (a labelled person, or part of one), an e-mail address, an IP address, a
  postal address. Mailing-list and server addresses count as correct for their kind (the
  policy removes every address); product names, headings, a horse ("Mr. Ed") and
  hypothetical users ("Ann") count as wrong.
- **person precision**: the same over person spans only.
- **author recall**: every labelled author name and e-mail (title and copyright pages) is
  absent from the de-identified text (accent- and case-insensitive); so are all other
  labelled people (reported separately).

Manuals that are not installed are skipped and listed (``modalign deid-eval`` needs the
Debian packages named in ``MANUALS``; ``make setup`` installs them).
"""

from __future__ import annotations

import ipaddress
import re
import time
from dataclasses import dataclass
from pathlib import Path

from modalign.pipeline.deid_eval.common import pct as _pct
from modalign.schemas.policy import DeidPolicy


@dataclass(frozen=True)
class Manual:
    package: str
    path: str
    authors: tuple[str, ...]  # names and e-mails on the title / copyright pages
    people: tuple[str, ...] = ()  # everyone else named (contributors, cited authors, thanked)


MANUALS: tuple[Manual, ...] = (
    Manual("quilt", "/usr/share/doc/quilt/quilt.pdf", ("Andreas Grünbacher", "agruen@suse.de"),
           ("Andrew Morton", "William Shakespeare", "Edward C. Bailey")),
    Manual("cvs", "/usr/share/doc/cvs/cvs-paper.pdf", ("Brian Berliner", "berliner@prisma.com"),
           ("Dick Grune", "Jeff Polk", "Raymond B. Essick", "Robert Bruce Kolstad", "Masahiro Honda",
            "Terrence Miller", "Andreas Lampen", "Axel Mahler", "Walter F. Tichy", "Andy Glew", "Larry Jones", "Alex", "Andy",
            "Larry", "Dick")),
    Manual("cvs", "/usr/share/doc/cvs/cvsclient.pdf", ()),
    Manual("libtasn1-doc", "/usr/share/doc/libtasn1-doc/libtasn1.pdf",
           ("Fabio Fiorina", "Simon Josefsson", "Nikos Mavrogiannopoulos")),
    Manual("pstoedit", "/usr/share/doc/pstoedit/pstoedit.pdf", ("Wolfgang Glunz",),
           ("Scott Pakin", "Martin Weber", "Klaus Steinberger", "Lar Kaufman", "David B. Rosen", "Carsten Hammer",
            "Christoph Jaeschke", "Thomas Hoffmann", "Jens Weber", "G. Edward Johnson", "Gerhard Kircher",
            "Bill Cheng", "Glenn M. Lewis", "Lutz Vieweg", "Derek B. Noonburg", "Rainer Dorsch", "Patrick Gosling",
            "Peter Katzmann", "Chris Cox", "Bjoern Petersen", "Egil Kvaleberg", "Burkhard Plaum", "Bernhard Herzog",
            "Rolf Niepraschk", "Gisbert W. Selke", "Robert S. Maier", "Daniel Gehriger", "Allen Barnett",
            "Masatake Yamoto", "Bob Friesenhahn", "Peter Deutsch", "Russell Lang", "Thorsten Behrens",
            "Reini Urban", "Leszek Piotrowicz", "Kai-Uwe Sattler", "Uwe Sattler", "Dave", "Jan Bottorff",
            "Piet van Oostrum", "Julian Smart", "Rob Warner", "Wolfgang", "Scott")),
    Manual("blktrace", "/usr/share/doc/blktrace/blktrace.pdf",
           ("Jens Axboe", "jens.axboe@oracle.com", "Alan D. Brunelle", "Alan.Brunelle@hp.com")),
    Manual("blktrace", "/usr/share/doc/blktrace/btt.pdf", ("Alan D. Brunelle", "Alan.Brunelle@hp.com")),
    Manual("xmlformat-doc", "/usr/share/doc/xmlformat-doc/xmlformat.pdf", ("Paul DuBois", "paul@kitebird.com"),
           ("Robert D. Cameron",)),
    Manual("debdelta-doc", "/usr/share/doc/debdelta-doc/debdelta_suite.pdf", ("Andrea C. G. Mennucci",)),
    Manual("purifyeps", "/usr/share/doc/purifyeps/purifyeps.pdf", ("Scott Pakin", "scott+peps@pakin.org"),
           ("Wolfgang Glunz",)),
    Manual("pssh", "/usr/share/doc/pssh/pssh-HOWTO.pdf", ("Brent Chun", "bnc at theether.org")),
    Manual("tig", "/usr/share/doc/tig/manual.pdf", ("Jonas Fonseca", "jonas.fonseca@gmail.com"), ("Petr Baudis",)),
    Manual("srf-doc", "/usr/share/doc/srf-doc/SRF_v_1_3_2_June_19th_2008-0001.pdf", (),
           ("James Bonfield", "James K. Bonfield", "Martin Shumway", "Vladimir Alekseyev", "Paul Flicek",
            "Darren Platt", "Mike Attili", "James Knight", "Clive Brown", "Dirk Evers", "Jonathan Manning",
            "LaDeana Hillier", "Michael C. Wendl", "Phil Green", "Tim Bray", "Jean Paoli", "C. M. Sperberg-McQueen",
            "Eve Maler", "François Yergeau", "Rodger Staden", "Brent Ewing", "Gabor Marth", "Toby Bloom",
            "Asim Siddiqui", "Steven Leonard", "Simon Brent")),
    Manual("coccinelle-doc", "/usr/share/doc/coccinelle/manual.pdf", ("Julia Lawall", "Yoann Padioleau"),
           ("Rene Rydhof Hansen", "Nicolas Palix", "Henrik Stuart", "Gilles Muller")),
    Manual("shared-mime-info", "/usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf",
           ("Thomas Leonard", "tal197 at users.sf.net")),
)
DEBIAN_PACKAGES = tuple(sorted({m.package for m in MANUALS}))
# ``deid-eval --quick`` and CI: every manual of at most 20 pages (chosen by length, not by result)
QUICK_MANUALS = tuple(m for m in MANUALS if Path(m.path).name in {
    "quilt.pdf", "cvs-paper.pdf", "blktrace.pdf", "xmlformat.pdf", "debdelta_suite.pdf", "purifyeps.pdf",
    "pssh-HOWTO.pdf", "manual.pdf", "shared-mime-info-spec.pdf"} and "coccinelle" not in m.path)


def _key(text: str) -> str:
    from modalign.operators.deid.name_lexicon import fold

    return re.sub(r"[\W_¨´`ˆ˜¸ˇ˚]+", "", fold(text))


def _masked(n: int, field: str, label: str) -> str:
    """A kept name as the report shows it: initials and where it is labelled ("B. F. (people[27])"),
    never the name itself (a report is printed and stored; the label list says who it is)."""
    initials = " ".join(w[0] + "." for w in label.replace("@", " ").split() if w[:1].isalpha())
    return f"{initials} ({field}[{n}])"


def _span_ok(kind: str, text: str, labels: list[str]) -> bool:
    """Whether a replaced span is what its kind claims (see the module docstring)."""
    flat = " ".join(text.split())
    if kind == "person":
        k = _key(flat)
        words = {_key(w) for w in re.split(r"[\s,]+", flat) if _key(w)}  # "Essick, Raymond B.": any order
        return len(k) >= 3 and any(k in _key(lab) or _key(lab) in k or words <= {_key(w) for w in lab.split()}
                                   for lab in labels if "@" not in lab and " at " not in lab)
    if kind == "email":
        return bool(re.search(r"\S[ ]*(?:@|\bat\b|\bAT\b|\(at\))[ ]*\S+\.\S", flat))
    if kind == "ip":
        try:
            ipaddress.ip_address(flat)
        except ValueError:
            return False
        return not re.fullmatch(r"\d\.\d+\.\d+\.\d+", flat)  # a kernel version such as 2.6.25.4 is not one
    if kind == "address":
        return bool(re.search(r"\d", flat)) and bool(re.search(r"[A-Za-z]{3}", flat))
    return False


def eval_manuals(work_dir: Path, policy: DeidPolicy | None = None, manuals: tuple[Manual, ...] = MANUALS) -> dict:
    """Precision and author recall on the installed manuals of ``manuals`` (see module docstring)."""
    from modalign.operators.deid.recognisers import detect_batch
    from modalign.operators.deid.text import TextPiiConfig, TextPiiOperator
    from modalign.operators.ingest.base import SourceContext
    from modalign.operators.ingest.pdf import PdfTextOperator
    from modalign.schemas.manifest import SourceSpec

    policy = policy or DeidPolicy()
    pol = policy.text
    op = TextPiiOperator(TextPiiConfig(text=pol, policy_tag=policy.tag, key_store_dir=Path(work_dir) / "eval-keys"))
    thresholds = {k: pol.threshold_for(k) for k in pol.entities}
    rows, missing, wrong = [], [], []
    t0 = time.perf_counter()
    for n, man in enumerate(manuals):
        path = Path(man.path)
        if not path.is_file():
            missing.append(f"{man.path} (Debian package {man.package})")
            continue
        spec = SourceSpec(id=f"manual-{n}", uri=path.name, modality="pdf")
        ctx = SourceContext(session_id="deid-eval", spec=spec, path=path, uri=str(path), version="eval")
        labels = [*man.authors, *man.people]
        spans_ok = spans = person_ok = persons = 0
        out_text = []
        for table in PdfTextOperator().read(ctx):
            texts = table.column("text").to_pylist()
            for text, found in zip(texts, detect_batch(texts, pol.entities, min_scores=thresholds)):
                for s in found:
                    if pol.action_for(s.kind) == "keep":
                        continue
                    ok = _span_ok(s.kind, text[s.start:s.end], labels)
                    spans, spans_ok = spans + 1, spans_ok + ok
                    if s.kind == "person":
                        persons, person_ok = persons + 1, person_ok + ok
                    if not ok:
                        wrong.append(f"{path.name}:{s.kind}:{' '.join(text[s.start:s.end].split())}")
            out_text += [t or "" for t in op.process(table).column("text").to_pylist()]
        flat = _key(" ".join(out_text))
        kept_authors = [_masked(i, "authors", a) for i, a in enumerate(man.authors) if _key(a) in flat]
        kept_people = [_masked(i, "people", p) for i, p in enumerate(man.people) if len(p.split()) > 1 and _key(p) in flat]
        rows.append({"manual": path.name, "package": man.package, "spans": spans, "correct": spans_ok,
                     "person_spans": persons, "person_correct": person_ok, "authors": len(man.authors),
                     "authors_kept": kept_authors, "people": len([p for p in man.people if len(p.split()) > 1]),
                     "people_kept": kept_people})
    tot = lambda k: sum(r[k] for r in rows)  # noqa: E731
    authors = tot("authors")
    return {
        "manuals": rows, "missing": missing, "wrong": wrong, "seconds": time.perf_counter() - t0,
        "spans": tot("spans"), "precision": tot("correct") / tot("spans") if tot("spans") else float("nan"),
        "person_precision": tot("person_correct") / tot("person_spans") if tot("person_spans") else float("nan"),
        "author_recall": 1 - sum(len(r["authors_kept"]) for r in rows) / authors if authors else float("nan"),
        "people_recall": (1 - sum(len(r["people_kept"]) for r in rows) / tot("people")) if tot("people") else float("nan"),
    }


def render_manuals(r: dict) -> list[str]:
    """Markdown lines of ``eval_manuals``'s dict."""
    lines = [
        "## Text precision on real manuals (Debian packages, text layer)",
        f"{len(r['manuals'])} manuals, {r['spans']} replaced spans, {r['seconds']:.0f} s.",
        "",
        "| figure | value | floor |", "| --- | --- | --- |",
        f"| replaced spans that are what they claim | {_pct(r['precision'])} | >= 95 % |",
        f"| person spans that are a person's name | {_pct(r['person_precision'])} | |",
        f"| author names and e-mails replaced | {_pct(r['author_recall'])} | 100 % |",
        f"| other people named (full names) replaced | {_pct(r['people_recall'])} | |",
        "", "| manual | spans | correct | authors kept | people kept |", "| --- | --- | --- | --- | --- |",
    ]
    for m in r["manuals"]:
        lines.append(f"| {m['manual']} | {m['spans']} | {m['correct']} | {', '.join(m['authors_kept']) or '-'} | "
                     f"{', '.join(m['people_kept']) or '-'} |")
    if r["wrong"]:
        lines += ["", "Wrong replacements: " + "; ".join(r["wrong"])]
    if r["missing"]:
        lines += ["", "Not installed (skipped): " + "; ".join(r["missing"])]
    return lines + [""]
