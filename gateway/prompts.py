"""Requests to token prompts and checked generation parameters.

Chat messages go through the target tokenizer's own chat template; completion
prompts are strings or token ids. Limits (n, max_tokens, the context length)
are checked here, so the loop only ever sees requests it can finish.
"""

from __future__ import annotations

from gateway.control import Control
from gateway.errors import APIError, bad_request, unsupported
from gateway.generation import GenerationRequest
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from gateway.settings import GatewayOptions
from workers.engine.text import encode_chat
from workers.speculation.sampling import SamplingParams


def message_text(message: ChatMessage, index: int) -> str:
    """A message's text; text parts are joined by newlines, as vLLM joins them."""
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise bad_request(
                f"`messages[{index}].content` is required", f"messages[{index}].content"
            )
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if part.type != "text":
            raise unsupported(param, f"of type {part.type!r} is not supported")
        if part.text is None:
            raise bad_request(f"`{param}.text` is required", f"{param}.text")
        texts.append(part.text)
    return "\n".join(texts)


def chat_prompt(tokenizer, request: ChatCompletionRequest) -> list[int]:
    turns = []
    for i, message in enumerate(request.messages):
        if message.role in ("tool", "function"):
            raise unsupported(
                f"messages[{i}].role", f"{message.role!r} is not supported (no tools)"
            )
        for name in message.unbuilt():
            if getattr(message, name) not in (None, []):
                raise unsupported(
                    f"messages[{i}].{name}",
                    "set is not supported (no tools, audio or refusals are served)",
                )
        role = "system" if message.role == "developer" else message.role
        turns.append({"role": role, "content": message_text(message, i)})
    if request.continue_final_message and turns[-1]["role"] != "assistant":
        raise bad_request(
            "`continue_final_message` needs the last message to be the assistant's",
            "continue_final_message",
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("the model has no chat template: use /v1/completions", "messages")
    try:
        return encode_chat(
            tokenizer, turns, request.add_generation_prompt, request.continue_final_message
        )
    except Exception as error:  # templates raise on conversations they do not accept
        raise bad_request(f"the chat template refused the messages: {error}", "messages") from error


def completion_prompts(tokenizer, prompt, vocab_size: int) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("`prompt` must not be empty", "prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(tokenizer(p)["input_ids"])
        else:
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary", f"prompt[{i}]")
            out.append(list(p))
    return out


def sampling_params(request: SamplingFields) -> SamplingParams:
    temperature = 1.0 if request.temperature is None else request.temperature
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    top_p = 1.0 if request.top_p is None else request.top_p
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=request.seed,
        min_p=request.min_p or 0.0,
    )


def stop_strings(request: SamplingFields) -> list[str]:
    stop = request.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16:
        raise bad_request("at most 16 stop strings", "stop")
    return [s for s in stops if s]


def generation_request(
    request: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    options: GatewayOptions,
    context_length: int,
    stop_ids: frozenset[int],
    affinity: str | None,
    control: Control,
    tenant: str | None = "",
    cache_salt: str = "",
) -> GenerationRequest:
    """Checks the request's limits against the server's and the context's."""
    if request.n > options.max_n:
        raise bad_request(f"n must be at most {options.max_n}", "n")
    if len(prompts) > options.max_prompts:
        raise bad_request(f"at most {options.max_prompts} prompts per request", "prompt")
    wanted = request.requested_max_tokens
    param = (
        "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
    )
    if wanted is not None and wanted > options.max_tokens_limit:
        raise bad_request(f"`{param}` must be at most {options.max_tokens_limit}", param)
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    max_tokens = []
    for prompt in prompts:
        if not prompt:
            raise bad_request("the prompt is empty", prompt_param)
        room = context_length - len(prompt)
        if room < 1 or (wanted is not None and wanted > room):
            raise APIError(
                400,
                f"this model's context is {context_length} tokens; the prompt has "
                f"{len(prompt)} and {wanted or 1} more were asked for",
                prompt_param,
                "context_length_exceeded",
            )
        max_tokens.append(wanted if wanted is not None else min(room, options.max_tokens_limit))
    try:
        params = sampling_params(request)
    except ValueError as error:
        raise bad_request(str(error)) from error
    return GenerationRequest(
        prompts=prompts,
        n=request.n,
        max_tokens=max_tokens,
        params=params,
        stop=stop_strings(request),
        control=control,
        stop_ids=stop_ids,
        num_logprobs=request.num_logprobs,
        affinity=affinity,
        provenance=bool(request.stream_options and request.stream_options.include_provenance),
        tenant=tenant,
        cache_salt=cache_salt,
        include_stop=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
    )
