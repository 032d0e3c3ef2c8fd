"""Settings of the gateway (`specsplit gateway`), built once and passed down.

`GatewayOptions` holds what both `specsplit gateway` and `specsplit serve`
accept; `GatewaySettings` adds where the workers are. Every field is a flag
(`--max-sessions`) and an environment variable (`SPECSPLIT_MAX_SESSIONS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from gateway.adaptive import AdaptiveConfig
from gateway.speculation import LoopOptions
from workers.draft.ngram import MIN_MATCH
from workers.draft.suffix import SuffixCache, SuffixCacheConfig
from workers.protocol import TreeSpec
from workers.rpc.security import ClientSecurity, read, read_token
from workers.settings import EMBEDDED_MODEL, settings_config
from workers.speculation.ngram import MAX_NGRAM


class GatewayOptions(BaseSettings):
    model_config = settings_config("gateway")

    target_model: str = Field(
        EMBEDDED_MODEL,
        description="the targets' model (alias, directory, .gguf, HF id): tokenizer and model name",
    )
    served_model_name: str = Field("", description="the name clients use; '' = --target-model")
    api_keys: str = Field("", description="comma list of accepted Bearer keys; '' = no auth")
    max_sessions: int = Field(64, ge=1, description="choices generated at once (more: queued)")
    max_waiting: int = Field(
        256, ge=0, description="requests that may wait for a session (more: 429); 0 = no queue"
    )
    max_queue_wait_s: float = Field(
        300.0, gt=0, description="longest a request waits for a session before 429"
    )
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask")
    max_n: int = Field(8, ge=1, description="largest n (choices per prompt)")
    max_prompts: int = Field(16, ge=1, description="most prompts in one /v1/completions batch")
    max_body_bytes: int = Field(4_000_000, ge=1024, description="largest request body")
    tree_depth: int = Field(6, ge=0, description="most draft tokens along one path")
    tree_branching: int = Field(2, ge=1, description="children per expanded node; 1 = chain")
    tree_budget: int = Field(16, ge=0, description="most draft tree nodes per round")
    ngram_min_match: int = Field(
        MIN_MATCH,
        ge=1,
        le=MAX_NGRAM,
        description="shortest suffix (tokens) the in-gateway n-gram draft copies after "
        "(vLLM's prompt_lookup_min); 2 or 3 drafts less often and more surely: faster on "
        "open-ended chat at a few streams, slower on text that copies its prompt",
    )
    adaptive_tree: bool = Field(
        True,
        description="size each round's tree (within depth and budget) to the session's recent "
        "acceptance, the target's live sessions and its measured round cost, down to no "
        "speculation where it does not pay; false = always the full tree",
    )
    adaptive_knee_tokens: float = Field(
        32.0,
        ge=0,
        description="a target round's fixed cost in tokens fed (a / b of its cost a + b*n) "
        "assumed until its rounds are measured, and the ratio the online fit is pulled towards",
    )
    adaptive_epoch_s: float = Field(
        2.0,
        gt=0,
        description="seconds of a target's drafting or plain epoch: its sessions draft in turns "
        "of epochs, the kind whose rounds measure more tokens a second most of the time "
        "(gateway/epochs.py)",
    )
    decode_steps: int = Field(
        4,
        ge=1,
        le=64,
        description="a round that drafts nothing (speculation off, a draft that does not pay "
        "or is down) has the target decode up to this many tokens in a row before it answers, "
        "so its next forward does not wait for the session's round trip (vLLM's multi-step "
        "scheduling); streamed that many at a time; not the first token, nor in a seeded "
        "sampled request that drafts, nor while a session's drafts would pay against such "
        "rounds and one was accepted in the last twice this many tokens; 1 = a token a round",
    )
    decode_lookup: int = Field(
        3,
        ge=0,
        le=16,
        description="each of a speculating round's decode steps (greedy, or sampled without a "
        "seed) also verifies up to this many tokens the target worker drafts itself by "
        "prompt lookup over the session's history (its latest 3-token matches), in the same "
        "forward, in the target's drafting epochs: what the gateway's own drafts would cost "
        "a round trip; 0 = none",
    )
    allow_lossy: bool = Field(
        False,
        description="serve requests that opt into a lossy acceptance rule (speculation."
        "acceptance threshold or typical); off: such a request gets a 400",
    )
    overlap_draft: bool = Field(
        False, description="draft the next round's tree while the target verifies this one"
    )
    hybrid_draft: bool = Field(
        False,
        description="with model or feature draft workers, merge the gateway's n-gram draft "
        "(prompt lookup and the suffix cache) into each round's tree, so one verify checks "
        "both; the draft worker fills only the budget the n-gram tree leaves",
    )
    suffix_cache_tokens: int = Field(
        16_384,
        ge=0,
        description="the in-gateway n-gram draft also copies from the recent outputs of the "
        "same API key's requests: at most this many tokens per key; 0 = off",
    )
    suffix_cache_tenants: int = Field(
        32, ge=1, description="API keys whose outputs the suffix cache holds (least recent out)"
    )
    prefix_cache_scope: Literal["global", "tenant"] = Field(
        "global",
        description="which requests share the workers' cached prompt prefixes: global = all "
        "(a request's cache_salt still sets it apart), tenant = only those of the same API key "
        "(a cache hit is faster, so a shared cache lets one key learn what another sent)",
    )
    health_interval_s: float = Field(2.0, gt=0, description="seconds between worker health checks")
    dns_refresh_s: float = Field(
        30.0, ge=0, description="seconds between re-resolving worker names; 0 = never"
    )
    rpc_timeout_s: float = Field(60.0, gt=0, description="deadline of one propose or verify call")
    worker_streams: bool = Field(
        True,
        description="send each target's Verify calls as messages of one long-lived gRPC stream "
        "(VerifyStream: a message costs about a third of a call); off = one call a round",
    )
    affinity_entries: int = Field(10_000, ge=0, description="conversations remembered for routing")
    prefix_routing_slack: int = Field(
        4,
        ge=0,
        description="a session without a conversation key goes to the worker that got the "
        "longest prefix of its prompt while that one has at most this many live sessions more "
        "than the least loaded; 0 = only when it is as little loaded",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM, seconds the requests in flight get to finish while new ones "
        "get 503",
    )
    log_level: str = Field("info", description="debug, info, warning or error")

    @property
    def tree_spec(self) -> TreeSpec:
        return TreeSpec(self.tree_depth, self.tree_branching, self.tree_budget)

    @property
    def loop_options(self) -> LoopOptions:
        adaptive = None
        if self.adaptive_tree:
            adaptive = AdaptiveConfig(self.adaptive_knee_tokens, epoch_s=self.adaptive_epoch_s)
        return LoopOptions(
            adaptive,
            self.overlap_draft,
            self.hybrid_draft,
            self.ngram_min_match,
            self.decode_steps,
            self.decode_lookup,
        )

    def suffix_cache(self) -> SuffixCache | None:
        """A fresh suffix cache, or None when it is off."""
        if not self.suffix_cache_tokens:
            return None
        return SuffixCache(SuffixCacheConfig(self.suffix_cache_tokens, self.suffix_cache_tenants))

    def cache_salt(self, tenant: str, requested: str | None) -> str:
        """The workers' prefix-cache salt of a request of `tenant` that asked for `requested`."""
        scope = tenant if self.prefix_cache_scope == "tenant" else ""
        return "" if not scope and not requested else f"{scope}\n{requested or ''}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.target_model

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())


