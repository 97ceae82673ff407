"""S3 read throughput of one source through the worker's readers, against reading the same file locally.

A file of random bytes (``--mb``, default 128) is written to a temporary folder and uploaded to a
SeaweedFS server this script starts (``tests/s3server.py``, on loopback). Each row reads the
whole source once and takes its sha256, as an ingest worker does:

- ``local hashing reader``: ``SeekableHashingReader(path)``, in the 32 KiB reads PyAV makes;
- ``s3 hashing reader (B MiB blocks)``: ``SeekableHashingReader`` over ``ObjectOpener.open``
  (buffered ranged GETs of B MiB through ``pyarrow.fs.S3FileSystem``), the same 32 KiB reads:
  what the video and audio decoders read through;
- ``s3 into memory (memfd)``: ``ObjectOpener.in_memory``, what a PDF becomes (its tools read a path);
- ``boto3 get_object``: one plain streamed GET, hashed: the server's own ceiling here (reference).

Every row's digest is checked against the file's. Loopback has no network latency: against a
remote store the ratio is lower, and larger blocks matter more.

    .venv/bin/python benchmarks/s3_read.py [--mb 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

READ = 32 * 1024  # PyAV's default I/O buffer: the size of a decoder's reads


def _drain(reader) -> str:
    while reader.read(READ):
        pass
    digest = reader.hexdigest()
    reader.close()
    return digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="size of the source (MiB)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row (the best is shown)")
    args = ap.parse_args()

    from s3server import s3_server

    from modalign.pipeline.discovery import ObjectPath
    from modalign.pipeline.object_reader import ObjectOpener
    from modalign.schemas.files import SeekableHashingReader

    with tempfile.TemporaryDirectory(prefix="modalign-s3-read-") as tmp:
        src = Path(tmp) / "source.bin"
        with open(src, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(2**20))
        size = src.stat().st_size
        expected = hashlib.sha256(src.read_bytes()).hexdigest()
        with s3_server(Path(tmp) / "s3") as s3:
            os.environ.update(s3.env())
            s3.client().upload_file(str(src), s3.bucket, "rec/source.bin")
            obj = ObjectPath(s3.bucket, "rec/source.bin")

            def s3_reader(block_mb: int):
                opener = ObjectOpener(s3.bucket, block_bytes=block_mb * 2**20)
                return lambda: _drain(SeekableHashingReader(opener=lambda: opener.open(obj)))

            def in_memory():
                mem = ObjectOpener(s3.bucket).in_memory(obj, max_bytes=size)
                try:
                    return mem.hexdigest()
                finally:
                    mem.close()

            rows = [("local hashing reader", lambda: _drain(SeekableHashingReader(src)))]
            rows += [(f"s3 hashing reader ({b} MiB blocks)", s3_reader(b)) for b in (1, 8, 32)]
            rows.append(("s3 into memory (memfd)", in_memory))

            def boto_get():  # what the server gives one plain stream: the ceiling of any reader here
                h = hashlib.sha256()
                body = s3.client().get_object(Bucket=s3.bucket, Key=obj.key)["Body"]
                for chunk in body.iter_chunks(2**20):
                    h.update(chunk)
                return h.hexdigest()

            rows.append(("boto3 get_object (reference)", boto_get))
            results = []
            for name, fn in rows:
                best = float("inf")
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    digest = fn()
                    best = min(best, time.perf_counter() - t)
                    assert digest == expected, f"{name}: wrong sha256"
                results.append((name, size / 2**20 / best))

    local = results[0][1]
    print(f"source: {size / 2**20:.0f} MiB of random bytes, sha256 taken while reading; best of {args.repeat}; "
          f"SeaweedFS on loopback, {os.cpu_count()} CPU(s)")
    print(f"{'reader':<34} {'MB/s':>8} {'vs local':>9}")
    for name, mbps in results:
        print(f"{name:<34} {mbps:>8.0f} {mbps / local:>8.2f}x")


if __name__ == "__main__":
    main()
