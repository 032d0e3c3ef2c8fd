"""A bench run as CSV, a Markdown report (tables + the issue's targets) and a PNG plot."""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.tools.bench.suite import Result, Run

CSV_FIELDS = [
    "row", "setup", "workload", "streams", "requests", "tokens", "wall_s", "tok_s_stream",
    "tok_s_total", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "tau", "acceptance",
    "lookahead_hit_rate", "gateway_p50_ms", "draft_p50_ms", "verify_p50_ms", "same_output",
    "load_1m", "tok_s_turns",
]  # fmt: skip


def publish(table: str, folder: Path, name: str) -> None:
    """Prints a benchmark kind's Markdown table and writes it to folder/name."""
    print(table)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(table + "\n")


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def progress(r: Result) -> str:
    f = r.figures
    return (
        f"{r.row:22s} {r.workload:9s} x{r.streams:<2d} {f.tok_s_stream:6.1f} tok/s/stream "
        f"{f.tok_s_total:6.1f} tok/s total  ttft {fmt(f.ttft_p50_ms, 0)} ms  "
        f"tau {fmt(f.tau, 2)}  same {r.same}  load {r.load:.1f}"
    )


def csv_row(r: Result) -> dict:
    f = r.figures
    return {
        "row": r.row,
        "setup": r.setup,
        "workload": r.workload,
        "streams": r.streams,
        "requests": f.requests,
        "tokens": f.tokens,
        "wall_s": round(f.wall_s, 3),
        "tok_s_stream": round(f.tok_s_stream, 2),
        "tok_s_total": round(f.tok_s_total, 2),
        "ttft_p50_ms": _round(f.ttft_p50_ms),
        "itl_p50_ms": _round(f.itl_p50_ms),
        "itl_p99_ms": _round(f.itl_p99_ms),
        "tau": _round(f.tau, 3),
        "acceptance": _round(f.acceptance, 3),
        "lookahead_hit_rate": _round(f.lookahead_hit_rate, 3),
        "gateway_p50_ms": _round(r.phases_ms.get("gateway"), 3),
        "draft_p50_ms": _round(r.phases_ms.get("draft"), 3),
        "verify_p50_ms": _round(r.phases_ms.get("verify"), 3),
        "same_output": "" if r.same is None else ("yes" if r.same else "NO"),
        "load_1m": round(r.load, 2),
        "tok_s_turns": " ".join(f"{x:.2f}" for x in r.turns),
    }


def _round(value, digits: int = 2):
    return "" if value is None else round(value, digits)


def single(run: Run, row: str, workload: str) -> Result | None:
    return next(
        (r for r in run.results if r.row == row and r.workload == workload and r.streams == 1),
        None,
    )


def speed(run: Run, row: str, workload: str) -> float | None:
    r = single(run, row, workload)
    return r.figures.tok_s_stream if r else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# the name suffixes of every row's bfloat16 twins (suite.serve_configs), the longest first
TWINS = ("-bf16-cores-calls", "-bf16-cores-noblocks", "-bf16-cores-noamx", "-bf16-cores", "-bf16")
# speculation off per dtype, kernel threads and kernel arithmetic
OFF_ROWS = (*(f"off{suffix}" for suffix in TWINS), "off")


def baseline(row: str) -> str:
    """The speculation-off row that `row` is set against: the one of its dtype, kernel
    threads and kernel arithmetic, whose names end as its own does (suite.serve_configs)."""
    return next(off for off in OFF_ROWS if row.endswith(off.removeprefix("off")))


@dataclass(frozen=True)
class Target:
    what: str
    reached: str  # the measured figure
    met: bool | None  # None: not measured in this run


