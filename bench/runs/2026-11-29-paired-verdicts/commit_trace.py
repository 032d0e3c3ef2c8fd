"""A `sitecustomize.py` that counts what a serve's rounds drafted and accepted: put a folder
holding this file under that name on the bench's PYTHONPATH and set SPECSPLIT_COMMIT_TRACE=1
(the serve it starts inherits both). In the gateway process it wraps `LoopState.commit` and,
every 5 s, appends the running totals to /tmp/dbg/commits-<pid>.jsonl: rounds, tokens, the
gateway's tree nodes and those accepted, the target's own lookup nodes and those accepted.
"""

import json
import os
import sys
import threading
import time

KEYS = ("rounds", "tokens", "tree_nodes", "tree_accepted", "lookup_nodes", "lookup_accepted")


def run() -> None:
    while "workers.loop.state" not in sys.modules:
        time.sleep(0.2)
    time.sleep(0.5)
    cls = sys.modules["workers.loop.state"].LoopState
    commit = cls.commit
    totals = dict.fromkeys(KEYS, 0)

    def traced(self, *args, **kwargs):
        round_ = commit(self, *args, **kwargs)
        for key, value in zip(
            KEYS,
            (
                1,
                len(round_.tokens),
                round_.tree_nodes,
                round_.tree_accepted,
                round_.lookup_nodes,
                len(round_.looked_up),
            ),
            strict=True,
        ):
            totals[key] += value
        return round_

    cls.commit = traced
    os.makedirs("/tmp/dbg", exist_ok=True)
    with open(f"/tmp/dbg/commits-{os.getpid()}.jsonl", "w") as out:
        while True:
            time.sleep(5)
            out.write(json.dumps({"t": round(time.time(), 1), **totals}) + "\n")
            out.flush()


if os.environ.get("SPECSPLIT_COMMIT_TRACE"):
    threading.Thread(target=run, daemon=True).start()
