"""De-identification policy: what is removed from each modality, and how.

The policy id, version and a digest of its content are stamped on every record and lineage
row (``DeidPolicy.tag``, ``<policy_id>@<version>+<8 hex of the canonical JSON's sha256>``), so
a compliance team can tell which rules produced any output, and a policy changed in a
config (say voice ``anonymise``) never shares the default's tag. Bump ``version`` whenever
a default rule changes. Unknown modalities, actions, entity types or keys
are validation errors (``extra="forbid"`` and literal types), never silently ignored.

Actions per modality:

- face: ``blur_permute`` (Gaussian blur, then a keyed pixel permutation inside the padded
  box), ``mask`` (the box is filled with its mean colour: nothing of the face is left),
  ``keep`` (no change; only for consented footage). Faces are tracked so that a face seen
  in neighbouring frames keeps a box that follows it (``FacePolicy.track_hold_s``), and a
  second detector pass looks where the first lost a tracked face (``second_pass``).
- voice: ``anonymise`` (default: before the MFCCs, the waveform is re-synthesised: the
  speaker's average spectral envelope removed, then per utterance a keyed McAdams + VTLN
  warp and envelope shape, on a keyed monotone pulse / noise source, see
  ``modalign.operators.deid.voice``; MFCCs of an un-anonymised voice are biometric data,
  GDPR Art. 9, so they are not the default), ``keep_mfcc`` (waveform dropped, MFCCs of the
  original voice kept: only with consent or another Art. 9(2) basis), ``drop`` (no
  voice-derived data kept).
- text, per entity type: ``pseudonymise`` (``<PERSON_3f9a1c2b>``: keyed, consistent within
  a tenant), ``hash`` (the full 64-hex keyed HMAC-SHA256: a collision-free join key; never
  an unkeyed hash, which a dictionary of phone numbers or birth dates would reverse),
  ``mask`` (``<PERSON>``), ``drop`` (removed), ``keep`` (counted, not replaced).
  ``TextPolicy.action`` applies to every detected entity type not listed in
  ``TextPolicy.actions``.

``legal_basis`` fields are free-text notes (e.g. "GDPR Art. 6(1)(f) legitimate interest;
DPIA-2026-04") recorded with the policy; they change no behaviour.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TextEntity = Literal["person", "email", "phone", "iban", "card", "ip", "address", "date_of_birth", "national_id"]
TextAction = Literal["pseudonymise", "hash", "mask", "drop", "keep"]
FaceAction = Literal["blur_permute", "mask", "keep"]
VoiceAction = Literal["keep_mfcc", "anonymise", "drop"]

ALL_TEXT_ENTITIES: tuple[str, ...] = TextEntity.__args__  # type: ignore[attr-defined]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FacePolicy(_Strict):
    action: FaceAction = "blur_permute"
    min_score: float = Field(0.5, ge=0.0, le=1.0, description="detector confidence threshold")
    pad_ratio: float = Field(
        0.35, ge=0.0, le=2.0,
        description="box padding to the left and right, fraction of the detected box's width (0.35: to the ears' "
                    "edge; dlib links a face by what lies around it too)",
    )
    pad_above_ratio: float = Field(
        0.6, ge=0.0, le=2.0,
        description="box padding above the face, fraction of the detected box's height (forehead, hair: the "
                    "detector's box starts at the brows)",
    )
    pad_below_ratio: float = Field(
        0.6, ge=0.0, le=2.0,
        description="box padding below the face, fraction of the detected box's height (chin, jaw, neck: the "
                    "detector's box ends at the mouth)",
    )
    blur_sigma_ratio: float = Field(0.15, gt=0.0, description="Gaussian sigma as a fraction of the box's larger side")
    temporal_window: int = Field(2, ge=0, description="a face box also covers this many frames before and after")
    track_hold_s: float = Field(
        0.5, ge=0.0, le=10.0,
        description="a tracked face keeps a box that moves with it until it has been missed for this long (and in "
                    "3 frames in a row); 0: no tracking",
    )
    tiles: int = Field(
        2, ge=1, le=4,
        description="also detect on an n x n grid of overlapping tiles (faces down to ~50 px in 720p); 1: whole frame only",
    )
    tile_every: Literal[1, 2] = Field(
        2, description="2: in a dense stream only every other frame is scanned; with tracking the frames between are "
                       "not detected at all (the face tracks carry each face there and interpolate it between two "
                       "scans), without it they get the whole frame only"
    )
    full_every: int = Field(
        2, ge=1, le=8,
        description="with tracking, in a dense stream: the tiles and the fine grid run on every full_every-th scan "
                    "(2: every other one); the scans between get the whole frame and a close look at each track it "
                    "missed. A face first found on a full scan is covered back in time (track_hold_s), so keep "
                    "full_every * tile_every frames under track_hold_s",
    )
    reuse_threshold: int = Field(
        12, ge=0, le=255,
        description="a tile (or the whole frame) whose grayscale 8x8 px cell means all moved by less than this since "
                    "a model last ran on it gets that run's detections again (the same pixels, the same answer); "
                    "0: every region detected on every scan",
    )
    second_pass: bool = Field(
        True,
        description="a second model (mediapipe short-range) also runs on the tiles and, closer, around each tracked "
                    "face the first pass missed",
    )
    still_model: Literal["mtcnn", "none"] = Field(
        "mtcnn",
        description="a third detector, of another family than MediaPipe's (MTCNN, with the weights facenet-pytorch "
                    "ships), on every frame that is no part of a dense run (stills, sampled frames, a stream's last "
                    "frame), where the close grids run too: it finds turned and low-detail faces neither MediaPipe "
                    "model sees; 'none': off",
    )
    legal_basis: str = Field("", description="free-text note recorded with the policy")

    @model_validator(mode="after")
    def _window_covers_skipped_tiles(self) -> "FacePolicy":
        if self.tiles > 1 and self.tile_every == 2 and self.temporal_window < 1:
            raise ValueError("face.tile_every=2 needs face.temporal_window >= 1 (or tile_every=1, or tiles=1)")
        return self


class VoicePolicy(_Strict):
    action: VoiceAction = "anonymise"
    segment_s: float = Field(
        4.0, ge=0.5, le=60.0,
        description="anonymise: utterance length on the stream's sample clock; each utterance draws its own parameters",
    )
    mcadams_alpha_range: tuple[float, float] = Field(
        (0.8, 1.0), description="anonymise: per-utterance McAdams range; frequency w (rad) becomes pi (w/pi)**alpha",
    )
    vtln_warp_range: tuple[float, float] = Field(
        (-0.2, 0.2), description="anonymise: per-utterance all-pass (VTLN) warp range; > 0 moves formants up",
    )
    f0_range_hz: tuple[float, float] = Field(
        (80.0, 250.0), description="anonymise: per-utterance monotone pitch range that replaces the speaker's pitch",
    )
    timbre_db: float = Field(
        10.0, ge=0.0, le=20.0,
        description="anonymise: per-utterance keyed envelope shape, 6 cosine terms of up to this many dB each",
    )
    envelope_norm_s: float = Field(
        3.0, ge=0.0, le=10.0,
        description="anonymise: the speaker's average envelope over this span is removed first (0: not removed)",
    )
    legal_basis: str = Field("", description="free-text note recorded with the policy")

    @model_validator(mode="after")
    def _ranges_change_voice(self) -> "VoicePolicy":
        (a0, a1), (w0, w1), (f0, f1) = self.mcadams_alpha_range, self.vtln_warp_range, self.f0_range_hz
        if not (0.5 < a0 <= a1 < 1.5 and -0.4 <= w0 <= w1 <= 0.4 and 50.0 <= f0 <= f1 <= 400.0):
            raise ValueError("voice ranges must be ordered (low, high) within mcadams_alpha (0.5, 1.5), "
                             "vtln_warp [-0.4, 0.4], f0_range_hz [50, 400]")
        if self.action == "anonymise" and max(abs(a0 - 1.0), abs(a1 - 1.0)) < 0.05 and max(abs(w0), abs(w1)) < 0.05:
            raise ValueError("voice.mcadams_alpha_range and voice.vtln_warp_range are too close to no change to "
                             "anonymise; use e.g. mcadams_alpha_range [0.8, 1.0], vtln_warp_range [-0.2, 0.2]")
        return self


class TextPolicy(_Strict):
    action: TextAction = Field("pseudonymise", description="default action for detected entities not in `actions`")
    entities: tuple[TextEntity, ...] = Field(
        ALL_TEXT_ENTITIES, description="entity types looked for; others are left as they are"
    )
    min_score: float = Field(0.5, ge=0.0, le=1.0, description="default detector score threshold")
    actions: dict[TextEntity, TextAction] = Field(
        default_factory=dict, description="per-entity action, e.g. {person: pseudonymise, ip: mask}"
    )
    min_scores: dict[TextEntity, float] = Field(
        default_factory=dict, description="per-entity score threshold, overriding min_score"
    )
    legal_basis: str = Field("", description="free-text note recorded with the policy")

    @model_validator(mode="after")
    def _listed_entities_are_detected(self) -> "TextPolicy":
        for name, mapping in (("actions", self.actions), ("min_scores", self.min_scores)):
            extra = sorted(set(mapping) - set(self.entities))
            if extra:
                raise ValueError(
                    f"text.{name} names entity type(s) {', '.join(extra)} that text.entities does not detect; "
                    "add them to text.entities or remove them"
                )
        for kind, score in self.min_scores.items():
            if not 0.0 <= score <= 1.0:
                raise ValueError(f"text.min_scores[{kind}] must be within [0, 1]")
        return self

    def action_for(self, kind: str) -> str:
        """The action applied to an entity of ``kind``."""
        return self.actions.get(kind, self.action)  # type: ignore[call-overload]

    def threshold_for(self, kind: str) -> float:
        """The minimum detector score for an entity of ``kind``."""
        return self.min_scores.get(kind, self.min_score)  # type: ignore[call-overload]


class FrameTextPolicy(_Strict):
    """Personal data shown as text inside video frames (a slide on screen, a badge).

    Frames are OCRed at ``ocr_fps``; the text policy's entity kinds found there are blurred
    and permuted in place. Text on screen for less than ``1 / ocr_fps`` can be missed.
    """

    action: Literal["blur_permute", "keep"] = "blur_permute"
    ocr_fps: float = Field(4.0, gt=0, le=30,
                           description="frames OCRed per second of video (on the stream's clock, plus its last frame)")
    reuse_threshold: int = Field(
        24, ge=0, le=255,
        description="a sample whose grayscale thumbnail (4x4 px cell means) differs from the stream's last OCRed "
                    "sample by less than this in every cell reuses that OCR (modalign.operators.deid.frame_text, "
                    "'Reuse'); 0: every sample is OCRed")
    legal_basis: str = Field("", description="free-text note recorded with the policy")


class DeidPolicy(_Strict):
    """Versioned de-identification policy for all modalities."""

    policy_id: str = Field("modalign-default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    version: str = Field("10", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
    legal_basis: str = Field("", description="free-text note recorded with the policy")
    face: FacePolicy = FacePolicy()
    voice: VoicePolicy = VoicePolicy()
    text: TextPolicy = TextPolicy()
    frame_text: FrameTextPolicy = FrameTextPolicy()

    @property
    def digest(self) -> str:
        """First 8 hex of the sha256 of the policy's canonical JSON: its content, every field."""
        import hashlib
        import json

        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:8]

    @property
    def tag(self) -> str:
        """``<policy_id>@<version>+<digest>``: two policies that differ in any rule never share a tag."""
        return f"{self.policy_id}@{self.version}+{self.digest}"


DEFAULT_POLICY_TAG = DeidPolicy().tag
