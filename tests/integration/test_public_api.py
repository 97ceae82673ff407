"""README's Python example, run as written: ``modalign.run`` then ``modalign.open``."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_example_runs_and_reads_the_tables(ray_local, sample_manifest, tmp_path, monkeypatch):
    import modalign

    code = re.search(r"## Python API.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    shutil.copytree(sample_manifest.parent, tmp_path / "sample")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODALIGN_KEY_STORE", str(tmp_path / "keys"))
    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), scope)
    summary, out = scope["summary"], scope["out"]
    quarantined = out.table("quarantine").to_table().to_pylist()
    assert summary["exit_code"] == 0 and not quarantined, quarantined
    assert summary["config"]["embed"]["image_fps"] == 2
    assert isinstance(out, type(modalign.open(tmp_path / "out"))) and out.sessions() == ["sample-meeting"]
    assert {"events_video", "events_audio", "events_pdf", "records", "ctal", "features", "lineage_sources"} <= set(
        out.tables())
    counts = {(r["modality"], r["decision"]): r["count_all"] for r in scope["records"].group_by(
        ["modality", "decision"]).aggregate([([], "count_all")]).to_pylist()}
    assert counts[("video", "matched")] >= 149 and counts[("pdf", "matched")] >= 149  # 6 s at 25 ticks/s
    assert "sample-meeting" in printed.getvalue()
    frames = out.table("features").to_table(filter=modalign_field("granularity") == "frame")
    assert frames.num_rows >= 12  # 2 fps of a 6 s video, plus the audio's per-second rows


def modalign_field(name: str):
    import pyarrow.dataset as ds

    return ds.field(name)


def test_open_names_a_folder_that_is_not_an_output(tmp_path):
    import modalign
    from modalign.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="not a modalign output folder \\(no commit\\)"):
        modalign.open(tmp_path)
    (tmp_path / "run.json").write_text("{}")  # an old layout, or a run that crashed before its commit
    with pytest.raises(ConfigError, match="never committed: re-run into it"):
        modalign.open(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        modalign.open(tmp_path / "nope")
