"""``modalign lineage trace | access`` on a real run (the ``lineage_run`` fixture of
``conftest.py``): the generated sample meeting (session subjects subject-0001 and
subject-0002), a two-recorder audio session ``solo`` (session subject subject-0003) whose room
recorder alone also lists subject-0001 and subject-0007 (per-source subjects), and a session
"deck" holding the meeting's slides again but listing no subject (found through the subject
registry only).

Every answer is checked against a direct pyarrow read of the committed tables."""

from __future__ import annotations

import html.parser
import json
from pathlib import Path

import pyarrow.compute as pc
import pytest

import modalign
from modalign.pipeline.cli import main
from modalign.pipeline.lineage import access, trace
from modalign.pipeline.sample import PLANTED_PII
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run_out(lineage_run) -> tuple[Path, Path]:
    """(OUT, INPUT) of the one run over the three sessions (read only)."""
    return lineage_run.out, lineage_run.input


def _read(out: Path, table: str, columns: list[str], filter_=None) -> list[dict]:
    return modalign.open(out).table(table).to_table(columns=columns, filter=filter_).to_pylist()


def test_trace_of_a_real_event_and_feature_names_source_policy_and_model(run_out):
    out, inp = run_out
    policy = modalign.open(out).run["versions"]["policy"]
    assert policy == RunConfig().policy.tag
    lineage = {(r["session_id"], r["source_id"]): r for r in _read(
        out, "lineage_sources", ["session_id", "source_id", "source_uri", "source_version", "policy"])}

    block = next(r for r in _read(out, "events_pdf", ["event_id", "words"], pc.field("session_id") == "sample-meeting")
                 if any(w["entity"] == "person" and w["text"].startswith("<PERSON_") for w in r["words"]))
    res = trace(out, block["event_id"])
    (o,) = res["origins"]
    want = lineage[("sample-meeting", "slides")]
    assert o["source_uri"] == want["source_uri"] == (inp / "meeting" / "slides.pdf").resolve().as_uri()
    assert o["source_version"] == want["source_version"] and o["policy"]["tag"] == want["policy"] == policy
    assert o["policy"]["content"]["text"]["action"] == RunConfig().policy.text.action
    models = {r["model_id"] for r in _read(out, "features", ["event_id", "model_id"],
                                           pc.field("event_id") == block["event_id"])}
    assert o["model_ids"] == sorted(models) and models and all(m.startswith("all-minilm-l6-v2@") for m in models)
    tokens = {w["text"] for w in block["words"] if w["entity"] and w["text"].startswith("<")}
    assert {p["pseudonym"] for p in res["target"]["event"]["pseudonyms"]} == tokens
    assert o["removed"]["personal_data"]["person"] >= 2 and o["subjects"] == ["subject-0001", "subject-0002"]

    roi = _read(out, "features", ["feature_id", "event_id", "model_id", "source_id"],
                (pc.field("granularity") == "roi") & (pc.field("modality") == "video"))[0]
    res = trace(out, str(roi["feature_id"]))
    (o,) = res["origins"]
    assert (o["source_id"], o["source_uri"]) == ("room_video", lineage[("sample-meeting", "room_video")]["source_uri"])
    assert o["model_ids"] == [roi["model_id"]] and res["target"]["feature"]["event_id"] == roi["event_id"]
    assert res["target"]["event"]["face_boxes"] and o["removed"]["face_boxes"] > 0
    assert any(d.startswith("mediapipe-face-detection@") for d in o["detectors"])
    lapel = next(x for x in trace(out, "sample-meeting:3")["origins"] if x["source_id"] == "lapel")
    assert lapel["clock"]["method"] == "estimated" and lapel["clock"]["reference"] == "room_video"


def _event_ids(out: Path, pairs: set[tuple[str, str]]) -> list[str]:
    ids = []
    for table in ("events_video", "events_audio", "events_pdf"):
        ids += [r["event_id"] for r in _read(out, table, ["session_id", "source_id", "event_id"])
                if (r["session_id"], r["source_id"]) in pairs]
    return sorted(ids)


