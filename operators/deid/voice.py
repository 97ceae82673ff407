"""Voice policy of MFCC tables, inside the ingest worker.

Data flow: ``operators.ingest`` audio decode -> MFCC (100 frames/s) -> **VoicePolicyOperator**
-> the aligner. The raw waveform is never stored: the audio ingest keeps only MFCCs, and
this operator removes any waveform column that would still be present. ``keep_mfcc``
passes the MFCC frames on with a ``deid`` header (method ``waveform_dropped``);
``drop`` withholds all voice features (zero rows, same schema), for sessions whose
participants did not consent to any voice-derived data.
"""

from __future__ import annotations

import pyarrow as pa
from pydantic import Field

from operators.base import OperatorConfig, TableOperator
from pipeline.errors import InputError
from schemas.arrow import arrow_type
from schemas.policy import VoicePolicy
from schemas.tables import DeidHeader

DEID = "deid"
DEID_TYPE = arrow_type(DeidHeader)


class VoicePolicyConfig(OperatorConfig):
    voice: VoicePolicy = VoicePolicy()
    policy_tag: str = "modalign-default@1"
    waveform_columns: tuple[str, ...] = Field(
        ("samples", "waveform", "pcm", "audio"),
        description="raw-audio columns removed if an upstream table still carries them",
    )


class VoicePolicyOperator(TableOperator[VoicePolicyConfig]):
    """Apply the voice policy to MFCC tables (``event_id, t_ns, frame_index, mfcc``).

    Output: the input columns minus any raw-waveform column, plus ``deid``
    (``waveform_dropped`` / detector ``none`` / count 0). ``drop``: zero rows, same schema.
    """

    kind = "voice_policy"
    version = "0.1.0"
    config_model = VoicePolicyConfig

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        schema = input_schema
        for name in (*self.config.waveform_columns, DEID):
            i = schema.get_field_index(name)
            if i >= 0:
                schema = schema.remove(i)
        return schema.append(pa.field(DEID, DEID_TYPE))

    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        missing = [c for c in ("event_id", "t_ns", "mfcc") if c not in table.column_names]
        if missing:
            raise InputError(f"MFCC table lacks column(s) {', '.join(missing)}", stage=self.kind,
                             code="schema_mismatch")
        out = table
        for name in (*self.config.waveform_columns, DEID):
            i = out.schema.get_field_index(name)
            if i >= 0:
                out = out.remove_column(i)
        if self.config.voice.action == "drop":
            out = out.slice(0, 0)
        header = {
            "policy": self.config.policy_tag,
            "method": "waveform_dropped" if self.config.voice.action == "keep_mfcc" else "dropped",
            "detector": "none",
            "count": 0,
            "threshold": 0.0,
        }
        return out.append_column(pa.field(DEID, DEID_TYPE), pa.array([header] * out.num_rows, type=DEID_TYPE))
