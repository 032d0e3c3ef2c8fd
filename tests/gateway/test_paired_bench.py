"""`specsplit bench paired`: both modes in one serve, waves taking turns, the same texts."""

from __future__ import annotations

import asyncio

from tests.gateway.helpers import live, target
from workers.tools.bench.paired import (
    PairedBenchSettings,
    Point,
    different_texts,
    run_point,
    table,
)
from workers.tools.bench.serving import MODEL_NAME


def test_waves_take_turns_in_one_serve_and_answer_alike(tiny_dir):
    s = PairedBenchSettings(prompts=3, max_tokens=6, streams="2", pairs=2)
    with live(tiny_dir, [target(tiny_dir)], served_model_name=MODEL_NAME) as gateway:
        point = asyncio.run(run_point(gateway.url, s, 2))
    # the warm-up pair (auto, off) is left out; then each pair flips the order
    assert [w.mode for w in point.waves] == ["off", "auto", "auto", "off"]
    # a wave is every prompt at least once, 2 requests a stream: 4 requests of 3 prompts
    assert all(w.figures.requests == 4 and len(w.texts) == 3 for w in point.waves)
    assert different_texts(point.waves) == []  # greedy: each prompt's answer in both modes
    assert all(w.figures.acceptance is None for w in point.of("off"))  # nothing drafted
    assert all(w.figures.tau == 1.0 for w in point.of("off"))
    assert all(w.figures.draft_nodes_per_token == 0.0 for w in point.of("off"))
    assert all(w.figures.tokens_per_round >= 1.0 for w in point.waves)
    assert len(point.ratios()) == 2 and all(r > 0 for r in point.ratios())
    row = table([point])[-1]
    assert row.startswith("| 2 |") and row.endswith("| yes |")


def test_sampled_waves_draw_their_texts_and_say_so(tiny_dir):
    s = PairedBenchSettings(prompts=3, max_tokens=6, streams="2", pairs=2, temperature=1.0)
    with live(tiny_dir, [target(tiny_dir)], served_model_name=MODEL_NAME) as gateway:
        point = asyncio.run(run_point(gateway.url, s, 2))
    # each request draws its own text (a greedy wave would repeat every answer)
    assert different_texts(point.waves) != []
    assert table([point], greedy=False)[-1].endswith("| sampled |")


def test_an_a_a_run_sends_speculation_off_in_both_modes(tiny_dir):
    s = PairedBenchSettings(prompts=3, max_tokens=6, streams="2", pairs=2, candidate="off")
    with live(tiny_dir, [target(tiny_dir)], served_model_name=MODEL_NAME) as gateway:
        point = asyncio.run(run_point(gateway.url, s, 2))
    assert [w.mode for w in point.waves] == ["off", "auto", "auto", "off"]
    # the default's waves ran as off's: the target alone, nothing drafted
    assert all(w.figures.acceptance is None for w in point.waves)
    assert all(w.figures.draft_nodes_per_token == 0.0 for w in point.waves)
    assert different_texts(point.waves) == []


def test_a_text_that_differs_between_waves_is_reported():
    from workers.tools.bench.measure import Figures
    from workers.tools.bench.paired import Wave

    figures = Figures.of([], 1.0)
    waves = [Wave("auto", figures, {0: "a", 1: "b"}), Wave("off", figures, {0: "a", 1: "c"})]
    assert different_texts(waves) == [1]
    assert Point(1, waves).of("off") == waves[1:]


def test_the_median_interval_is_the_order_statistics_of_the_tables():
    from workers.tools.bench.paired import median_interval

    # the k-th smallest to the k-th largest of n values: the sign test's 95% interval for
    # a median, as tabulated
    ks = {6: 1, 8: 1, 9: 2, 12: 3, 15: 4, 16: 4, 17: 5, 20: 6}
    for n, k in ks.items():
        values = [float(v) for v in range(n, 0, -1)]  # any order
        assert median_interval(values) == (k, n + 1 - k)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # too few for 95%


def test_the_busy_share_is_the_requests_time_over_the_streams_time():
    from workers.tools.bench.measure import Figures, Timed
    from workers.tools.bench.paired import Wave

    def wave(mode: str, spans: list[tuple[float, float]], wall: float) -> Wave:
        timed = [Timed(start, end=end, tokens=10) for start, end in spans]
        return Wave(mode, Figures.of(timed, wall), {})

    # two streams for 4 s: off keeps both busy; auto's second stream ends its last request
    # at 1 s and then idles (the drain), so 5 of its 8 stream-seconds were in requests
    off = wave("off", [(0.0, 2.0), (2.0, 4.0), (0.0, 2.0), (2.0, 4.0)], 4.0)
    auto = wave("auto", [(0.0, 3.0), (3.0, 4.0), (0.0, 0.5), (0.5, 1.0)], 4.0)
    point = Point(2, [auto, off])
    assert point.busy("off") == 1.0
    assert point.busy("auto") == 5 / 8
    assert "| 1.00 → 0.62 |" in table([point])[-1]


def test_the_draft_nodes_are_the_defaults_tree_nodes_a_token():
    from workers.tools.bench.measure import Figures, Timed
    from workers.tools.bench.paired import Wave

    def wave(mode: str, drafted: list[int]) -> Wave:
        timed = [
            Timed(0.0, end=1.0, tokens=10, stats={"draft_tokens": d, "emitted_tokens": 10})
            for d in drafted
        ]
        return Wave(mode, Figures.of(timed, 1.0), {})

    # 5 and 15 nodes over 20 tokens, then none: the median of the default's waves; off's
    # waves (which draft nothing) do not enter it
    waves = [wave("auto", [5, 15]), wave("off", [0, 0]), wave("auto", [0, 0]), wave("off", [0])]
    waves.append(wave("auto", [10, 20]))
    waves.append(wave("off", [0]))
    point = Point(2, waves)
    assert [w.figures.draft_nodes_per_token for w in point.of("auto")] == [1.0, 0.0, 1.5]
    assert point.draft_nodes() == 1.0
    assert "| - | 1.00 | 0.00 → 0.00 |" in table([point])[-1]  # τ (no steps), the nodes
    assert Figures.of([Timed(0.0, end=1.0, tokens=3)], 1.0).draft_nodes_per_token is None
