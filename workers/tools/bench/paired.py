"""`specsplit bench paired`: the default against speculation off inside one serve, wave by wave.

Serves of the same configuration on these VMs differ by up to 1.5× (the
machine's speed moves between minutes: a forward of the same eight decode
rows took 22.5 ms in one serve and 30.7 ms in the next), so a row's serve
against another's measures the machine more than the rows where they differ
by a few per cent. Here one serve (`make run`'s defaults plus
`--serve-args`) runs both: at each point of `--streams`, waves of requests
alternate between the deployment's speculation (`"method": "auto"`) and
speculation off (`"speculation": {"method": "off"}`, the target alone), the
order flipping each pair (auto, off / off, auto / ...), so a slow minute
falls on both and each pair's ratio compares seconds apart. A wave is
`--streams` clients taking the workload's prompts from one queue
(`serving.run_streams`), each sending at least `--requests-per-stream`; a
pair of waves before the measured ones warms the serve and the prefix
cache, so every wave finds the same prompts cached. Every answer must be
the same text in both modes (greedy); `--temperature` above 0 sends sampled
requests instead (the OpenAI API's default is 1), whose texts differ by draw.

`--candidate off` makes it an A/A run: the default's waves send speculation
off as well, so every pair's true ratio is 1.00 and the medians, ranges and
intervals printed are the spread this machine gives a ratio of equals (what
a point where the default drafts nothing, and so does off's work, can read).

Prints, per point: each mode's median tokens/s over its waves, the median
of the pairs' ratios (auto / off) with their spread and a 95% interval for
it (`median_interval`: where it holds 1.00, the pairs cannot tell the modes
apart on this machine), the pairs where auto was ahead, the default's
tokens per target forward and the draft tree nodes it sent the target a token
(`Point.draft_nodes`), each mode's tokens per round trip to the target
(its verify calls), the share of its streams' time each mode's waves spent
in requests (`Point.busy`), and the CPU time the serve's gateway process and
its workers spent per token in each mode (from /proc: these cores are shared,
so what one spends the other waits for).

A wave ends with its last request: once the queue is empty its streams fall
idle one by one, and a mode that speeds some requests more than others (a
draft that copies one prompt and finds nothing in the next) finishes
unevenly, its wave waiting on its slowest requests while its streams idle.
The busy share tells that apart from a slower round: where it is lower in one
mode, more of its wave was that drain. More `--requests-per-stream` make the
drain a smaller part of a wave, as a serve under sustained load has none.
"""

from __future__ import annotations

import asyncio
import math
import os
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from workers.settings import parse, settings_config
from workers.tools.bench.machine import describe, load_words
from workers.tools.bench.measure import Figures
from workers.tools.bench.serving import MODEL_NAME, ServeProcess, children, run_streams
from workers.tools.bench.workloads import messages, warm_up

MODES = {"auto": None, "off": {"speculation": {"method": "off"}}}  # a request's extra body


class PairedBenchSettings(BaseSettings):
    model_config = settings_config("bench paired")

    workload: str = Field("chat", description="grounded, humaneval, chat or shared-system")
    prompts: int = Field(24, ge=1, description="the workload's prompts")
    max_tokens: int = Field(64, ge=1, description="most new tokens per request")
    streams: str = Field("1,4,8,16,32", description="concurrent streams, one serve per point")
    requests_per_stream: int = Field(
        2, ge=1, description="each stream of a wave sends at least this many requests"
    )
    pairs: int = Field(6, ge=1, description="measured pairs of waves (auto, off) per point")
    temperature: float = Field(
        0.0, ge=0, le=2, description="the requests' temperature; 0: greedy, the same texts"
    )
    serve_args: str = Field("", description="extra `specsplit serve` arguments")
    candidate: Literal["auto", "off"] = Field(
        "auto",
        description="what the default's waves send: auto (the deployment's speculation), or "
        "off for an A/A run (both modes off: the spread of a ratio whose truth is 1.00)",
    )

    def points(self) -> list[int]:
        return [int(x) for x in self.streams.split(",") if x.strip()]


