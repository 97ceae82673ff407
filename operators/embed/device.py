"""Device choice for the embedding stage: one decision per encoder, and what its actor asks Ray for.

Encoders run on CUDA (bf16 autocast) when a GPU is visible and the config allows it, and
in fp32 on the CPU otherwise. The choice is made once per loaded encoder, so every batch
of an actor runs on the same device and gives the same numbers. Host-to-GPU copies go
through pinned memory with ``non_blocking=True`` (``to_device``), so the copy of one batch
overlaps the GPU work queued before it.

``embed_actor_resources`` is what the pipeline passes to each embed actor's
``.options(...)``: one GPU when the cluster (or this machine) has one and the config does
not force the CPU, nothing otherwise (torch is then never imported by the caller when
the cluster's GPU count is given). ``embed_actor_count`` is how many it starts: one per GPU,
or on CPUs one per four ingest actors.
"""

from __future__ import annotations

import logging
from typing import Any

from modalign.schemas.errors import ConfigError

log = logging.getLogger(__name__)

DEVICE_PREFERENCES = ("auto", "cpu", "cuda")


def _parse(pref: str) -> tuple[str, str]:
    p = (pref or "auto").strip().lower()
    base = p.split(":", 1)[0]
    if base not in DEVICE_PREFERENCES or (base != "cuda" and ":" in p):
        raise ConfigError(f"embedding device must be one of auto, cpu, cuda, cuda:N; got {pref!r}")
    return p, base


def pick_device(pref: str = "auto") -> str:
    """``"cuda"`` (or ``"cuda:N"``) when CUDA is available and ``pref`` allows it, else ``"cpu"``.

    ``pref``: ``auto`` (GPU if present), ``cpu`` (never GPU), ``cuda`` / ``cuda:N`` (GPU,
    falling back to the CPU with a warning when none is visible). Anything else is a
    ``ConfigError``.
    """
    p, base = _parse(pref)
    if base == "cpu":
        return "cpu"
    import torch  # heavy: only when a GPU could be chosen

    if torch.cuda.is_available():
        return p if base == "cuda" else "cuda"
    if base == "cuda":
        log.warning("embedding device %r requested but CUDA is not available; using the CPU", pref)
    return "cpu"


def is_cuda(device: str | None) -> bool:
    return bool(device) and str(device).startswith("cuda")


def to_device(tensor: Any, device: str) -> Any:
    """``tensor`` on ``device``: CPU tensors go to a GPU from pinned memory, without blocking the host."""
    if not is_cuda(device):
        return tensor
    if tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


INGEST_PER_EMBED_CPU = 4  # on CPUs, ingest actors per embed actor: an ingest actor does about 4x the work


def embed_actor_count(resources: dict, cluster_gpus: float, n_ingest: int, configured: int | None = None) -> int:
    """How many embed actors a run starts: ``configured`` if set; else one per whole GPU of the
    cluster when ``resources`` (``embed_actor_resources``) asks for a GPU; else, on CPUs, one per
    ``INGEST_PER_EMBED_CPU`` ingest actors. At least one."""
    if configured is not None:
        return max(1, configured)
    if resources.get("num_gpus"):
        return max(1, int(cluster_gpus))
    return max(1, n_ingest // INGEST_PER_EMBED_CPU)


def embed_actor_resources(device: str = "auto", cluster_gpus: float | None = None) -> dict:
    """Ray resources for an embed actor: ``{"num_gpus": 1}`` when a GPU is there to use, else ``{}``.

    ``device``: the embed config's preference (``cpu`` never asks for a GPU).
    ``cluster_gpus``: the cluster's GPU count (``ray.cluster_resources().get("GPU", 0)``);
    ``None`` asks this machine's torch instead (a local run). ``cuda`` with no GPU anywhere
    returns ``{}`` (the encoder falls back to the CPU with a warning).
    """
    _, base = _parse(device)
    if base == "cpu":
        return {}
    if cluster_gpus is None:
        import torch

        has_gpu = torch.cuda.is_available()
    else:
        has_gpu = float(cluster_gpus) >= 1
    return {"num_gpus": 1} if has_gpu else {}
