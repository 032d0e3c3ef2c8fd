"""`specsplit bench lossy`: what each lossy acceptance rule buys, and what it changes.

For each draft in `--drafts`, starts one `specsplit serve --allow-lossy` (the
embedded target) and streams every prompt of both workloads, greedy, once
per acceptance setting in turn (exact first, so every setting of a prompt
runs side by side): the grounded prompts of `specsplit bench` and held-out
everyday chat prompts (`specsplit bench draft`'s). Per draft, workload and
setting it prints tokens/s (completion tokens over the requests' summed
time), its ratio to exact, tau (tokens per target forward), and how far the
text agrees with the exact (lossless) text: the share of prompts whose text
is identical, and the mean share of the exact text's characters that the
lossy text reproduces before it first differs.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings

from workers.settings import parse, settings_config
from workers.tools.bench.machine import describe, load_words
from workers.tools.bench.measure import Timed
from workers.tools.bench.serving import MODEL_NAME, ServeProcess, stream_chat
from workers.tools.bench.workloads import grounded_messages

SETTINGS = {  # name -> the request's "speculation" field
    "exact": {"acceptance": "exact"},
    "threshold 0.3": {"acceptance": "threshold", "threshold": 0.3},
    "threshold 0.1": {"acceptance": "threshold", "threshold": 0.1},
    "typical (0.09, 0.3)": {"acceptance": "typical", "epsilon": 0.09, "delta": 0.3},
}
DRAFT_ARGS = {  # a draft -> its serve flags (the model draft's small tree, as the README says)
    "ngram": ["--draft-model", "ngram"],
    "smollm2-135m-draft": ["--draft-model", "smollm2-135m-draft", "--tree-depth", "3"]
    + ["--tree-budget", "6"],
}


class LossyBenchSettings(BaseSettings):
    model_config = settings_config("bench lossy")

    prompts: int = Field(8, ge=1, description="prompts per workload")
    max_tokens: int = Field(64, ge=1, description="new tokens per request")
    drafts: str = Field("ngram,smollm2-135m-draft", description="comma list: ngram, a model")


def chat_messages(n: int) -> list[list[dict]]:
    from workers.tools.distill import prompts

    return [[{"role": "user", "content": t}] for t in prompts.take("heldout", 1, n)]


@dataclass
class Row:
    """One (draft, workload, setting): its requests."""

    timed: list[Timed] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(t.tokens for t in self.timed) / sum(t.seconds for t in self.timed)

    @property
    def tau(self) -> float:
        stats = [t.stats or {} for t in self.timed]
        steps = sum(s.get("verify_steps", 0) for s in stats)
        return sum(s.get("emitted_tokens", 0) for s in stats) / steps if steps else 0.0

    def agreement(self, exact: Row) -> tuple[float, float]:
        """Share of identical texts, and the mean share of the exact text kept before the
        first difference."""
        same, kept = 0, 0.0
        for mine, ref in zip(self.timed, exact.timed, strict=True):
            same += mine.text == ref.text
            prefix = os.path.commonprefix([mine.text, ref.text])
            kept += len(prefix) / len(ref.text) if ref.text else 1.0
        return same / len(self.timed), kept / len(self.timed)


async def run_workload(url: str, conversations, max_tokens: int) -> dict[str, Row]:
    rows = {name: Row() for name in SETTINGS}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for messages in conversations:
            for name, speculation in SETTINGS.items():
                extra = {"speculation": speculation}
                timed = await stream_chat(client, url, messages, max_tokens, len, extra)
                rows[name].timed.append(timed)
    return rows


def table(draft: str, workload: str, rows: dict[str, Row]) -> list[str]:
    exact = rows["exact"]
    out = []
    for name, row in rows.items():
        same, kept = row.agreement(exact)
        ratio = row.tokens_per_s / exact.tokens_per_s
        out.append(
            f"| {draft} | {workload} | {name} | {row.tokens_per_s:.1f} | {ratio:.2f}x | "
            f"{row.tau:.2f} | {same:.0%} | {kept:.0%} |"
        )
    return out


def run(s: LossyBenchSettings) -> str:
    workloads = {
        "grounded": grounded_messages(s.prompts),
        "chat": chat_messages(s.prompts),
    }
    lines = [
        f"machine: {describe()}; load average at the start {load_words()}",
        f"{s.prompts} prompts per workload, max_tokens {s.max_tokens}, temperature 0, one "
        "stream, every setting of a prompt in turn, against `specsplit serve --allow-lossy`",
        "",
        "| draft | workload | acceptance | tokens/s | vs exact | tau | identical texts | "
        "exact text kept |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for draft in (d.strip() for d in s.drafts.split(",") if d.strip()):
        args = DRAFT_ARGS.get(draft, ["--draft-model", draft])
        serve_args = ["--served-model-name", MODEL_NAME, "--allow-lossy", *args]
        with ServeProcess([*serve_args, "--log-level", "warning"]) as serve:
            warm = workloads["chat"][:1]
            asyncio.run(run_workload(serve.url, warm, 8))
            for workload, conversations in workloads.items():
                rows = asyncio.run(run_workload(serve.url, conversations, s.max_tokens))
                lines += table(draft, workload, rows)
    lines.append(f"load average at the end {load_words()}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    print(run(parse(LossyBenchSettings, argv)))