@dataclass(frozen=True)
class Wave:
    mode: str
    figures: Figures
    texts: dict[int, str]  # conversation -> answer
    cpu_s: tuple[float, float] = (0.0, 0.0)  # the gateway's and the workers' CPU seconds

    @property
    def tok_s(self) -> float:
        return self.figures.tok_s_total

    def cpu_ms_per_token(self, part: int) -> float:
        return 1000 * self.cpu_s[part] / max(1, self.figures.tokens)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (every thread) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_cpu(pid: int | None) -> tuple[float, float]:
    """CPU seconds so far of the serve `pid` (the gateway) and of its children (the workers);
    zeros without a pid."""
    if pid is None:
        return 0.0, 0.0
    return cpu_seconds(pid), sum(cpu_seconds(child) for child in children(pid))


@dataclass(frozen=True)
class Point:
    streams: int
    waves: list[Wave]  # the measured ones, in order (the warm-up pair left out)

    def of(self, mode: str) -> list[Wave]:
        return [w for w in self.waves if w.mode == mode]

    def ratios(self) -> list[float]:
        """auto / off of each pair of waves."""
        return [a.tok_s / o.tok_s for a, o in zip(self.of("auto"), self.of("off"), strict=True)]

    def cpu_ms_per_token(self, mode: str, part: int) -> float:
        """Median over the mode's waves: the gateway's (part 0) or the workers' (1)."""
        return statistics.median(w.cpu_ms_per_token(part) for w in self.of(mode))

    def tau(self) -> float | None:
        """Tokens per target forward of the default's waves."""
        taus = [w.figures.tau for w in self.of("auto") if w.figures.tau is not None]
        return statistics.median(taus) if taus else None

    def busy(self, mode: str) -> float:
        """Median over the mode's waves of the share of their streams' time spent in
        requests: the requests' seconds over the streams times the wave's (1.00: no stream
        was ever idle; the drain after the last request was taken lowers it)."""
        return statistics.median(
            w.figures.busy_s / (self.streams * w.figures.wall_s) if w.figures.wall_s else 0.0
            for w in self.of(mode)
        )

    def draft_nodes(self) -> float:
        """Median over the default's waves of the draft tree nodes it sent the target a
        token: 0.00 with the same tokens a round trip as off says both modes had the target
        do the same work, so that their ratio measures the machine between waves."""
        return statistics.median(w.figures.draft_nodes_per_token or 0.0 for w in self.of("auto"))

    def tokens_per_round(self, mode: str) -> float:
        """Median over the mode's waves of the tokens a round trip to the target brought
        (decode steps bring several without a draft): where τ is 1.00 in both modes, the
        same figure in both says they ran the same rounds."""
        return statistics.median(w.figures.tokens_per_round or 0.0 for w in self.of(mode))


def pair_order(pair: int) -> tuple[str, str]:
    """Which mode goes first in pair `pair`: they take turns, so neither always follows the
    other (the first wave of a pair finds the machine as the previous pair's second left it)."""
    return ("auto", "off") if pair % 2 == 0 else ("off", "auto")


def different_texts(waves: list[Wave]) -> list[int]:
    """Conversations whose answer was not the same text in every wave."""
    answers: dict[int, set[str]] = {}
    for wave in waves:
        for key, text in wave.texts.items():
            answers.setdefault(key, set()).add(text)
    return sorted(key for key, texts in answers.items() if len(texts) > 1)


async def run_wave(
    url: str,
    conversations: list[list[dict]],
    s: PairedBenchSettings,
    streams: int,
    mode: str,
    pid: int | None,
) -> Wave:
    per_stream = max(s.requests_per_stream, math.ceil(len(conversations) / streams))
    before = serve_cpu(pid)
    body = MODES[s.candidate if mode == "auto" else mode]  # the "auto" waves: the candidate's
    extra = {**(body or {}), "temperature": s.temperature}
    timed, wall = await run_streams(
        url, conversations, streams, per_stream, s.max_tokens, lambda text: 1, extra
    )
    cpu = tuple(b - a for a, b in zip(before, serve_cpu(pid), strict=True))
    return Wave(mode, Figures.of(timed, wall), {t.key: t.text for t in timed}, cpu)


