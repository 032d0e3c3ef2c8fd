"""OpenAI request bodies, as strict pydantic models.

Unknown fields are refused (400 naming the field), and so are known OpenAI
features this server does not build (tools, response_format, ...) and
penalties, which would change the target's distribution and so break
lossless speculation: a request never gets something other than what it
asked for without being told.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import APIError, unsupported

NonNegInt = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    # no coercion either: `false` is not a token id, nor `0.0` a boolean, nor "5" a count
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False  # one last chunk with the usage, `choices` empty
    include_provenance: bool = False  # extension: where each token came from (`specsplit`)


class SpeculationRequest(Strict):
    """The `speculation` extra-body field: how this request speculates (all optional).

    `method`: "auto" (the deployment's draft), "off" (the target alone), "ngram" (the
    n-gram drafter) or "draft" (a draft model); a method the deployment lacks is a 400.
    `max_depth` / `max_nodes` cap the server's tree (--tree-depth / --tree-budget).
    `acceptance`: "exact" (lossless, the default), or a lossy rule the server must allow
    (--allow-lossy): "threshold" accepts a draft token the target gives at least
    `threshold`; "typical" (Medusa) one with p > min(`epsilon`, `delta` * exp(-entropy)).
    """

    method: Literal["auto", "off", "ngram", "draft"] = "auto"
    max_depth: int | None = Field(None, ge=0, le=64)  # most draft tokens along one path
    max_nodes: int | None = Field(None, ge=0, le=1024)  # most draft tree nodes per round
    acceptance: Literal["exact", "threshold", "typical"] = "exact"
    threshold: float | None = Field(None, gt=0.0, le=1.0)  # "threshold": least p_target
    epsilon: float | None = Field(None, gt=0.0, le=1.0)  # "typical": the probability cap
    delta: float | None = Field(None, gt=0.0, le=1.0)  # "typical": the entropy scale

    def refuse_unsupported(self) -> None:
        """Each rule's parameters only with that rule."""
        owners = {"threshold": "threshold", "epsilon": "typical", "delta": "typical"}
        for name, rule in owners.items():
            if getattr(self, name) is not None and self.acceptance != rule:
                raise APIError(
                    400,
                    f'`speculation.{name}` belongs to acceptance "{rule}", not "{self.acceptance}"',
                    f"speculation.{name}",
                )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other part types are refused by name later

    type: str  # only "text" is served
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted; chat templates have no place for it


class SamplingFields(Strict):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None = 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extra body; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # also the affinity key when no X-Session-ID is sent
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    speculation_stats: bool = False  # extra body: this request's speculation counters
    speculation: SpeculationRequest | None = None  # extra body: how this request speculates
    # extra body (vLLM's): cached prompt prefixes are shared only with the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # known OpenAI parameters that this server does not build: refused when set
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(
                    400,
                    f"`{name}` must be 0: penalties change the target distribution, and this "
                    "server decodes losslessly",
                    name,
                    "unsupported_parameter",
                )
        for name in self.unbuilt():
            value = getattr(self, name)
            if value not in (None, False, {}, [], "auto", "none", "default"):
                raise unsupported(name)
        if self.speculation is not None:
            self.speculation.refuse_unsupported()
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "`stream_options` is only allowed with stream=true", "stream_options"
            )

    def unbuilt(self) -> tuple[str, ...]:
        return ("logit_bias", "metadata", "store", "service_tier")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None

    def unbuilt(self) -> tuple[str, ...]:
        return (
            *super().unbuilt(),
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "functions",
            "function_call",
            "audio",
            "prediction",
            "reasoning_effort",
            "web_search_options",
        )

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.response_format and self.response_format.get("type") != "text":
            raise unsupported("response_format")
        if self.modalities and self.modalities != ["text"]:
            raise unsupported("modalities", 'other than ["text"] is not supported')
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs logprobs=true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int:
        """-1: none; k >= 0: each token's logprob and the k most likely alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else -1


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "other than n is not supported")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "with logprobs is not supported (no prompt logprobs)")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs
