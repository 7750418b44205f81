"""The driver's error vocabulary, one of each: the job's failure, the worker's own exception
inside Ray's wrapper, a stale leader's refused call, and the one-line description events and
failure reasons use. Light module: imports nothing heavy (no Ray)."""

from __future__ import annotations


class JobFailed(Exception):
    """The job cannot go on; the message is the failure reason shown to the user."""


def worker_cause(e: BaseException) -> BaseException:
    """The worker's own exception inside Ray's wrapper (``RayTaskError.cause``), else ``e``."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def is_stale(e: BaseException) -> bool:
    """True if ``e`` (possibly Ray's wrapper) is a worker refusing a stale leader's call."""
    from .workers.fencing import StaleLeader

    return isinstance(worker_cause(e), StaleLeader)


def describe_error(err: BaseException) -> str:
    """One line for events and failure reasons: the worker's own exception rather than Ray's
    wrapper and traceback; Ray's long "The actor ..." text is dropped."""
    e = worker_cause(err)
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}{': ' + text if text and not text.startswith('The actor') else ''}"
