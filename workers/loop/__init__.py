"""The speculation loop, once: propose -> verify -> commit -> emit.

    state.py     one session's round bookkeeping, pure: the plan, the history, counters,
                 the tree a round may ask for, committing a verify outcome
    driver.py    `Loop`: drives rounds over a draft and a target Backend through a `Route`
                 (which workers serve the session, what a failure does); no I/O of its own
    inprocess.py Backends over runners in this process, and `LocalDecoder`, the loop over them

`specsplit generate`, the benchmarks, the tests (in-process and over gRPC) and the gateway
all run `Loop.rounds`; the gateway adds routing, failover, adaptive trees, the look-ahead
and metrics through the Route and the Loop's hooks (gateway/speculation.py).
"""

from workers.loop.driver import Loop, Pair, Route, Seat, generate
from workers.loop.state import Counters, Generation, LoopState, Plan, Round

__all__ = [
    "Counters",
    "Generation",
    "Loop",
    "LoopState",
    "Pair",
    "Plan",
    "Round",
    "Route",
    "Seat",
    "generate",
]
