"""What OpenAI SDK and vLLM users send besides the basics, through the real `openai` client:
nulls for the defaults, replies sent back as the SDK dumps them, a model by its id, and
vLLM's `ignore_eos` and `continue_final_message`."""

from __future__ import annotations

import shutil

import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from tests.gateway.helpers import MODEL, WORDS, live, target, word_tokenizer

CHAT = [{"role": "user", "content": "hello world , the cat"}]
PROMPT = "hello world , the cat"


def sdk(gateway) -> OpenAI:
    return OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(tiny_dir) -> OpenAI:
    """The SDK against one target and the in-gateway n-gram draft."""
    with live(tiny_dir, [target(tiny_dir)]) as gateway:
        yield sdk(gateway)


def chat(client: OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, **kw
    )


def test_nulls_stand_for_the_defaults(client):
    """The SDK sends null for an argument given as None; OpenAI's API reads it as the default."""
    reply = chat(client, CHAT, n=None, logprobs=None, extra_body={"speculation_stats": None})
    assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    assert reply.choices[0].message.content == chat(client, CHAT).choices[0].message.content
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=None, n=None, stream=None
    )
    assert len(completion.choices) == 1
    assert not completion.choices[0].text.startswith(PROMPT)


def test_a_reply_goes_back_as_the_sdk_dumps_it(client):
    first = chat(client, CHAT).choices[0].message
    dumped = first.model_dump()
    assert {"refusal", "tool_calls", "annotations", "audio", "function_call"} <= set(dumped)
    follow = {"role": "user", "content": "one two"}
    as_dumped = chat(client, [*CHAT, dumped, follow])
    as_text = chat(client, [*CHAT, {"role": "assistant", "content": first.content}, follow])
    assert as_dumped.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_dumped.choices[0].message.content == as_text.choices[0].message.content


def test_text_parts_are_joined_by_newlines(client):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    by_parts = chat(client, [{"role": "user", "content": parts}])
    by_text = chat(client, [{"role": "user", "content": "hello\nworld"}])
    assert by_parts.usage.prompt_tokens == by_text.usage.prompt_tokens
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content


def test_a_model_by_its_id(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "specsplit")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-17")
    assert info.value.body["code"] == "model_not_found"


def test_continue_final_message_continues_the_assistants_text(client):
    """vLLM's assistant prefill: the reply goes on from the last message's own text."""
    messages = [*CHAT, {"role": "assistant", "content": "one two"}]
    prompt = word_tokenizer().apply_chat_template(
        messages, continue_final_message=True, tokenize=False
    )
    assert prompt.rstrip().endswith("one two")
    reply = chat(
        client,
        messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens == completion.usage.prompt_tokens
    assert reply.choices[0].message.content == completion.choices[0].text
    finished = chat(client, messages)  # without it the assistant's turn is closed, as before
    assert finished.usage.prompt_tokens > reply.usage.prompt_tokens


def greedy_words(model_dir, prompt: str, count: int) -> list[str]:
    """transformers' greedy tokens, end tokens and all, as the word tokenizer spells them."""
    tokenizer = word_tokenizer()
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tokenizer.convert_ids_to_tokens(ids[-count:])


def greedy_choice(client: OpenAI, method: str = "auto", **extra):
    """PROMPT's greedy completion of 12 tokens with its logprobs, `extra` in the body."""
    return client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={**extra, "speculation": {"method": method}},
    ).choices[0]


def test_ignore_eos_goes_on_with_the_targets_own_tokens(client, tiny_dir, tmp_path):
    """vLLM's ignore_eos, through speculation and without it: the target's greedy tokens
    past its end token, up to max_tokens; checked on a target whose end token is a word
    its greedy text reaches early."""
    words = greedy_words(tiny_dir, PROMPT, 12)
    end = next(w for w in words[2:] if w in WORDS)
    path = shutil.copytree(tiny_dir, tmp_path / "ends")
    tokenizer = word_tokenizer()
    tokenizer.eos_token = end
    tokenizer.save_pretrained(path)
    with live(path, [target(path)]) as gateway:
        ends = sdk(gateway)
        stopped = ends.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage.completion_tokens < 12
        for served, method in [(ends, "auto"), (ends, "off"), (client, "auto")]:
            past = greedy_choice(served, method, ignore_eos=True)
            assert past.finish_reason == "length"
            assert past.logprobs.tokens == words


