"""The one user-facing exception hierarchy.

Every error a user can cause (a bad file, a bad name, a bad option) is a
LayerdiffError that names what is wrong: the file, the node or the field.
Anything else reaching a service boundary is a bug and is reported as such.
"""
from __future__ import annotations

# grpc is imported only where a status is sent: importing layerdiff must not
# load it, so that a command can quiet gRPC's own logging before it starts.


class LayerdiffError(Exception):
    """A problem with the user's input or environment, described for the user."""

    code: str = "INVALID_ARGUMENT"     # the grpc.StatusCode it travels as

    def __init__(self, message: str, *, file: str | None = None, node: str | None = None,
                 field: str | None = None) -> None:
        self.file = file
        self.node = node
        self.field = field
        parts = []
        if file:
            parts.append(f"file {file!r}")
        if node:
            parts.append(f"node {node!r}")
        if field:
            parts.append(f"field {field!r}")
        prefix = ", ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class NotFoundError(LayerdiffError):
    code = "NOT_FOUND"


class LimitError(LayerdiffError):
    code = "RESOURCE_EXHAUSTED"


class UnavailableError(LayerdiffError):
    code = "UNAVAILABLE"


class Unauthenticated(LayerdiffError):
    """No token, or one the service does not accept."""
    code = "UNAUTHENTICATED"


class PermissionDenied(LayerdiffError):
    """An accepted token asking for what another token owns."""
    code = "PERMISSION_DENIED"


def abort_with(context, exc: BaseException) -> None:
    """Translate an exception into a gRPC status (raises)."""
    import grpc

    if isinstance(exc, LayerdiffError):
        context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


# What ``layerdiff run`` exits with, and what a job's outcome carries.
EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_NO_ANSWER = 0, 1, 2, 3


class JobFailed(LayerdiffError):
    """A job that ended without an answer. ``exit_status`` says why, as the
    command line does: 2 for bad input or usage, 3 when a component failed."""

    def __init__(self, message: str, exit_status: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def os_error_in(e: BaseException | None, errnos: tuple[int, ...], phrases: tuple[str, ...]) -> bool:
    """Whether ``e``, or what it was raised from (its cause or context, on
    and on), is an OSError of one of ``errnos`` or says one of ``phrases``
    (a library's error that carries the system's message, not its number)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in errnos:
            return True
        text = str(e)
        if any(p in text for p in phrases):
            return True
        e = e.__cause__ or e.__context__
    return False
