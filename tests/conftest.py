"""Shared fixtures: one local Ray per test session, one generated sample session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tesseract's own threading is slower on few cores (STACK.md); keep tests on one thread.
os.environ.setdefault("OMP_THREAD_LIMIT", "1")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for all integration tests: 2 CPUs, no dashboard."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    from modalign.pipeline.local_ray import stop_local_ray

    stop_local_ray()  # the monitor first, else ray.shutdown waits 1 s on it


@pytest.fixture(scope="session")
def sample_manifest(tmp_path_factory) -> Path:
    """A 6-second generated sample session (video + lapel audio + slides PDF)."""
    from modalign.pipeline.sample import generate_sample

    return generate_sample(tmp_path_factory.mktemp("sample"), duration_s=6.0, seed=0)


@pytest.fixture(scope="session")
def image_encoder():
    """One EfficientNet-Lite0 encoder (CPU) for every test that embeds images."""
    from modalign.operators.embed.image import ImageEmbedConfig, ImageEncoder

    enc = ImageEncoder(ImageEmbedConfig(device="cpu"))
    enc.setup()
    return enc


@pytest.fixture(scope="session")
def text_encoder():
    """One MiniLM text encoder (CPU) for every test that embeds text."""
    from modalign.operators.embed.text import TextEmbedConfig, TextEncoder

    enc = TextEncoder(TextEmbedConfig(device="cpu"))
    enc.setup()
    return enc
