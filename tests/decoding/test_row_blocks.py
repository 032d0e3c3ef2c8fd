"""A target that computes rows in blocks cuts greedy trees whose last nodes alone would open a
block and fill less than half of it (TargetRunner.fit_blocks): the text stays the target's
own, through the runner and the loop over real gRPC workers (the gateway:
tests/gateway/test_row_blocks.py)."""

import pytest

from tests.engine.tiny import tiny_engine
from tests.workers.helpers import draft_worker, target_worker
from workers.draft.ngram import NgramDrafter
from workers.engine.sessions import SessionTable
from workers.loop import Generation, Pair, Plan, generate
from workers.loop.inprocess import InProcessDraft, InProcessTarget
from workers.protocol import TreeSpec, VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.target.runner import TargetRunner

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=3)
PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 88, 41, 5, 17]


class Sessions:
    """Sessions s0, s1, ... of PROMPT on one runner, each call feeding its one new token."""

    def __init__(self, runner: TargetRunner, count: int):
        self.runner = runner
        self.held = [0] * count
        self.step([TokenTree.empty()] * count, prompt=True)

    def step(self, trees: list[TokenTree], params=GREEDY, prompt: bool = False):
        """One batch: session i's next round with trees[i]; returns the outcomes."""
        calls = [
            VerifyCall(f"s{i}", held, PROMPT if prompt else [], tree, params)
            for i, (held, tree) in enumerate(zip(self.held, trees, strict=True))
        ]
        outcomes = self.runner.verify(calls)
        for i, outcome in enumerate(outcomes):
            self.held[i] = (len(PROMPT) if prompt else self.held[i]) + len(outcome.emitted)
        return outcomes


def runner(row_block: int, sessions: int = 4) -> TargetRunner:
    engine = tiny_engine(seed=0, slots=sessions)
    return TargetRunner(engine, SessionTable(sessions), row_block=row_block)


def chains(*lengths: int) -> list[TokenTree]:
    return [TokenTree.chain([9] * n) if n else TokenTree.empty() for n in lengths]


def test_a_node_that_alone_opens_a_block_is_cut_and_changes_no_token():
    # blocks of 4: four decode rows fill one; the node would be the next block's only row
    plain, cutting = Sessions(runner(1), 4), Sessions(runner(4), 4)
    kept, cut = plain.step(chains(1, 0, 0, 0)), cutting.step(chains(1, 0, 0, 0))
    assert [o.dropped for o in kept] == [0, 0, 0, 0]
    assert [o.dropped for o in cut] == [1, 0, 0, 0]
    assert cut[0].accepted == [] and cut[0].emitted == kept[0].emitted[:1]
    assert [o.emitted for o in cut[1:]] == [o.emitted for o in kept[1:]]


def test_nodes_filling_half_a_block_stay_and_the_largest_tree_loses_first():
    sessions = Sessions(runner(8), 4)
    assert [o.dropped for o in sessions.step(chains(3, 1, 0, 0))] == [0, 0, 0, 0]  # 8 rows
    assert [o.dropped for o in sessions.step(chains(3, 2, 0, 0))] == [1, 0, 0, 0]  # 9
    assert [o.dropped for o in sessions.step(chains(2, 2, 1, 0))] == [0, 1, 0, 0]  # ties: last
    assert [o.dropped for o in sessions.step(chains(4, 4, 4, 0))] == [0, 0, 0, 0]  # 16
    assert [o.dropped for o in sessions.step(chains(6, 5, 5, 0))] == [0, 0, 0, 0]  # 20: half
    assert [o.dropped for o in sessions.step(chains(6, 5, 4, 0))] == [2, 1, 0, 0]  # 19


def test_a_tree_is_never_cut_where_the_batch_has_one_block():
    sessions = Sessions(runner(16), 1)  # one decode row and 6 nodes: 7 rows, one block
    assert [o.dropped for o in sessions.step(chains(6))] == [0]


def test_a_sampled_calls_tree_is_never_cut():
    sessions = Sessions(runner(4), 4)
    assert [o.dropped for o in sessions.step(chains(1, 0, 0, 0), SAMPLED)] == [0, 0, 0, 0]


class Recorded:
    """A target backend that adds up the nodes its answers dropped."""

    def __init__(self, backend):
        self.backend, self.dropped = backend, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    async def verify(self, call):
        outcome = await self.backend.verify(call)
        self.dropped += outcome.dropped
        return outcome


async def speculate(target, draft, prompt: list[int]) -> Generation:
    recorded = Recorded(target)
    route = await Pair.of(recorded, draft)
    plan = Plan(prompt, 40, GREEDY, TreeSpec(depth=6, branching=2, budget=12))
    generation = await generate(route, plan, "s")
    assert recorded.dropped > 0  # some trees were cut
    return generation


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
async def test_the_loop_with_cut_trees_gives_the_targets_greedy_text(transport):
    prompt = PROMPT * 3  # the n-gram draft copies its repeats: trees of many sizes
    alone = TargetRunner(tiny_engine(seed=1, slots=2), SessionTable(2))
    target_only = await generate(
        await Pair.of(InProcessTarget("t", alone, threaded=False)), Plan(prompt, 40, GREEDY), "s"
    )
    engine = tiny_engine(seed=1, slots=2)
    if transport == "inprocess":
        cutting = TargetRunner(engine, SessionTable(2), row_block=4)
        target = InProcessTarget("t", cutting, threaded=False)
        draft = InProcessDraft("d", NgramDrafter(SessionTable(2)), threaded=False)
        got = await speculate(target, draft, prompt)
    else:
        async with (
            target_worker(engine, row_block=4) as (_, target),
            draft_worker(None) as (_, draft),
        ):
            got = await speculate(target, draft, prompt)
    assert got.token_ids == target_only.token_ids
    assert got.stats.verify_steps < 40  # the drafts that stayed still helped
