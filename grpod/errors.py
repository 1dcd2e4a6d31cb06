"""What failed inside a task group: the first real error of (possibly nested) exception groups."""

from __future__ import annotations


def first_error(exc: BaseException, kind: type[BaseException] = Exception) -> BaseException | None:
    """`exc` itself, or the first leaf (depth first) of the exception groups `exc` nests, that is a
    `kind`; None when none is. The default `kind` passes over cancellation, KeyboardInterrupt and
    SystemExit: a task group that was cancelled holds no error."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_error(inner, kind)
            if found is not None:
                return found
        return None
    return exc if isinstance(exc, kind) else None