def targets(run: Run) -> list[Target]:
    out: list[Target] = []

    def add(what: str, value: float | None, goal: float, unit: str = "×", below: bool = False):
        met = None if value is None else (value <= goal if below else value >= goal)
        out.append(Target(what, fmt(value, 2, unit), met))

    g = "grounded"
    tree = speed(run, "ngram-tree-adaptive", g)
    add(
        "grounded, n-gram tree, 1 stream vs speculation off ≥ 3×",
        ratio(tree, speed(run, "off", g)),
        3.0,
    )
    add(
        "grounded, n-gram tree, 1 stream vs transformers prompt lookup ≥ 1.0×",
        ratio(tree, speed(run, "hf-prompt-lookup", g)),
        1.0,
    )
    for draft in ("ngram", "model"):
        for workload in ("grounded", "humaneval"):
            t, c = single(run, f"{draft}-tree", workload), single(run, f"{draft}-chain", workload)
            value = ratio(t.figures.tau, c.figures.tau) if t and c else None
            add(f"{workload}, {draft} tree vs chain at the same budget: τ ≥ 1.2×", value, 1.2)
    for workload in ("grounded", "humaneval"):
        model_rows = {r.row for r in run.results if r.row.startswith("model-")}
        best = max((speed(run, r, workload) or 0.0 for r in model_rows), default=0.0)
        add(
            f"{workload}, model draft, 1 stream vs transformers assisted ≥ 1.0×",
            ratio(best or None, speed(run, "hf-assisted", workload)),
            1.0,
        )
    for row in run.settings.names(run.settings.sweep_rows):
        one = sweep_point(run, row, 1)
        eight = sweep_point(run, row, 8)
        add(f"{row}: 8 streams aggregate vs 1 stream ≥ 4×", ratio(eight, one), 4.0)
    worst = None
    for row in run.settings.names(run.settings.sweep_rows):
        if row in OFF_ROWS:
            continue
        off = baseline(row)
        ratios = [
            ratio(sweep_point(run, row, n), sweep_point(run, off, n)) for n in sweep_streams(run)
        ]
        ratios = [x for x in ratios if x is not None]
        if ratios and "adaptive" in row:
            worst = min(ratios) if worst is None else min(worst, min(ratios))
    add(
        "adaptive n-gram tree: no sweep point > 5% slower than off (worst ratio ≥ 0.95×)",
        worst,
        0.95,
    )
    gateway = [
        r.phases_ms.get("gateway")
        for r in run.results
        if r.streams == 1 and r.phases_ms.get("gateway") is not None
    ]
    add(
        "gateway overhead per round, p50 ≤ 2 ms (worst 1-stream row)",
        max(gateway, default=None),
        2.0,
        " ms",
        below=True,
    )
    return out


def workloads(s) -> str:
    described = {
        "grounded": f"{s.prompts} input-grounded prompts",
        "humaneval": f"the first {s.humaneval} HumanEval problems",
        "chat": f"{s.prompts} everyday chat questions",
        "shared-system": f"{s.prompts} everyday chat questions after one long system prompt",
    }
    return ", ".join(described[w] for w in s.names(s.workloads))


def sweep_streams(run: Run) -> list[int]:
    return sorted({r.streams for r in run.results if r.workload == run.settings.sweep_workload})


def sweep_result(run: Run, row: str, streams: int) -> Result | None:
    return next(
        (
            r
            for r in run.results
            if r.row == row and r.workload == run.settings.sweep_workload and r.streams == streams
        ),
        None,
    )


def sweep_point(run: Run, row: str, streams: int) -> float | None:
    r = sweep_result(run, row, streams)
    return r.figures.tok_s_total if r else None


def turn_ratios(run: Run, row: str, streams: int) -> list[float]:
    """The row's tok/s over speculation off's at a sweep point, turn by turn: the serves
    of one turn ran next to each other, so each ratio is the row against off on the same
    minute of the machine, and their spread is how far the median's ratio can be read."""
    mine, off = sweep_result(run, row, streams), sweep_result(run, baseline(row), streams)
    if mine is None or off is None:
        return []
    return [a / b for a, b in zip(mine.turns, off.turns, strict=False) if b]


def turns(s) -> str:
    """How the SpecSplit rows shared each point, in words ('' for one serve each)."""
    if s.repeats == 1:
        return ""
    return f" ({s.repeats} serves each, rows taking turns; the median by tok/s shown)"


def steady(s) -> str:
    """How many requests a sweep point's streams send, where it is not one wave."""
    if s.min_requests_per_stream <= 1:
        return ""
    return (
        f"; each stream of a point sends at least {s.min_requests_per_stream} requests "
        "(the prompts cycled), so most of a point runs with every stream busy"
    )