def test_access_lists_exactly_the_rows_of_the_subjects_sessions_and_sources(run_out):
    out, _ = run_out
    sources = {(r["session_id"], r["source_id"]) for r in _read(out, "lineage_sources", ["session_id", "source_id"])}
    meeting = {p for p in sources if p[0] == "sample-meeting"}
    solo = {p for p in sources if p[0] == "solo"}
    assert len(meeting) == 4 and len(solo) == 2 and ("deck", "slides") in sources  # the deck session lists no subject
    for subject, pairs in (("subject-0002", meeting), ("subject-0007", {("solo", "room")}),
                           ("subject-0001", meeting | {("solo", "room")}), ("subject-0003", solo)):
        rep = access(out, subject)
        assert {(o["session_id"], o["source_id"]) for o in rep["sources"]} == pairs, subject
        assert sorted(e["event_id"] for e in rep["events"]) == _event_ids(out, pairs), subject
        feats = [r for r in _read(out, "features", ["session_id", "source_id", "feature_id", "cache_key"])
                 if (r["session_id"], r["source_id"]) in pairs]
        assert sorted(f["feature_id"] for f in rep["features"]) == sorted(f["feature_id"] for f in feats), subject
        assert sorted(i for ix in rep["faiss"] for i in ix["feature_ids"]) == sorted(f["feature_id"] for f in feats)
        assert {c["cache_key"] for c in rep["cache"]} >= {f["cache_key"] for f in feats}
        assert all(c["segment"] for c in rep["cache"])  # every named entry is in the cache
        ticks = [r for r in _read(out, "records", ["session_id", "source_id", "tick_index"])
                 if (r["session_id"], r["source_id"]) in pairs]
        assert len(rep["timeline"]) == len(ticks) > 0
    assert {p["kind"] for p in access(out, "subject-0002")["pseudonyms"]} >= {"person", "email"}
    assert access(out, "subject-0007")["pseudonyms"] == []


class _Text(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.chunks: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.chunks.append(data)


def test_the_access_report_parses_and_holds_no_planted_personal_data(run_out, tmp_path, capsys):
    out, _ = run_out
    page = tmp_path / "access.html"
    assert main(["lineage", "access", str(out), "--subject", "subject-0001", "--format", "html",
                 "--out", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    p = _Text()
    p.feed(text)
    p.close()
    assert p.tags[:2] == ["html", "head"] and "script" not in p.tags and "table" in p.tags
    shown = "".join(p.chunks)
    assert "sample-meeting/slides/block/0" in shown and "<PERSON_" in shown
    assert "access report (html) for subject subject-0001" in capsys.readouterr().out
    assert main(["lineage", "access", str(out), "--subject", "subject-0001", "--json"]) == 0
    as_json = capsys.readouterr().out
    assert json.loads(as_json)["counts"]["sources"] == 5  # the meeting's 4 and solo's room recorder
    for _kind, value, _page in PLANTED_PII:  # names (and each part of them), e-mails, phones: in neither report
        for part in [value, *(w for w in value.split() if w.isalpha() and len(w) > 3)]:
            assert part.lower() not in text.lower() and part.lower() not in as_json.lower(), part


def test_a_subject_registry_finds_a_document_of_another_session_that_mentions_the_subject(run_out, tmp_path):
    """The deck session lists no subject, so only the registry (the subject's name, outside OUT)
    links it to subject-0001: access lists exactly the document events carrying the name's keyed
    pseudonym in any session, and an erasure (dry run) takes the deck's source too, unless told
    to keep mentions. The report names no one."""
    from modalign.operators.deid.keystore import KeyStore
    from modalign.operators.deid.text import pseudonym
    from modalign.pipeline.erasure import erase
    from modalign.pipeline.sample import subject_id

    out, _ = run_out
    keys = out.parent / "keys"
    name = next(v for k, v, _ in PLANTED_PII if k == "person" and subject_id(v) == "subject-0001")
    registry = tmp_path / "subjects.yaml"
    registry.write_text(f"subject-0001:\n  person: [{name}]\n")
    assert "mentions" not in access(out, "subject-0001", key_store=keys)  # no registry in the key store
    report = access(out, "subject-0001", registry=registry, key_store=keys)
    token = pseudonym(KeyStore(keys).key("default"), "person", name)
    want = {(r["session_id"], r["event_id"]) for r in _read(out, "events_pdf", ["session_id", "event_id", "words"])
            if any(token in (w["text"] or "") for w in r["words"])}
    got = {(m["session_id"], m["event_id"]) for m in report["mentions"]}
    assert got == want and {s for s, _ in got} == {"sample-meeting", "deck"}
    assert {m["pseudonym"] for m in report["mentions"]} == {token} and report["counts"]["mentions"] == len(got)
    assert "deck" not in report["sessions"] and name not in json.dumps(report)

    def erased(**kw) -> set:
        dry = erase(out, subject="subject-0001", dry_run=True, key_store=keys, registry=registry, **kw)
        return {(o["session_id"], o["source_id"]) for o in dry["sources"]}

    with_mentions, without = erased(), erased(mentions=False)
    assert with_mentions - without == {("deck", "slides")}
    assert ("sample-meeting", "slides") in without
