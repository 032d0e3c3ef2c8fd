"""CUDA graphs for the decode and verify forwards: one captured launch instead of a few
thousand.

On a GPU a small forward (a decode step, a draft tree) is bound by kernel launches,
not arithmetic: the chunked attention (workers/engine/attention.py) alone runs
some 40 small kernels a layer. `CudaGraphs` captures `NativeLlama.hidden` once per
batch layout and replays it, copying the new batch's tensors into the captured
ones (vLLM's and gpt-fast's approach). A layout is every shape the forward
depends on: the tokens fed, each row group's rows, new tokens and key widths.
Key widths grow with the context, so the batch pads them to whole powers of two
blocks (`widen`): masked columns of the null block change no output, and one
graph serves a session while its context doubles. The KV pool is the same
tensor in every replay, written and read in place.

A layout's first forward runs eagerly (on a side stream, as capture wants) and
is then captured; later ones replay. Forwards of more than `max_tokens` tokens
(prefill) run eagerly, where launches are a small share. All graphs share one
memory pool; each output is copied out right after its replay, before another
graph can reuse that memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from workers.engine.batch import ForwardBatch, KeyRows, Widen

Hidden = Callable[[ForwardBatch, torch.Tensor | None], torch.Tensor]  # batch, features -> (N, E)


def widen(width: int, block: int, most: int) -> int:
    """A key width of whole blocks padded to a power of two blocks, `most` at most."""
    blocks = width // block
    return min(block * (1 << (blocks - 1).bit_length()), max(most, width))


def layout(batch: ForwardBatch, features: torch.Tensor | None) -> tuple:
    """Every shape a forward of `batch` depends on: the key of its graph."""

    def rows(keys: KeyRows | None) -> tuple[int, int] | None:
        return None if keys is None else (keys.count, keys.width)

    groups = tuple(
        (None if g.tokens is None else g.tokens.numel(), g.new, rows(g.shared), rows(g.tail))
        for g in batch.groups
    )
    return len(batch.tokens), groups, features is not None


def inputs(batch: ForwardBatch, features: torch.Tensor | None) -> list[torch.Tensor]:
    """The batch's tensors, in a fixed order: what a replay copies into the captured ones."""
    out = [batch.tokens, batch.positions, batch.token_positions]
    for g in batch.groups:
        if g.tokens is not None:
            out.append(g.tokens)
        for keys in (g.shared, g.tail):
            if keys is not None:
                out += [keys.entries, keys.mask]
    if features is not None:
        out.append(features)
    return out


def cloned(batch: ForwardBatch) -> ForwardBatch:
    """The batch with each tensor copied: the captured graph's own inputs."""

    def keys(k: KeyRows | None) -> KeyRows | None:
        return None if k is None else replace(k, entries=k.entries.clone(), mask=k.mask.clone())

    groups = [
        replace(
            g,
            tokens=None if g.tokens is None else g.tokens.clone(),
            shared=keys(g.shared),
            tail=keys(g.tail),
        )
        for g in batch.groups
    ]
    return replace(
        batch,
        tokens=batch.tokens.clone(),
        positions=batch.positions.clone(),
        token_positions=batch.token_positions.clone(),
        groups=groups,
    )


Run = Callable[[], torch.Tensor]  # a forward over the captured inputs -> (N, E)


class Recorder(Protocol):
    """How a forward is captured and replayed."""

    def record(self, run: Run) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        """Runs `run` once and records it: (its result now, the recorded output, a replay
        that refreshes that output from the recorded inputs' current values)."""
        ...


@dataclass
class CudaRecorder:
    """CUDA graphs sharing one memory pool."""

    pool: tuple | None = None

    def record(self, run: Run) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        side = torch.cuda.Stream()  # capture wants a warmed-up forward, on a side stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            now = run()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (another engine loading, a server
        # starting) go on during a capture instead of invalidating it
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = run()  # recorded, not run
        return now, output, graph.replay


@dataclass
class Captured:
    """One layout's recorded forward, its input tensors and its output."""

    replay: Callable[[], None]
    inputs: list[torch.Tensor]
    output: torch.Tensor  # (N, E)


@dataclass
class CudaGraphs:
    """Captured forwards by layout, on one CUDA device (`recorder`: CUDA graphs; tests on a
    CPU record by running the forward again)."""

    block: int  # the KV cache's block size: key widths are whole blocks
    most_width: int  # the widest key row a slot can need
    max_tokens: int = 64  # forwards feeding more tokens run eagerly
    max_graphs: int = 512  # layouts captured at most; further ones run eagerly
    recorder: Recorder = field(default_factory=CudaRecorder)
    graphs: dict[tuple, Captured] = field(default_factory=dict)
    replays: int = 0  # forwards served by a captured graph

    def widen_for(self, tokens: int) -> Widen | None:
        """How a forward of `tokens` pads its key widths: to shared widths where it will be
        captured, not at all where it runs eagerly."""
        if tokens > self.max_tokens:
            return None
        return lambda width: widen(width, self.block, self.most_width)

    def __call__(
        self, hidden: Hidden, batch: ForwardBatch, features: torch.Tensor | None
    ) -> torch.Tensor:
        """`hidden(batch, features)`, replayed where this layout was captured."""
        if len(batch.tokens) > self.max_tokens:
            return hidden(batch, features)
        key = layout(batch, features)
        captured = self.graphs.get(key)
        if captured is not None:
            for static, new in zip(captured.inputs, inputs(batch, features), strict=True):
                static.copy_(new)
            captured.replay()
            self.replays += 1
            return captured.output.clone()
        if len(self.graphs) >= self.max_graphs:
            return hidden(batch, features)
        static = cloned(batch)
        static_features = None if features is None else features.clone()
        now, output, replay = self.recorder.record(lambda: hidden(static, static_features))
        self.graphs[key] = Captured(replay, inputs(static, static_features), output)
        return now
