"""Drafting and plain epochs (gateway/epochs.py): a target's sessions draft in turns, the
kind of epoch whose rounds measure more tokens a second most of the time; and through the
gateway's loop, epochs that switch mid-request leave greedy text as the target's."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from openai import OpenAI

from gateway.adaptive import AdaptiveConfig, CostFit
from gateway.epochs import Epochs, load_class
from gateway.speculation import UNSTATED_LOOKUP_ROWS
from tests.gateway.helpers import MODEL, live, slow_target
from tests.gateway.test_adaptive import SPEC, rates, session

CONFIG = AdaptiveConfig(epoch_s=1.0)


def run_epoch(epochs: Epochs, start: float, load: int, rate: float) -> bool:
    """One epoch from `start`: its kind, and rounds of one second each that commit `rate`
    tokens, begun and ended inside it."""
    drafting = epochs.drafting(start, load, CONFIG)
    epochs.observe(start + 0.5, 0.5, round(rate / 2))
    epochs.observe(start + 0.9, 0.4, round(rate * 0.4))
    return drafting


def test_a_loads_first_epochs_draft_then_run_plain_then_the_faster_kind():
    epochs = Epochs()
    kinds = [run_epoch(epochs, float(t), 8, 100) for t in range(4)]
    assert kinds == [True, True, False, False]  # warm_epochs of each, drafting first


def test_the_faster_kind_runs_and_the_slower_every_explore_every_epochs():
    """A lead within twice the standard error: the slower kind runs every explore_every-th
    epoch, no more often."""
    for faster in (True, False):
        epochs, kinds, noisy = Epochs(), [], 0
        for t in range(200):
            drafting = epochs.drafting(float(t), 8, CONFIG)
            if drafting == faster:  # 60 and 160 in turns: a mean of 104-116, a wide spread
                noisy += 1
                rate = 160 if noisy % 2 else 60
            else:
                rate = 100
            epochs.observe(t + 0.9, 0.8, round(rate * 0.8))
            kinds.append(drafting)
        later = kinds[2 * CONFIG.warm_epochs :]
        slower = [i for i, kind in enumerate(later) if kind != faster]
        assert len(slower) >= 20
        assert all(b - a == CONFIG.explore_every for a, b in zip(slower, slower[1:], strict=False))


def test_a_clear_lead_explores_the_other_kind_four_times_as_rarely():
    epochs = Epochs()
    kinds = []
    for t in range(400):
        drafting = epochs.drafting(float(t), 1, CONFIG)
        epochs.observe(t + 0.9, 0.8, 160 if drafting else 80)  # drafting twice as fast
        kinds.append(drafting)
    plain = kinds[20:].count(False)
    assert 0 < plain <= len(kinds[20:]) // (4 * CONFIG.explore_every) + 1


def test_a_round_counts_only_in_the_epoch_it_began_and_ended_in():
    epochs = Epochs()
    epochs.drafting(0.0, 4, CONFIG)
    epochs.observe(0.6, 0.5, 5)
    epochs.drafting(1.0, 4, CONFIG)  # a new epoch from t = 1
    epochs.observe(1.2, 0.5, 50)  # began at 0.7, in the epoch before: not counted
    epochs.observe(1.7, 0.5, 5)
    assert (epochs.running.tokens, epochs.running.seconds) == (5, 0.5)
    rates_at = epochs.rates(4)
    assert rates_at.drafting.epochs == 1 and rates_at.drafting.mean == 10.0


def test_an_idle_epoch_teaches_nothing_and_loads_keep_their_own_rates():
    epochs = Epochs()
    epochs.drafting(0.0, 2, CONFIG)
    epochs.observe(0.1, 0.05, 1)  # 0.05 s of rounds in 1 s epochs: a target between requests
    epochs.drafting(1.0, 16, CONFIG)
    assert epochs.rates(2).drafting.epochs == 0
    assert load_class(1) == 0 and load_class(3) == 1 and load_class(16) == load_class(31) == 4
    assert epochs.running.load == 4 and epochs.rates(16).turns == 1 and epochs.rates(2).turns == 1


def test_in_a_plain_epoch_a_session_looks_nothing_up_and_takes_decode_steps():
    prompt = (5, 6, 7, 8) * 2  # every round matches 3 tokens: drafts pay at alpha 0.9
    speculation = session(rates(0.9), prompt, ngram=True, steps=4)
    epochs = Epochs()
    speculation.target.worker = SimpleNamespace(
        cost=CostFit(), load=1, max_tree_nodes=64, epochs=epochs
    )
    speculation.unaccepted = 0  # a draft was just accepted: a token a round while drafts pay
    assert speculation.shape(SPEC) is not None and speculation.plain_steps() == 1
    epochs.running.drafting = False  # the target's epoch turns plain
    speculation.history.append(5)
    speculation.target.held = len(speculation.history)
    assert speculation.shape(SPEC) is None
    assert len(speculation.suffix) < len(speculation.history)  # not looked up
    assert speculation.plain_steps() == 4


def test_a_plain_epoch_asks_for_the_targets_own_lookups_only_beside_a_few_sessions():
    """A drafting epoch asks every stepped round for the target's lookups; a plain one only
    while its target holds more than one session and fewer than the cheap rows it states
    (`WorkerInfo.lookup_rows`; UNSTATED_LOOKUP_ROWS where it states none), so that its
    steps' forwards have rows left that cost next to nothing (gateway/speculation.py); a
    round of one step asks for none."""
    speculation = session(rates(0.9), (5, 6, 7, 8) * 2, ngram=True, steps=4)
    speculation.lookup = 3  # --decode-lookup 3
    worker = SimpleNamespace(
        cost=CostFit(), load=1, max_tree_nodes=64, epochs=Epochs(), lookup_rows=None
    )
    speculation.target.worker = worker
    assert speculation.lookups(4) == 3 and speculation.lookups(1) == 0  # a drafting epoch
    worker.epochs.running.drafting = False  # the target's epoch turns plain

    def asking(rows: int | None) -> list[int]:
        """The loads at which a plain epoch asks for 3 looked-up tokens a step."""
        worker.lookup_rows, asked = rows, []
        for load in (1, 2, 4, 5, 6, 8, 15, 16, 32):
            worker.load = load
            if speculation.lookups(4) == 3:
                asked.append(load)
        return asked

    assert asking(None) == asking(UNSTATED_LOOKUP_ROWS) == [2, 4, 5]  # this CPU's kernel: 6
    assert asking(16) == [2, 4, 5, 6, 8, 15]  # the AMX tile unit's
    assert asking(1) == asking(0) == []  # no cheap rows: a plain epoch asks for none


def test_epochs_that_switch_mid_request_keep_greedy_text_the_targets(tiny_dir):
    """Through the gateway's loop with its n-gram draft, against a target that takes 4 ms a
    forward, epochs of 50 ms switch between drafting and plain rounds within requests, and
    the texts are those of a fixed tree; both kinds of epoch ran and measured rounds."""
    prompts = ["one two three one two three one two three", "a b c d a b c d a b c d a"]
    prompts += [f"{w} the cat sat on the mat {w} the cat" for w in ("hello", "so", "and")]
    texts = {}
    for adaptive in (False, True):
        kw = dict(adaptive_tree=adaptive, adaptive_epoch_s=0.05, tree_depth=6)
        with live(tiny_dir, [slow_target(tiny_dir, "t0", 0.004)], **kw) as gateway:
            client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            texts[adaptive] = [
                client.completions.create(model=MODEL, prompt=p, max_tokens=48, temperature=0)
                .choices[0]
                .text
                for p in prompts
            ]
            if adaptive:
                (worker,) = gateway.gateway.router.targets.workers.values()
                by_load = worker.epochs.by_load.values()
                assert sum(r.drafting.epochs for r in by_load) >= CONFIG.warm_epochs
                assert sum(r.plain.epochs for r in by_load) >= CONFIG.warm_epochs
    assert texts[True] == texts[False]


def test_plain_epochs_beside_a_few_sessions_keep_greedy_text_the_targets(tiny_dir):
    """Three greedy streams at once through the gateway's loop, epochs of 50 ms switching
    between drafting and plain rounds, decode steps verifying the target's own lookups in
    8 cheap rows, which it states in its Info (a plain epoch asks for them at such a load):
    every text is speculation off's, and both kinds of epoch ran."""
    copy = "one two three four five six seven eight nine ten "
    prompts = [copy * 3, "red green blue " * 6, "to be or not to be " * 4]
    kw = dict(adaptive_epoch_s=0.05, decode_steps=4, decode_lookup=3, suffix_cache_tokens=0)
    with live(tiny_dir, [slow_target(tiny_dir, "t0", 0.004, lookup_rows=8)], **kw) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)

        def complete(prompt: str, method: str) -> str:
            extra = {"speculation": {"method": method}}
            reply = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=48, temperature=0, extra_body=extra
            )
            return reply.choices[0].text

        off = [complete(p, "off") for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: complete(p, "auto"), prompts * 2))
        (worker,) = gateway.gateway.router.targets.workers.values()
        rates = [r for r in worker.epochs.by_load.values() if r.turns]
    assert texts == off * 2
    assert worker.lookup_rows == 8  # the gateway bounds plain epochs' lookups by them
    assert sum(r.drafting.epochs for r in rates) and sum(r.plain.epochs for r in rates)


def test_a_targets_epochs_are_exported_and_forgotten_with_it():
    from prometheus_client import generate_latest

    from gateway.metrics import Metrics

    metrics, epochs = Metrics(), Epochs()
    run_epoch(epochs, 0.0, 8, 100)
    run_epoch(epochs, 1.0, 8, 100)
    metrics.observe_epochs("t0:1", epochs, 8)
    text = generate_latest(metrics.registry).decode()
    assert 'specsplit_target_drafting{address="t0:1"} 1.0' in text
    assert 'specsplit_target_epoch_tokens_per_second{address="t0:1",kind="drafting"} 100.0' in text
    assert 'kind="plain"' not in text  # no plain epoch measured yet
    metrics.forget_target("t0:1")
    assert "t0:1" not in generate_latest(metrics.registry).decode()
