"""`specsplit bench`: its figures, its report and its workloads (no models, no servers)."""

from __future__ import annotations

import csv
import os

import pytest

from workers.tools.bench import report, suite
from workers.tools.bench.measure import Figures, Timed, histogram_quantile, percentile
from workers.tools.bench.serving import ServeConfig, spread_tokens
from workers.tools.bench.suite import (
    BenchSettings,
    Result,
    Run,
    all_rows,
    serve_configs,
    serve_points,
)
from workers.tools.bench.workloads import WORKLOADS, messages, warm_up


def timed(start: float, chunks: list[tuple[float, int]], stats: dict | None = None) -> Timed:
    t = Timed(start, end=chunks[-1][0], chunks=chunks, tokens=sum(n for _, n in chunks))
    t.stats = stats
    return t


def test_itl_counts_each_token_of_a_chunk_once():
    t = timed(0.0, [(1.0, 1), (1.6, 3), (1.8, 1)])
    assert t.ttft == 1.0
    assert t.itl() == pytest.approx([0.2, 0.2, 0.2, 0.2])


def test_percentiles():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    buckets = [(0.001, 0.0), (0.002, 10.0), (0.005, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.002)
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.0015)
    assert histogram_quantile([(float("inf"), 0.0)], 0.5) is None


def test_figures_pool_requests_and_speculation_counters():
    stats = {"verify_steps": 2, "emitted_tokens": 5, "draft_tokens": 8, "accepted_tokens": 3}
    a = timed(0.0, [(0.5, 2), (1.0, 3)], stats)
    b = timed(1.0, [(1.5, 1), (2.0, 4)], stats)
    f = Figures.of([a, b], wall_s=2.0)
    assert f.tokens == 10 and f.tok_s_stream == pytest.approx(10 / 2.0)
    assert f.tau == pytest.approx(10 / 4) and f.acceptance == pytest.approx(6 / 16)
    assert f.ttft_p50_ms == pytest.approx(500.0)
    assert f.lookahead_hit_rate is None


def test_chunk_token_shares_add_up_to_the_usage_count():
    t = Timed(0.0, chunks=[(1.0, 0), (2.0, 0), (3.0, 0)], tokens=10)
    spread_tokens(t, [1, 1, 1])
    assert sum(n for _, n in t.chunks) == 10


def test_workloads():
    grounded = messages("grounded", 5)
    assert len(grounded) == 5 and all(m[0]["role"] == "user" for m in grounded)
    assert "Repeat this text exactly" in grounded[0][0]["content"]
    humaneval = messages("humaneval", 3)
    assert len(humaneval) == 3 and "def " in humaneval[0][0]["content"]
    shared = messages("shared-system", 3)
    assert shared[0][0] == shared[2][0] and shared[0][0]["role"] == "system"
    assert shared[0][1] != shared[1][1]
    assert warm_up(shared) == [shared[0][0], {"role": "user", "content": "Say hello."}]
    assert warm_up(grounded) == [{"role": "user", "content": "Say hello."}]
    for workload in WORKLOADS:  # every workload is described in the report's header
        assert report.workloads(BenchSettings(workloads=workload))
    with pytest.raises(ValueError):
        messages("nope", 1)


def test_rows_describe_their_configuration():
    configs = serve_configs(BenchSettings())
    assert configs["off"].describe() == "speculation off"
    assert configs["off-no-prefix-cache"].describe() == "speculation off, no prefix caching"
    assert configs["ngram-chain"].branching == 1
    tree, chain = configs["ngram-tree"], configs["ngram-chain"]
    assert tree.budget == chain.budget  # the tree/chain comparison is at the same budget
    assert "overlap" in configs["model-tree-overlap"].describe()
    assert configs["hybrid"].describe().startswith("model tree") and configs["hybrid"].hybrid
    assert ServeConfig("x", "ngram", 4, 2, 8, adaptive=True).describe().endswith("adaptive")
    assert configs["off-bf16"].describe() == "speculation off, bfloat16"
    assert (
        configs["ngram-tree-adaptive-bf16"].speculation()
        == configs["ngram-tree-adaptive"].speculation()
    )
    assert {r.removeprefix("off") for r in configs if r.startswith("off-bf16")} == set(
        report.TWINS
    )  # every twin is known to report.baseline
    twin = configs["hybrid-bf16-cores"]  # every SpecSplit row has its bfloat16 twins
    assert twin.hybrid and (twin.dtype, twin.amx) == ("bfloat16", True) and twin.kernel_threads
    everything = all_rows(configs)  # all: each float32 row, and off and the default in bf16
    assert "hybrid" in everything and "hybrid-bf16-cores" not in everything
    assert {"off-bf16-cores-noamx", "ngram-tree-adaptive-bf16-cores-noamx"} <= set(everything)
    assert "off-bf16-cores-noblocks" not in everything
    assert configs["off-bf16-cores-noblocks"].describe().endswith("blocks op by op")
    assert "off-bf16-cores-calls" not in everything
    assert configs["off-bf16-cores-calls"].describe().endswith("Verify as calls")