class GatewaySettings(GatewayOptions):
    model_config = settings_config("gateway")

    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    target_addresses: str = Field(
        "", description="comma list of target workers, host:port (a DNS name may list many)"
    )
    draft_addresses: str = Field(
        "", description="comma list of draft workers; '' = the draft runs in the gateway"
    )
    local_draft: Literal["ngram", "none"] = Field(
        "ngram", description="in-gateway draft used without --draft-addresses; none = target alone"
    )
    worker_ca: Path | None = Field(None, description="PEM CA that signed the workers' certificates")
    worker_cert: Path | None = Field(
        None, description="PEM client certificate, for workers that require mutual TLS"
    )
    worker_key: Path | None = Field(None, description="its PEM private key")
    worker_token_file: Path | None = Field(None, description="file holding the workers' token")
    worker_tls_name: str = Field(
        "",
        description="the name the workers' certificate is for (they are dialled by IP); '' = "
        "the host as addressed",
    )
    insecure: bool = Field(
        False, description="plaintext to the workers, no token; without it --worker-ca is needed"
    )

    def worker_security(self) -> ClientSecurity | None:
        """TLS and token from the files named, or None (plaintext) only with --insecure."""
        if self.insecure:
            return None
        if self.worker_ca is None:
            raise ValueError(
                "the workers serve TLS: give --worker-ca (and --worker-token-file, --worker-cert, "
                "--worker-key as they require), or --insecure for plaintext"
            )
        return ClientSecurity(
            read(self.worker_ca), read(self.worker_cert), read(self.worker_key),
            read_token(self.worker_token_file), self.worker_tls_name or None,
        )  # fmt: skip
