"""Tiny models on disk, in-process workers and a live gateway for the gateway tests."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gateway.app import create_app
from gateway.serve import free_ports
from gateway.settings import GatewaySettings
from tests.engine.tiny import tiny_hf_model
from workers.draft.features import model_drafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.loop.inprocess import InProcessDraft, InProcessFactory, InProcessTarget
from workers.protocol import TreeSpec
from workers.target.runner import TargetRunner

SPECIALS = ["<unk>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = (
    "the a cat dog sat on mat ran fast slow red blue green café naïve 日本 語 über "
    "hello world one two three four five six seven eight nine ten , . ! ?"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL = "tiny-chat"


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whole words (with a few multi-byte ones), joined by spaces when decoded."""
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tiny_model(path: Path, seed: int = 0, noise: float = 0.0) -> Path:
    """A tiny random Llama with the word tokenizer, in HF layout (as the loader expects)."""
    tokenizer = word_tokenizer()
    model = tiny_hf_model(vocab=len(tokenizer), seed=seed)
    if noise:
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_engine(
    path: Path, slots: int = 4, dtype: str = "float32", prefix_caching: bool = True
) -> Engine:
    config = EngineConfig(
        model=str(path), max_sessions=slots, max_seq_len=256, dtype=dtype,
        prefix_caching=prefix_caching,
    )  # fmt: skip
    return Engine.load(config)


def target(
    path: Path,
    address: str = "t0",
    slots: int = 4,
    dtype: str = "float32",
    prefix_caching: bool = True,
) -> InProcessTarget:
    engine = load_engine(path, slots, dtype, prefix_caching)
    return InProcessTarget(address, TargetRunner(engine, SessionTable(slots)))


def model_draft(
    path: Path, address: str = "d0", slots: int = 4, kind: type[InProcessDraft] = InProcessDraft
) -> InProcessDraft:
    """A model draft of the tiny model at `path`, served in-process by `kind`."""
    engine = load_engine(path, slots)
    return kind(address, model_drafter(engine, SessionTable(slots)))


class StallingDraft(InProcessDraft):
    """A model draft whose proposes deeper than `stall_deeper_than` levels hang for
    `stall_s` once it is set (a draft that hangs on such calls), counting those the
    gateway cancelled."""

    stall_s: float = 0.0
    stall_deeper_than: int = 0
    cancelled: int = 0

    async def propose(self, call):
        if self.stall_s and call.spec.depth > self.stall_deeper_than:
            try:
                await asyncio.sleep(self.stall_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await super().propose(call)


def stalling_draft(path: Path, address: str, slots: int = 4) -> StallingDraft:
    return model_draft(path, address, slots, StallingDraft)


class RecordingDraft(InProcessDraft):
    """A model draft that keeps the tree shape of every propose the gateway sent it."""

    def __init__(self, address: str, drafter):
        super().__init__(address, drafter)
        self.specs: list[TreeSpec] = []

    async def propose(self, call):
        self.specs.append(call.spec)
        return await super().propose(call)


def recording_draft(path: Path, address: str = "d0", slots: int = 4) -> RecordingDraft:
    return model_draft(path, address, slots, RecordingDraft)


def settings(model_dir: Path, targets: list[str], drafts: list[str] = (), **kw) -> GatewaySettings:
    values = dict(
        target_model=str(model_dir),
        served_model_name=MODEL,
        target_addresses=",".join(targets),
        draft_addresses=",".join(drafts),
        health_interval_s=0.2,
        dns_refresh_s=0,
        api_keys="",
        # one drafting epoch the whole test (gateway/epochs.py): a test of something else
        # that drafts for longer than two epochs would otherwise find its rounds plain, by
        # how fast the machine ran it; tests/gateway/test_epochs.py sets its own
        adaptive_epoch_s=3600.0,
    )
    return GatewaySettings(**{**values, **kw})


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class LiveGateway:
    """The gateway app served by uvicorn on a free port, in a background thread."""

    app: object
    port: int = 0

    def __enter__(self) -> LiveGateway:
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=asyncio.run, args=(self.serve(),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coroutine, timeout: float = 30.0):
        """Runs a coroutine on the server's event loop (the gateway's objects live there)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def gateway(self):
        return self.app.state.gateway


def live(model_dir: Path, backends: list, **kw) -> LiveGateway:
    targets = [b.address for b in backends if b.role == "target"]
    drafts = [b.address for b in backends if b.role == "draft"]
    app = create_app(settings(model_dir, targets, drafts, **kw), InProcessFactory(backends))
    return LiveGateway(app)


class SlowTarget(InProcessTarget):
    """A target that takes `delay` seconds per forward (a verify's, or each of its decode
    steps) plus `token_delay` per token it feeds, so a test can act mid-stream or see a
    costly target; setting `stall_s` makes its next verify take that much longer (a hang)."""

    delay: float = 0.0
    token_delay: float = 0.0
    stall_s: float = 0.0

    async def verify(self, call):
        stall, self.stall_s = self.stall_s, 0.0
        fed = len(call.tokens) + len(call.tree) + call.steps
        await asyncio.sleep(self.delay * call.steps + self.token_delay * fed + stall)
        return await super().verify(call)


def slow_target(
    path: Path,
    address: str,
    delay: float,
    slots: int = 4,
    token_delay: float = 0.0,
    lookup_rows: int | None = None,
) -> SlowTarget:
    engine = load_engine(path, slots)
    runner = TargetRunner(engine, SessionTable(slots), lookup_rows=lookup_rows)
    backend = SlowTarget(address, runner)
    backend.delay = delay
    backend.token_delay = token_delay
    return backend


def wait_until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def sample(text: str, series: str) -> float | None:
    """The value of one series in a /metrics text; None when it is absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None
