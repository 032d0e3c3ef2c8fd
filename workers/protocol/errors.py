"""The failures of a worker call, one type per thing the caller does about them.

Runners raise them, the gRPC layer maps each to one status code and back
(workers/rpc/status.py), and the loop reacts to them the same way whether the
worker is in this process or behind the network:

- `SessionLost`   the worker does not hold the session at the caller's base_len
                  (unknown, evicted, out of sync; gRPC NOT_FOUND): re-send the history.
- `WorkerBusy`    every session slot is held by a call in flight (RESOURCE_EXHAUSTED):
                  try another worker.
- `WorkerDown`    the worker cannot be reached or failed (UNAVAILABLE, DEADLINE_EXCEEDED,
                  INTERNAL, ...): mark it down and fail over.
- `InvalidCall`   the worker refused the call as malformed (INVALID_ARGUMENT): a bug
                  or a request over a limit. A ValueError, so validation code raising
                  ValueError (bad token ids, a malformed tree) means the same.
"""

from __future__ import annotations


class WorkerError(Exception):
    """A worker call failed; the subclass says what the caller should do."""


class SessionLost(WorkerError):
    """The worker does not hold the session at base_len: re-send the full history."""


class WorkerBusy(WorkerError):
    """Every session slot of the worker is busy: try another worker."""


class WorkerDown(WorkerError):
    """The worker is unreachable or broken: mark it down and fail over."""


class InvalidCall(WorkerError, ValueError):
    """The worker refused the call as malformed."""


class IncompatibleWorkers(ValueError):
    """A draft and a target whose token ids do not mean the same text."""


def as_worker_error(error: BaseException) -> WorkerError:
    """The worker error a failed call stands for, whatever layer raised it."""
    if isinstance(error, WorkerError):
        return error
    if isinstance(error, ValueError):
        return InvalidCall(str(error))
    return WorkerDown(f"{type(error).__name__}: {error}")
