"""A `sitecustomize.py` that samples a serve's target epochs (gateway/epochs.py): put a folder
holding this file under that name on the bench's PYTHONPATH and set SPECSPLIT_EPOCH_TRACE=1
(the serve it starts inherits both). In the gateway process it wraps `Speculation.shape` to
find the bound target and, every 2 s, appends to /tmp/dbg/epochs-<pid>.jsonl: the target's
load; the running epoch (its load's power of two, whether it drafts, its counted rounds'
tokens and seconds so far); per load, both kinds' mean rates and epochs, and the epochs run.
"""

import json
import os
import sys
import threading
import time


def record(worker) -> dict:
    epochs, running = worker.epochs, worker.epochs.running
    return {
        "t": round(time.time(), 1),
        "load": worker.load,
        "running": running
        and [running.load, running.drafting, round(running.tokens), round(running.seconds, 2)],
        "by_load": {
            load: [
                round(rates.drafting.mean, 1),
                rates.drafting.epochs,
                round(rates.plain.mean, 1),
                rates.plain.epochs,
                rates.turns,
            ]
            for load, rates in epochs.by_load.items()
        },
    }


def run() -> None:
    while "gateway.speculation" not in sys.modules:
        time.sleep(0.2)
    time.sleep(0.5)
    cls = sys.modules["gateway.speculation"].Speculation
    latest = {}
    shape = cls.shape

    def traced(self, spec):
        latest["session"] = self
        return shape(self, spec)

    cls.shape = traced
    os.makedirs("/tmp/dbg", exist_ok=True)
    with open(f"/tmp/dbg/epochs-{os.getpid()}.jsonl", "w") as out:
        while True:
            time.sleep(2)
            session = latest.get("session")
            if session is None or session.target.worker is None:
                continue
            out.write(json.dumps(record(session.target.worker)) + "\n")
            out.flush()


if os.environ.get("SPECSPLIT_EPOCH_TRACE"):
    threading.Thread(target=run, daemon=True).start()
