"""What a person sees while `modalign run` works: bars on a terminal, plain or JSON lines otherwise.

The plain lines are read from the shared CLI run (its stderr is a pipe); the bars come from a run
whose stderr is a real pseudo-terminal (``pty``), the JSON lines from a run with
``--log-format json``. Each final progress figure is checked against the run's run.json.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

MODALIGN = str(Path(sys.executable).parent / "modalign")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_plain_progress_lines_when_stderr_is_not_a_terminal(sample_run):
    run = sample_run["run"]
    assert run.returncode == 0, run.stderr[-2000:]
    assert not ANSI.search(run.stderr)  # no terminal control codes in a pipe
    lines = [line for line in run.stderr.splitlines() if line.startswith("modalign: progress [")]
    assert len(lines) >= 2  # one when the run starts, one when it ends
    summary = _run_json(sample_run["dirs"]["out"])
    last = lines[-1]
    assert f"{summary['counts']['events']['video']} frames" in last
    assert "4/4 sources done (4 ingested, 0 partial, 0 quarantined; 0 quarantine rows)" in last
    assert "aligned 1/1 sessions" in last and "eta 0 s" in last
    assert re.search(r"media (\d+\.\d)/\1 s \(100%\)", last)  # every recording ingested to its end


def _in_a_terminal(argv: list[str], env: dict, timeout_s: float = 600) -> tuple[int, str]:
    """Run argv with stdin, stdout and stderr on a 160x40 pseudo-terminal; (exit code, what it drew)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env=dict(env, TERM="xterm-256color", COLUMNS="160"))
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
    finally:
        os.close(master)
    return proc.wait(timeout=60), out.decode("utf-8", errors="replace")


def test_rich_bars_on_a_terminal(sample_run, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, MODALIGN_KEY_STORE=str(sample_run["dirs"]["keys"]))
    rc, drawn = _in_a_terminal([MODALIGN, "run", str(sample_run["manifest_path"]), "--out", str(out)], env)
    assert rc == 0, drawn[-3000:]
    assert "\x1b[" in drawn  # a terminal gets control codes (colour, cursor moves)
    text = ANSI.sub("", drawn)
    assert "━" in text
    assert "modalign: progress [" not in text  # bars instead of the plain lines
    summary = _run_json(out)
    final = text[text.rindex("sources  "):]  # the last frame the bars drew
    assert "4/4" in final and "4 discovered, 4 ingested, 0 partial, 0 quarantined" in final
    assert f"{summary['counts']['events']['video']} frames" in final
    assert "recordings (s)" in final and "embed batches" in final and "sessions aligned" in final
    assert "modalign: ingest sample-meeting/room_video (video)" in text  # messages print above the bars
    assert "tables (rows):" in text  # then the summary on stdout


def test_json_log_format_every_line_is_an_object(sample_run, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, MODALIGN_KEY_STORE=str(sample_run["dirs"]["keys"]))
    r = subprocess.run([MODALIGN, "run", str(sample_run["manifest_path"]), "--out", str(out), "--log-format", "json"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stderr.splitlines()]  # Ray's own warnings included
    assert all({"ts", "level", "event"} <= set(row) for row in rows)
    messages = [row["message"] for row in rows if row["event"] == "message"]
    assert any(m.startswith("commit 1 of ") for m in messages)
    final = [row for row in rows if row["event"] == "progress"][-1]
    summary = _run_json(out)
    c = summary["counts"]
    assert final["final"] is True and final["stage"] == "commit"
    assert (final["sources"], final["sources_done"], final["ingested"]) == (4, 4, 4)
    assert final["frames"] == c["events"]["video"]
    assert final["embed_done"] == final["embed_batches"] > 0
    assert final["sessions_aligned"] == c["sessions"] == 1
    assert final["media_s"] == final["media_total_s"] > 0
