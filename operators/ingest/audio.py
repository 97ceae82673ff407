"""Audio ingest: decode an audio source (or a video's audio stream) into MFCC frames.

First stage of the audio path (source -> 16 kHz mono -> MFCC -> voice policy -> embed).
PyAV decodes and resamples; ``modalign.operators.ingest.mfcc`` computes MFCCs (``n_fft`` = window = 25 ms,
hop 10 ms, ``center=False``: frame k covers samples ``[k*hop, k*hop + win)``), i.e.
100 frames per second. Time comes from the decoded frames' PTS (the demuxer has already
removed AAC/MP3 priming through edit lists / gapless headers), not from a sample count
since zero: frame k is at ``session(start + k*hop / rate)`` where ``start`` is the first
frame's PTS. A PTS jump forward (a gap in the recording) is filled with silence so the
sample timeline stays on the PTS; a jump backward is ignored. Raw ADTS ``.aac`` has no
priming metadata, so its first ~2048 samples shift it by that much.

The waveform exists only inside ``read`` (chunked, with the window overlap carried across chunks
so the output equals a one-shot computation); it is never returned, stored or logged. Tables
hold ``chunk_s`` of frames each and start at its multiples (frame 0, 1000, 2000, ... at 10 s),
whatever sizes the decoder hands over. A long stream can be cut into ranges (``AudioRange``,
``plan_ranges``) that several workers process at once, with the same rows in the same tables.
MFCCs use log-mel (``log(mel + 1e-6)``), which is frame-local; a dB scale (torchaudio's default)
clips against the chunk's maximum and would make chunked output depend on chunk boundaries.

``voiced`` (when ``vad``) flags each MFCC frame by an energy voice-activity detector on the
same frame grid (``modalign.operators.ingest.vad``: log-energy over an adaptive noise floor, with
hangover); it is computed from the waveform here, so nothing downstream needs it.

``quality`` (``schemas.tables.AudioQuality``: loudness, clipping ratio, speech-to-noise estimate) of
each frame's window is measured on the decoded signal before the voice policy's transform
(``modalign.operators.quality.audio``), chunk-independent like the MFCCs; only the scalars leave.

Long files stay sample-accurate: frame k's time is ``start + k*hop/rate`` in exact integer
arithmetic (no accumulated float), and a WAV header that declares more data than the file
holds is reported as ``truncated`` after the audio that is there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from modalign.operators.align.clock import samples_to_ns
from modalign.operators.ingest._av import check_truncated, declared_span_ns, open_container, partial_error, wav_declared_ns
from modalign.operators.ingest.base import SourceContext, SourceOperator, event_id
from modalign.operators.ingest.mfcc import LogMelMfcc
from modalign.operators.ingest.vad import EnergyVad, frame_energy_db
from modalign.operators.quality.audio import AudioQualityMeter
from modalign.schemas.arrow import arrow_type
from modalign.schemas.errors import LimitExceededError, UnreadableInputError, UnsupportedInputError
from modalign.schemas.config import AudioIngestConfig
from modalign.schemas.tables import AudioQuality
from modalign.schemas.units import NS_PER_S

GAP_TOLERANCE_NS = 5_000_000  # PTS jumps above this are filled with silence


# The operator's config is the run config's section: one declaration of every field.
AudioMfccConfig = AudioIngestConfig


def audio_mfcc_schema(n_mfcc: int = 40) -> pa.Schema:
    return pa.schema([
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("t_ns", pa.int64(), nullable=False, metadata={"doc": "session ns of the frame's first sample"}),
        pa.field("frame_index", pa.int64(), nullable=False, metadata={"doc": "MFCC frame k of the source"}),
        pa.field("mfcc", pa.list_(pa.float32(), n_mfcc), nullable=False, metadata={"doc": "log-mel cepstrum"}),
        pa.field("voiced", pa.bool_(), nullable=True,
                 metadata={"doc": "energy voice-activity flag (modalign.operators.ingest.vad); null when vad is off"}),
        pa.field("quality", arrow_type(AudioQuality), nullable=False,
                 metadata={"doc": "properties of the frame's window, before voice anonymisation "
                                  "(operators.quality.audio)"}),
    ], metadata={"table": "audio_mfcc", "doc": "MFCC frames, 10 ms hop; the waveform is never stored"})


# Sample formats converted to float in numpy when no resampling is needed (the scale is
# swresample's, so both paths give the same samples): name -> (offset, scale).
_DIRECT_FORMATS = {"s16": (0, 1 / 32768), "s16p": (0, 1 / 32768), "s32": (0, 1 / 2**31), "s32p": (0, 1 / 2**31),
                   "flt": (0, 1.0), "fltp": (0, 1.0), "dbl": (0, 1.0), "dblp": (0, 1.0),
                   "u8": (128, 1 / 128), "u8p": (128, 1 / 128)}


def _direct_mono(frame: Any) -> np.ndarray:
    """Float32 samples of a mono frame at the target rate, without swresample."""
    offset, scale = _DIRECT_FORMATS[frame.format.name]
    x = frame.to_ndarray().reshape(-1).astype(np.float32)
    if offset:
        x -= offset
    if scale != 1.0:
        x *= np.float32(scale)
    return x


class PcmStream:
    """Iterate one audio stream as mono float32 chunks at ``rate``, gap-filled on the PTS.

    ``start_ns`` (local ns of the first sample) is set once the first frame is decoded;
    ``produced`` counts samples yielded so far. PyAV errors propagate to the caller.
    Mono input already at ``rate`` is converted in numpy (the same samples swresample
    gives, without its per-frame cost); anything else goes through swresample (which also
    downmixes, with its own channel weights)."""

    def __init__(self, container: Any, stream: Any, rate: int):
        self.container, self.stream, self.rate = container, stream, rate
        self.start_ns: int | None = None
        self.produced = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        import av

        resampler, key, in_end = None, None, None  # in_end: local ns where the last input frame ended
        for frame in self.container.decode(self.stream):
            tb = frame.time_base or self.stream.time_base
            if frame.pts is not None:  # pts_to_ns in plain ints (rounded to nearest): this runs per frame
                t = (2 * frame.pts * tb.numerator * NS_PER_S + tb.denominator) // (2 * tb.denominator)
            else:  # no PTS: contiguous with the previous frame
                t = in_end if in_end is not None else 0
            if self.start_ns is None:
                self.start_ns = t
            fkey = (frame.format.name, frame.layout.name, frame.sample_rate)
            direct = (frame.sample_rate == self.rate and frame.layout.nb_channels == 1
                      and frame.format.name in _DIRECT_FORMATS)
            jump = in_end is not None and t - in_end > GAP_TOLERANCE_NS
            if resampler is not None and (jump or fkey != key or direct):
                yield from self._emit(resampler.resample(None))  # flush before a gap or format change
                resampler = None
            if jump:
                gap = int(round((t - self.start_ns) * self.rate / NS_PER_S)) - self.produced
                for i in range(0, max(gap, 0), self.rate):  # 1 s pieces: a bogus jump cannot blow memory
                    piece = min(self.rate, gap - i)
                    self.produced += piece
                    yield np.zeros(piece, np.float32)
            in_end = t + frame.samples * NS_PER_S // frame.sample_rate
            if direct:
                x = _direct_mono(frame)
                if x.size:
                    self.produced += x.size
                    yield x
                continue
            if resampler is None:
                resampler, key = av.AudioResampler(format="flt", layout="mono", rate=self.rate), fkey
            yield from self._emit(resampler.resample(frame))
        if resampler is not None:
            yield from self._emit(resampler.resample(None))

    def _emit(self, frames: list) -> Iterator[np.ndarray]:
        for f in frames:
            x = f.to_ndarray().reshape(-1).astype(np.float32, copy=False)
            if x.size:
                self.produced += x.size
                yield x


@dataclass(frozen=True)
class AudioRange:
    """One stretch of an audio stream, for one worker (``plan_ranges``): MFCC frames
    ``[start_frame, end_frame)`` (None: to the end) on the frame grid of a decode from the start.

    Every range decodes the stream from its start, so that decoder and resampler state and the
    gap filling are exactly a whole decode's, and de-identifies (anonymises) only what it needs:
    its frames, the context samples of the voice transform on either side, and before its first
    frame enough frames for the voice-activity detector's history and, on the untransformed
    signal, the quality meter's. Its rows are then byte-identical to a whole decode's, in the
    same tables: both are cut at the multiples of ``chunk_frames``, and so are the range borders."""

    index: int
    count: int
    start_frame: int
    end_frame: int | None
    origin_ns: int  # local ns of the stream's first sample, as the container declares it
    frames: int  # of the whole stream, as declared
    hop: int  # samples per frame step
    rate_hz: int
    sha256: str | None = None  # of the whole file: a range cannot hash it on the way

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def end_local_ns(self) -> int | None:
        """Where this range's output ends (local ns): the next range's first frame (None: the last)."""
        if self.end_frame is None:
            return None
        return self.origin_ns + samples_to_ns(self.end_frame * self.hop, self.rate_hz)

    @property
    def seconds(self) -> float:
        """About how much of the stream this range outputs, for progress displays."""
        end = self.frames if self.end_frame is None else self.end_frame
        return max(0, end - self.start_frame) * self.hop / self.rate_hz

    def rows_owned(self, table: pa.Table) -> None:
        """None: the operator outputs this range's own frames only (nothing to filter)."""
        return None


