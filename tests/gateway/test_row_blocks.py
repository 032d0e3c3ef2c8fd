"""Through the gateway, a target that cuts greedy trees spilling into a new block of rows
(TargetRunner.fit_blocks) still gives the target's greedy text, and says what it dropped."""

import httpx
from openai import OpenAI

from tests.gateway.helpers import MODEL, live, load_engine
from workers.engine.sessions import SessionTable
from workers.loop.inprocess import InProcessTarget
from workers.target.runner import TargetRunner


def test_the_gateway_with_cut_trees_gives_the_targets_greedy_text(tiny_dir):
    runner = TargetRunner(load_engine(tiny_dir), SessionTable(4), row_block=4)
    messages = [{"role": "user", "content": "one two three one two three one two three one"}]
    # a tree every round that finds a match, a token a round otherwise: the rounds, and so
    # the trees' sizes, follow the text alone (decode steps end on the worker's forwards)
    backends = [InProcessTarget("t0", runner)]
    with live(tiny_dir, backends, adaptive_tree=False, decode_steps=1) as gateway:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)

        def text(speculation: dict | None) -> str:
            extra = {} if speculation is None else {"speculation": speculation}
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=32, temperature=0, extra_body=extra
            )
            return reply.choices[0].message.content

        assert text(None) == text({"method": "off"})
        metrics = httpx.get(gateway.url + "/metrics").text
    dropped = [line for line in metrics.splitlines() if line.startswith("specsplit_dropped_draft")]
    assert dropped and float(dropped[0].split()[-1]) > 0
