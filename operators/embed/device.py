"""Device choice for the embedding stage: one decision per encoder, made in ``setup()``.

Encoders run on CUDA (bf16 autocast) when a GPU is visible and the config allows it, and
in fp32 on the CPU otherwise. The choice is made once per loaded encoder, so every batch
of an actor runs on the same device and gives the same numbers.
"""

from __future__ import annotations

import logging

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

DEVICE_PREFERENCES = ("auto", "cpu", "cuda")


def pick_device(pref: str = "auto") -> str:
    """``"cuda"`` (or ``"cuda:N"``) when CUDA is available and ``pref`` allows it, else ``"cpu"``.

    ``pref``: ``auto`` (GPU if present), ``cpu`` (never GPU), ``cuda`` / ``cuda:N`` (GPU,
    falling back to the CPU with a warning when none is visible). Anything else is a
    ``ConfigError``.
    """
    p = (pref or "auto").strip().lower()
    base = p.split(":", 1)[0]
    if base not in DEVICE_PREFERENCES or (base != "cuda" and ":" in p):
        raise ConfigError(f"embedding device must be one of auto, cpu, cuda, cuda:N; got {pref!r}")
    if base == "cpu":
        return "cpu"
    import torch  # heavy: only when a GPU could be chosen

    if torch.cuda.is_available():
        return p if base == "cuda" else "cuda"
    if base == "cuda":
        log.warning("embedding device %r requested but CUDA is not available; using the CPU", pref)
    return "cpu"
