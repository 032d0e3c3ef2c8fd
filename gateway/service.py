"""The gateway's shared state and what each endpoint does with it.

`Gateway.start` loads the target's tokenizer, builds the worker pools and
starts watching them; the route handlers call one method each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from gateway.admission import Admissions
from gateway.control import control
from gateway.errors import APIError, bad_request
from gateway.generation import GenerationRequest, Generator, Record
from gateway.metrics import Metrics
from gateway.pool import Pool, Router, split_addresses
from gateway.prompts import chat_prompt, completion_prompts, generation_request
from gateway.responses import Format, sse
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.text import TokenText
from workers.loop.inprocess import InProcessFactory, local_ngram_draft
from workers.protocol import BackendFactory

log = logging.getLogger("specsplit.gateway")

DISCONNECT_POLL_S = 0.25
DRAIN_POLL_S = 0.05
ACCEPTANCE_HEADER = "x-specsplit-acceptance"  # "exact", or the lossy rule that made the text
CUT_GRACE_S = 3.0  # after the drain timed out: for those still generating to send the 503


def load_target_tokenizer(model: str):
    from workers.engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model))


@dataclass
class Gateway:
    settings: GatewaySettings
    tokenizer: object
    router: Router
    metrics: Metrics
    generator: Generator
    started: int
    token_text: TokenText = field(init=False)
    admissions: Admissions = field(init=False)

    def __post_init__(self):
        self.token_text = TokenText(self.tokenizer)  # reads tokenizer.json once, not per request
        s = self.settings
        self.admissions = Admissions(self.router, self.metrics, s.max_waiting, s.max_queue_wait_s)

    @classmethod
    async def start(
        cls, settings: GatewaySettings, factory: BackendFactory, metrics: Metrics
    ) -> Gateway:
        from workers.engine.loader import tokenizer_fingerprint

        tokenizer = await asyncio.to_thread(load_target_tokenizer, settings.target_model)
        fingerprint = tokenizer_fingerprint(tokenizer)

        options = settings.loop_options

        def pool(role, addresses, make=factory) -> Pool:
            return Pool(
                role,
                addresses,
                make,
                metrics,
                fingerprint,
                settings.health_interval_s,
                settings.dns_refresh_s,
                adaptive=options.adaptive if role == "target" else None,
            )

        targets = pool("target", split_addresses(settings.target_addresses))
        if not targets.addresses:
            raise ValueError("no target workers: set --target-addresses")
        # the gateway's own n-gram drafter: the default draft, and there for requests that
        # ask for "ngram" when the drafts are workers or off by default; it alone reads the
        # suffix cache
        suffixes = settings.suffix_cache()
        local = local_ngram_draft(
            max(2 * settings.max_sessions, 64), suffixes, settings.ngram_min_match
        )
        ngram = pool("draft", [local.address], InProcessFactory([local]))
        drafts = ngram if settings.local_draft == "ngram" else None
        if settings.draft_addresses:
            drafts = pool("draft", split_addresses(settings.draft_addresses))
        router = Router(
            targets,
            drafts,
            metrics,
            settings.max_sessions,
            settings.affinity_entries,
            settings.prefix_routing_slack,
            retry_after_s=max(1, round(settings.health_interval_s)),
            ngram=ngram if drafts is not ngram else None,
        )
        await asyncio.gather(*(p.start() for p in router.pools()))
        generator = Generator(router, tokenizer, metrics, options, suffixes)
        return cls(settings, tokenizer, router, metrics, generator, int(time.time()))

    async def close(self) -> None:
        await self.router.drain()
        for p in self.router.pools():
            await p.close()

    # --- endpoints ----------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [self.model(self.settings.model_name)]}

    def model(self, name: str) -> dict:
        self.check_model(name)
        return {"id": name, "object": "model", "created": self.started, "owned_by": "specsplit"}

    def health(self) -> JSONResponse:
        """200 when a target and a draft serve (or the draft is in-gateway or off); counts only."""
        router = self.router
        pools = {"targets": router.targets, "drafts": router.drafts}
        counts = {
            role: {"serving": len(p.serving()), "configured": len(p.workers)}
            for role, p in pools.items()
            if p is not None
        }
        healthy = router.healthy() and not router.draining
        status = "draining" if router.draining else "ok" if healthy else "unavailable"
        return JSONResponse({"status": status, **counts}, status_code=200 if healthy else 503)

    async def drain(self, timeout_s: float, cut: asyncio.Event) -> bool:
        """What SIGTERM does first: readiness and new requests get 503 while the requests
        in flight finish, for up to `timeout_s` or until `cut`. Those still generating then
        end with a 503 shutting_down (a final SSE error event when streaming), given
        CUT_GRACE_S to send it. True when none was cut."""
        self.router.draining = True
        self.admissions.wake()  # the requests still waiting get the 503 now
        await self.wait_idle(timeout_s, cut)
        if not self.router.live:
            return True
        log.warning("drain timed out with %d choices still generating", self.router.live)
        if not cut.is_set():
            self.router.cut = True  # each ends with the 503 after its current round
            await self.wait_idle(CUT_GRACE_S, cut)
        return False

    async def wait_idle(self, timeout_s: float, cut: asyncio.Event) -> None:
        deadline = time.monotonic() + timeout_s
        while self.router.live > 0 and time.monotonic() < deadline and not cut.is_set():
            await asyncio.sleep(DRAIN_POLL_S)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        body.refuse_unsupported()
        prompt = chat_prompt(self.tokenizer, body)
        plan = self.plan(body, [prompt], request)
        return await self.respond(plan, self.format(body, plan), "chat", body.stream, request)

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        body.refuse_unsupported()
        prompts = completion_prompts(self.tokenizer, body.prompt, len(self.tokenizer))
        plan = self.plan(body, prompts, request)
        echo = None
        if body.echo:
            echo = [self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
            if isinstance(body.prompt, str):
                echo = [body.prompt]
        fmt = self.format(body, plan, echo)
        return await self.respond(plan, fmt, "completions", body.stream, request)

    # --- helpers -----------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(
                404,
                f"the model `{model}` does not exist; this server serves "
                f"`{self.settings.model_name}`",
                "model",
                "model_not_found",
            )

    def stop_ids(self, body) -> frozenset[int]:
        """The tokens that end a choice: the model's end tokens (none with ignore_eos) and the
        request's stop_token_ids."""
        ids = set(body.stop_token_ids or ())
        if any(token >= len(self.tokenizer) for token in ids):
            raise bad_request("`stop_token_ids` holds an id past the vocabulary", "stop_token_ids")
        if not body.ignore_eos:
            ids |= self.router.eos_token_ids()
            if getattr(self.tokenizer, "eos_token_id", None) is not None:
                ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def format(self, body, plan: GenerationRequest, echo: list[str] | None = None) -> Format:
        """How a chat (no echo) or completion response is written."""
        return Format(
            chat=isinstance(body, ChatCompletionRequest),
            model=body.model,
            tokens=self.token_text,
            choices=plan.choices,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            speculation_stats=body.speculation_stats,
            speculation=plan.control.stats(),
            num_logprobs=plan.num_logprobs,
            echo=echo,
            n=plan.n,
        )

    def plan(self, body, prompts: list[list[int]], request: Request) -> GenerationRequest:
        context = self.router.context_length() or getattr(self.tokenizer, "model_max_length", 2048)
        tenant = getattr(request.state, "tenant", "")
        conversation = request.headers.get("x-session-id") or body.prompt_cache_key or body.user
        # a conversation is its key's own: another key naming it shares no worker session
        affinity = None if conversation is None else f"{tenant}/{conversation}"
        s = self.settings
        pools = self.router.draft_pools()
        default = next((m for m, p in pools.items() if p is self.router.drafts), "off")
        spec = control(body.speculation, s.tree_spec, default, set(pools), s.allow_lossy)
        salt = s.cache_salt(tenant, body.cache_salt)
        if body.seed is not None and body.temperature != 0:
            tenant = None  # a seeded sample drafts from itself only: same seed, same text
        return generation_request(
            body, prompts, s, context, self.stop_ids(body), affinity, spec, tenant, salt
        )

    async def respond(
        self, plan: GenerationRequest, fmt: Format, endpoint: str, stream: bool, request: Request
    ):
        # waits in line before any response starts: a refused stream still gets a real 429
        admission = await until_disconnected(request, self.admissions.admit(plan.choices))
        record = Record(endpoint, getattr(request.state, "arrived", None) or time.perf_counter())
        deltas = self.generator.generate(plan, record, admission)
        headers = {ACCEPTANCE_HEADER: plan.control.acceptance.describe()}
        if stream:
            return EventSourceResponse(
                sse(fmt.chunks(deltas, record)),
                sep="\n",
                headers=headers,
                background=BackgroundTask(admission.arelease),
            )
        try:
            body = await until_disconnected(request, fmt.collect(deltas, record))
            return JSONResponse(body, headers=headers)
        finally:
            admission.release()


async def until_disconnected(request: Request, work: Awaitable):
    """Awaits `work`; cancels it and answers 499 when the client goes away (vLLM's
    disconnect watcher)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                if not task.cancel():  # it finished meanwhile: its result is the caller's
                    return task.result()
                log.info("client disconnected; request cancelled")
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client closed the request", None, "client_closed")
    finally:
        if not task.done():
            task.cancel()
