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
    └── DependencyMissingError   a Python or Debian package is absent: says what to install

Messages say what failed, for which source and time, and what to do next. They never
contain personal data: a message names a source URI and a time range, not its content.
"""

from __future__ import annotations


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
