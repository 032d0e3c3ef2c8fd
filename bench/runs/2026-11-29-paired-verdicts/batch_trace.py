"""A `sitecustomize.py` that counts the calls a serve's gateway sends a worker together: put a
folder holding this file under that name on the bench's PYTHONPATH and set
SPECSPLIT_BATCH_TRACE=1 (the serve it starts inherits both). In the gateway process it wraps
`Coalescer.answers` and, every 5 s, appends to /tmp/dbg/batches-<pid>.jsonl how many batches
of each size it sent so far ("16s": 16 calls of decode steps; "1": one one-step call).
"""

import collections
import json
import os
import sys
import threading
import time


def run() -> None:
    while "workers.rpc.coalesce" not in sys.modules:
        time.sleep(0.2)
    time.sleep(0.5)
    cls = sys.modules["workers.rpc.coalesce"].Coalescer
    answers = cls.answers
    sizes = collections.Counter()

    async def traced(self, requests):
        steps = getattr(requests[0], "steps", 0) > 1
        sizes[f"{len(requests)}{'s' if steps else ''}"] += 1
        return await answers(self, requests)

    cls.answers = traced
    os.makedirs("/tmp/dbg", exist_ok=True)
    with open(f"/tmp/dbg/batches-{os.getpid()}.jsonl", "w") as out:
        while True:
            time.sleep(5)
            out.write(json.dumps({"t": round(time.time(), 1), **sizes}) + "\n")
            out.flush()


if os.environ.get("SPECSPLIT_BATCH_TRACE"):
    threading.Thread(target=run, daemon=True).start()
