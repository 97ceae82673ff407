"""The GDPR access report a person reads (``modalign lineage access OUT --subject S --format
html``), rendered from the shared real run (``lineage_run`` in ``conftest.py``) and loaded in
headless chromium (``tests/browser.py``): what is on screen must be what the JSON report says,
the page must be self-contained and quiet, and no raw identifier of the subject may be in it.

Subject-0001 is in every source of the sample meeting and in solo's room recorder; the
subject registry (outside OUT) names her, so the deck that mentions her is listed too."""

from __future__ import annotations

import json
import re

import pytest

from browser import WINDOW, Page, screenshot_pixels
from modalign.pipeline.cli import main
from modalign.pipeline.sample import PLANTED_PII, subject_id

pytestmark = pytest.mark.integration

S = "subject-0001"


@pytest.fixture(scope="module")
def reports(lineage_run, tmp_path_factory) -> dict:
    """The access report of S as the CLI writes it: the HTML page, its bytes and the JSON report."""
    d = tmp_path_factory.mktemp("access-report")
    registry = d / "subjects.yaml"  # the subject's raw identifiers: outside OUT, never in a report
    name = next(v for k, v, _ in PLANTED_PII if k == "person" and subject_id(v) == S)
    email = next(v for k, v, _ in PLANTED_PII if k == "email" and v.startswith(name.split()[0].lower() + "."))
    registry.write_text(f"{S}:\n  person: [{name}]\n  email: [{email}]\n")
    args = ["lineage", "access", str(lineage_run.out), "--subject", S, "--registry", str(registry),
            "--key-store", str(lineage_run.keys)]
    assert main([*args, "--format", "html", "--out", str(d / "access.html")]) == 0
    assert main([*args, "--format", "json", "--out", str(d / "access.json")]) == 0
    return {"html": d / "access.html", "bytes": (d / "access.html").read_bytes(),
            "json": json.loads((d / "access.json").read_text(encoding="utf-8")),
            "identifiers": [name, email], "dir": d}


@pytest.fixture(scope="module")
def page(chromium, reports) -> Page:
    return chromium.open(reports["html"], reports["dir"] / "access.png")


def _lines(text: str) -> list[str]:
    """innerText as lines, each table row's cells joined by one tab, spaces squeezed."""
    return [re.sub(r"[ \t]*\t[ \t]*", "\t", line).strip() for line in text.splitlines()]


def _section(text: str, heading: str) -> str:
    """The text from the line ``heading`` to the next ``Source …`` heading or section title."""
    lines = text.splitlines()
    i = lines.index(heading)
    end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("Source ")
                or re.fullmatch(r"Events \(\d+\)", lines[j])), len(lines))
    return "\n".join(lines[i:end])


def test_the_page_is_self_contained_quiet_and_its_images_decode(page, reports):
    assert page.title == f"Access report: subject {S}"
    assert page.requests and page.requests[0] == page.url and page.url.startswith("file://")
    assert page.external_requests == [], page.external_requests  # no font, style sheet or image from elsewhere
    assert [u for u in page.requests if u != page.url] == []  # the report loads nothing, not even a local file
    assert page.console_at("SEVERE", "WARNING") == [], page.console_at("SEVERE", "WARNING")
    # the report is text and tables only: no <img> (so none can fail to decode), said so rather than skipped
    assert page.images == [] and b"<img" not in reports["bytes"].lower()
    assert all(img.decoded for img in page.images)


def test_the_screenshot_is_the_whole_page_and_not_blank(page):
    pixels = screenshot_pixels(page)
    width, height = page.content_size
    assert page.viewport == WINDOW
    assert width == WINDOW[0], "the page is wider than the window: a long value overflows (scrolls sideways)"
    assert page.expanded_width == WINDOW[0], "with the long lists opened, a value overflows the window"
    assert height > WINDOW[1]  # a report of 5 sources is longer than one screen, and all of it is in the PNG
    assert pixels.std() > 20 and (pixels < 100).mean() > 0.01 and (pixels > 200).mean() > 0.5  # dark text on light


def test_the_visible_text_is_what_the_json_report_says(page, reports):
    rep = reports["json"]
    text, lines, all_lines = page.text, _lines(page.text), _lines(page.text_expanded)
    assert f"Access report (GDPR Art. 15): subject {S}" in lines
    for what, n in rep["counts"].items():  # the summary table, on screen without a click
        assert f"{what}\t{n}" in lines, (what, n)
    assert rep["counts"]["sources"] == len(rep["sources"]) == 5 and rep["counts"]["mentions"] > 0
    for o in rep["sources"]:
        heading = f"Source {o['session_id']}/{o['source_id']}"
        assert heading in lines, heading
        body = _lines(_section(text, heading))
        assert f"events\t{o['events']}" in body and f"modality\t{o['modality']}" in body, heading
        assert f"policy\t{o['policy']['tag']}" in body, heading
        assert o["deid"], heading
        for h in o["deid"]:  # how it was de-identified: method, detector and count, row by row
            row = "\t".join(str(h[c]) for c in ("method", "detector", "count"))
            assert any(line.startswith(row) for line in body), (heading, row)
    assert rep["pseudonyms"]
    for p in rep["pseudonyms"]:  # listed with kind and occurrences (a long list may be folded: a click opens it)
        assert f"{p['pseudonym']}\t{p['kind']}\t{p['occurrences']}" in all_lines, p
    for m in rep["mentions"]:
        row = "\t".join(str(m[c]) for c in ("session_id", "source_id", "event_id", "pseudonym", "kind", "occurrences"))
        assert row in all_lines, row
    assert {m["session_id"] for m in rep["mentions"]} == {"sample-meeting", "deck"}
    for e in rep["events"]:  # every event id, its method and count are reachable
        assert any(line.startswith(f"{e['event_id']}\t{e['table']}\t{e['t_ns']}\t{e['deid']['method']}")
                   for line in all_lines), e["event_id"]


def test_no_raw_identifier_of_the_subject_is_in_the_page(page, reports):
    assert "Clara Hartmann" in reports["identifiers"] and "clara.hartmann@example.com" in reports["identifiers"]
    raw = reports["bytes"].decode("utf-8").lower()
    shown = (page.text_expanded + page.title).lower()
    for _kind, value, _page in PLANTED_PII:  # the registry's identifiers and every other planted one, and name parts
        for part in [value, *(w for w in value.split() if w.isalpha() and len(w) > 3)]:
            assert part.lower() not in raw and part.lower() not in shown, part
    assert S in shown and S in raw
