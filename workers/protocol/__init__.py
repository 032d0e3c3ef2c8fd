"""What crosses between the gateway and the workers: calls, outcomes, errors, the Backend.

    calls.py    TreeSpec, ProposeCall, VerifyCall, VerifyOutcome, TokenLogprob, Timings,
                WorkerInfo: plain frozen dataclasses, the same in-process and over gRPC
    errors.py   SessionLost, WorkerBusy, WorkerDown, InvalidCall: the only worker errors
    backend.py  the Backend protocol one worker implements, by role

Importing it loads no model code (no engine, no transformers).
"""

from workers.protocol.backend import Backend, BackendFactory, Role
from workers.protocol.calls import (
    FEATURE_DTYPE,
    UNFINISHED,
    Features,
    ProposeCall,
    Timings,
    TokenLogprob,
    TreeSpec,
    Unfinished,
    VerifyCall,
    VerifyOutcome,
    WorkerInfo,
    check_pair,
)
from workers.protocol.errors import (
    IncompatibleWorkers,
    InvalidCall,
    SessionLost,
    WorkerBusy,
    WorkerDown,
    WorkerError,
    as_worker_error,
)

__all__ = [
    "FEATURE_DTYPE",
    "Features",
    "UNFINISHED",
    "Unfinished",
    "Backend",
    "BackendFactory",
    "IncompatibleWorkers",
    "InvalidCall",
    "ProposeCall",
    "Role",
    "SessionLost",
    "Timings",
    "TokenLogprob",
    "TreeSpec",
    "VerifyCall",
    "VerifyOutcome",
    "WorkerBusy",
    "WorkerDown",
    "WorkerError",
    "WorkerInfo",
    "as_worker_error",
    "check_pair",
]
