"""Prometheus metrics of the gateway, on its own CollectorRegistry (no global state).

Labels are bounded: endpoint and status come from a fixed set of routes and
codes, phase from {draft, verify, gateway}, parts from {ngram, model, both} and the round
cost's from COST_PARTS, epoch kinds from EPOCH_KINDS, position is capped at
MAX_POSITION, role + address are bounded by the worker pools. No session ids.

Speculation is exported as counters so that rates are PromQL over them:

    # acceptance rate: accepted draft tokens / proposed draft tokens
    sum(rate(specsplit_accepted_tokens_total[5m]))
      / sum(rate(specsplit_draft_tokens_total[5m]))

    # mean accepted length: accepted draft tokens per target forward
    # (add 1 for tokens per forward: every verify step also emits a bonus token)
    sum(rate(specsplit_accepted_tokens_total[5m]))
      / sum(rate(specsplit_verify_steps_total[5m]))

    # acceptance at depth k of the tree (the chance that a round gets past k)
    sum(rate(specsplit_accepted_tokens_per_position_total{position="k"}[5m]))
      / sum(rate(specsplit_verify_steps_total[5m]))

    # share of hybrid rounds whose tree held both the n-gram and the model draft
    sum(rate(specsplit_hybrid_rounds_total{parts="both"}[5m]))
      / sum(rate(specsplit_hybrid_rounds_total[5m]))

    # share of rounds decoded without a draft because none was healthy
    sum(rate(specsplit_degraded_rounds_total[5m]))
      / sum(rate(specsplit_verify_steps_total[5m]))

    # what decode steps (4) save a round without a draft, per target, in seconds: three
    # quarters of the time a one-forward round spends besides the forward
    0.75 * max by (address) (specsplit_target_round_cost_seconds{part="beside"})

    # p95 time to first token
    histogram_quantile(0.95,
      sum by (le) (rate(specsplit_time_to_first_token_seconds_bucket[5m])))

    # p99 time in the admission queue, and the share of requests that waited at all
    histogram_quantile(0.99,
      sum by (le) (rate(specsplit_request_queue_time_seconds_bucket[5m])))
    1 - sum(rate(specsplit_request_queue_time_seconds_bucket{le="0.005"}[5m]))
      / sum(rate(specsplit_request_queue_time_seconds_count[5m]))
"""

from __future__ import annotations

import contextlib
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.adaptive import RoundCost
from gateway.epochs import Epochs
from workers.protocol import Role

# request path -> `endpoint` label; a model's own path (/v1/models/ID) is "models" too,
# any other path "other"
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/health": "health",
    "/metrics": "metrics",
}


def endpoint_of(path: str) -> str:
    """The `endpoint` label of a request path."""
    return "models" if path.startswith("/v1/models/") else ENDPOINTS.get(path, "other")


GENERATION_ENDPOINTS = ("chat", "completions")
# what the generation routes answer (their `responses=` in gateway/routes.py)
GENERATION_STATUSES = ("200", "400", "401", "404", "413", "429", "500", "503")
PHASES = ("draft", "verify", "gateway")  # of one speculation round
# what a hybrid round's tree held: the gateway's n-gram nodes, the model's, or both
HYBRID_PARTS = ("ngram", "model", "both")
COST_PARTS = ("fixed", "token", "outside", "beside")  # of a target's RoundCost
EPOCH_KINDS = ("drafting", "plain")  # a target's epochs (gateway.epochs)
ROLES: tuple[Role, ...] = get_args(Role)

