"""Drafting epochs and plain epochs: whether a target's sessions draft at all, by what its
rounds measure.

The adaptive trees (gateway.adaptive) shape each round by a cost model, and at
a busy target the model misses what rounds cost each other: at 32 grounded
streams on a 2-core machine, a drafted round was modelled at 52 ms a committed
token and measured 37 for its own session, while what its nodes cost the
other sessions' forwards is in no round; a token a round without a draft,
among sessions taking decode steps, was modelled at 66 ms and took 106
(bench/runs/2026-11-28-reweigh). Where drafting is near break-even those
errors decide, and the default ran 0.96-0.97 of speculation off there.

So a target's sessions take turns of epochs (`AdaptiveConfig.epoch_s`). In a
drafting epoch every round is shaped by the cost model; in a plain epoch no
session looks a draft up or weighs one, and rounds take decode steps, as with
speculation off (the target's own lookups in its steps' cheap rows aside, at a
target holding fewer sessions than its forwards have cheap rows:
gateway.speculation, plain_lookups). Each epoch measures the tokens its
sessions' rounds committed per second of those rounds (a round counts in the
epoch it began and ended in), which takes in what any session's draft cost the
others' rounds. Per load (the target's sessions at the epoch's start, by powers
of two) each kind of epoch keeps an exponentially weighted mean and spread of
its epochs' rates: the faster kind runs, and the other every
`explore_every`-th epoch (a quarter as often once they differ by more than
twice their standard error), so the verdict follows the text and the load. A
load's first epochs draft, then run plain, `warm_epochs` of each. An epoch
whose rounds add up to less than a tenth of `epoch_s` teaches nothing (a
target between requests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.adaptive import AdaptiveConfig

CLEAR_SE = 2.0  # a lead of this many standard errors explores the other kind less often
CLEAR_SLOWDOWN = 4  # ... this many times less often


@dataclass
class Rate:
    """One kind of epoch's rates at one load: exponentially weighted mean and mean square
    of its epochs' tokens per second of rounds."""

    mean: float = 0.0
    square: float = 0.0
    epochs: int = 0

    def observe(self, rate: float, config: AdaptiveConfig) -> None:
        if not self.epochs:
            self.mean, self.square = rate, rate * rate
        else:
            w = config.epoch_ewma
            self.mean += w * (rate - self.mean)
            self.square += w * (rate * rate - self.square)
        self.epochs += 1

    def variance_of_mean(self, config: AdaptiveConfig) -> float:
        """The mean's variance: the epochs' spread over the epochs it weighs (at most those
        an exponentially weighted mean of weight w stands for, (2 - w) / w)."""
        w = config.epoch_ewma
        weighs = min(self.epochs, (2.0 - w) / w)
        return max(0.0, self.square - self.mean * self.mean) / max(1.0, weighs)


@dataclass
class Epoch:
    """The epoch running: when it began, at which load, of which kind, and its rounds."""

    start: float  # time.perf_counter() seconds
    load: int  # the load's power of two (`load_class`)
    drafting: bool
    tokens: float = 0.0
    seconds: float = 0.0  # the counted rounds' seconds, summed over sessions


@dataclass
class LoadRates:
    """At one load: both kinds' rates and the epochs run."""

    drafting: Rate = field(default_factory=Rate)
    plain: Rate = field(default_factory=Rate)
    turns: int = 0

    def of(self, drafting: bool) -> Rate:
        return self.drafting if drafting else self.plain

    def next_kind(self, config: AdaptiveConfig) -> bool:
        """Whether the next epoch at this load drafts (see the module docstring)."""
        self.turns += 1
        if self.drafting.epochs < config.warm_epochs:
            return True
        if self.plain.epochs < config.warm_epochs:
            return False
        lead = self.drafting.mean - self.plain.mean
        spread = self.drafting.variance_of_mean(config) + self.plain.variance_of_mean(config)
        clear = abs(lead) > CLEAR_SE * math.sqrt(spread)
        period = config.explore_every * (CLEAR_SLOWDOWN if clear else 1)
        explore = self.turns % period == 0
        return (lead >= 0) != explore


def load_class(load: int) -> int:
    """Loads 1, 2-3, 4-7, 8-15, ... as 0, 1, 2, 3, ..."""
    return max(1, load).bit_length() - 1


@dataclass
class Epochs:
    """A target's epochs (see the module docstring); one per target worker."""

    running: Epoch | None = None
    by_load: dict[int, LoadRates] = field(default_factory=dict)

    def drafting(self, now: float, load: int, config: AdaptiveConfig) -> bool:
        """Whether this round may draft: the running epoch's kind, a new epoch's once it
        has run `epoch_s`."""
        running = self.running
        if running is None or now - running.start >= config.epoch_s:
            if running is not None:
                self.close(running, config)
            loaded = load_class(load)
            rates = self.by_load.setdefault(loaded, LoadRates())
            running = self.running = Epoch(now, loaded, rates.next_kind(config))
        return running.drafting

    def observe(self, ended: float, seconds: float, tokens: int) -> None:
        """A session's round that ended at `ended` after `seconds` and committed `tokens`:
        counted where it began inside the running epoch."""
        running = self.running
        if running is not None and seconds > 0 and ended - seconds >= running.start:
            running.tokens += tokens
            running.seconds += seconds

    def close(self, epoch: Epoch, config: AdaptiveConfig) -> None:
        if epoch.seconds < 0.1 * config.epoch_s or epoch.tokens <= 0:
            return
        self.by_load[epoch.load].of(epoch.drafting).observe(epoch.tokens / epoch.seconds, config)

    def rates(self, load: int) -> LoadRates | None:
        """Both kinds' rates at a load (None before its first epoch)."""
        return self.by_load.get(load_class(load))