def test_stop_token_ids_end_a_choice_on_the_token(client):
    """vLLM's stop_token_ids: the choice ends with the first of them it generates, which its
    logprobs list and its text leaves out, unless include_stop_str_in_output (vLLM's rule)."""
    words = greedy_choice(client, ignore_eos=True).logprobs.tokens
    stop = next(w for w in words[2:] if w in WORDS)
    token = word_tokenizer().convert_tokens_to_ids(stop)
    for method in ("auto", "off"):
        choice = greedy_choice(client, method, stop_token_ids=[token])
        assert choice.finish_reason == "stop"
        assert choice.logprobs.tokens == words[: words.index(stop) + 1]
        assert choice.text.split() == words[: words.index(stop)]
        kept = greedy_choice(
            client, method, stop_token_ids=[token], include_stop_str_in_output=True
        )
        assert kept.text == f"{choice.text} {stop}"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body={"stop_token_ids": [len(word_tokenizer())]}
        )
    assert info.value.body["param"] == "stop_token_ids"


@pytest.mark.parametrize(("logprobs", "temperature"), [(0, 0), (1, 1.0)])
def test_completion_top_logprobs_hold_the_chosen_token(client, logprobs, temperature):
    """OpenAI's legacy completions: up to logprobs + 1 entries, the chosen token always."""
    choice = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=temperature,
        seed=3,
        logprobs=logprobs,
    ).choices[0]
    lp = choice.logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob)
        assert len(top) <= logprobs + 1


def test_min_p_one_keeps_only_the_likeliest_token(client):
    """vLLM's min_p through HTTP and the workers: at 1 a sampled request keeps only the
    likeliest token at each step, so its text is the greedy text."""
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    for method in ("auto", "off"):
        sampled = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=1.0,
            extra_body={"min_p": 1.0, "speculation": {"method": method}},
        )
        assert sampled.choices[0].text == greedy.choices[0].text


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    """vLLM's include_stop_str_in_output, streamed and not."""
    words = greedy_choice(client, ignore_eos=True).logprobs.tokens
    stop = next(w for w in words[2:] if w in WORDS)
    kept = []
    for include in (False, True):
        body = {
            "stop": [stop],
            "temperature": 0,
            "extra_body": {"include_stop_str_in_output": include},
        }
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **body)
        stream = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, stream=True, **body
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert reply.choices[0].text == streamed
        assert reply.choices[0].finish_reason == "stop"
        kept.append(reply.choices[0].text)
    assert kept[1] == kept[0] + stop
    assert stop not in kept[0]


def test_skip_special_tokens_false_keeps_their_text(client):
    """vLLM's skip_special_tokens: false, a special token's text is in the text, but for the
    end token that ended the choice (unless include_stop_str_in_output)."""
    words = greedy_choice(client, ignore_eos=True).logprobs.tokens
    assert "</s>" in words  # the greedy text reaches the end token within 12 tokens
    skipped = greedy_choice(client, ignore_eos=True)
    kept = greedy_choice(client, ignore_eos=True, skip_special_tokens=False)
    assert "</s>" not in skipped.text and "</s>" in kept.text
    assert kept.text.replace("</s>", "").split() == skipped.text.split()
    ended = greedy_choice(client, skip_special_tokens=False)
    assert ended.finish_reason == "stop" and ended.text.split() == words[: words.index("</s>")]
    shown = greedy_choice(client, skip_special_tokens=False, include_stop_str_in_output=True)
    assert shown.text == f"{ended.text} </s>"
