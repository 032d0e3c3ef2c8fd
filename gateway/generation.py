"""From a checked request to a stream of text deltas: the one generator.

`generate` runs every choice of a request (each prompt times n) and yields
`Delta`s as rounds are verified: for each choice, the text its round
completes (held back at incomplete characters and possible stop-string
starts), the tokens behind it, and at the end its finish reason. Streaming
responses format each delta as it comes; non-streaming ones collect them.
Usage and speculation stats accumulate in a `Record` as the stream runs.
With `provenance`, each delta also says where its tokens came from
(gateway.provenance).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from gateway.adaptive import AdaptiveConfig, RatesByMatch
from gateway.control import Control
from gateway.metrics import Metrics
from gateway.pool import Admission, Router, shutting_down
from gateway.provenance import Provenance
from gateway.speculation import LoopOptions, Speculation
from gateway.text import Piece, TextStream
from workers.draft.suffix import SuffixCache
from workers.loop import Counters, Plan
from workers.protocol import TokenLogprob
from workers.speculation.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """A request as the loop sees it: token prompts and checked parameters."""

    prompts: list[list[int]]  # one per prompt; each runs n choices
    n: int
    max_tokens: list[int]  # per prompt (bounded by the context left after it)
    params: SamplingParams
    stop: list[str]
    control: Control  # how it speculates: method, largest tree, acceptance rule
    stop_ids: frozenset[int]
    num_logprobs: int = -1
    affinity: str | None = None
    provenance: bool = False  # each delta says where its tokens came from
    tenant: str | None = ""  # a hash of the request's API key ('' = none): its suffix cache;
    # None: this request neither reads nor feeds it (a seeded sample)
    cache_salt: str = ""  # its workers share KV prefixes only with the same salt ('' = all)
    include_stop: bool = False  # the text keeps the stop string or token that ended it
    skip_special_tokens: bool = True  # special tokens (an end token, a template's) make no text

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def plan(self, index: int) -> Plan:
        """Choice `index` = prompt index * n + j; seeded choices get seeds seed + index."""
        prompt = index // self.n
        params = self.params
        if params.seed is not None and index > 0:
            params = replace(params, seed=params.seed + index)
        return Plan(
            self.prompts[prompt],
            self.max_tokens[prompt],
            params,
            self.control.spec,
            self.stop_ids,
            self.num_logprobs,
            self.control.acceptance,
            self.tenant,
            self.cache_salt,
        )


@dataclass
class Delta:
    index: int  # choice index
    text: str = ""
    tokens: list[int] = field(default_factory=list)  # tokens whose text this delta completes
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each token's text starts
    finish_reason: str | None = None
    provenance: dict | None = None  # the stream's `specsplit` extension, when asked for


@dataclass
class Record:
    """What a request used and produced, filled in while it streams."""

    endpoint: str
    arrived: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counters: Counters = field(default_factory=Counters)
    first_token_at: float | None = None

    @property
    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class Generator:
    """The loop's collaborators, shared by every request."""

    router: Router
    tokenizer: object
    metrics: Metrics
    options: LoopOptions = LoopOptions()  # how trees are made (adaptive, overlapped, hybrid)
    suffixes: SuffixCache | None = None  # each choice's output goes here for later drafts
    recent: RatesByMatch = field(init=False)  # acceptance over every session's recent rounds

    def __post_init__(self):
        self.recent = RatesByMatch.prior(self.options.adaptive or AdaptiveConfig())

    async def generate(
        self, request: GenerationRequest, record: Record, admission: Admission
    ) -> AsyncIterator[Delta]:
        """Every choice of the request, interleaved as their rounds complete."""
        try:
            record.prompt_tokens = sum(len(p) for p in request.prompts)
            self.metrics.prompt_tokens.inc(record.prompt_tokens)
            choices = [self.choice(i, request, record) for i in range(request.choices)]
            async for delta in merge(choices):
                yield delta
        finally:
            admission.release()
            self.observe(record)

    async def choice(
        self, index: int, request: GenerationRequest, record: Record
    ) -> AsyncIterator[Delta]:
        speculation = Speculation(
            self.router,
            request.plan(index),
            self.metrics,
            request.affinity,
            index,
            self.options,
            self.recent,
            request.control.method,
            self.suffixes,
        )
        text = TextStream(
            self.tokenizer, request.stop, request.include_stop, request.skip_special_tokens
        )
        origins = Provenance() if request.provenance else None
        last_round: float | None = None
        try:
            async with contextlib.aclosing(speculation.rounds()) as rounds:
                async for round_ in rounds:
                    now = time.perf_counter()
                    if record.first_token_at is None:
                        record.first_token_at = now
                        self.metrics.time_to_first_token.observe(now - record.arrived)
                    if last_round is not None and round_.tokens:
                        self.metrics.inter_token_latency.observe(
                            (now - last_round) / len(round_.tokens)
                        )
                    last_round = now
                    if origins is not None:
                        origins.add(round_, speculation.drafter)
                    ended_on_token = round_.finish_reason == "stop" and not request.include_stop
                    piece = text.push(round_.tokens, round_.logprobs, ended_on_token)
                    finish = "stop" if text.stopped else round_.finish_reason
                    if finish is not None:
                        piece = joined(piece, text.finish())
                    if piece or finish is not None:
                        yield Delta(
                            index,
                            piece.text,
                            piece.tokens,
                            piece.logprobs,
                            piece.offsets,
                            finish,
                            origins.take(piece) if origins is not None else None,
                        )
                    if finish is not None:
                        break
                    if self.router.cut:
                        raise shutting_down(self.router.retry_after_s)
        finally:
            self.leave_choice(speculation, text, record)

    def leave_choice(self, speculation: Speculation, text: TextStream, record: Record) -> None:
        plan = speculation.state.plan
        if self.suffixes is not None and plan.tenant is not None:
            output = speculation.history[len(plan.prompt) :]
            self.suffixes.add(plan.tenant, plan.prompt, output)
        record.completion_tokens += len(text.tokens)
        record.counters.add(speculation.counters)
        self.metrics.generation_tokens.inc(len(text.tokens))

    def observe(self, record: Record) -> None:
        self.metrics.e2e_latency.labels(record.endpoint).observe(
            time.perf_counter() - record.arrived
        )
        if record.counters.draft_tokens:
            c = record.counters
            self.metrics.acceptance_rate.observe(c.accepted_tokens / c.draft_tokens)


def joined(a: Piece, b: Piece) -> Piece:
    return Piece(
        a.text + b.text,
        a.tokens + b.tokens,
        a.logprobs + b.logprobs,
        a.offsets + b.offsets,
        a.spans + b.spans,
    )


async def merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Items of several async generators as they come; closes all of them on exit."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put(item)
        except Exception as error:  # noqa: BLE001 - re-raised by the consumer
            await queue.put(error)
        await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
