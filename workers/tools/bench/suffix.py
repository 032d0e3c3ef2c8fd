"""`specsplit bench suffix`: the suffix cache off vs on, on workloads that repeat across requests.

Starts two `specsplit serve`s with the embedded target and the in-gateway
n-gram draft, one with `--suffix-cache-tokens 0` and one with the cache on,
and sends each request of a workload to one and then the other (never both
at once, alternating which goes first), greedy, streaming, no API key:

- `questions`: a few questions, each asked in several wordings, one after
  the other (many users asking overlapping questions);
- `file-edits`: an agent asks for a ~30-line file back with one small change,
  and the next request edits the file as the model returned it;
- `distinct`: traffic that never repeats, what the cache may cost: the chat and
  grounded workloads of `specsplit bench serve` (8 each), each asked once.

For each workload and cache setting it prints tokens/s (completion tokens
over the requests' summed time), tokens per target forward and the draft's
acceptance rate, and how many greedy texts are equal off and on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.settings import parse, settings_config
from workers.tools.bench.machine import describe, load_words
from workers.tools.bench.measure import Figures, Timed
from workers.tools.bench.serving import MODEL_NAME, ServeProcess, stream_chat
from workers.tools.bench.workloads import chat_messages, grounded_messages

QUESTIONS = [
    [
        "What is the capital of France?",
        "Which city is the capital of France?",
        "Tell me the capital city of France.",
        "france capital?",
    ],
    [
        "How do I reverse a list in Python?",
        "In Python, how can I reverse a list?",
        "What's the way to reverse a Python list?",
        "python reverse list",
    ],
    [
        "Why is the sky blue?",
        "Can you explain why the sky is blue?",
        "What makes the sky look blue?",
        "sky blue why",
    ],
    [
        "What is photosynthesis?",
        "Explain photosynthesis.",
        "Can you tell me what photosynthesis is?",
        "photosynthesis meaning",
    ],
    [
        "How many days are in a leap year?",
        "How many days does a leap year have?",
        "Number of days in a leap year?",
        "leap year days",
    ],
]

FILE = '''import json
from pathlib import Path


def load_config(path):
    """Reads the JSON config at path."""
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    """Writes config as JSON to path."""
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def merge(base, override):
    """A copy of base with the keys of override on top."""
    out = dict(base)
    for key, value in override.items():
        out[key] = value
    return out


def main():
    config = load_config("config.json")
    config = merge(config, {"debug": True})
    save_config("config.json", config)


if __name__ == "__main__":
    main()
'''

EDITS = [
    "Rename the function `merge` to `merged`.",
    "Change the JSON indent from 2 to 4.",
    'Make `main` set "debug" to False instead of True.',
    "Add a docstring to `main` that says it turns on debug mode.",
    "Rename the variable `out` to `result`.",
    "Change the file name config.json to settings.json everywhere.",
]


class SuffixBenchSettings(BaseSettings):
    model_config = settings_config("bench suffix")

    workloads: str = Field(
        "questions,file-edits", description="comma list: questions, file-edits, distinct"
    )
    cache_tokens: int = Field(
        16_384, ge=1, description="--suffix-cache-tokens of the cache-on serve"
    )
    question_tokens: int = Field(64, ge=1, description="max_tokens of each question")
    edit_tokens: int = Field(400, ge=1, description="max_tokens of each file edit")
    rounds: int = Field(2, ge=1, description="times each question's wordings are all asked")


def question_prompts(rounds: int) -> list[list[dict]]:
    """Every wording of every question, wording by wording, `rounds` times."""
    wordings = len(QUESTIONS[0])
    return [
        [{"role": "user", "content": q[w]}]
        for _ in range(rounds)
        for w in range(wordings)
        for q in QUESTIONS
    ]


def edit_prompt(file: str, edit: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding assistant. Reply with the whole file."},
        {"role": "user", "content": f"Here is config.py:\n```python\n{file}```\n{edit}"},
    ]


def edited_file(text: str, fallback: str) -> str:
    """The code block of the model's answer (the next edit's input); the fallback if none."""
    if "```" not in text:
        return fallback
    body = text.split("```", 2)[1]
    body = body.split("\n", 1)[1] if "\n" in body else ""
    return body if body.strip() else fallback


@dataclass
class Side:
    """One serve and what its requests took."""

    name: str
    url: str
    timed: list[Timed]


async def side_by_side(
    sides: list[Side], prompts: list[list[dict]], max_tokens: int, start: int = 0
) -> list[tuple[str, ...]]:
    """Each prompt to every side in turn (the first side alternating); the texts."""
    texts = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for i, messages in enumerate(prompts, start):
            order = sides if i % 2 == 0 else sides[::-1]
            for side in order:
                timed = await stream_chat(client, side.url, messages, max_tokens, lambda t: 1)
                side.timed.append(timed)
            texts.append(tuple(side.timed[-1].text for side in sides))
    return texts


async def file_edits(sides: list[Side], max_tokens: int) -> list[tuple[str, ...]]:
    """The edits in a chain: each edits the file as the cache-off side returned it."""
    file, texts = FILE, []
    for i, edit in enumerate(EDITS):
        (pair,) = await side_by_side(sides, [edit_prompt(file, edit)], max_tokens, i)
        texts.append(pair)
        file = edited_file(pair[0], file)
    return texts


def serve_args(cache_tokens: int) -> list[str]:
    args = ["--served-model-name", MODEL_NAME, "--log-level", "warning"]
    return args + ["--suffix-cache-tokens", str(cache_tokens)]


def row(workload: str, side: Side) -> str:
    f = Figures.of(side.timed, sum(t.seconds for t in side.timed))
    tau = f"{f.tau:.2f}" if f.tau is not None else "-"
    acceptance = f"{f.acceptance:.3f}" if f.acceptance is not None else "-"
    return (
        f"| {workload} | {side.name} | {f.requests} | {f.tokens} | {f.tok_s_stream:.2f} "
        f"| {tau} | {acceptance} |"
    )


def run(s: SuffixBenchSettings) -> str:
    workloads: dict[str, Callable] = {
        "questions": lambda sides: side_by_side(
            sides, question_prompts(s.rounds), s.question_tokens
        ),
        "file-edits": lambda sides: file_edits(sides, s.edit_tokens),
        "distinct": lambda sides: side_by_side(
            sides, chat_messages(8) + grounded_messages(8), s.question_tokens
        ),
    }
    wanted = [w.strip() for w in s.workloads.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in workloads]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; known: {sorted(workloads)}")
    lines = [
        "| workload | suffix cache | requests | tokens | tokens/s | tokens per target forward "
        "| acceptance |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    same_lines = []
    load = load_words()
    for workload in wanted:  # fresh serves (an empty cache) per workload
        with ServeProcess(serve_args(0)) as off, ServeProcess(serve_args(s.cache_tokens)) as on:
            sides = [Side("off", off.url, []), Side(f"on ({s.cache_tokens})", on.url, [])]
            texts = asyncio.run(workloads[workload](sides))
            lines += [row(workload, side) for side in sides]
            same = sum(a == b for a, b in texts)
            same_lines.append(f"{workload}: greedy texts equal off and on: {same} of {len(texts)}")
    return "\n".join(
        [
            f"machine: {describe()}; load average at the start {load}, at the end {load_words()}",
            "`specsplit serve` defaults (embedded SmolLM2-135M target, in-gateway n-gram draft), "
            "temperature 0, streaming, one request at a time",
            "",
            *lines,
            "",
            *same_lines,
        ]
    )


def main(argv: list[str]) -> None:
    print(run(parse(SuffixBenchSettings, argv)))
