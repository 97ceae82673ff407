"""modalign: a streaming multimodal data pipeline (ingest, align, de-identify, embed, lineage).

The public Python API. The repository root is this package: its folders install as
``modalign.schemas`` (models, errors, Arrow schemas), ``modalign.operators`` (Ray-free
stage operators) and ``modalign.pipeline`` (Ray, CLI, storage). Importing ``modalign``
loads none of torch, Ray, FAISS, OpenCV, spaCy or MediaPipe; they load when work starts.

    >>> import modalign
    >>> summary = modalign.run("sample/manifest.yaml", "out")      # doctest: +SKIP
    >>> out = modalign.open("out")                                  # doctest: +SKIP
    >>> out.sessions(), out.table("records").to_table().num_rows    # doctest: +SKIP
"""

from __future__ import annotations

from os import PathLike
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from modalign.pipeline.outputs import Output
    from modalign.schemas.config import RunConfig

__all__ = ["run", "open"]


def run(
    input_path: str | PathLike,
    out: str | PathLike,
    config: "RunConfig | dict[str, Any] | str | PathLike | None" = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the batch pipeline over a manifest, a folder or a media file into ``out``.

    ``config`` is a ``RunConfig``, a dict of its fields, or a YAML/JSON file; the result is
    the run summary that ``OUT/run.json`` also holds. Raises ``ConfigError`` before any
    work when the input or config is invalid, ``OutputLockedError`` when another run is
    writing ``out``, ``EnvironmentFaultError`` when the machine fails (OUT read-only or full,
    a dead aligner); then nothing is committed and ``out`` is as it was.
    """
    from modalign.pipeline.runner import run as _run

    return _run(input_path, out, config, progress)


def open(out: str | PathLike, storage: Any = None) -> "Output":  # noqa: A001 - the public name is modalign.open
    """The output folder of a run (or ``s3://bucket/prefix``) as of its latest commit: sessions and
    tables as Arrow datasets. ``storage``: the endpoint and retries of an S3 OUT, as the run
    config's ``storage`` section (a dict or ``StorageConfig``; default: ``$AWS_ENDPOINT_URL``)."""
    from modalign.pipeline.outputs import Output

    return Output(out, storage)