def test_each_row_is_set_against_speculation_off_of_its_dtype_and_kernel_threads():
    configs = serve_configs(BenchSettings())
    for row, config in configs.items():
        off = configs[report.baseline(row)]
        assert off.draft == "none" and off.prefix_caching
        assert (off.dtype, off.kernel_threads, off.amx, off.compiled_blocks) == (
            config.dtype,
            config.kernel_threads,
            config.amx,
            config.compiled_blocks,
        ), row
    assert configs["ngram-tree-adaptive-bf16-cores"].kernel_threads == len(os.sched_getaffinity(0))
    assert "kernel on" in configs["off-bf16-cores"].describe()
    assert configs["off-bf16-cores-noamx"].describe().endswith("AMX off")
    numerics = {c.numerics() for c in configs.values()}  # one text reference for each
    assert numerics == {"float32", "bfloat16", "bfloat16, AMX off"}
    s = BenchSettings(streams="1,8", sweep_rows="off-bf16,ngram-tree-adaptive-bf16")
    run = Run(s, "test machine", "", (0.5, 0.5, 0.5))
    for row, tokens in (("off-bf16", 20), ("ngram-tree-adaptive-bf16", 30)):
        for streams in (1, 8):
            f = Figures.of([timed(0.0, [(1.0, tokens * streams)])], 1.0)
            run.results.append(Result(row, row, "grounded", streams, f, True, {"gateway": 0.5}))
    text = report.markdown(run)
    assert "| 30.0 (1.50×) | 240.0 (1.50×) |" in text  # the sweep, against off-bf16


def test_a_swept_row_must_be_one_of_the_rows_when_named():
    with pytest.raises(SystemExit, match="--sweep-rows ngram-tree: not among --rows"):
        suite.run_suite(BenchSettings(rows="off", sweep_rows="off,ngram-tree"))


def test_a_bfloat16_row_is_checked_against_bfloat16_texts():
    run = Run(BenchSettings(), "test machine", "", (0.0, 0.0, 0.0))
    fp32, bf16 = timed(0.0, [(1.0, 4)]), timed(0.0, [(1.0, 4)])
    bf16.text = "another greedy text"
    assert run.check("chat", [fp32]) and run.check("chat", [bf16], "bfloat16")
    assert not run.check("chat", [bf16])  # against the float32 reference


def fake_run() -> Run:
    s = BenchSettings(streams="1,8", sweep_rows="off,ngram-tree-adaptive")
    run = Run(s, "test machine", "a draft", (0.5, 0.5, 0.5))

    def add(row, workload, streams, chunks, stats=None, gateway=0.8):
        f = Figures.of([timed(0.0, chunks, stats)], chunks[-1][0])
        run.results.append(Result(row, row, workload, streams, f, True, {"gateway": gateway}))

    stats = {"verify_steps": 2, "emitted_tokens": 8, "draft_tokens": 8, "accepted_tokens": 6}
    for workload in ("grounded", "humaneval"):
        add("hf-prompt-lookup", workload, 1, [(1.0, 4), (2.0, 4)], gateway=None)
        add("off", workload, 1, [(1.0, 4), (4.0, 4)])
        add("ngram-chain", workload, 1, [(0.5, 8)], stats)
        add("ngram-tree-adaptive", workload, 1, [(0.5, 8)], stats)
    add("off", "grounded", 8, [(1.0, 30)])
    add("ngram-tree-adaptive", "grounded", 8, [(1.0, 40)], stats)
    return run


def test_report_files(tmp_path):
    paths = report.write(fake_run(), tmp_path)
    assert [p.name for p in paths] == ["bench.csv", "bench.md", "bench.png"]
    rows = list(csv.DictReader(paths[0].open()))
    assert {r["row"] for r in rows} >= {"off", "ngram-tree-adaptive"}
    text = paths[1].read_text()
    assert "## One stream" in text and "## Concurrency sweep" in text and "## Targets" in text
    assert "test machine" in text
    assert paths[2].stat().st_size > 10_000  # a real PNG