async def run_point(
    url: str, s: PairedBenchSettings, streams: int, pid: int | None = None
) -> Point:
    conversations = messages(s.workload, s.prompts)
    await run_streams(url, [warm_up(conversations)], 1, 1, 8, lambda text: 1)
    waves = []
    for pair in range(s.pairs + 1):  # pair 0 warms the serve up
        for mode in pair_order(pair):
            wave = await run_wave(url, conversations, s, streams, mode, pid)
            if pair:
                waves.append(wave)
    return Point(streams, waves)


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of what `values` sample: the k-th
    smallest to the k-th largest, k as large as leaves the chance that the median lies
    outside at most 1 - `confidence` (each value falls below the median with probability
    1/2, so the count below is binomial); None where even the whole range is too short
    (fewer than six values at 95%)."""
    n, ordered = len(values), sorted(values)
    outside = 0.0  # P(the interval from the k-th smallest misses the median), k = 1, 2, ...
    best = None
    for k in range(1, n // 2 + 1):
        outside += 2 * math.comb(n, k - 1) / 2**n  # P(fewer than k below) + P(fewer than k above)
        if outside > 1 - confidence:
            break
        best = ordered[k - 1], ordered[n - k]
    return best


def serve_args(s: PairedBenchSettings, streams: int) -> list[str]:
    """`make run`'s serve (`--dtype auto`), room for the point's streams, then --serve-args."""
    args = ["--served-model-name", MODEL_NAME, "--log-level", "warning", "--dtype", "auto"]
    args += ["--max-sessions", "256", "--worker-max-sessions", str(max(8, streams))]
    return args + shlex.split(s.serve_args)


def measure(s: PairedBenchSettings) -> list[Point]:
    points = []
    for streams in s.points():
        with ServeProcess(serve_args(s, streams)) as serve:
            points.append(asyncio.run(run_point(serve.url, s, streams, serve.process.pid)))
    return points


def table(points: list[Point], greedy: bool = True) -> list[str]:
    """The points' rows; sampled waves (not `greedy`) answer each prompt with texts that
    differ by draw, so their "same texts" column says "sampled"."""
    lines = [
        "| streams | off, tokens/s | the default, tokens/s | default / off, median of pairs "
        "| pairs' range | 95% interval | default ahead | τ of the default "
        "| draft nodes a token, default | tokens a round trip, off → default "
        "| streams busy, off → default "
        "| CPU ms a token, gateway, off → default | workers | same texts |",
        "|---:|---:|---:|---:|---|---|---:|---:|---:|---|---|---|---|:---:|",
    ]
    for point in points:
        ratios = point.ratios()
        off = statistics.median(w.tok_s for w in point.of("off"))
        auto = statistics.median(w.tok_s for w in point.of("auto"))
        tau = point.tau()
        ahead = sum(r > 1.0 for r in ratios)
        same = "sampled" if not greedy else "yes" if not different_texts(point.waves) else "NO"
        interval = median_interval(ratios)
        held = "-" if interval is None else f"{interval[0]:.2f}–{interval[1]:.2f}"
        cpu = [point.cpu_ms_per_token(mode, part) for part in (0, 1) for mode in MODES]
        lines.append(
            f"| {point.streams} | {off:.1f} | {auto:.1f} | **{statistics.median(ratios):.2f}** "
            f"| {min(ratios):.2f}–{max(ratios):.2f} | {held} | {ahead} of {len(ratios)} "
            f"| {'-' if tau is None else f'{tau:.2f}'} | {point.draft_nodes():.2f} "
            f"| {point.tokens_per_round('off'):.2f} → {point.tokens_per_round('auto'):.2f} "
            f"| {point.busy('off'):.2f} → {point.busy('auto'):.2f} "
            f"| {cpu[1]:.2f} → {cpu[0]:.2f} "
            f"| {cpu[3]:.2f} → {cpu[2]:.2f} | {same} |"
        )
    return lines


def run(s: PairedBenchSettings) -> str:
    load = load_words()
    points = measure(s)
    sampling = f"temperature {s.temperature}" if s.temperature else "greedy"
    head = [
        f"`specsplit bench paired`: {s.workload}, {s.prompts} prompts, {s.max_tokens} tokens "
        f"a request, {sampling}, {s.pairs} pairs of waves a point; serve: `make run`'s defaults"
        + (f" and `{s.serve_args}`" if s.serve_args else ""),
        *(["an A/A run: the default's waves send speculation off too"] * (s.candidate == "off")),
        f"machine: {describe()}; load average before {load}, after {load_words()}",
        "",
    ]
    return "\n".join(head + table(points, greedy=not s.temperature))


def main(argv: list[str]) -> None:
    print(run(parse(PairedBenchSettings, argv)))
