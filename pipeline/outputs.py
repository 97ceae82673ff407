"""``modalign.open(OUT)``: an output folder as Arrow datasets, for Python users.

Sits after the run: it reads the folder's latest commit (``pipeline.commits``) and hands
each table to the user as a ``pyarrow.dataset.Dataset`` over exactly the committed files
(lazy, column-pruned, filterable; DuckDB, Polars and pandas take it as is), so a run in
progress or one that crashed is never half-seen. It is the reader every command uses
(``inspect``, ``search``, ``cache``). It imports no Ray and no model.

OUT may be ``s3://bucket/prefix``: the commit log is read from the store and the datasets
read the committed objects through the pyarrow S3 filesystem (``Output.filesystem``; pass it
on to pyarrow, Polars or Ray Data with the paths of ``files``). The endpoint comes from
``storage`` (a ``StorageConfig``) or ``$AWS_ENDPOINT_URL``; credentials from the AWS chain.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path, PurePath
from typing import Any

from modalign.pipeline.commits import CommitLog, Snapshot
from modalign.pipeline.layout import INDEX, TABLES, OutputLayout, safe_name
from modalign.schemas.errors import ConfigError


def refuse_s3(out: str | PathLike, what: str, why: str = "") -> None:
    """``ConfigError`` when OUT is ``s3://bucket/prefix``: ``what`` works on a local OUT only (yet)."""
    from modalign.pipeline.objstore import Location

    if isinstance(out, str) and Location.parse(out).is_s3:
        raise ConfigError(f"{what} is not supported on an s3:// OUT yet ({out}){': ' + why if why else ''}; "
                          "it works on a local output folder")


class Output:
    """One output folder of ``modalign run``, as of its latest commit when opened."""

    def __init__(self, out: str | PathLike, storage: Any = None) -> None:
        if isinstance(storage, dict):
            from pydantic import ValidationError

            from modalign.schemas.config import StorageConfig
            from modalign.schemas.load import format_validation_error

            try:
                storage = StorageConfig.model_validate(storage)
            except ValidationError as exc:
                raise ConfigError(format_validation_error(exc, "storage")) from None
        self.layout = OutputLayout.of(out, storage)  # a folder or s3://bucket/prefix
        if not self.layout.is_s3 and not Path(out).is_dir():
            raise ConfigError(f"output folder {out} does not exist")
        snapshot = CommitLog(self.layout.store).latest()  # EnvironmentFaultError: the store cannot be read
        if snapshot is None:
            hint = (" (its run.json is from a modalign before commits, or from a run that never committed: "
                    "re-run into it)" if self.layout.exists(self.layout.run_json) else "")
            raise ConfigError(f"{out} is not a modalign output folder (no commit){hint}; "
                              f"run `modalign run INPUT --out {out}` first")
        self.snapshot: Snapshot = snapshot

    @property
    def root(self) -> PurePath:
        """OUT's folder, or on object storage its ``bucket/prefix`` path on ``filesystem``."""
        return self.layout.root

    @property
    def uri(self) -> str:
        """OUT as a user names it (a folder, or ``s3://bucket/prefix``)."""
        return self.layout.uri

    @property
    def filesystem(self) -> Any:
        """The pyarrow filesystem ``files`` are on (None: the local one)."""
        return self.layout.fs

    def __repr__(self) -> str:
        return f"modalign.Output({self.uri!r})"

    @property
    def version(self) -> int:
        """The commit version this view reads."""
        return self.snapshot.version

    @property
    def run(self) -> dict[str, Any]:
        """The summary of the run that made the commit (``run.json`` is a copy of it)."""
        return self.snapshot.summary

    def tables(self) -> list[str]:
        """Names of the tables this folder holds (``TABLE`` names of ``schemas.tables``)."""
        return [name for name in TABLES if self.files(name)]

    def files(self, name: str) -> list[PurePath]:
        """The committed Parquet files of one table, sorted (paths on ``filesystem``)."""
        if name not in TABLES:
            raise ConfigError(f"no table {name!r}; tables: {', '.join(TABLES)}")
        return [self.root / f for f in self.snapshot.under(TABLES[name].PATH) if f.endswith(".parquet")]

    def table(self, name: str) -> Any:
        """One table as a ``pyarrow.dataset.Dataset`` with the table's declared schema."""
        import pyarrow.dataset as ds

        return ds.dataset([str(p) for p in self.files(name)], schema=TABLES[name].schema(), format="parquet",
                          filesystem=self.layout.fs)

    def index_file(self, model_id: str, granularity: str) -> PurePath | None:
        """The committed FAISS index of one model and granularity (None: none was built)."""
        prefix = f"{INDEX}/{safe_name(model_id)}__{granularity}-"
        return next((self.root / f for f in self.snapshot.shared if f.startswith(prefix)), None)

    def sessions(self) -> list[str]:
        """The session ids of the run, sorted."""
        t = self.table("lineage_sources").to_table(columns=["session_id"])
        return sorted(set(t.column("session_id").to_pylist()))

    # -- training datasets (pipeline.dataset, pipeline.readers) -----------------------------------

    def aligned(self, unit: str = "tick", clip_s: float | None = None, stride_s: float | None = None,
                modalities: Any = None, sessions: Any = None, time_range: Any = None, decode: bool = True,
                features: Any = None, **options: Any) -> Any:
        """Aligned training samples as an iterator of ``pyarrow.RecordBatch`` (``pipeline.dataset``).

        ``unit``: ``"tick"`` (one sample per tick) or ``"clip"`` (``clip_s`` seconds every
        ``stride_s``, default ``clip_s``); ``modalities``: some of video, audio, pdf; ``sessions``:
        session ids (default all); ``time_range``: ``(start_ns, end_ns)`` on the session clock;
        ``decode``: frames as uint8 HWC (else JPEG bytes); ``features``: True (every stream) or names
        ``MODALITY/GRANULARITY`` (``video/frame``, ``pdf/roi``, ...). ``options``: ``sources``
        (modality -> source id), ``batch_size``, ``chunk_s``, ``frame_size`` (H, W), ``decode_threads``.
        Batches never span sessions; a session is read chunk by chunk (``chunk_s``, default 10 s)."""
        from modalign.pipeline.dataset import AlignedSpec, context, iter_batches

        spec = AlignedSpec.make(unit, clip_s, stride_s, modalities, sessions, time_range, decode, features, **options)
        return iter_batches(context(self, spec))

    def torch_dataset(self, rank: int | None = None, world_size: int | None = None, even: str | None = None,
                      **aligned: Any) -> Any:
        """The samples of ``aligned(**aligned)`` as a PyTorch ``IterableDataset``, sharded by session chunk
        over DataLoader workers and ranks (default: ``torch.distributed``); ``even="drop"|"pad"``: the same
        number of samples for every worker of every rank; ``pipeline.readers``."""
        from modalign.pipeline.readers import torch_dataset

        return torch_dataset(self, rank=rank, world_size=world_size, even=even, **aligned)

    def ray_dataset(self, **aligned: Any) -> Any:
        """The samples of ``aligned(**aligned)`` as a Ray Data ``Dataset`` (one task per session chunk)."""
        from modalign.pipeline.readers import ray_dataset

        return ray_dataset(self, **aligned)

    def hf_dataset(self, cache_dir: str | None = None, **aligned: Any) -> Any:
        """The samples of ``aligned(**aligned)`` as a Hugging Face ``datasets.Dataset`` (JPEG bytes by default)."""
        from modalign.pipeline.readers import hf_dataset

        return hf_dataset(self, cache_dir=cache_dir, **aligned)
