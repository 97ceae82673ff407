"""The one exception tree of modalign.

Every error the pipeline raises on purpose is a ``ModalignError``; each class has a stable
``code`` (written to quarantine rows, ``run.json`` and CLI output) and says whether a
retry can help (``retryable``)::

    ModalignError
    ├── ConfigError              bad manifest, config or policy: stop before any work
    ├── InputError               bad media: quarantine the source (or range), go on
    │   ├── UnreadableInputError     missing, empty, corrupt or truncated file
    │   ├── UnsupportedInputError    a format or codec we do not read
    │   ├── LimitExceededError       over a configured limit (pixels, pages, duration, size)
    │   └── InputTimeoutError        one unit (page render, OCR, decode) ran out of time
    ├── ComplianceError          de-identification could not be guaranteed: withhold, never write raw
    ├── QualityGateError         a record broke a ``fail`` quality expectation: bad input, the run stops
    │                            before its commit (nothing of it is committed)
    ├── DependencyMissingError   a Python or Debian package is absent: says what to install
    ├── EnvironmentFaultError    the machine failed, not the input (read-only or full OUT, a dead
    │                            aligner): stop the run with one message, never quarantine inputs
    └── OutputLockedError        another run holds the output folder's lease: nothing was written

Messages say what failed, for which source and time, and what to do next. They never
contain personal data: a message names a source URI and a time range, not its content.

A quarantined source or range records why as a ``QuarantineReason`` (the ``code`` of the
``InputError`` or ``ComplianceError`` that rejected it); ``QuarantineRow`` validates it.
"""

from __future__ import annotations

from enum import StrEnum


class QuarantineReason(StrEnum):
    """Why an input (or a range of it) was quarantined: the stable codes of quarantine rows."""

    # the file itself
    PATH_OUTSIDE_ROOT = "path_outside_root"  # resolves outside the input root: refused before any read
    FILE_MISSING = "file_missing"            # the path is not a file (or vanished before it was read)
    FILE_EMPTY = "file_empty"                # zero bytes
    LIMIT_EXCEEDED = "limit_exceeded"        # over a configured size limit (e.g. ingest.max_file_bytes)
    WRONG_TYPE = "wrong_type"                # a document under a media name
    NOT_MEDIA = "not_media"                  # FFmpeg reads it only as text art
    UNREADABLE = "unreadable"                # the container or document cannot be parsed
    UNSUPPORTED = "unsupported"              # a format or codec modalign does not read
    NO_VIDEO_STREAM = "no_video_stream"
    NO_AUDIO_STREAM = "no_audio_stream"
    # a range of a decodable file
    DECODE_FAILED = "decode_failed"
    CORRUPT_FRAMES = "corrupt_frames"
    TRUNCATED = "truncated"
    DURATION_EXCEEDED = "duration_exceeded"
    PIXELS_EXCEEDED = "pixels_exceeded"
    TIMEOUT = "timeout"
    # documents
    NOT_PDF = "not_pdf"
    PDF_ENCRYPTED = "pdf_encrypted"
    PDF_CORRUPT = "pdf_corrupt"
    PDF_EMPTY = "pdf_empty"
    PAGES_EXCEEDED = "pages_exceeded"
    INFO_TIMEOUT = "info_timeout"
    PAGE_TOO_LARGE = "page_too_large"
    IMAGE_TOO_LARGE = "image_too_large"
    BLOCKS_EXCEEDED = "blocks_exceeded"
    MEMORY_EXCEEDED = "memory_exceeded"
    RENDER_TIMEOUT = "render_timeout"
    OCR_TIMEOUT = "ocr_timeout"
    RENDER_FAILED = "render_failed"
    OCR_FAILED = "ocr_failed"
    PAGES_FAILED = "pages_failed"            # several pages failed for different reasons
    # operators and clocks
    BAD_BATCH = "bad_batch"                  # a table an operator cannot process (schema, type)
    SCHEMA_MISMATCH = "schema_mismatch"
    OFFSET_NOT_FOUND = "offset_not_found"    # clock estimation found no consistent offset
    SKEW_OUT_OF_RANGE = "skew_out_of_range"
    LATE_SOURCE = "late_source"
    SOURCE_CONFLICT = "source_conflict"
    INPUT_INVALID = "input_invalid"
    DEID_FAILED = "deid_failed"              # de-identification could not be guaranteed: withheld
    # quality gates (``QualityConfig.expectations``; runbooks/quality-shift.md)
    QUALITY_EXPECTATION = "quality_expectation"  # records a ``drop`` expectation removed: one row per contiguous run
    QUALITY_FAILED = "quality_failed"        # a ``fail`` expectation was broken: the run stopped, never committed
    # not the input's fault, recorded so the source's missing rows are explained
    INTERNAL_ERROR = "internal_error"        # an operator bug; see the worker log
    WORKER_FAILED = "worker_failed"          # the ingest actor died while processing this source
    # compliance
    ERASED = "erased"                        # erased from OUT (``modalign lineage erase``): its denylist refuses it


