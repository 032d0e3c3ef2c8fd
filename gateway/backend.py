"""What the gateway needs from one worker, and the failures it can report.

A `Backend` is one draft or target worker as the gateway sees it: a handful of
coarse async calls that mirror the worker's gRPC service. Two kinds implement
it: `gateway.inprocess` (runners in this process, for tests and the
in-gateway n-gram draft) and `gateway.grpc_backend` (a worker over the network).

Failures are four exception types, one per thing the loop does about them:

- `SessionLost`   the worker does not hold the session at the caller's
                  base_len (gRPC NOT_FOUND): re-send the full history there.
- `WorkerBusy`    every slot is held by a call in flight (RESOURCE_EXHAUSTED):
                  try another worker.
- `WorkerDown`    the worker cannot be reached or failed (UNAVAILABLE,
                  DEADLINE_EXCEEDED, INTERNAL, ...): mark it down, fail over.
- `InvalidCall`   the worker refused the call as malformed (INVALID_ARGUMENT):
                  a bug or a request over a limit; the request fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from workers.draft.runner import ProposeCall
from workers.spec.tree import TokenTree
from workers.target.runner import VerifyCall, VerifyOutcome

Role = Literal["draft", "target"]


class WorkerError(Exception):
    """A worker call failed; the subclass says what the caller should do."""


class SessionLost(WorkerError):
    """The worker does not hold the session at base_len: re-send the history."""


class WorkerBusy(WorkerError):
    """Every session slot of the worker is busy: try another worker."""


class WorkerDown(WorkerError):
    """The worker is unreachable or broken: mark it down and fail over."""


class InvalidCall(WorkerError):
    """The worker refused the call as malformed."""


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself (the gRPC InfoResponse)."""

    role: Role
    model_id: str  # alias, directory or HF id; "ngram" for the model-free drafter
    tokenizer_fingerprint: str  # "" = model-free drafter, pairs with any target
    vocab_size: int  # 0 = unknown (model-free)
    context_length: int  # most tokens per session; 0 = unlimited
    max_sessions: int  # sessions held at once; 0 = unlimited
    live_sessions: int = 0  # sessions held now
    eos_token_ids: tuple[int, ...] = ()  # tokens that end a generation
    max_tree_nodes: int = 0  # most draft nodes per tree; 0 = no limit stated


class Backend(Protocol):
    """One worker. Draft workers answer `propose`, target workers `verify`."""

    role: Role
    address: str  # where it is ("host:port", or a name for in-process workers)

    async def propose(self, call: ProposeCall) -> TokenTree: ...

    async def verify(self, call: VerifyCall) -> VerifyOutcome: ...

    async def end(self, session_id: str) -> None:
        """Frees the session; ending an unknown session is not an error."""

    async def health(self) -> bool:
        """True when the worker is serving."""

    async def info(self) -> WorkerInfo: ...

    async def close(self) -> None:
        """Releases the connection (not the worker)."""


BackendFactory = Callable[[Role, str], Backend]
"""Makes the backend of the worker at an address (called once per address)."""
