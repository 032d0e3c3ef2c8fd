"""Deltas to OpenAI response bodies: stream chunks or one collected response.

A `Format` turns the one delta stream into the shapes of one endpoint:
`chunks` for streaming (a chat stream opens each choice with the role delta
and closes it with the finish reason; usage and speculation stats come last),
`collect` for a non-streaming response (the same deltas, joined per choice).
`sse` frames chunks as server-sent events, ending with `data: [DONE]`, or
with an error event in the OpenAI error shape when generation fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.generation import Delta, Record
from gateway.text import TokenText
from workers.protocol import TokenLogprob

log = logging.getLogger("specsplit.gateway")


@dataclass
class Choice:
    """A choice being collected from its deltas."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Format:
    """How one request's deltas become OpenAI objects."""

    chat: bool  # /v1/chat/completions, else /v1/completions
    model: str
    tokens: TokenText  # the gateway's, shared by every request
    choices: int
    include_usage: bool = False
    speculation_stats: bool = False  # asked for; a lossy response carries them regardless
    speculation: dict = field(default_factory=dict)  # the request's Control.stats()
    num_logprobs: int = -1
    echo: list[str] | None = None  # per prompt: its text, prepended to its choices (completions)
    n: int = 1
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def head(self, **fields) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            **fields,
        }

    def chunk(self, **fields) -> dict:
        return self.head(
            **fields, object="chat.completion.chunk" if self.chat else "text_completion"
        )

    @property
    def reports_speculation(self) -> bool:
        """Asked for, or lossy: a lossy response always says so."""
        return self.speculation_stats or self.speculation.get("lossless") is False

    def stats(self, record: Record) -> dict:
        return {**record.counters.as_dict(), **self.speculation}

    def token_text(self, token: int) -> str:
        return self.tokens(token)[0]

    # --- logprobs ---------------------------------------------------------

    def logprobs(self, delta: Delta | Choice, base_offset: int = 0) -> dict | None:
        if self.num_logprobs < 0:
            return None
        if self.chat:
            return {"content": [self.chat_logprob(lp) for lp in delta.logprobs]}
        return {
            "tokens": [self.token_text(lp.token) for lp in delta.logprobs],
            "token_logprobs": [lp.logprob for lp in delta.logprobs],
            # the chosen token's too, as OpenAI's: up to logprobs + 1 entries
            "top_logprobs": [
                {
                    **{self.token_text(t): p for t, p in lp.top},
                    self.token_text(lp.token): lp.logprob,
                }
                for lp in delta.logprobs
            ],
            "text_offset": [base_offset + o for o in delta.offsets],
        }

    def chat_logprob(self, lp: TokenLogprob) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text, data = self.tokens(token)
            return {"token": text, "logprob": logprob, "bytes": data}

        return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}

    # --- streaming --------------------------------------------------------

    async def chunks(self, deltas: AsyncIterator[Delta], record: Record) -> AsyncIterator[dict]:
        usage = {"usage": None} if self.include_usage else {}
        started: set[int] = set()
        if self.chat:
            for i in range(self.choices):
                started.add(i)
                opening = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                }
                yield self.chunk(choices=[{**opening, "finish_reason": None}], **usage)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                echo = self.echo[delta.index // self.n] if self.echo is not None else ""
                if echo and delta.index not in started:  # the prompt opens its choices' text
                    started.add(delta.index)
                    delta.text = echo + delta.text
                carries_logprobs = bool(delta.tokens) and self.num_logprobs >= 0
                ends_completion = not self.chat and delta.finish_reason is not None
                # where the tokens came from (opt-in): on the chunk with their text, else
                # on the chat's closing chunk (tokens with no text of their own, such as eos)
                origins = {"specsplit": delta.provenance} if delta.provenance else {}
                if delta.text or carries_logprobs or ends_completion:
                    choice = self.stream_choice(delta, len(echo))
                    yield self.chunk(choices=[choice], **usage, **origins)
                    origins = {}
                if delta.finish_reason is not None and self.chat:
                    closing = {"index": delta.index, "delta": {}, "logprobs": None}
                    yield self.chunk(
                        choices=[{**closing, "finish_reason": delta.finish_reason}],
                        **usage,
                        **origins,
                    )
        tail = {}
        if self.include_usage:
            tail["usage"] = record.usage
        if self.reports_speculation:
            tail["speculation_stats"] = self.stats(record)
        if tail:
            yield self.chunk(choices=[], **tail)

    def stream_choice(self, delta: Delta, offset: int) -> dict:
        finish = None if self.chat else delta.finish_reason
        logprobs = self.logprobs(delta, offset)
        if self.chat:
            return {
                "index": delta.index,
                "delta": {"content": delta.text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        return {
            "index": delta.index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    # --- one response -----------------------------------------------------

    async def collect(self, deltas: AsyncIterator[Delta], record: Record) -> dict:
        choices = [Choice() for _ in range(self.choices)]
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                c = choices[delta.index]
                c.offsets += delta.offsets
                c.text += delta.text
                c.tokens += delta.tokens
                c.logprobs += delta.logprobs
                c.finish_reason = delta.finish_reason or c.finish_reason
        body = self.head(
            choices=[self.full_choice(i, c) for i, c in enumerate(choices)], usage=record.usage
        )
        if self.reports_speculation:
            body["speculation_stats"] = self.stats(record)
        return body

    def full_choice(self, index: int, c: Choice) -> dict:
        finish = c.finish_reason or "length"
        if self.chat:
            message = {"role": "assistant", "content": c.text}
            return {
                "index": index,
                "message": message,
                "logprobs": self.logprobs(c),
                "finish_reason": finish,
            }
        echo = self.echo[index // self.n] if self.echo is not None else ""
        return {
            "index": index,
            "text": echo + c.text,
            "logprobs": self.logprobs(c, len(echo)),
            "finish_reason": finish,
        }


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Server-sent events of the chunks, then [DONE]; a failure ends with an error event."""
    try:
        async for chunk in chunks:
            yield {"data": json.dumps(chunk, ensure_ascii=False)}
    except APIError as error:
        yield {"data": json.dumps(error.body)}
        return
    except Exception as error:  # noqa: BLE001 - the stream already started: report, close
        log.exception("generation failed mid-stream")
        body = APIError(500, f"generation failed: {type(error).__name__}: {error}").body
        yield {"data": json.dumps(body)}
        return
    yield {"data": "[DONE]"}
