"""A `sitecustomize.py` that logs every epoch a serve's targets close (gateway/epochs.py): put
a folder holding this file under that name on the bench's PYTHONPATH and set
SPECSPLIT_CLOSE_TRACE=1 (the serve it starts inherits both). In the gateway process it wraps
`Epochs.close` and appends one JSON line an epoch to /tmp/dbg/closes-<pid>.jsonl: its start
(perf_counter seconds), its load's power of two, whether it drafted, its counted rounds'
tokens and seconds.
"""

import json
import os
import sys
import threading
import time


def run() -> None:
    while "gateway.epochs" not in sys.modules:
        time.sleep(0.2)
    time.sleep(0.5)
    cls = sys.modules["gateway.epochs"].Epochs
    close = cls.close
    os.makedirs("/tmp/dbg", exist_ok=True)
    out = open(f"/tmp/dbg/closes-{os.getpid()}.jsonl", "w")  # noqa: SIM115 (the serve's life)

    def traced(self, epoch, config):
        line = [round(epoch.start, 3), epoch.load, epoch.drafting, round(epoch.tokens)]
        out.write(json.dumps(line + [round(epoch.seconds, 3)]) + "\n")
        out.flush()
        return close(self, epoch, config)

    cls.close = traced


if os.environ.get("SPECSPLIT_CLOSE_TRACE"):
    threading.Thread(target=run, daemon=True).start()
