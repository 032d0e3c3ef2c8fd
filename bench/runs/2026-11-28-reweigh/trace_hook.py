"""A `sitecustomize.py` that samples a serve's adaptive state: put a folder holding this file
as `sitecustomize.py` on the bench's PYTHONPATH (the serve it starts inherits it).

In the gateway process it wraps `Speculation.shape` and, every 2 s, appends to
/tmp/dbg/trace-<pid>.jsonl: the bound target's cost line (a, b, o, beside, in ms) and the
modelled seconds of a stepped token at its load (`RoundCost.plain`), every session's
estimates per kind (chain and tree rates, drafted rounds taken in, the largest
calibration factor), every session's pace, and the outcomes of the rounds shaped since:
"prompt", "drafted" (a one-node tree of a session with no rounds off: "drafted/probe?"),
"skipped" (a round that kept its quiet) or "none may_pay=<verdict> kind=<kind>" (the
verdict of `drafts_may_pay` at the round's history, "?" where it was not weighed); and,
per kind of round past a session's first ("drafted", or "steps<k>" for a round without a
draft that decoded k tokens), the rounds and their mean modelled and measured
milliseconds a committed token: modelled as the cost model prices them (a drafted round
as every one of the target's sessions feeding its tree, `RoundCost.seconds`; a round of
steps at `RoundCost.plain`), measured as the session's seconds from its last verify's
answer to this one's.
"""

import collections
import json
import os
import sys
import threading
import time


def outcome(speculation, quiet: int, feeding: bool, shaped) -> str:
    if feeding:
        return "prompt"
    if quiet and speculation.quiet == quiet:
        return "skipped"
    if shaped is not None:
        probe = shaped.budget == 1 and not speculation.rates.rounds_off
        return "drafted/probe?" if probe else "drafted"
    may_pay = speculation.may_pay
    verdict = may_pay[1] if may_pay and may_pay[0] == len(speculation.history) else "?"
    return f"none may_pay={verdict} kind={speculation.kind}"


def sample(speculation, counts: collections.Counter) -> dict:
    cost = speculation.round_cost(speculation.stepping)
    recent = speculation.recent
    parts = (cost.fixed_s, cost.token_s, cost.outside_s, cost.beside_s)
    return {
        "t": round(time.time(), 1),
        "load": speculation.load,
        "cost": [round(x * 1e3, 2) for x in parts],
        "plain_ms": round(cost.plain(speculation.load) * 1e3, 2),
        "recent": [
            (
                round(r.chain.rate, 3),
                round(r.tree.rate, 3),
                r.measured,
                round(r.calibration.most(), 3),
            )
            for r in recent.kinds
        ]
        if recent
        else None,
        "pace": [round(recent.pace.tokens, 2), round(recent.pace.par, 2)] if recent else None,
        "counts": dict(counts),
    }


def patch() -> None:
    while "gateway.speculation" not in sys.modules:
        time.sleep(0.2)
    time.sleep(0.5)
    cls = sys.modules["gateway.speculation"].Speculation
    counts: collections.Counter = collections.Counter()
    rounds = collections.defaultdict(list)
    latest = {}
    shape = cls.shape

    def traced(self, spec):
        quiet, feeding = self.quiet, self.target.held < len(self.history)
        shaped = shape(self, spec)
        latest["session"] = self
        counts[outcome(self, quiet, feeding, shaped)] += 1
        return shaped

    cls.shape = traced
    observe = cls.observe
    from workers.speculation.tree import depths

    def observed(self, tree, round_):
        observe(self, tree, round_)
        if self.cycle_s <= 0 or self.target.worker is None or round_.finish_reason:
            return
        load, tokens = self.load, max(1, len(round_.tokens))
        if len(tree):
            depth = int(depths(tree.parents).max())
            modelled = self.round_cost(1).seconds(load * (1 + len(tree)), depth)
            kind = "drafted"
        else:
            steps = max(1, round_.steps)
            modelled = steps * self.round_cost(steps).plain(load)
            kind = f"steps{steps}"
        rounds[kind].append((modelled / tokens, self.cycle_s / tokens))

    cls.observe = observed
    os.makedirs("/tmp/dbg", exist_ok=True)
    with open(f"/tmp/dbg/trace-{os.getpid()}.jsonl", "w") as out:
        while True:
            time.sleep(2)
            speculation = latest.get("session")
            if speculation is None or speculation.target.worker is None:
                continue
            record = sample(speculation, counts)
            record["per_token_ms"] = {
                kind: [
                    len(v),
                    round(1e3 * sum(m for m, _ in v) / len(v), 2),
                    round(1e3 * sum(x for _, x in v) / len(v), 2),
                ]
                for kind, v in rounds.items()
                if v
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
            counts.clear()
            rounds.clear()


if "serve" in " ".join(sys.argv):
    threading.Thread(target=patch, daemon=True).start()
