"""The one CLI run the e2e tests share: ``modalign sample`` + ``modalign run`` in subprocesses.

``test_cli`` checks its output against the sample's ground truth; ``test_canary`` scans every
file it wrote anywhere (OUT, its TMPDIR, Ray's temp dir with logs, the key store, the console)
for the planted personal data. One run serves both: the run is given its own TMPDIR and
RAY_TMPDIR so that all it writes is findable. A test that changes OUT or the key store works
on a copy (``shutil.copytree``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

DURATION_S = 6.0
MODALIGN = str(Path(sys.executable).parent / "modalign")


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory):
    """{"root", "duration_s", "run" (CompletedProcess), "dirs" (out, tmpdir, ray, keys, console), "manifest_path"}."""
    root = tmp_path_factory.mktemp("e2e")
    # Ray's socket paths (session dir + /sockets/plasma_store) must stay under 108 bytes: a short dir
    ray_tmp = Path(tempfile.mkdtemp(prefix="mcr", dir="/tmp"))
    dirs = {"out": root / "out", "tmpdir": root / "tmpdir", "ray": ray_tmp, "keys": root / "keys"}
    dirs["tmpdir"].mkdir()
    env = dict(os.environ, MODALIGN_KEY_STORE=str(dirs["keys"]))
    run_env = dict(env, TMPDIR=str(dirs["tmpdir"]), RAY_TMPDIR=str(ray_tmp))  # the scanned run's own temp dirs
    try:
        subprocess.run([MODALIGN, "sample", str(root / "sample"), "--duration", str(DURATION_S)], check=True,
                       env=env)
        manifest_path = root / "sample" / "manifest.yaml"
        run = subprocess.run([MODALIGN, "run", str(manifest_path), "--out", str(dirs["out"])], env=run_env,
                             capture_output=True, text=True, timeout=900)
        (root / "console.txt").write_text(run.stdout + "\n" + run.stderr)
        dirs["console"] = root / "console.txt"
        yield {"root": root, "duration_s": DURATION_S, "run": run, "dirs": dirs, "manifest_path": manifest_path}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