class ModalignError(Exception):
    """Base of every error modalign raises on purpose."""

    code: str = "error"
    retryable: bool = False

    def __init__(self, message: str, *, source_uri: str | None = None, stage: str | None = None):
        self.source_uri = source_uri
        self.stage = stage
        prefix = f"[{self.code}]"
        where = f" {source_uri}" if source_uri else ""
        at = f" ({stage})" if stage else ""
        super().__init__(f"{prefix}{where}{at}: {message}")
        self.message = message


class ConfigError(ModalignError):
    """A manifest, config or policy is invalid; raised before any work starts."""

    code = "config_invalid"


class InputError(ModalignError):
    """A source cannot be (fully) ingested; it is quarantined and the run goes on."""

    code = "input_invalid"

    def __init__(
        self,
        message: str,
        *,
        source_uri: str | None = None,
        stage: str | None = None,
        code: str | None = None,
        start_t_ns: int | None = None,
        end_t_ns: int | None = None,
    ):
        if code is not None:
            self.code = code
        self.start_t_ns = start_t_ns
        self.end_t_ns = end_t_ns
        super().__init__(message, source_uri=source_uri, stage=stage)


class UnreadableInputError(InputError):
    """Missing, empty, corrupt or truncated input."""

    code = "unreadable"


class UnsupportedInputError(InputError):
    """A format or codec modalign does not read."""

    code = "unsupported"


class LimitExceededError(InputError):
    """The input is over a configured limit (pixels, pages, duration, file size)."""

    code = "limit_exceeded"


class InputTimeoutError(InputError):
    """One unit of work (render, OCR page, decode) exceeded its timeout."""

    code = "timeout"
    retryable = True


class ComplianceError(ModalignError):
    """De-identification could not be guaranteed; the data is withheld, never written raw."""

    code = "deid_failed"


class QualityGateError(ModalignError):
    """A record broke a quality expectation whose action is ``fail`` (``schemas.config.QualityConfig``).

    The input is bad for what the output is used for (a dark or single-channel camera feeding an RGB
    model): the run stops before its commit, nothing of it is committed (exit 1). The message names
    the source, the property, the value, the time and the expectation."""

    code = "quality_failed"


class DependencyMissingError(ModalignError):
    """A required package or binary is absent."""

    code = "dependency_missing"

    def __init__(self, what: str, *, pip: str | None = None, apt: str | None = None):
        hints = []
        if pip:
            hints.append(f"pip install {pip}")
        if apt:
            hints.append(f"apt-get install {apt}")
        hint = f"; install it with: {' or '.join(hints)} (or run `make setup`)" if hints else ""
        super().__init__(f"{what} is not available{hint}")


class EnvironmentFaultError(ModalignError):
    """The environment failed (OUT read-only or full, an actor that holds run state died).

    Not the input's fault: the run stops with this one message (exit 1) and no source is
    quarantined for it; re-run once the cause is fixed."""

    code = "environment_fault"
    retryable = True


class OutputLockedError(ModalignError):
    """Another writer holds the output folder (its lease is live), or committed first.

    Nothing of this run was written or committed; wait for the holder, or re-run once its
    lease has expired (a dead holder's lease is taken over)."""

    code = "out_locked"
    retryable = True