def markdown(run: Run) -> str:
    s = run.settings
    lines = [
        "# `specsplit bench`",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on {run.machine}; "
        f"load average at start {run.started_load[0]:.2f} / {run.started_load[1]:.2f} / "
        f"{run.started_load[2]:.2f} (1/5/15 min). Target {s.target_model}, float32 unless "
        f"a row says otherwise, greedy, at most {s.max_tokens} new tokens per request. "
        f"Model draft: {run.draft or '-'}. "
        f"Workloads: {workloads(s)}. SpecSplit rows: `specsplit serve` per row and point"
        f"{turns(s)}, workers with {s.worker_threads or 'the default number of'} torch "
        f"thread(s), streamed over HTTP with httpx{steady(s)}. The run took "
        f"{run.seconds / 60:.1f} min.",
        "",
        "## One stream",
        "",
        "| row | setup | workload | tok/s | × off | × hf-generate | TTFT p50 ms "
        "| ITL p50 / p99 ms | τ | acceptance | gateway p50 ms | same text |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in [r for r in run.results if r.streams == 1]:
        f = r.figures
        lines.append(
            f"| {r.row} | {r.setup} | {r.workload} | {f.tok_s_stream:.1f} "
            f"| {fmt(ratio(f.tok_s_stream, speed(run, baseline(r.row), r.workload)), 2)} "
            f"| {fmt(ratio(f.tok_s_stream, speed(run, 'hf-generate', r.workload)), 2)} "
            f"| {fmt(f.ttft_p50_ms, 0)} | {fmt(f.itl_p50_ms, 1)} / {fmt(f.itl_p99_ms, 1)} "
            f"| {fmt(f.tau, 2)} | {fmt(f.acceptance, 2)} | {fmt(r.phases_ms.get('gateway'), 2)} "
            f"| {'-' if r.same is None else ('yes' if r.same else 'NO')} |"
        )
    points = sweep_streams(run)
    rows = [row for row in s.names(s.sweep_rows) if any(r.row == row for r in run.results)]
    if rows and len(points) > 1:
        lines += [
            "",
            f"## Concurrency sweep ({s.sweep_workload}): aggregate tok/s "
            "(× speculation off of the same dtype and kernel threads at that point)",
            "",
            "| row | " + " | ".join(f"{n} streams" for n in points) + " | 8 vs 1 |",
            "|---|" + "---:|" * (len(points) + 1),
        ]
        for row in rows:
            cells = []
            for n in points:
                value = sweep_point(run, row, n)
                off = sweep_point(run, baseline(row), n)
                rel = (
                    f" ({ratio(value, off):.2f}×)"
                    if row not in OFF_ROWS and ratio(value, off)
                    else ""
                )
                cells.append(fmt(value, 1) + rel)
            scaling = ratio(sweep_point(run, row, 8), sweep_point(run, row, 1))
            lines.append(f"| {row} | " + " | ".join(cells) + f" | {fmt(scaling, 2, '×')} |")
        lines += turns_table(run, [row for row in rows if row not in OFF_ROWS], points)
    lines += ["", "## Targets (issue 6)", "", "| target | reached | met |", "|---|---:|:---:|"]
    for t in targets(run):
        met = "not measured" if t.met is None else ("yes" if t.met else "**no**")
        lines.append(f"| {t.what} | {t.reached} | {met} |")
    return "\n".join(lines) + "\n"


def turns_table(run: Run, rows: list[str], points: list[int]) -> list[str]:
    """Each turn's × speculation off at every sweep point (no lines with one serve each)."""
    cells = {row: [turn_ratios(run, row, n) for n in points] for row in rows}
    if not any(len(ratios) > 1 for row in rows for ratios in cells[row]):
        return []
    lines = [
        "",
        "Each turn's × speculation off (a serve of the row over off's serve of the same "
        "turn, turns in order): the spread is this machine's noise at that point.",
        "",
        "| row | " + " | ".join(f"{n} streams" for n in points) + " |",
        "|---|" + "---:|" * len(points),
    ]
    for row in rows:
        shown = [" / ".join(f"{x:.2f}" for x in ratios) or "-" for ratios in cells[row]]
        lines.append(f"| {row} | " + " | ".join(shown) + " |")
    return lines


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    singles = [r for r in run.results if r.streams == 1]
    workloads = sorted({r.workload for r in singles})
    names = list(dict.fromkeys(r.row for r in singles))
    width = 0.8 / max(1, len(workloads))
    for i, workload in enumerate(workloads):
        values = [speed(run, n, workload) or 0.0 for n in names]
        xs = [j + i * width for j in range(len(names))]
        left.bar(xs, values, width, label=workload)
    left.set_xticks([j + width * (len(workloads) - 1) / 2 for j in range(len(names))])
    left.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
    left.set_ylabel("tokens/s, one stream")
    left.set_title("One stream: transformers vs SpecSplit (HTTP + gRPC)")
    left.legend()
    points = sweep_streams(run)
    swept = False
    for row in run.settings.names(run.settings.sweep_rows):
        values = [sweep_point(run, row, n) for n in points]
        if any(v is not None for v in values):
            right.plot(points, [v or 0.0 for v in values], marker="o", label=row)
            swept = True
    right.set_xlabel("concurrent streams")
    right.set_ylabel("aggregate tokens/s")
    right.set_xticks(points)
    right.set_title(f"Concurrency sweep, {run.settings.sweep_workload} workload")
    if swept:
        right.legend()
    fig.suptitle(f"specsplit bench: {run.machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(run: Run, out: Path) -> list[Path]:
    csv_path, md_path, png_path = out / "bench.csv", out / "bench.md", out / "bench.png"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in run.results:
            writer.writerow(csv_row(r))
    md_path.write_text(markdown(run))
    plot(run, png_path)
    return [csv_path, md_path, png_path]
