"""Helpers of ``benchmarks/e2e.py`` (process-tree memory, configs, report) and of
``benchmarks/naive_pipeline.py`` (offset estimate, tick matching). No pipeline run here:
the benchmark itself is run by hand (``python benchmarks/e2e.py --duration 6``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


e2e = _load("e2e")
naive = _load("naive_pipeline")

# A parent that starts a child, which starts a grandchild; each holds (written, so resident)
# memory for a while, the grandchild 160 MiB.
TREE = """
import subprocess, sys, time
depth, mib = int(sys.argv[1]), int(sys.argv[2])
held = b"x" * (mib << 20)
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[3], str(depth - 1), "160", sys.argv[3]])] if depth else []
time.sleep(1.5)
for k in kids:
    k.wait()
"""


def test_measure_sums_rss_over_the_whole_tree(tmp_path):
    res = e2e.measure([sys.executable, "-c", TREE, "2", "40", TREE], tmp_path / "tree.log")
    assert res["rc"] == 0
    assert res["procs"] == 3  # parent, child, grandchild seen at once
    # 40 + 160 + 160 MiB held, plus three interpreters: no single process comes near it
    assert res["peak_rss_mib"] >= 360
    assert res["peak_rss_mib"] < 360 + 3 * 60
    assert res["peak_private_mib"] <= res["peak_rss_mib"]
    assert res["samples"] >= 5 and res["wall_s"] >= 1.5
    assert 0 < res["cpu_s"] < 2 * res["wall_s"]  # three interpreters' start-up and the writes, counted
    assert list(res["cpu_by_process"]) == [Path(sys.executable).name]  # all three are "python -c"
    assert sum(res["cpu_by_process"].values()) == pytest.approx(res["cpu_s"])


def test_process_names():
    import os

    import subprocess

    assert e2e.process_name(os.getpid()) == "pytest"  # python -m pytest, or the .venv/bin/pytest script
    p = subprocess.Popen([sys.executable, "-u", str(ROOT / "benchmarks" / "naive_pipeline.py"), "--help"],
                         stdout=subprocess.DEVNULL)
    try:
        assert e2e.process_name(p.pid) in ("naive_pipeline.py", "?")  # "?" only if it has already exited
    finally:
        p.wait()


def named(pid: int, wait_s: float = 5.0) -> str:
    """The process's name once its exec has finished (right after Popen, cmdline can still be empty)."""
    import time

    deadline = time.monotonic() + wait_s
    while (name := e2e.process_name(pid)) == "?" and time.monotonic() < deadline:
        time.sleep(0.01)
    return name


def test_process_names_of_scripts_without_py_and_of_binaries(tmp_path):
    import subprocess

    script = tmp_path / "some-tool"  # as pip writes .venv/bin/pytest: no .py
    script.write_text("import time\ntime.sleep(30)\n")
    with subprocess.Popen([sys.executable, "-u", str(script)]) as p, \
            subprocess.Popen(["sleep", "30"]) as q:
        try:
            assert named(p.pid) == "some-tool"
            assert named(q.pid) == "sleep"  # not its argument
        finally:
            p.kill()
            q.kill()


def test_process_tree_of_a_gone_process_is_itself_only(tmp_path):
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert e2e.children(p.pid) == []
    assert e2e.process_tree(p.pid) == [p.pid]
    assert e2e.rss_kib(p.pid) == (0, 0)


def test_same_work_config_is_the_naive_scripts_work(tmp_path):
    from modalign.schemas.config import RunConfig

    path = e2e.write_config(tmp_path / "same.json", e2e.same_work_config(tmp_path / "keys"))
    cfg = RunConfig.model_validate_json(path.read_text())
    assert cfg.policy.frame_text.action == "keep"
    assert cfg.policy.voice.action == "keep_mfcc"
    assert cfg.policy.face.action == "blur_permute"  # faces stay on, every frame
    assert cfg.ingest.video.sample_fps is None
    assert cfg.embed.image_fps == 1.0
    assert cfg.key_store == tmp_path / "keys"
    default = RunConfig.model_validate(e2e.default_config(tmp_path / "keys"))
    assert default.policy == RunConfig().policy


def test_write_config_refuses_an_unknown_field(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        e2e.write_config(tmp_path / "bad.json", {"policy": {"frame_text": {"acton": "keep"}}})
    assert not (tmp_path / "bad.json").exists()


def test_report_rates_and_ratios(tmp_path):
    log = tmp_path / "naive.log"
    log.write_text('loading\ncounts: {"frames": 1}\nnoise\ncounts: {"frames": 150, "pii_replaced": 8}\n')
    assert e2e.naive_counts(log) == {"frames": 150, "pii_replaced": 8}
    r = lambda wall, rss: {"wall_s": wall, "cpu_s": 2 * wall, "peak_rss_mib": rss, "peak_private_mib": rss, "procs": 1, "rc": 0,
                           "produced": {"timing": {"ray_start_s": 4.25, "processing_s": 20.0}}}
    results = {"default": r(30.0, 2000.0), "same": r(20.0, 1800.0), "naive": r(40.0, 900.0), "long": r(200.0, 2400.0)}
    durations = {"default": 60.0, "same": 60.0, "naive": 60.0, "long": 120.0}
    text = "\n".join(e2e.ratios(results, durations))
    assert "default policy: 2.00x real time" in text
    assert "same work vs naive script: 2.00x its rate" in text and "peak RSS 2.00x" in text
    assert "120 s vs 60 s session (default policy): 1.20x" in text
    rows = e2e.table(results, durations).splitlines()
    assert rows[2].startswith("| default | 60 | 30.0 | 2.00 | 60.0 | 2000 |") and "Ray 4.2 s, processing 20.0 s" in rows[2]


def test_naive_offset_estimate_finds_a_known_lag():
    rng = np.random.default_rng(1)
    ref = rng.normal(size=naive.SR * 4).astype(np.float32)
    lag = int(0.73 * naive.SR)  # the other recorder starts 730 ms into the reference
    other = ref[lag:] + rng.normal(0, 0.1, len(ref) - lag).astype(np.float32)
    assert naive.offset_ns(ref, other) == 730_000_000


def test_naive_tick_matching_leaves_gaps_outside_tolerance():
    ms = 1_000_000
    times = np.array([0, 40, 80, 200], np.int64) * ms
    ticks = np.array([0, 40, 80, 120, 160, 200], np.int64) * ms
    assert naive.nearest(times, ticks, 33 * ms).tolist() == [0, 1, 2, -1, -1, 3]
    pages = np.array([0, 100], np.int64) * ms  # sample-and-hold
    assert naive.nearest(pages, ticks, None).tolist() == [0, 0, 0, 1, 1, 1]


def test_settings_set_nested_config_fields():
    data = e2e.with_settings({"key_store": "k", "ingest": {"audio": {"chunk_s": 5}}},
                             ["ingest.video.range_s=null", "ingest.audio.chunk_s=2.5", "policy.tag=lab"])
    assert data == {"key_store": "k", "ingest": {"audio": {"chunk_s": 2.5}, "video": {"range_s": None}},
                    "policy": {"tag": "lab"}}
    with pytest.raises(ValueError, match="dotted.key=JSON"):
        e2e.with_settings({}, ["range_s"])
