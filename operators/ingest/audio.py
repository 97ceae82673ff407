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

The waveform exists only inside ``read`` (chunked, ``chunk_s`` at a time, with the
window overlap carried across chunks so the output equals a one-shot computation); it is
never returned, stored or logged. MFCCs use log-mel (``log(mel + 1e-6)``), which is
frame-local; a dB scale (torchaudio's default) clips against the chunk's maximum and would
make chunked output depend on chunk boundaries.

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


class AudioMfccOperator(SourceOperator[AudioMfccConfig]):
    """Decodes an audio source (or a video's first audio stream) into MFCC frame tables."""

    kind = "audio_mfcc"
    version = "0.4.0"  # 0.3.0: the quality column; 0.4.0: MFCCs in numpy (torchaudio's within 1e-4)
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

    def read(self, ctx: SourceContext) -> Iterator[pa.Table]:
        import av

        self.ensure_setup()
        cfg, win, hop = self.config, self.win, self.hop
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
            vad = self._vad() if cfg.vad else None
            meter = AudioQualityMeter(win, hop)  # on the signal as decoded, before the voice transform
            chunk = max(int(cfg.chunk_s * cfg.sample_rate_hz), win)
            max_samples = int(cfg.max_duration_s * cfg.sample_rate_hz)
            pending: list[np.ndarray] = []
            held, first_frame = 0, 0  # samples buffered; index of the frame starting at pending[0]
            tf = self.waveform_transform
            # A hook with ``context_samples`` is called (samples, start_sample, source_key) with that much
            # untransformed input on each side of what is kept, so chunking never changes its output.
            margin = int(getattr(tf, "context_samples", 0))
            left = np.zeros(0, np.float32)  # the (up to) ``margin`` raw samples before pending[0]
            source_key = f"{ctx.session_id}/{ctx.spec.id}"

            def emit(final: bool) -> Iterator[pa.Table]:
                nonlocal pending, held, first_frame, left
                if held < win or (not final and held < chunk + margin):
                    return
                raw = np.concatenate(pending) if len(pending) > 1 else pending[0]
                if tf is None:
                    x = raw
                elif margin:
                    y = tf(np.concatenate([left, raw]), first_frame * hop - left.size, source_key)[left.size:]
                    x = y if final else y[:raw.size - margin]
                else:
                    x = tf(raw)
                feats = self.mfcc(x)
                n = feats.shape[0]
                voiced = None if vad is None else vad(frame_energy_db(x, n, win, hop))
                quality = meter.measure(raw, n)  # frame k's window is raw[k*hop:k*hop+win], as x's
                if margin:
                    left = np.concatenate([left, raw[max(0, n * hop - margin):n * hop]])[-margin:].copy()
                rest = raw[n * hop:].copy()  # < one window (+ margin), untransformed; lets the chunk go
                pending, held = ([rest] if rest.size else []), rest.size
                yield self._table(ctx, pcm.start_ns, first_frame, feats, voiced, quality)
                first_frame += n

            def last_t() -> int | None:
                if pcm.produced == 0:
                    return None
                return ctx.clock.to_session(pcm.start_ns + samples_to_ns(pcm.produced - 1, cfg.sample_rate_hz))

            try:
                for x in pcm:
                    pending.append(x)
                    held += x.size
                    if pcm.produced > max_samples:  # keep what is within the limit, drop the rest
                        over = pcm.produced - max_samples
                        pending[-1], held = x[:x.size - over], held - over
                        yield from emit(final=True)
                        limit_t = ctx.clock.to_session(pcm.start_ns + samples_to_ns(max_samples, cfg.sample_rate_hz))
                        raise LimitExceededError(f"decoded past max_duration_s={cfg.max_duration_s:.0f}; the rest "
                                                 "is dropped", source_uri=ctx.uri, stage=self.kind,
                                                 code="duration_exceeded", start_t_ns=limit_t)
                    yield from emit(final=False)
            except av.error.FFmpegError as e:
                yield from emit(final=True)
                raise partial_error(ctx, self.kind, container, stream, last_t(),
                                    f"decoding failed ({type(e).__name__})") from None
            yield from emit(final=True)
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