def plan_ranges(container: Any, config: AudioIngestConfig, parts: int, min_s: float) -> list[AudioRange]:
    """Cut the first audio stream of ``container`` into up to ``parts`` ranges of at least ``min_s``
    seconds each, at table borders (``AudioMfccOperator.chunk_frames``), from its declared duration;
    [] when that makes one range, or the duration is unknown or over ``max_duration_s`` (the whole
    decode reports that). Each range decodes the stream from its start: more of them cost more."""
    if not container.streams.audio or parts < 2:
        return []
    start, end = declared_span_ns(container, container.streams.audio[0])
    if end is None or end <= start or end - start > config.max_duration_s * NS_PER_S:
        return []
    seconds = (end - start) / NS_PER_S
    count = min(parts, int(seconds // min_s))
    if count < 2:
        return []
    op = AudioMfccOperator(config)
    hop, rate, chunk = op.hop, config.sample_rate_hz, op.chunk_frames
    total = int(seconds * rate) // hop
    cuts = sorted({int(round(i * total / count / chunk)) * chunk for i in range(1, count)} - {0})
    bounds: list[int | None] = [0, *cuts, None]
    return [AudioRange(index=i, count=len(bounds) - 1, start_frame=int(bounds[i] or 0), end_frame=bounds[i + 1],
                       origin_ns=start, frames=total, hop=hop, rate_hz=rate) for i in range(len(bounds) - 1)]


class _Frames:
    """The decoded samples of one stream, turned into MFCC tables of ``chunk_frames`` frames.

    Tables start at the multiples of ``chunk_frames`` whatever sizes the decoder hands over, so the
    output does not depend on the codec's frame size, and a range (``AudioRange``) that starts at a
    multiple gets a whole decode's tables. ``push`` takes the next samples; ``cut`` yields
    ``(first_frame, mfcc, voiced, quality)`` for every table the samples so far complete (``final``:
    the stream has ended, the rest too).

    The waveform transform (``context_samples``) gets that much untransformed input on either side
    of the samples a table keeps, so its output never depends on the cut. A range starts earlier
    than its first frame: it drops the samples no output depends on, feeds the quality meter the
    loudness history its floors need, then computes (and discards) frames from the detector's
    history on, so that its own frames' ``voiced`` and ``quality`` equal a whole decode's."""

    def __init__(self, op: "AudioMfccOperator", vad: EnergyVad | None, window: AudioRange | None,
                 source_key: str) -> None:
        self.op, self.vad, self.source_key = op, vad, source_key
        self.win, self.hop, self.chunk = op.win, op.hop, op.chunk_frames
        self.tf = op.waveform_transform
        self.margin = int(getattr(self.tf, "context_samples", 0))
        self.meter = AudioQualityMeter(self.win, self.hop)  # on the signal as decoded, before the transform
        self.k0 = window.start_frame if window is not None else 0
        self.k1 = window.end_frame if window is not None else None
        if self.k0 % self.chunk or (self.k1 is not None and self.k1 % self.chunk):
            raise ValueError(f"audio range {window} is not cut at multiples of {self.chunk} frames (chunk_s)")
        history = vad.floor_frames + vad.hangover if vad is not None else 0
        self.first = max(0, self.k0 - history)  # the first frame computed (the warm-up's, for a range)
        self.meter_from = min(self.meter.history_from(self.k0), self.first)
        self.base = max(0, min(self.meter_from * self.hop, self.first * self.hop - self.margin))  # first sample kept
        self.pos = 0  # stream samples pushed so far
        self.started = self.k0 == 0
        self.pending: list[np.ndarray] = []
        self.held = 0  # samples in pending: from stream sample first * hop on
        self.left = np.zeros(0, np.float32)  # the (up to) margin untransformed samples before pending
        self.done = False  # a range's last frame is out

    def frames_in(self, samples: int) -> int:
        """Frames whose window ``samples`` samples hold in full."""
        return (samples - self.win) // self.hop + 1 if samples >= self.win else 0

    def owns_end(self, produced: int) -> bool:
        """Whether the stream ending (or failing) after ``produced`` samples is this range's to report:
        the first frame it did not output is one of this range's (a whole stream: always)."""
        end = self.frames_in(produced)
        return self.k0 <= end and (self.k1 is None or end < self.k1)

    def push(self, x: np.ndarray) -> None:
        at, self.pos = self.pos, self.pos + x.size
        if self.pos <= self.base or self.done:
            return
        self.pending.append(x[max(0, self.base - at):])
        self.held += self.pending[-1].size
        if not self.started and self.pos >= self.first * self.hop + self.win:
            self._start()

    def _start(self) -> None:
        """A range's warm-up: the quality meter's history up to the first frame computed, and the
        transform's left context."""
        hop, raw = self.hop, np.concatenate(self.pending)
        self.meter.start_at(self.meter_from)
        if self.first > self.meter_from:
            self.meter.measure(raw[self.meter_from * hop - self.base:], self.first - self.meter_from)
        at = self.first * hop - self.base
        self.left = raw[max(0, at - self.margin):at].copy()
        rest = raw[at:].copy()
        self.pending, self.held, self.started = [rest], rest.size, True

    def cut(self, final: bool) -> Iterator[tuple[int, np.ndarray, np.ndarray | None, tuple]]:
        hop, win, margin = self.hop, self.win, self.margin
        while self.started and not self.done:
            boundary = (self.first // self.chunk + 1) * self.chunk
            target = boundary - self.first
            need = (target - 1) * hop + win
            if self.held >= need + margin:
                n, take = target, need + margin
            elif final and self.held >= win:  # the stream's end: what is there
                n, take = min(target, self.frames_in(self.held)), self.held
            else:
                return
            raw = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
            x = raw[:take]
            if self.tf is not None and margin:
                x = self.tf(np.concatenate([self.left, x]), self.first * hop - self.left.size,
                            self.source_key)[self.left.size:]
            elif self.tf is not None:
                x = self.tf(x)
            x = x[:(n - 1) * hop + win]
            feats = self.op.mfcc(x)
            voiced = None if self.vad is None else self.vad(frame_energy_db(x, n, win, hop))
            quality = self.meter.measure(raw, n)  # frame k's window is raw[k*hop:k*hop+win], as x's
            used = n * hop
            if margin:
                self.left = np.concatenate([self.left, raw[max(0, used - margin):used]])[-margin:].copy()
            rest = raw[used:].copy()  # < one table (+ margin), untransformed; lets the rest go
            self.pending, self.held = ([rest] if rest.size else []), rest.size
            first, self.first = self.first, self.first + n
            if first >= self.k0:  # (a range's warm-up frames end at its first table's border)
                yield first, feats, voiced, quality
            if self.k1 is not None and self.first >= self.k1:
                self.done = True


class AudioMfccOperator(SourceOperator[AudioMfccConfig]):
    """Decodes an audio source (or a video's first audio stream) into MFCC frame tables."""

    kind = "audio_mfcc"
    # 0.3.0: the quality column; 0.4.0: MFCCs in numpy (torchaudio's within 1e-4); 0.5.0: tables cut at
    # multiples of chunk_frames (were: wherever the decoded samples filled a chunk), and ranges
    version = "0.5.0"
    modality = "audio"
    config_model = AudioMfccConfig

    def __init__(self, config: AudioMfccConfig | None = None, *,
                 waveform_transform: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """``waveform_transform``: applied to each chunk's 16 kHz mono samples before MFCC and
        VAD, inside this process (the voice policy's anonymisation hook, ``modalign.operators.deid.voice``).
        One with ``context_samples`` gets ``(samples, start_sample, source_key)`` (sample index on this
        stream's clock, ``session/source``) and that much context, so its output is chunk-independent."""
        super().__init__(config)
        self.waveform_transform = waveform_transform

    def output_schema(self) -> pa.Schema:
        return audio_mfcc_schema(self.config.n_mfcc)

    @property
    def win(self) -> int:
        return int(round(self.config.win_ms * self.config.sample_rate_hz / 1000))

    @property
    def hop(self) -> int:
        return int(round(self.config.hop_ms * self.config.sample_rate_hz / 1000))

    def setup(self) -> None:
        cfg = self.config
        self._mfcc = LogMelMfcc(cfg.sample_rate_hz, cfg.n_mfcc, cfg.n_mels, self.win, self.hop)
        self._ready = True

    def mfcc(self, samples: np.ndarray) -> np.ndarray:
        """``(frames, n_mfcc)`` float32 of a mono chunk; frame k starts at sample k*hop."""
        return self._mfcc(samples)

    @property
    def chunk_frames(self) -> int:
        """Frames per table: tables start at the multiples of this (frame 0 of the stream on)."""
        return max(1, int(round(self.config.chunk_s * self.config.sample_rate_hz / self.hop)))

    def read(self, ctx: SourceContext) -> Iterator[pa.Table]:
        import av

        self.ensure_setup()
        cfg, win, hop = self.config, self.win, self.hop
        window: AudioRange | None = ctx.window
        container = open_container(ctx.path, ctx.uri, stage=self.kind, reader=ctx.reader)
        with container:
            if not container.streams.audio:
                raise UnsupportedInputError("no audio stream; give this source another modality or drop it",
                                            source_uri=ctx.uri, stage=self.kind, code="no_audio_stream")
            stream = container.streams.audio[0]
            start, end = declared_span_ns(container, stream)
            if end is not None and end - start > cfg.max_duration_s * NS_PER_S:
                raise LimitExceededError(f"stream lasts {(end - start) / NS_PER_S:.0f} s, over max_duration_s="
                                         f"{cfg.max_duration_s:.0f}; split the source or raise the limit",
                                         source_uri=ctx.uri, stage=self.kind, code="duration_exceeded")
            header_end = wav_declared_ns(ctx.path, ctx.reader)  # FFmpeg hides a lying WAV size; see _av
            if header_end is not None:
                header_end += start
            pcm = PcmStream(container, stream, cfg.sample_rate_hz)
            frames = _Frames(self, self._vad() if cfg.vad else None, window, f"{ctx.session_id}/{ctx.spec.id}")
            max_samples = int(cfg.max_duration_s * cfg.sample_rate_hz)

            def tables(final: bool) -> Iterator[pa.Table]:
                for first, feats, voiced, quality in frames.cut(final):
                    yield self._table(ctx, pcm.start_ns, first, feats, voiced, quality)

            def last_t() -> int | None:
                if pcm.produced == 0:
                    return None
                return ctx.clock.to_session(pcm.start_ns + samples_to_ns(pcm.produced - 1, cfg.sample_rate_hz))

            # An error is raised by the range holding the first frame it costs (a decode from the
            # start meets it in every later range too): the others end quietly where it stops them.
            try:
                for x in pcm:
                    if pcm.produced > max_samples:  # keep what is within the limit, drop the rest
                        frames.push(x[:x.size - (pcm.produced - max_samples)])
                        yield from tables(final=True)
                        if not frames.owns_end(max_samples):
                            return
                        limit_t = ctx.clock.to_session(pcm.start_ns + samples_to_ns(max_samples, cfg.sample_rate_hz))
                        raise LimitExceededError(f"decoded past max_duration_s={cfg.max_duration_s:.0f}; the rest "
                                                 "is dropped", source_uri=ctx.uri, stage=self.kind,
                                                 code="duration_exceeded", start_t_ns=limit_t)
                    frames.push(x)
                    yield from tables(final=False)
                    if frames.done:  # a range's last frame: the next range goes on from there
                        return
            except av.error.FFmpegError as e:
                yield from tables(final=True)
                if not frames.owns_end(pcm.produced):
                    return
                raise partial_error(ctx, self.kind, container, stream, last_t(),
                                    f"decoding failed ({type(e).__name__})") from None
            yield from tables(final=True)
            if not frames.owns_end(pcm.produced):
                return
            if pcm.produced == 0:
                raise UnreadableInputError("no audio could be decoded; check that the file plays, re-encode it",
                                           source_uri=ctx.uri, stage=self.kind)
            check_truncated(ctx, self.kind, container, stream, last_t(), declared_end_ns=header_end)

    def _vad(self) -> EnergyVad:
        cfg, hop_s = self.config, self.hop / self.config.sample_rate_hz
        return EnergyVad(floor_frames=round(cfg.vad_floor_s / hop_s), threshold_db=cfg.vad_threshold_db,
                         min_dbfs=cfg.vad_min_dbfs, hangover_frames=round(cfg.vad_hangover_ms / 1000 / hop_s))

    def _table(self, ctx: SourceContext, start_ns: int, first: int, feats: np.ndarray,
               voiced: np.ndarray | None, quality: tuple[np.ndarray, np.ndarray, np.ndarray]) -> pa.Table:
        n, rate = feats.shape[0], self.config.sample_rate_hz
        idx = np.arange(first, first + n, dtype=np.int64)
        local = start_ns + (idx * self.hop * 2 * NS_PER_S + rate) // (2 * rate)  # samples_to_ns, vectorised
        sid, src = ctx.session_id, ctx.spec.id
        return pa.table({
            "event_id": [event_id(sid, src, "mfcc", int(i)) for i in idx],
            "t_ns": ctx.clock.to_session_array(local),
            "frame_index": idx,
            "mfcc": pa.FixedSizeListArray.from_arrays(pa.array(feats.reshape(-1)), self.config.n_mfcc),
            "voiced": pa.nulls(n, pa.bool_()) if voiced is None else pa.array(voiced, pa.bool_()),
            "quality": pa.StructArray.from_arrays([pa.array(q, pa.float32()) for q in quality],
                                                  fields=list(arrow_type(AudioQuality))),
        }, schema=audio_mfcc_schema(self.config.n_mfcc))


def decode_audio(path: str | Path | None, sample_rate_hz: int = 16000, *, max_duration_s: float = 4 * 3600,
                 reader: Any = None, uri: str | None = None) -> tuple[np.ndarray, int]:
    """Whole first audio stream as mono float32 at ``sample_rate_hz`` and the local ns of its
    first sample. For in-process use (clock-offset estimation) only: never store the result.
    ``reader``: a seekable file object to decode instead of ``path`` (closed after)."""
    import av

    path, stage = (Path(path) if path is not None else None), "decode_audio"
    uri = uri or str(path)
    container = open_container(path, uri, stage=stage, reader=reader)
    with container:
        if not container.streams.audio:
            raise UnsupportedInputError("no audio stream", source_uri=uri, stage=stage, code="no_audio_stream")
        pcm = PcmStream(container, container.streams.audio[0], sample_rate_hz)
        parts = []
        try:
            for x in pcm:
                parts.append(x)
                if pcm.produced > max_duration_s * sample_rate_hz:
                    raise LimitExceededError(f"longer than max_duration_s={max_duration_s:.0f}", source_uri=uri,
                                             stage=stage, code="duration_exceeded")
        except av.error.FFmpegError as e:
            raise UnreadableInputError(f"decoding failed ({type(e).__name__})", source_uri=uri,
                                       stage=stage, code="decode_failed") from None
    if not parts:
        raise UnreadableInputError("no audio could be decoded", source_uri=uri, stage=stage)
    return np.concatenate(parts), int(pcm.start_ns)
