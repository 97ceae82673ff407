"""De-identification policy: what is removed from each modality, and how.

The policy id and version are stamped on every record and lineage row, so a compliance
team can tell which rules produced any output. Unknown actions or entity types are
validation errors (``extra="forbid"`` and literal types).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TextEntity = Literal["person", "email", "phone", "iban", "card", "ip", "address", "date_of_birth", "national_id"]
TextAction = Literal["pseudonymise", "mask", "drop", "keep"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FacePolicy(_Strict):
    action: Literal["blur_permute", "keep"] = "blur_permute"
    min_score: float = Field(0.5, ge=0.0, le=1.0, description="detector confidence threshold")
    pad_ratio: float = Field(0.25, ge=0.0, le=2.0, description="box padding, fraction of box size on each side")
    blur_sigma_ratio: float = Field(0.15, gt=0.0, description="Gaussian sigma as a fraction of the box's larger side")
    temporal_window: int = Field(2, ge=0, description="a face box also covers this many frames before and after")


class VoicePolicy(_Strict):
    action: Literal["keep_mfcc", "drop"] = "keep_mfcc"


class TextPolicy(_Strict):
    action: TextAction = "pseudonymise"
    entities: tuple[TextEntity, ...] = ("person", "email", "phone", "iban", "card", "ip")
    min_score: float = Field(0.5, ge=0.0, le=1.0)


class DeidPolicy(_Strict):
    """Versioned de-identification policy for all modalities."""

    policy_id: str = "modalign-default"
    version: str = "1"
    face: FacePolicy = FacePolicy()
    voice: VoicePolicy = VoicePolicy()
    text: TextPolicy = TextPolicy()

    @property
    def tag(self) -> str:
        return f"{self.policy_id}@{self.version}"
