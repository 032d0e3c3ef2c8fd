"""One worker as its caller sees it: a handful of coarse async calls.

Implemented by `workers.loop.inprocess` (runners in this process: tests,
`specsplit generate`, the gateway's own n-gram draft) and `workers.rpc.client`
(a worker over gRPC). Every failure is raised as one of workers.protocol.errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from workers.protocol.calls import ProposeCall, VerifyCall, VerifyOutcome, WorkerInfo
from workers.speculation.tree import TokenTree

Role = Literal["draft", "target"]


class Backend(Protocol):
    """One worker. Draft workers answer `propose`, target workers `verify`."""

    role: Role
    address: str  # where it is ("host:port", or a name for in-process workers)

    async def propose(self, call: ProposeCall) -> TokenTree: ...

    async def verify(self, call: VerifyCall) -> VerifyOutcome: ...

    async def end(self, session_id: str) -> bool:
        """Frees the session; returns whether the worker held it (an unknown one is no error)."""

    async def health(self) -> bool:
        """True when the worker is serving."""

    async def info(self) -> WorkerInfo: ...

    async def close(self) -> None:
        """Releases the connection (not the worker)."""


BackendFactory = Callable[[Role, str], Backend]
"""Makes the backend of the worker at an address (called once per address)."""
