"""One contract every registered operator passes.

Table operators: output schema as declared, input never mutated, deterministic output,
a clean ``ModalignError`` on a batch missing its columns. Source operators: the same
file read twice gives the same tables, garbage gives an ``InputError``. Every operator:
kind, version and a frozen config that rejects unknown keys. A new operator must add an
example input here, or ``test_every_registered_operator_has_an_example`` fails.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from modalign import operators
from modalign.operators.base import REGISTRY, TableOperator
from modalign.operators.ingest.base import SourceContext, SourceOperator
from modalign.schemas.errors import InputError, ModalignError
from modalign.schemas.arrow import arrow_type
from modalign.schemas.manifest import SourceSpec
from modalign.schemas.tables import Box, Word

pytestmark = pytest.mark.unit

for _m in pkgutil.walk_packages(operators.__path__, "modalign.operators."):
    importlib.import_module(_m.name)


def _frames() -> pa.Table:
    from skimage.data import astronaut

    canvas = np.full((360, 640, 3), 90, np.uint8)
    canvas[40:296, 200:456] = astronaut()[::2, ::2]
    frames = np.stack([canvas, np.roll(canvas, 8, axis=1)])
    return pa.table({
        "event_id": ["s/cam/frame/0", "s/cam/frame/1"],
        "t_ns": pa.array([0, 40_000_000], pa.int64()),
        "frame": pa.FixedShapeTensorArray.from_numpy_ndarray(frames),
        "face_boxes": pa.array([[], [{"x0": 250, "y0": 60, "x1": 330, "y1": 140, "score": 0.9}]],
                               pa.list_(arrow_type(Box))),
    })


def _mfcc(n: int = 250) -> pa.Table:
    rng = np.random.default_rng(0)
    vals = rng.normal(size=(n, 40)).astype(np.float32)
    return pa.table({
        "event_id": [f"s/mic/mfcc/{i}" for i in range(n)],
        "t_ns": pa.array(np.arange(n, dtype=np.int64) * 10_000_000),
        "frame_index": pa.array(np.arange(n, dtype=np.int64)),
        "mfcc": pa.FixedSizeListArray.from_arrays(pa.array(vals.ravel()), 40),
    })


def _anonymised_mfcc() -> pa.Table:
    """MFCCs as the audio ingest hands them on under the default (anonymise) voice policy: marked."""
    from modalign.operators.deid.voice import mark_transformed, voice_transform
    from modalign.schemas.policy import VoicePolicy

    return mark_transformed(_mfcc(), voice_transform(VoicePolicy()))


def _blocks() -> pa.Table:
    text = "Budget review with Julia Fischer, julia.fischer@example.com"
    words = [{"text": w, "x0": 10 * i, "y0": 0, "x1": 10 * i + 9, "y1": 10, "conf": 95.0, "entity": None}
             for i, w in enumerate(text.split())]
    return pa.table({
        "event_id": ["s/deck/block/0", "s/deck/block/1"],
        "t_ns": pa.array([0, 0], pa.int64()),
        "text": [text, "Infrastructure milestones for March"],
        "words": pa.array([words, []], pa.list_(arrow_type(Word))),
        "box": pa.array([{"x0": 0, "y0": 0, "x1": 100, "y1": 10, "score": 0.9}] * 2, arrow_type(Box)),
    })


TABLE_EXAMPLES = {
    "face_blur": _frames,
    "frame_text": _frames,
    "frame_embed": _frames,
    "text_pii": _blocks,
    "text_block_embed": _blocks,
    "voice_policy": _anonymised_mfcc,
    "audio_embed": _mfcc,
}


def _wav(path: Path) -> Path:
    import wave

    t = np.arange(16_000) / 16_000
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes((0.2 * np.sin(2 * np.pi * 300 * t) * 32767).astype("<i2").tobytes())
    return path


def _mp4(path: Path) -> Path:
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        for i in range(10):
            img = np.full((64, 96, 3), i * 20, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _pdf(path: Path) -> Path:
    from reportlab.lib.pagesizes import landscape, A6
    from reportlab.pdfgen import canvas

    c = canvas.Canvas(str(path), pagesize=landscape(A6))
    c.setFont("Helvetica", 20)
    c.drawString(20, 150, "Quarterly roadmap")
    c.showPage()
    c.save()
    return path


SOURCE_EXAMPLES = {"video_frames": ("video", _mp4, ".mp4"), "audio_mfcc": ("audio", _wav, ".wav"),
                   "pdf_text": ("pdf", _pdf, ".pdf")}
# Operators that are not batch maps: encoders used by the table operators, and the
# stateful per-session aligner (its properties are in test_align.py).
OTHER = {"image_embed", "text_embed", "tick_aligner"}


def test_every_registered_operator_has_an_example():
    assert set(REGISTRY) == set(TABLE_EXAMPLES) | set(SOURCE_EXAMPLES) | OTHER


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_identity_and_strict_frozen_config(kind):
    cls = REGISTRY[kind]
    assert cls.kind == kind and cls.version.count(".") == 2
    cfg = cls.config_model()
    with pytest.raises(ValidationError):
        cls.config_model(no_such_field=1)
    field = next(iter(type(cfg).model_fields), None)
    if field is not None:
        with pytest.raises(ValidationError):
            setattr(cfg, field, getattr(cfg, field))


def _op(kind: str, tmp_path: Path):
    cls = REGISTRY[kind]
    if kind == "text_pii":
        from modalign.operators.deid.text import TextPiiConfig

        return cls(TextPiiConfig(key_store_dir=tmp_path / "keys"))
    if kind == "face_blur":
        from modalign.operators.deid.faces import FaceBlurConfig

        return cls(FaceBlurConfig(secret=b"k" * 32))
    return cls()


@pytest.mark.parametrize("kind", sorted(TABLE_EXAMPLES))
def test_table_operator_contract(kind, tmp_path):
    op = _op(kind, tmp_path)
    assert isinstance(op, TableOperator)
    table = TABLE_EXAMPLES[kind]()
    snapshot = pa.Table.from_batches(
        [pa.RecordBatch.from_pylist(table.to_pylist(), schema=table.schema)]) if kind not in ("face_blur", "frame_text", "frame_embed") else None
    before = [bytes(b) if b is not None else None for col in table.columns for ch in col.chunks for b in ch.buffers()]

    def run() -> pa.Table:  # the whole output for the table as one stream (look-ahead operators flush)
        out = [op.process(table)] + op.flush()
        return pa.concat_tables([t for t in out if t.num_rows] or out[:1])

    out1 = run()
    op.reset()
    out2 = run()

    after = [bytes(b) if b is not None else None for col in table.columns for ch in col.chunks for b in ch.buffers()]
    assert before == after, "process() mutated its input buffers"
    if snapshot is not None:
        assert table.equals(snapshot)
    assert out1.equals(out2), "process() is not deterministic"
    declared = op.output_schema(table.schema)
    assert out1.schema.names == declared.names
    with pytest.raises(ModalignError):
        op.process(pa.table({"unexpected": [1, 2]}))


@pytest.mark.parametrize("kind", sorted(SOURCE_EXAMPLES))
def test_source_operator_contract(kind, tmp_path):
    modality, make, suffix = SOURCE_EXAMPLES[kind]
    op = REGISTRY[kind]()
    assert isinstance(op, SourceOperator) and op.modality == modality

    def ctx(path: Path) -> SourceContext:
        spec = SourceSpec(id="src", uri=path.name, modality=modality)
        return SourceContext("s", spec, path, path.as_uri(), "sha256:test")

    good = make(tmp_path / f"good{suffix}")
    first = pa.concat_tables(list(op.read(ctx(good))))
    second = pa.concat_tables(list(op.read(ctx(good))))
    assert first.num_rows > 0 and first.equals(second)
    assert set(op.output_schema().names) <= set(first.schema.names) | {"frame"}
    assert first.column("t_ns").to_pylist() == sorted(first.column("t_ns").to_pylist())

    garbage = tmp_path / f"garbage{suffix}"
    garbage.write_bytes(b"\x00\x13not media\xff" * 64)
    with pytest.raises(InputError) as err:
        list(op.read(ctx(garbage)))
    assert garbage.as_uri() in str(err.value)
