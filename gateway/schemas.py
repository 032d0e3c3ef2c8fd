"""OpenAI request bodies, as strict pydantic models.

Unknown fields are refused (400 naming the field), and so are known OpenAI
features this server does not build (tools, response_format, ...) and
penalties, which would change the target's distribution and so break
lossless speculation: a request never gets something other than what it
asked for without being told.
"""

from __future__ import annotations

from types import NoneType
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from gateway.errors import APIError, unsupported

NonNegInt = Annotated[int, Field(ge=0)]


def null_means_default(field: FieldInfo) -> bool:
    """An optional field whose type has no null: a null sent for it stands for its default."""
    return not field.is_required() and NoneType not in get_args(field.annotation)


def optional_fields_nullable(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The JSON schema (OpenAPI's too) says what `Strict` accepts: null for such fields."""
    properties = schema.get("properties", {})
    for name, field in model.model_fields.items():
        if name in properties and null_means_default(field):
            value = properties[name]
            kept = {k: value.pop(k) for k in ("title", "default") if k in value}
            properties[name] = {"anyOf": [value, {"type": "null"}], **kept}


class Strict(BaseModel):
    # no coercion either: `false` is not a token id, nor `0.0` a boolean, nor "5" a count
    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra=optional_fields_nullable
    )

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data: Any) -> Any:
        """An explicit null for an optional field means its default, as in OpenAI's API
        (whose SDK sends null for an argument given as None): `"n": null` is n = 1."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or not null_means_default(fields[key])
        }


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
    """One message. An assistant message as a response carries it (the SDK's
    `message.model_dump()`) is taken back: its tool, audio and refusal fields only when
    empty, as this server calls no tools; its annotations (citations) are not part of
    the prompt."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None  # required but for an assistant's
    name: str | None = None  # accepted; chat templates have no place for it
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None
    tool_call_id: str | None = None

    def unbuilt(self) -> tuple[str, ...]:
        return ("refusal", "tool_calls", "function_call", "audio", "tool_call_id")


class SamplingFields(Strict):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None = 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extra body; 0 or -1 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extra body (vLLM's); 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the affinity key when no X-Session-ID is sent: prompt_cache_key, else user
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None  # accepted; changes nothing here
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM's; only 1 (none) is served
    ignore_eos: bool = False  # vLLM's: generate past the end-of-sequence token
    stop_token_ids: list[NonNegInt] | None = None  # vLLM's: more tokens that end a choice
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps what stopped it
    skip_special_tokens: bool = True  # vLLM's: false, special tokens' text is in the text
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
        for name, neutral in (
            ("presence_penalty", 0),
            ("frequency_penalty", 0),
            ("repetition_penalty", 1),
        ):
            if getattr(self, name) not in (None, neutral):
                raise APIError(
                    400,
                    f"`{name}` must be {neutral}: penalties change the target distribution, "
                    "and this server decodes losslessly",
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
    # vLLM's: open an assistant turn after the messages, or continue the last (assistant)
    # message as it stands, its text the start of the reply
    add_generation_prompt: bool = True
    continue_final_message: bool = False
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
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                400,
                "`continue_final_message` needs add_generation_prompt=false",
                "continue_final_message",
            )

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
