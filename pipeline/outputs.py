"""``modalign.open(OUT)``: an output folder as Arrow datasets, for Python users.

Sits after the run: it reads what ``modalign run`` wrote (``pipeline.layout``) and
hands each table to the user as a ``pyarrow.dataset.Dataset`` (lazy, column-pruned,
filterable; DuckDB, Polars and pandas take it as is). It imports no Ray and no model.
"""

from __future__ import annotations

import json
from os import PathLike
from pathlib import Path
from typing import Any

from modalign.pipeline.layout import TABLES, OutputLayout
from modalign.schemas.errors import ConfigError


class Output:
    """One output folder of ``modalign run``."""

    def __init__(self, out: str | PathLike) -> None:
        self.layout = OutputLayout(Path(out))
        if not self.layout.run_json.is_file():
            raise ConfigError(f"{out} is not a modalign output folder (no run.json); "
                              f"run `modalign run INPUT --out {out}` first")

    @property
    def root(self) -> Path:
        return self.layout.root

    def __repr__(self) -> str:
        return f"modalign.Output({str(self.root)!r})"

    @property
    def run(self) -> dict[str, Any]:
        """The summary of the run that wrote the folder (``run.json``)."""
        return json.loads(self.layout.run_json.read_text(encoding="utf-8"))

    def tables(self) -> list[str]:
        """Names of the tables this folder holds (``TABLE`` names of ``schemas.tables``)."""
        return [name for name in TABLES if any(self.layout.table_dir(name).rglob("*.parquet"))]

    def table(self, name: str) -> Any:
        """One table as a ``pyarrow.dataset.Dataset`` with the table's declared schema."""
        import pyarrow.dataset as ds

        if name not in TABLES:
            raise ConfigError(f"no table {name!r}; tables: {', '.join(TABLES)}")
        folder = self.layout.table_dir(name)
        files = sorted(str(p) for p in folder.rglob("*.parquet")) if folder.is_dir() else []
        return ds.dataset(files, schema=TABLES[name].schema(), format="parquet")

    def sessions(self) -> list[str]:
        """The session ids of the run, sorted."""
        t = self.table("lineage_sources").to_table(columns=["session_id"])
        return sorted(set(t.column("session_id").to_pylist()))
