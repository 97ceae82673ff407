"""Session manifests: what users write to describe one capture event.

A manifest lists a session's sources (video, audio, PDF), how each source's clock maps
onto the session clock, the page schedule of documents and the data subjects present (per
session, or per source).
Sample sessions also carry ``ground_truth`` so tests can check outputs against it.
Validation errors name the offending field; loading is in ``modalign.schemas.load``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

Modality = Literal["video", "audio", "pdf"]

MEDIA_SUFFIXES: dict[str, Modality] = {
    ".mp4": "video", ".mov": "video", ".mkv": "video", ".webm": "video", ".avi": "video",
    ".wav": "audio", ".mp3": "audio", ".m4a": "audio", ".flac": "audio", ".ogg": "audio", ".aac": "audio",
    ".pdf": "pdf",
}


DAY_NS = 86_400 * 1_000_000_000
MAX_LOCAL_NS = 7 * DAY_NS  # a page schedule reaches at most a week into its recording


# An opaque data-subject id ("subject-0001", a registry key): never a name or an e-mail, so no
# whitespace and no '@'. It is written to lineage rows in OUT.
SubjectId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ClockMapping(_Strict):
    """Maps a source's local clock onto the session clock.

    ``t_session_ns = offset_ns + t_local_ns + t_local_ns * skew_ppm / 1e6``, computed in
    integers (see ``modalign.operators.align.clock``) so hours of media convert without float drift.
    """

    offset_ns: int = Field(0, ge=-DAY_NS, le=DAY_NS, description="session-clock time of the source's local zero, ns "
                                                                 "(within one day)")
    skew_ppm: float = Field(0.0, ge=-10_000, le=10_000, description="source clock rate error, parts per million")
    estimated: bool = Field(False, description="True when offset/skew came from estimation, not the manifest")
    estimate_from: str | None = Field(
        None, description="id of another source with audio: estimate offset/skew against it by cross-correlation"
    )
    verify_with: str | None = Field(
        None, description="id of another source with audio: keep this mapping, but measure drift against it"
    )
    confidence: float | None = Field(None, ge=0, le=1, description="confidence of an estimated mapping")

    @model_validator(mode="after")
    def _one_reference(self) -> "ClockMapping":
        if self.estimate_from and self.verify_with:
            raise ValueError("set at most one of clock.estimate_from and clock.verify_with")
        return self

    @property
    def reference(self) -> str | None:
        """The source this clock is estimated or verified against, if any."""
        return self.estimate_from or self.verify_with


class SourceSpec(_Strict):
    """One object (file or object-store key) in a session."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="unique within the session")
    uri: str = Field(min_length=1, description="path (relative to the manifest) or URI")
    modality: Modality
    clock: ClockMapping = ClockMapping()
    page_schedule_ns: list[int] | None = Field(
        None, description="PDF only: local time at which each page becomes active (page i until page i+1)"
    )
    page_duration_ns: int = Field(
        5_000_000_000, gt=0, le=DAY_NS, description="PDF without schedule: each page held this long, sequentially"
    )
    audio_track: bool = Field(
        True, description="video only: also ingest the container's own audio stream as the audio source "
                          "'<id>.audio' (same clock, same de-identification as a separate recording)"
    )
    track_of: str | None = Field(
        None, description="set by modalign, not in manifests: the video source whose audio stream this source is"
    )
    subjects: list[SubjectId] = Field(
        default_factory=list, max_length=10_000,
        description="data-subject ids present in this source only (opaque ids, never names), in addition to the "
                    "session's subjects; a video's own audio track inherits them",
    )

    @field_validator("page_schedule_ns")
    @classmethod
    def _schedule_sorted(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if any(b <= a for a, b in zip(v, v[1:])):
                raise ValueError("page_schedule_ns must be strictly increasing")
            if v and v[0] < 0:
                raise ValueError("page_schedule_ns must not be negative")
            if v and v[-1] > MAX_LOCAL_NS:
                raise ValueError(f"page_schedule_ns must stay within {MAX_LOCAL_NS} ns (a week)")
            if len(v) > 100_000:
                raise ValueError("page_schedule_ns lists more than 100,000 pages")
        return v

    @field_validator("subjects")
    @classmethod
    def _subjects_unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("subjects lists a subject id twice")
        return v

    @model_validator(mode="after")
    def _schedule_only_for_pdf(self) -> "SourceSpec":
        if self.page_schedule_ns is not None and self.modality != "pdf":
            raise ValueError(f"source {self.id!r}: page_schedule_ns is only valid for modality 'pdf'")
        return self


class PlantedPII(_Strict):
    """A personal-data item planted in a sample session (ground truth for tests)."""

    kind: Literal["person", "email", "phone", "iban", "card", "address", "date_of_birth", "ip"]
    value: str
    page_index: int | None = None


class GroundTruth(_Strict):
    """What a generated sample session is known to contain."""

    duration_ns: int
    transcript: str = ""
    speech_source_id: str | None = None
    audio_offsets_ns: dict[str, int] = Field(default_factory=dict, description="true clock offset per source id")
    slide_words: list[str] = Field(default_factory=list, description="non-personal words printed on the slides")
    planted_pii: list[PlantedPII] = Field(default_factory=list)
    face_source_id: str | None = None


TRACK_SUFFIX = ".audio"


class Manifest(_Strict):
    """A session: several sources sharing one timeline."""

    session_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    sources: list[SourceSpec] = Field(min_length=1, max_length=1000)
    subjects: list[str] = Field(default_factory=list, description="data-subject ids present in the session")
    tenant: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$",
                        description="pseudonym key scope: letters, digits, '_' and '-' (a key file name, no path)")
    ground_truth: GroundTruth | None = None

    @model_validator(mode="after")
    def _unique_ids(self) -> "Manifest":
        seen: set[str] = set()
        for s in self.sources:
            if s.id in seen:
                raise ValueError(f"duplicate source id {s.id!r}")
            seen.add(s.id)
        by_id = {s.id: s for s in self.sources}
        for s in self.sources:
            ref = s.clock.reference
            if ref is not None and (ref not in seen or ref == s.id):
                raise ValueError(f"source {s.id!r}: clock.estimate_from/verify_with names no other source ({ref!r})")
            if ref is not None and by_id[ref].modality == "pdf":
                raise ValueError(f"source {s.id!r}: clock reference {ref!r} is a PDF; name a source with sound "
                                 "(audio, or a video with its audio track)")
            chain, cur = [s.id], ref
            while cur is not None:  # estimate_from / verify_with must not loop back
                if cur in chain:
                    raise ValueError(f"clock references form a cycle: {' -> '.join(chain + [cur])}")
                chain.append(cur)
                cur = by_id[cur].clock.reference
            if s.track_of is not None:
                raise ValueError(f"source {s.id!r}: track_of is set by modalign, not in a manifest")
            if s.modality == "video" and s.audio_track and s.id + TRACK_SUFFIX in seen:
                raise ValueError(f"source {s.id!r}: its audio track would be source {s.id + TRACK_SUFFIX!r}, "
                                 "which the manifest already names; rename it or set audio_track: false")
        return self

    def subjects_of(self, source: SourceSpec) -> tuple[str, ...]:
        """The data subjects of one source: the session's, then the source's own, each once."""
        return tuple(dict.fromkeys([*self.subjects, *source.subjects]))

    def ingest_sources(self) -> list[SourceSpec]:
        """The sources as ingested: each video with ``audio_track`` followed by its audio stream
        as a source of its own (``<id>.audio``, same uri and clock)."""
        out: list[SourceSpec] = []
        for s in self.sources:
            out.append(s)
            if s.modality == "video" and s.audio_track:
                out.append(s.model_copy(update={"id": s.id + TRACK_SUFFIX, "modality": "audio", "track_of": s.id}))
        return out
