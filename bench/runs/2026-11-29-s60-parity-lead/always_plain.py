"""Diagnostic only: with SPECSPLIT_ALWAYS_PLAIN=1, every target epoch of the gateway is
plain (gateway.epochs.LoadRates.next_kind returns False), so the default does speculation
off's work with its adaptive bookkeeping."""

import os
import sys
import threading
import time


def patch() -> None:
    while "gateway.epochs" not in sys.modules:
        time.sleep(0.02)
    sys.modules["gateway.epochs"].LoadRates.next_kind = lambda self, config: False


if os.environ.get("SPECSPLIT_ALWAYS_PLAIN"):
    threading.Thread(target=patch, daemon=True).start()
