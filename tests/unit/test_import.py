"""Importing our packages must not import heavy modules (they load inside setup())."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

HEAVY = ["torch", "torchaudio", "ray", "faiss", "cv2", "spacy", "mediapipe", "av", "pytesseract",
         "sentence_transformers", "transformers", "duckdb"]
# Modules whose job is to wire Ray: they may import it (and only they).
RAY_WIRING = {"modalign.pipeline.actors"}


def _modules() -> list[str]:
    from modalign import operators
    from modalign import pipeline
    from modalign import schemas

    names = ["modalign"]
    for pkg in (pipeline, operators, schemas):
        names.append(pkg.__name__)
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    return sorted(n for n in names if n not in RAY_WIRING)


def test_importing_any_module_loads_no_heavy_dependency():
    code = (
        "import importlib, json, sys\n"
        f"mods = {_modules()!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_public_api_import_loads_nothing_heavy_and_no_generic_names(tmp_path):
    """``import modalign`` (and the public functions) load no heavy module, and the installed
    distribution puts no ``pipeline``/``operators``/``schemas`` module into a user's path."""
    code = (
        "import importlib.util, json, sys\n"
        "import modalign\n"
        "api = [callable(modalign.run), callable(modalign.open)]\n"
        f"heavy = sorted(h for h in {HEAVY!r} if h in sys.modules)\n"
        "generic = [n for n in ('pipeline', 'operators', 'schemas') if importlib.util.find_spec(n)]\n"
        "print(json.dumps([api, heavy, generic]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[True, True], [], []]


def test_module_list_is_not_empty():
    mods = _modules()
    assert "modalign" in mods and "modalign.operators.modalities" in mods
    assert "modalign.pipeline.runner" in mods and "modalign.operators.align.aligner" in mods and "modalign.schemas.tables" in mods
