"""A `sitecustomize.py` for gateway_waves.py (copy it so named into a folder on PYTHONPATH).

SPECSPLIT_GW_PROFILE=DIR: SIGUSR1 starts cProfile in this process's main thread (the serve's:
the gateway's event loop); the next SIGUSR1 stops it and dumps DIR/profile-N.prof (N counts
the dumps). The workers, the serve's children, install the handler too and are never sent
the signal."""

import os

_dir = os.environ.get("SPECSPLIT_GW_PROFILE")
if _dir:
    import cProfile
    import signal

    _state = {"profile": None, "n": 0}

    def _toggle(signum, frame):
        if _state["profile"] is None:
            _state["profile"] = cProfile.Profile()
            _state["profile"].enable()
        else:
            _state["profile"].disable()
            _state["profile"].dump_stats(os.path.join(_dir, f"profile-{_state['n']}.prof"))
            _state["profile"] = None
            _state["n"] += 1

    signal.signal(signal.SIGUSR1, _toggle)
