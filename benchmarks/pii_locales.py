"""Text PII recall across locales, fonts and scan conditions, on values the detector was never tuned on.

``python benchmarks/pii_locales.py [--per-kind 40] [--ocr-per-kind 3] [--seed 7]``

Runs ``modalign.pipeline.deid_eval.locales`` at full size (deid-eval's quick slice is
smaller): Faker values of 14 locales as born-digital sentences, and the same kinds printed
in four fonts, half of the pages scanned, read back through the product's OCR. Prints
recall per kind and locale, per font and scan condition, and the misses, so failure
classes are visible. Measures only: nothing is tuned here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-kind", type=int, default=40, help="born-digital values per kind and locale")
    ap.add_argument("--ocr-per-kind", type=int, default=3, help="printed values per kind and locale (0: skip OCR)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    from modalign.pipeline.deid_eval.locales import LOCALES, eval_locales_ocr, eval_locales_text, render_locales

    text = eval_locales_text(per_kind=args.per_kind, seed=args.seed)
    print("| kind | all | " + " | ".join(LOCALES) + " |")
    print("| --- " * (len(LOCALES) + 2) + "|")
    for kind, total in sorted(text["per_kind"].items()):
        cells = [text["cells"].get(f"{kind}|{loc}") for loc in LOCALES]
        row = [f"{c[0] / c[1]:.0%}" if c else "-" for c in cells]
        print(f"| {kind} | **{total['recall']:.1%}** ({total['n']}) | " + " | ".join(row) + " |")
    ocr = None
    if args.ocr_per_kind:
        with tempfile.TemporaryDirectory() as tmp:
            ocr = eval_locales_ocr(Path(tmp), per_kind=args.ocr_per_kind, seed=args.seed)
    print("\n".join(render_locales(text, ocr)))
    for kind, misses in sorted(text["missed"].items()):
        print(f"missed {kind} (born-digital): " + "; ".join(misses))
    print(f"born-digital: {text['seconds']:.0f} s" + (f"; OCR {ocr['ocr_s']:.0f} s" if ocr else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
