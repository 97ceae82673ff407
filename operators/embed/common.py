"""What the embedding table operators share: a (possibly shared) encoder and a feature cache.

``FrameEmbedOperator`` and ``TextEmbedOperator`` map de-identified payload tables to
feature rows (``modalign.operators.cache.keys.feature_schema``); each wraps one encoder operator,
configured by the ``encoder`` field of its own config, and an optional ``FeatureCache``.
"""

from __future__ import annotations

from typing import ClassVar

import pyarrow as pa

from modalign.operators.base import C, Operator, TableOperator
from modalign.operators.cache.keys import feature_schema
from modalign.operators.cache.store import FeatureCache
from modalign.schemas.errors import ConfigError


class EncoderTableOperator(TableOperator[C]):
    """A table operator around an encoder (``config.encoder``) with an optional feature cache.

    An encoder instance may be shared between operators (one model in memory); its config
    must then equal this operator's ``config.encoder``.
    """

    encoder_cls: ClassVar[type[Operator]]

    def __init__(self, config: C | None = None, *, encoder: Operator | None = None,
                 cache: FeatureCache | None = None) -> None:
        if config is None and encoder is not None:
            config = self.config_model(encoder=encoder.config)
        super().__init__(config)
        if encoder is not None and encoder.config != self.config.encoder:
            raise ConfigError(f"the shared {encoder.kind} encoder's config differs from {self.kind}'s encoder config")
        self.encoder = encoder if encoder is not None else self.encoder_cls(self.config.encoder)
        self.cache = cache

    def setup(self) -> None:
        self.encoder.ensure_setup()
        self._ready = True

    def load(self) -> None:
        """Set up and load the encoder's network now (it loads on first use otherwise)."""
        self.ensure_setup()
        self.encoder.load()

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        return feature_schema()