MAX_POSITION = 16  # accepted-per-position label values run 0..MAX_POSITION ("16" = 16 and deeper)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# round phases run from sub-millisecond (gateway work, an n-gram draft) to seconds
PHASE_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003) + LATENCY_BUCKETS
RATE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "specsplit_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("specsplit_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "specsplit_generation_tokens", "Tokens generated (returned to clients)", registry=r
        )
        self.time_to_first_token = Histogram(
            "specsplit_time_to_first_token_seconds",
            "Request arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "specsplit_inter_token_latency_seconds",
            "Time between rounds of a choice divided by the tokens the later round emitted",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "specsplit_e2e_request_latency_seconds",
            "Request arrival to its last token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.round_phase = Histogram(
            "specsplit_round_phase_seconds",
            "Time of one speculation round by phase (draft, verify, gateway)",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        # each round observes its phases: their series bound once (a `labels` call costs a
        # few µs of the gateway's one thread, three a round), which also starts them at zero
        self.phase = {phase: self.round_phase.labels(phase) for phase in PHASES}
        self.draft_tokens = Counter(
            "specsplit_draft_tokens", "Draft tree nodes sent to verification", registry=r
        )
        self.accepted_tokens = Counter(
            "specsplit_accepted_tokens", "Draft tree nodes the target accepted", registry=r
        )
        self.verify_steps = Counter(
            "specsplit_verify_steps",
            "Target forwards that committed tokens: a round's, or each of its decode steps",
            registry=r,
        )
        self.accepted_per_position = Counter(
            "specsplit_accepted_tokens_per_position",
            f"Rounds whose accepted path reached depth `position` (0-based, capped {MAX_POSITION})",
            ["position"],
            registry=r,
        )
        self.acceptance_rate = Histogram(
            "specsplit_request_acceptance_rate",
            "Accepted / proposed draft tokens of one request (requests that drafted)",
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.live_sessions = Gauge(
            "specsplit_live_sessions", "Choices being generated now", registry=r
        )
        self.requests_running = Gauge(
            "specsplit_num_requests_running",
            "Requests admitted and generating now (each holds one live session per choice)",
            registry=r,
        )
        self.requests_waiting = Gauge(
            "specsplit_num_requests_waiting",
            "Requests waiting in the admission queue for sessions",
            registry=r,
        )
        self.request_queue_time = Histogram(
            "specsplit_request_queue_time_seconds",
            "Time an admitted request waited in the admission queue (0 when there was room)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_up = Gauge(
            "specsplit_worker_up",
            "1 when the worker passes health checks",
            ["role", "address"],
            registry=r,
        )
        self.target_round_cost = Gauge(
            "specsplit_target_round_cost_seconds",
            "A target worker's round cost as the adaptive trees read it "
            "(gateway/adaptive.py RoundCost): part=fixed (a, a call whatever it feeds), "
            "token (b, each token its batch feeds), outside (a round's time outside the "
            "call's work), beside (a one-forward round's time besides the forward, what a "
            "round of decode steps pays once)",
            ["address", "part"],
            registry=r,
        )
        self.target_epoch_rate = Gauge(
            "specsplit_target_epoch_tokens_per_second",
            "A target worker's drafting and plain epochs at its load now (gateway/epochs.py): "
            "the tokens its sessions' rounds committed a second of those rounds, each kind's "
            "weighted mean over its epochs",
            ["address", "kind"],
            registry=r,
        )
        self.target_drafting = Gauge(
            "specsplit_target_drafting",
            "1 while a target worker runs a drafting epoch, 0 in a plain one (gateway/epochs.py)",
            ["address"],
            registry=r,
        )
        self.hybrid_rounds = Counter(
            "specsplit_hybrid_rounds",
            "Rounds of hybrid sessions with a tree, by what it held: n-gram nodes only, "
            "model nodes only (a model node equal to an n-gram one counts as n-gram), or both",
            ["parts"],
            registry=r,
        )
        self.degraded_rounds = Counter(
            "specsplit_degraded_rounds",
            "Rounds decoded by the target alone because no draft worker answered",
            registry=r,
        )
        self.dropped_draft_tokens = Counter(
            "specsplit_dropped_draft_tokens",
            "Draft tokens a target left out of its forward: greedy trees' last nodes that "
            "alone would have opened a block of rows its forward computes (16 on AMX)",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "specsplit_prefix_cache_hits",
            "Session (re)starts on a target that reused cached prompt tokens",
            registry=r,
        )
        self.prefix_cache_hit_tokens = Counter(
            "specsplit_prefix_cache_hit_tokens",
            "Prompt tokens a target reused from its cache on (re)start",
            registry=r,
        )
        self.prefix_routed = Counter(
            "specsplit_prefix_routed_sessions",
            "Sessions bound to the worker that got the longest prefix of their prompt (prefix-"
            "aware routing) rather than the least loaded one",
            ["role"],
            registry=r,
        )
        self.history_resends = Counter(
            "specsplit_history_resends",
            "Full histories re-sent to a worker that lost a session (NOT_FOUND)",
            ["role"],
            registry=r,
        )
        self.failovers = Counter(
            "specsplit_failovers",
            "Sessions moved to another worker because theirs failed",
            ["role"],
            registry=r,
        )
        self.hung_calls = Counter(
            "specsplit_hung_calls",
            "Worker calls cancelled past their hang bound (each one also a failover)",
            ["role"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "specsplit_worker_restarts",
            "Worker processes `specsplit serve` started again after they exited",
            ["role"],
            registry=r,
        )

        self.start_at_zero()

    def start_at_zero(self) -> None:
        """Creates the series of every known label value at 0, as Prometheus advises: `rate()`
        then sees the first failover or 5xx, and queries need no `or vector(0)`."""
        for endpoint in ENDPOINTS.values():
            for status in GENERATION_STATUSES if endpoint in GENERATION_ENDPOINTS else ("200",):
                self.requests.labels(endpoint, status)
        for endpoint in GENERATION_ENDPOINTS:
            self.e2e_latency.labels(endpoint)
        for parts in HYBRID_PARTS:
            self.hybrid_rounds.labels(parts)
        for position in range(MAX_POSITION + 1):
            self.accepted_per_position.labels(position=str(position))
        for role in ROLES:
            self.history_resends.labels(role)
            self.prefix_routed.labels(role)
            self.failovers.labels(role)
            self.hung_calls.labels(role)
            self.worker_restarts.labels(role)

    def observe_round(
        self, drafted: int, accepted: int, degraded: bool, prefix_hit: int, steps: int = 1
    ) -> None:
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self.verify_steps.inc(steps)
        for position in range(min(accepted, MAX_POSITION + 1)):
            self.accepted_per_position.labels(position=str(position)).inc()
        if degraded:
            self.degraded_rounds.inc()
        if prefix_hit > 0:
            self.prefix_cache_hits.inc()
            self.prefix_cache_hit_tokens.inc(prefix_hit)

    def observe_round_cost(self, address: str, cost: RoundCost) -> None:
        """A target's round cost, as the adaptive trees read it."""
        seconds = (cost.fixed_s, cost.token_s, cost.outside_s, cost.beside_s)
        parts = zip(COST_PARTS, seconds, strict=True)
        for part, value in parts:
            self.target_round_cost.labels(address, part).set(value)

    def observe_epochs(self, address: str, epochs: Epochs, load: int) -> None:
        """A target's epochs: the running one's kind, both kinds' rates at its load."""
        if epochs.running is not None:
            self.target_drafting.labels(address).set(1 if epochs.running.drafting else 0)
        rates = epochs.rates(load)
        if rates is None:
            return
        for kind in EPOCH_KINDS:
            rate = rates.of(kind == "drafting")
            if rate.epochs:
                self.target_epoch_rate.labels(address, kind).set(rate.mean)

    def forget_target(self, address: str) -> None:
        """A target that left the pool: its round cost and its epochs."""
        for part in COST_PARTS:
            with contextlib.suppress(KeyError):
                self.target_round_cost.remove(address, part)
        for kind in EPOCH_KINDS:
            with contextlib.suppress(KeyError):
                self.target_epoch_rate.remove(address, kind)
        with contextlib.suppress(KeyError):
            self.target_drafting.remove(address)

    def observe_hybrid(self, ngram_nodes: int, model_nodes: int) -> None:
        """A hybrid round's tree: its nodes from the n-gram part and those the model added."""
        parts = "both" if ngram_nodes and model_nodes else "ngram" if ngram_nodes else "model"
        self.hybrid_rounds.labels(parts).inc()
