"""What one request took, and the figures a benchmark row reports from many of them.

A `Timed` request records its start, when each chunk of new tokens arrived
and how many tokens it carried, and (for SpecSplit) the response's
speculation counters. A `Figures` summary pools requests:

- tokens/s per stream: tokens over the requests' summed end-to-end time;
- aggregate tokens/s: tokens over the wall time of the whole batch of streams;
- time to first token: request sent -> first non-empty chunk (prefill included);
- inter-token latency: each chunk's gap after the previous one divided by
  its tokens, counted once per token (a speculative round that brings 6
  tokens after 120 ms is six tokens at 20 ms), p50 and p99 over all tokens;
- tau: tokens per target forward (accepted draft tokens + the bonus), the
  acceptance rate (accepted / proposed draft tokens) and tokens per round trip
  (a verify call: one forward, or a round of decode steps), from the counters.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Timed:
    """One request, as the client saw it."""

    start: float  # perf_counter when the request was sent
    key: int = -1  # which conversation of the workload it was
    end: float = 0.0  # when its last byte arrived
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    tokens: int = 0  # completion tokens
    text: str = ""
    stats: dict | None = None  # speculation_stats of a SpecSplit response

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    def itl(self) -> list[float]:
        """One inter-token latency per token after the first chunk."""
        out: list[float] = []
        for (before, _), (at, n) in zip(self.chunks, self.chunks[1:], strict=False):
            if n > 0:
                out += [(at - before) / n] * n
        return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Figures:
    """A row's numbers (None where they do not apply)."""

    requests: int
    tokens: int
    wall_s: float
    tok_s_stream: float
    tok_s_total: float
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tau: float | None
    acceptance: float | None
    lookahead_hit_rate: float | None
    tokens_per_round: float | None = None
    busy_s: float = 0.0  # the requests' seconds, summed
    draft_nodes_per_token: float | None = None  # tree nodes sent to verification a token

    @classmethod
    def of(cls, timed: list[Timed], wall_s: float) -> Figures:
        tokens = sum(t.tokens for t in timed)
        busy = sum(t.seconds for t in timed)
        itl = [x for t in timed for x in t.itl()]
        ttfts = [t.ttft for t in timed if t.ttft is not None]
        stats = [t.stats for t in timed if t.stats]

        def total(key: str) -> int:
            return sum(s.get(key, 0) for s in stats)

        steps, drafted, rounds = total("verify_steps"), total("draft_tokens"), total("rounds")
        looked = total("lookahead_hits") + total("lookahead_misses")
        ms = 1000.0
        return cls(
            requests=len(timed),
            tokens=tokens,
            wall_s=wall_s,
            tok_s_stream=tokens / busy if busy else 0.0,
            tok_s_total=tokens / wall_s if wall_s else 0.0,
            ttft_p50_ms=statistics.median(ttfts) * ms if ttfts else None,
            itl_p50_ms=scaled(percentile(itl, 50), ms),
            itl_p99_ms=scaled(percentile(itl, 99), ms),
            tau=total("emitted_tokens") / steps if steps else None,
            acceptance=total("accepted_tokens") / drafted if drafted else None,
            lookahead_hit_rate=total("lookahead_hits") / looked if looked else None,
            tokens_per_round=total("emitted_tokens") / rounds if rounds else None,
            busy_s=busy,
            draft_nodes_per_token=drafted / tokens if stats and tokens else None,
        )


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound
