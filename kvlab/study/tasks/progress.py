"""A progress bar that is a no-op when progress is off."""

from __future__ import annotations


def progress_bar(enabled: bool, **kwargs):
    """tqdm(**kwargs) when enabled, else an object with the same `update` / context-manager surface."""
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(**kwargs, leave=False, dynamic_ncols=True)
    return _Silent()


class _Silent:
    total = 0

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int = 1) -> None:
        pass
