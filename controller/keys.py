"""The etcd key schema, in one place (see docs/architecture.md).

Every key lives under the versioned prefix ``/rrl/v1``. Functions here only
build strings; they never talk to etcd. Job ids, group and worker names are
validated so that no key (and no path built from a job id) can escape its
folder.
"""

from __future__ import annotations

import re

PREFIX = "/rrl/v1"

# used with fullmatch: ``$`` alone would also accept a trailing newline ("job\n")
_ID_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class InvalidId(ValueError):
    """A job id, group or worker name that cannot be used in a key or a path."""


def check_job_id(job: str) -> str:
    """Return ``job`` if it is a valid job id, else raise :class:`InvalidId`.

    Valid: 1-63 characters, lower-case letters, digits and ``-``, starting and
    ending with a letter or digit (a DNS label, so it is also a safe folder name
    and Kubernetes object name).
    """
    if not isinstance(job, str) or not _ID_RE.fullmatch(job):
        raise InvalidId(
            f"invalid job id {job!r}: use 1-63 lower-case letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return job


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is a valid group / worker / controller name."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidId(f"invalid {what} {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name


def leader() -> str:
    return f"{PREFIX}/leader"


def controllers() -> str:
    return f"{PREFIX}/controllers/"


def controller(cid: str) -> str:
    return f"{controllers()}{check_name(cid, 'controller id')}"


def jobs() -> str:
    return f"{PREFIX}/jobs/"


def job(job_id: str) -> str:
    return f"{jobs()}{check_job_id(job_id)}/"


def spec(job_id: str) -> str:
    return f"{job(job_id)}spec"


def desired(job_id: str) -> str:
    return f"{job(job_id)}desired"


def state(job_id: str) -> str:
    return f"{job(job_id)}state"


def members(job_id: str, group: str | None = None) -> str:
    base = f"{job(job_id)}members/"
    return base if group is None else f"{base}{check_name(group, 'group')}/"


def member(job_id: str, group: str, worker: str) -> str:
    return f"{members(job_id, group)}{check_name(worker, 'worker')}"


def lineage(job_id: str, at_step: int | None = None) -> str:
    """A trainer group (re)start: ``lineage/{step}`` (zero-padded: key order is step order)."""
    base = f"{job(job_id)}lineage/"
    return base if at_step is None else f"{base}{at_step:010d}"


def verified(job_id: str) -> str:
    """The result of the newest `rrl verify` of the job (written by the CLI, shown on the page)."""
    return f"{job(job_id)}verified"


def checkpoints(job_id: str) -> str:
    return f"{job(job_id)}checkpoints/"


def checkpoint(job_id: str, step: int) -> str:
    # zero-padded so that etcd's key order is step order
    return f"{checkpoints(job_id)}{step:010d}"


def events(job_id: str) -> str:
    return f"{job(job_id)}events/"


def event(job_id: str, seq: int) -> str:
    return f"{events(job_id)}{seq:012d}"


def split_job_key(key: str) -> tuple[str, str] | None:
    """``/rrl/v1/jobs/{job}/{rest}`` -> ``(job, rest)``; None for other keys."""
    base = jobs()
    if not key.startswith(base):
        return None
    job_id, _, rest = key[len(base) :].partition("/")
    return job_id, rest


def split_member_key(key: str) -> tuple[str, str, str] | None:
    """``.../jobs/{job}/members/{group}/{worker}`` -> ``(job, group, worker)``."""
    parts = split_job_key(key)
    if parts is None:
        return None
    job_id, rest = parts
    bits = rest.split("/")
    if len(bits) != 3 or bits[0] != "members":
        return None
    return job_id, bits[1], bits[2]
