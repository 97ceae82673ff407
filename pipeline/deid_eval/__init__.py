"""De-identification efficacy figures: what ``modalign deid-eval`` reports.

Sits beside the data flow, not in it: it generates labelled media, runs the same
de-identification operators the ingest worker runs (``modalign.operators.deid``), and measures with
tools that play no part in the pipeline whether the removed personal data can still be
found or linked:

- **text**: a labelled OCR set (reportlab pages in Helvetica, Times and Courier; a third
  of them printed, noised, rotated and re-embedded as image-only "scans"), read by the
  real ``PdfTextOperator`` (poppler + tesseract) and de-identified page by page by
  ``TextPiiOperator``. Scoring is per entity by word boxes: an entity is *found* when
  every OCR word lying on its printed box (at least half of the word's area) was
  rewritten; a *false positive* is a run of rewritten words on no entity. This is
  tolerant of OCR errors (a misread letter inside an entity does not matter, a split
  e-mail counts as found only if both halves were replaced) and strict about leaks.
- **locales** (``locales``): Faker values of 14 locales, never tuned on: born-digital
  sentences, and pages in four TrueType fonts, half of them scanned, read back by the
  product's OCR; recall per kind, locale, font and scan condition.
- **manuals** (``manuals``): precision on real software manuals installed from Debian
  packages, against hand-made labels of the people named in them; author names and e-mails
  must all be replaced.
- **faces**: the astronaut of ``skimage.data.astronaut()`` (public domain) flipped,
  scaled, colour-jittered and pasted onto other skimage images; anonymised by
  ``FaceBlurOperator`` (its own MediaPipe detector, the default policy); then checked
  by an independent detector (OpenCV's Haar cascade, and dlib's HOG detector) and by
  dlib's 128-d face descriptor (ResNet, face-recognition-models): a face is *linked*
  when the descriptor at the face's place in the anonymised image is within 0.6 (dlib's
  own same-person threshold) of the original's. Before-figures show the checks work on
  the original faces. On real footage (``eval_face_clips``): real faces moving over real
  video frames with scale change, occlusion and motion blur, skimage's LFW subset, and the
  opencv-doc videos (face regions there: the union of dlib HOG, Haar and the anonymiser's
  own detections on the originals); frames re-detected, linked, uncovered, false boxes.
- **voice**: espeak-ng variants, flite voices and natural speech from Debian packages, anonymised
  by the policy's ``VoiceAnonymiser`` (keyed, per utterance), embedded with resemblyzer's
  speaker encoder (256-d, cosine); EER of an ignorant attacker (original enrolment) and of a
  lazy-informed one (enrolment anonymised with the same method, its own key), beside the
  originals' EER. Content kept: pocketsphinx word error rate before/after.

``run_eval(work_dir)`` returns a JSON-able dict; ``render(report)`` a markdown report.
Evaluation-only packages: resemblyzer (+ librosa, webrtcvad-wheels), dlib-bin,
face-recognition-models; nothing downloads weights at run time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from modalign.pipeline.deid_eval.faces import (DLIB_LINK_DISTANCE, FaceSample, eval_face_clips, eval_faces, make_face_samples,
                                              render_face_clips, render_faces)
from modalign.pipeline.deid_eval.locales import eval_locales_ocr, eval_locales_text, render_locales
from modalign.pipeline.deid_eval.manuals import MANUALS, QUICK_MANUALS, eval_manuals, render_manuals
from modalign.pipeline.deid_eval.text import (DIRECT, QUOTA, LabelledEntity, OcrSet, build_ocr_set, eval_text, make_text_corpus,
                                              render_text, score_text)
from modalign.pipeline.deid_eval.voice import QUICK_VOICE, VOICES, eer_threshold, espeak_16k, eval_voice, render_voice
from modalign.schemas.policy import DeidPolicy


def run_eval(work_dir: Path, quick: bool = False, policy: DeidPolicy | None = None) -> dict:
    """All three evaluations under ``policy`` (default: ``DeidPolicy()``); returns a JSON-able dict.

    ``work_dir`` receives the generated PDFs and a throw-away pseudonym key; ``quick``
    shrinks the sets (about a third of the time). Raises DependencyMissingError when an
    evaluation package (resemblyzer, dlib-bin, face-recognition-models) is missing.
    """
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    policy = policy or DeidPolicy()
    t0 = time.perf_counter()
    report: dict[str, Any] = {"policy": policy.tag}
    quota = {k: max(4, v // 3) for k, v in QUOTA.items()} if quick else None
    report["text"] = eval_text(work_dir, policy, build_ocr_set(work_dir, quota=quota))
    report["locales"] = {"text": eval_locales_text(per_kind=10 if quick else 40, policy=policy),
                         "ocr": eval_locales_ocr(work_dir, per_kind=1 if quick else 3, policy=policy)}
    report["manuals"] = eval_manuals(work_dir, policy, QUICK_MANUALS if quick else MANUALS)
    report["faces"] = eval_faces(n=30 if quick else 100, policy=policy)
    report["face_clips"] = eval_face_clips(quick=quick, policy=policy)
    report["voice"] = eval_voice(policy=policy, **(QUICK_VOICE if quick else {"alphas": (0.8,)}))
    report["seconds"] = time.perf_counter() - t0
    return report


def render(report: dict) -> str:
    """Markdown report of ``run_eval``'s dict."""
    lines = [f"# De-identification efficacy (policy {report.get('policy', '?')})", ""]
    parts = (("text", render_text), ("locales", lambda r: render_locales(r.get("text"), r.get("ocr"))),
             ("manuals", render_manuals), ("faces", render_faces), ("face_clips", render_face_clips),
             ("voice", render_voice))
    for key, part in parts:
        if report.get(key):
            lines += part(report[key])
    if "seconds" in report:
        lines.append(f"Evaluation took {report['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def to_json(report: dict) -> dict:
    """The report with numpy scalars made plain (for ``--json``)."""
    import json

    return json.loads(json.dumps(report, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


__all__ = ["run_eval", "render", "to_json", "eval_text", "eval_faces", "eval_voice", "build_ocr_set",
           "eval_locales_text", "eval_locales_ocr", "eval_manuals", "MANUALS", "QUICK_MANUALS",
           "eval_face_clips", "make_face_samples", "make_text_corpus", "score_text", "eer_threshold", "espeak_16k", "LabelledEntity", "OcrSet",
           "FaceSample", "DIRECT", "DLIB_LINK_DISTANCE", "QUOTA", "VOICES"]
