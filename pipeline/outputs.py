"""``modalign.open(OUT)``: an output folder as Arrow datasets, for Python users.

Sits after the run: it reads the folder's latest commit (``pipeline.commits``) and hands
each table to the user as a ``pyarrow.dataset.Dataset`` over exactly the committed files
(lazy, column-pruned, filterable; DuckDB, Polars and pandas take it as is), so a run in
progress or one that crashed is never half-seen. It is the reader every command uses
(``inspect``, ``search``, ``cache``). It imports no Ray and no model.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from modalign.pipeline.commits import CommitLog, Snapshot
from modalign.pipeline.layout import INDEX, TABLES, OutputLayout, safe_name
from modalign.schemas.errors import ConfigError


class Output:
    """One output folder of ``modalign run``, as of its latest commit when opened."""

    def __init__(self, out: str | PathLike) -> None:
        self.layout = OutputLayout(Path(out))
        if not Path(out).is_dir():
            raise ConfigError(f"output folder {out} does not exist")
        snapshot = CommitLog.of(out).latest()
        if snapshot is None:
            hint = (" (its run.json is from a modalign before commits, or from a run that never committed: "
                    "re-run into it)" if self.layout.run_json.is_file() else "")
            raise ConfigError(f"{out} is not a modalign output folder (no commit){hint}; "
                              f"run `modalign run INPUT --out {out}` first")
        self.snapshot: Snapshot = snapshot

    @property
    def root(self) -> Path:
        return self.layout.root

    def __repr__(self) -> str:
        return f"modalign.Output({str(self.root)!r})"

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

    def files(self, name: str) -> list[Path]:
        """The committed Parquet files of one table, sorted."""
        if name not in TABLES:
            raise ConfigError(f"no table {name!r}; tables: {', '.join(TABLES)}")
        return [self.root / f for f in self.snapshot.under(TABLES[name].PATH) if f.endswith(".parquet")]

    def table(self, name: str) -> Any:
        """One table as a ``pyarrow.dataset.Dataset`` with the table's declared schema."""
        import pyarrow.dataset as ds

        return ds.dataset([str(p) for p in self.files(name)], schema=TABLES[name].schema(), format="parquet")

    def index_file(self, model_id: str, granularity: str) -> Path | None:
        """The committed FAISS index of one model and granularity (None: none was built)."""
        prefix = f"{INDEX}/{safe_name(model_id)}__{granularity}-"
        return next((self.root / f for f in self.snapshot.shared if f.startswith(prefix)), None)

    def sessions(self) -> list[str]:
        """The session ids of the run, sorted."""
        t = self.table("lineage_sources").to_table(columns=["session_id"])
        return sorted(set(t.column("session_id").to_pylist()))
