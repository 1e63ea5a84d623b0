"""A call to the analyzer as the client sees it, whatever carries it: a
gRPC call to a served analyzer (``analyzer_client``), or a call to the one
running in this process (``local_client``). What a failed call becomes
(``call_failure``, ``call_details``), Ctrl-C (``Interrupted``), and a
report's files taken into the output directory. Nothing here loads gRPC:
a command that runs its analyzer in its own process never does.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from layerdiff.common.errors import EXIT_BAD_INPUT, EXIT_NO_ANSWER, JobFailed, LayerdiffError
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    from layerdiff.common.artifacts import ArtifactStore
    from layerdiff.common.localfile import LocalFile

# status codes of a call that refuses its input (exit status 2)
_BAD_INPUT = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "OUT_OF_RANGE",
                        "ALREADY_EXISTS"})
_WRONG_TOKEN = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})


class _Code:
    """A status code as a gRPC call's error gives it (its ``name``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StatusCode.{self.name}"


class CallError(Exception):
    """A call to the analyzer in this process that failed, read as a gRPC
    call's error is: ``code()`` (with its ``name``) and ``details()``."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self._code = _Code(code)
        self._details = details

    def code(self) -> _Code:
        return self._code

    def details(self) -> str:
        return self._details

    @classmethod
    def of(cls, e: BaseException) -> CallError:
        """What the served analyzer would have answered: a LayerdiffError
        with its status code, anything else as INTERNAL."""
        if isinstance(e, LayerdiffError):
            return cls(e.code, str(e))
        return cls("INTERNAL", f"internal error: {type(e).__name__}: {e}")


def call_errors() -> tuple[type[BaseException], ...]:
    """The errors a call to the analyzer raises: gRPC's where gRPC is loaded
    (a served analyzer was called), and CallError."""
    grpc = sys.modules.get("grpc")
    return (CallError, grpc.RpcError) if grpc is not None else (CallError,)


def code_name(e: BaseException) -> str | None:
    """The status code of a failed call, by name (None where it has none)."""
    code = e.code() if hasattr(e, "code") else None
    return getattr(code, "name", None)


def call_failure(what: str, e: BaseException) -> LayerdiffError:
    """A failed call to a service: its refusal of bad input (exit status 2),
    or the service gone or unreachable (3)."""
    name = code_name(e)
    details = (e.details() if hasattr(e, "details") else "") or f"StatusCode.{name}"
    if name in _BAD_INPUT:
        return JobFailed(details, EXIT_BAD_INPUT)
    if name in _WRONG_TOKEN:     # usage: the wrong token
        return JobFailed(f"{what}: {details}", EXIT_BAD_INPUT)
    return JobFailed(f"{what}: {details}", EXIT_NO_ANSWER)


def call_details(e: BaseException) -> str:
    """One line saying why a call failed."""
    name = code_name(e) or "error"
    details = (e.details() if hasattr(e, "details") else "") or ""
    return " ".join(f"{name}: {details}".split()) if details else name


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a job. ``message`` says what became of the job: cancelled
    on the analyzer, already ended, or why it could not be cancelled. It is a
    KeyboardInterrupt, so a script stops as it would anyway."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.job_id = job_id

    def __str__(self) -> str:
        return self.message


def by_ctrl_c(e: BaseException) -> bool:
    """Is ``e`` Ctrl-C, or what it broke on its way out? Raised into a
    library in the middle of a statement (gRPC's stream waiting on a
    condition, its lock released and not yet taken back), it can come back
    as another exception ('cannot release un-acquired lock') whose context
    is the KeyboardInterrupt."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        if isinstance(at, KeyboardInterrupt):
            return True
        seen.add(id(at))
        at = at.__context__
    return False


@contextmanager
def sigint_held():
    """Hold off Ctrl-C while a job is being cancelled: a second press must not
    break off the cancel (it is bounded by CANCEL_TIMEOUT anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: None)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def hand_over(store: ArtifactStore, beside: ArtifactStore | None, data: bytes, name: str,
              origin: LocalFile | None) -> str:
    """An upload to an analyzer in this process: put into its store (taken
    as it lies, where ``origin`` is the file it was read from) and linked
    into the collector's beside it; the artifact id."""
    artifact = store.put(data, name, origin).id
    if beside is not None:
        beside.link_from(store, artifact)
    return artifact


def state_of(events) -> tuple[pb.JobEvent | None, bool]:
    """A job's latest event and whether it has ended, read from a watch of
    its events (``events``: iterable, with ``cancel()``) that runs out of time
    while the job goes on (DEADLINE_EXCEEDED)."""
    last = None
    try:
        for ev in events:
            last = ev
    except call_errors() as e:
        if code_name(e) != "DEADLINE_EXCEEDED":
            raise
        return last, False
    finally:
        events.cancel()
    return last, True


def after_cancel(job_id: str, ev: pb.JobEvent) -> Interrupted:
    """Ctrl-C's answer once job ``job_id`` was asked to cancel (``ev``: what
    the analyzer said of it then)."""
    if ev.state in (pb.DONE, pb.FAILED):
        return Interrupted(f"interrupted; job {job_id} had already ended ({pb.JobState.Name(ev.state)})", job_id)
    return Interrupted(f"interrupted; job {job_id} cancelled", job_id)


def report_dir(out: Path) -> Path:
    """``out`` made (with its parents) to take a report, resolved."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LayerdiffError(f"cannot create the report directory: {e.strerror}", file=str(out),
                             field="out") from None
    return out.resolve()


def report_target(out: Path, root: Path, rel: str) -> Path:
    """Where a report file named ``rel`` goes in ``out`` (``root``: out
    resolved); a name that would leave it is refused."""
    target = (out / rel).resolve()
    if root not in target.parents:
        raise LayerdiffError(f"report file {rel!r} would land outside {out}", field="path")
    return target


def _link_or_copy(src: Path, target: Path) -> None:
    try:
        os.link(src, target)
    except OSError:
        shutil.copyfile(src, target)


def take_report(files: list[tuple[str, Path]], out: Path, root: Path) -> list[Path]:
    """An embedded analyzer's report files into ``out``: hard links where
    both lie on one file system (its directory goes with the process, the
    links stay), copies elsewhere."""
    written = []
    made: dict[str, Path] = {}      # each directory of the report checked and made once, not once a file
    for rel, src in files:
        folder, _, name = rel.rpartition("/")
        if name in ("", ".", ".."):
            raise LayerdiffError(f"report file {rel!r} would land outside {out}", field="path")
        where = made.get(folder)
        target = (where or root) / name
        try:
            if where is None:
                where = report_target(out, root, folder) if folder else root
                where.mkdir(parents=True, exist_ok=True)
                made[folder] = where
                target = where / name
            # a link (or anything) already at the name is replaced, never written through
            # (looked for only where the link finds it: most reports go to a new directory)
            try:
                os.link(src, target)
            except FileExistsError:
                target.unlink()
                _link_or_copy(src, target)
            except OSError:
                shutil.copyfile(src, target)
        except OSError as e:
            raise LayerdiffError(f"cannot write a report: {e.strerror}", file=str(target), field="out") from None
        written.append(target)
    return written
