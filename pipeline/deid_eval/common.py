"""What the three evaluations share: optional-package loading and percentage formatting."""

from __future__ import annotations

import importlib
from typing import Any

from modalign.schemas.errors import DependencyMissingError


def need(module: str, pip: str) -> Any:
    """Import an evaluation-only package, or raise DependencyMissingError naming the pip line."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DependencyMissingError(f"Python package {pip} (needed by deid-eval)", pip=pip) from None


def pct(x: float) -> str:
    """``12.3 %``, or ``n/a`` for NaN."""
    return "n/a" if x != x else f"{100 * x:.1f} %"