def test_targets_are_judged_from_the_figures():
    targets = {t.what: t for t in report.targets(fake_run())}
    vs_off = targets["grounded, n-gram tree, 1 stream vs speculation off ≥ 3×"]
    assert vs_off.met and vs_off.reached == "8.00×"  # 16 tok/s against 2
    assert targets["grounded, model draft, 1 stream vs transformers assisted ≥ 1.0×"].met is None
    gateway = targets["gateway overhead per round, p50 ≤ 2 ms (worst 1-stream row)"]
    assert gateway.met and gateway.reached == "0.80 ms"


def test_rows_take_turns_at_each_point_and_the_median_serve_stands(monkeypatch):
    s = BenchSettings(
        streams="1,16", sweep_rows="off,ngram-tree-adaptive", sweep_workload="chat", repeats=3
    )
    configs = serve_configs(s)
    rows = [configs["off"], configs["ngram-tree-adaptive"], configs["ngram-chain"]]
    workloads = {"chat": messages("chat", 2)}
    assert serve_points(s, rows[0], workloads) == [("chat", 1), ("chat", 16)]
    assert serve_points(s, rows[2], workloads) == [("chat", 1)]  # not swept

    served: list[tuple[str, int, int]] = []  # (row, streams, the serve's max sessions)
    # one stream: off 5, 3, 8; the tree 1, 2, 7; the chain 9, 4, 6 (row after row, three
    # turns); 16 streams: off 11, 12, 15; the tree 10, 13, 14
    speeds = iter([5.0, 1.0, 9.0, 3.0, 2.0, 4.0, 8.0, 7.0, 6.0, 11.0, 10.0, 12.0, 13.0, 15.0, 14.0])

    class FakeServe:
        url = "http://fake"

        def __init__(self, config, model, draft, sessions, knee, threads):
            self.sessions = sessions

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    async def warm(*args):
        return [], 0.0

    def fake_measure(run, serve, config, workload, n, conversations, count_tokens):
        served.append((config.name, n, serve.sessions))
        f = Figures.of([timed(0.0, [(1.0, 4)])], 1.0)
        f.tok_s_total = next(speeds)
        same = len(served) != 13  # the tree's second turn at 16 streams differs
        return Result(config.name, config.name, workload, n, f, same)

    monkeypatch.setattr(suite, "Serve", FakeServe)
    monkeypatch.setattr(suite, "run_streams", warm)
    monkeypatch.setattr(suite, "measure", fake_measure)
    run = Run(s, "test machine", "", (0.0, 0.0, 0.0))
    suite.run_serves(run, rows, workloads, None, lambda text: {"input_ids": []})
    turns = ["off", "ngram-tree-adaptive", "ngram-chain"]
    assert [(r, n) for r, n, _ in served] == [(r, 1) for r in turns * 3] + [
        (r, 16) for r in turns[:2] * 3
    ]
    assert {r: m for r, _, m in served} == {"off": 16, "ngram-tree-adaptive": 16, "ngram-chain": 8}
    medians = {(r.row, r.streams): (r.figures.tok_s_total, r.same) for r in run.results}
    assert medians == {
        ("off", 1): (5.0, True),
        ("ngram-tree-adaptive", 1): (2.0, True),
        ("ngram-chain", 1): (6.0, True),
        ("off", 16): (12.0, True),
        ("ngram-tree-adaptive", 16): (13.0, False),  # every turn's text is checked
    }
    # the median keeps every turn, and the report sets each against off's of the same turn
    turns = {(r.row, r.streams): r.turns for r in run.results}
    assert turns[("off", 16)] == [11.0, 12.0, 15.0]
    assert turns[("ngram-tree-adaptive", 16)] == [10.0, 13.0, 14.0]
    ratios = report.turn_ratios(run, "ngram-tree-adaptive", 16)
    assert [round(x, 3) for x in ratios] == [0.909, 1.083, 0.933]
    table = report.markdown(run)
    assert "| ngram-tree-adaptive | 0.20 / 0.67 / 0.88 | 0.91 / 1.08 / 0.93 |" in table


def test_streams_send_the_prompts_once_or_at_least_the_minimum():
    assert suite.requests_per_stream(24, 1, 1) == 24
    assert suite.requests_per_stream(24, 32, 1) == 1  # one wave
    assert suite.requests_per_stream(24, 16, 1) == 2
    assert suite.requests_per_stream(24, 32, 4) == 4  # most of the point with 32 busy
    assert suite.requests_per_stream(24, 1, 4) == 24
    one_wave = report.markdown(Run(BenchSettings(), "test machine", "", (0.0, 0.0, 0.0)))
    assert "at least" not in one_wave
    steady = BenchSettings(min_requests_per_stream=4)
    assert "at least 4 requests" in report.markdown(Run(steady, "test machine", "", (0, 0, 0)))
