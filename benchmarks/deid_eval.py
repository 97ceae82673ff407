"""De-identification efficacy report: ``python benchmarks/deid_eval.py [--quick] [--json]``.

Runs ``modalign.pipeline.deid_eval.run_eval`` in a temporary folder (generated inputs only) and prints
the markdown report: text recall/precision/F2 on a labelled OCR set, face detection and
descriptor linking before/after anonymisation, speaker linkability (EER of an ignorant and a
lazy-informed attacker) and WER of the policy's voice anonymisation. Floors (issue 5): direct-
identifier recall >= 95 %, F2 >= 0.90, Haar finds <= 1 % and dlib links <= 1 % of anonymised faces;
(issue 11) voice EER >= 40 % against each attacker; a floor that does not hold is printed as
``FLOOR NOT MET`` (exit 0, or 1 with ``--strict``).

The full run takes a few minutes on 2 cores (``--quick``: about a third). Needs the
evaluation packages: resemblyzer, dlib-bin, face-recognition-models (see README).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


from modalign.pipeline.deid_eval import render, run_eval, to_json  # noqa: E402


def floors(report: dict) -> list[str]:
    """The issue's floors that do not hold (empty: all hold)."""
    failed = []
    t, f, v = report["text"], report["faces"], report["voice"]
    if t["direct_recall"] < 0.95:
        failed.append(f"text direct recall {t['direct_recall']:.3f} < 0.95")
    if t["f2"] < 0.90:
        failed.append(f"text F2 {t['f2']:.3f} < 0.90")
    if f["haar_after"] > 0.01:
        failed.append(f"Haar finds {f['haar_after']:.3f} > 0.01 of anonymised faces")
    if f["linked_after"] > 0.01:
        failed.append(f"dlib links {f['linked_after']:.3f} > 0.01 of anonymised faces")
    for attacker in ("ignorant", "lazy_informed"):  # issue 11: neither attacker links the anonymised voice
        if v[attacker]["eer"] < 0.40:
            failed.append(f"voice EER against the {attacker.replace('_', '-')} attacker {v[attacker]['eer']:.3f} < 0.40")
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sets (about a third of the time)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a floor does not hold")
    ap.add_argument("--work-dir", type=Path, help="keep the generated inputs here (default: a temp dir)")
    args = ap.parse_args()
    if args.work_dir:
        report = run_eval(args.work_dir, quick=args.quick)
    else:
        with tempfile.TemporaryDirectory(prefix="deid-eval-") as tmp:
            report = run_eval(Path(tmp), quick=args.quick)
    print(json.dumps(to_json(report), indent=2) if args.json else render(report))
    failed = floors(report)
    for line in failed:
        print(f"FLOOR NOT MET: {line}", file=sys.stderr)
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
