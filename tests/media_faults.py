"""Media that fails part-way: PyAV containers whose decoder or demuxer raises after N items."""

from __future__ import annotations


def fail_after(monkeypatch, method: str, n: int) -> None:
    """Make ``av.open`` return containers whose ``method`` ("decode" or "demux") raises
    ``InvalidDataError`` at its n-th item, as a damaged stream or index would."""
    import av

    real_open = av.open

    class Failing:
        def __init__(self, c):
            self._c = c

        def __getattr__(self, name):
            return getattr(self._c, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._c.close()

        def _fail(self, *a, **k):
            for i, item in enumerate(getattr(self._c, method)(*a, **k)):
                if i == n:
                    raise av.error.InvalidDataError(1094995529, "Invalid data found")
                yield item

    setattr(Failing, method, Failing._fail)
    monkeypatch.setattr(av, "open", lambda *a, **k: Failing(real_open(*a, **k)))
