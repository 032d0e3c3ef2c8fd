"""The draft shipped for the embedded target: reachable by its alias, small, a plain model."""

from __future__ import annotations

import json

import pytest
import torch

from workers.draft.runner import ModelDrafter
from workers.engine.batch import SlotInput
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import ALIASES, load_tokenizer, resolve_model, tokenizer_fingerprint
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat, stop_token_ids
from workers.loop.inprocess import LocalDecoder
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner

ALIAS = "smollm2-135m-draft"


def test_alias_resolves_to_a_small_packaged_model_dir():
    path = resolve_model(ALIAS)
    assert path == ALIASES[ALIAS]
    # the files a wheel ships (a local OUT/checkpoint/ is git-ignored)
    assert sum(f.stat().st_size for f in path.iterdir() if f.is_file()) < 30e6
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152


def test_alias_loads_in_float32_on_the_native_engine():
    engine = Engine.load(EngineConfig(model=ALIAS, max_sessions=1, max_seq_len=64))
    assert next(engine.model.parameters()).dtype == torch.float32
    assert engine.vocab_size == 49152
    logits = engine.forward([engine_row([1, 9690, 198])])[0]  # (1, V)
    assert logits.shape == (1, 49152) and torch.isfinite(logits).all()


def engine_row(tokens: list[int]) -> SlotInput:
    return SlotInput(0, 0, list(range(-1, len(tokens) - 1)), tokens)


@pytest.mark.embedded
def test_pairs_with_the_embedded_target_and_speculates_losslessly(embedded_hf, embedded_tokenizer):
    draft = Engine.load(EngineConfig(model=ALIAS, max_sessions=2, max_seq_len=512))
    assert tokenizer_fingerprint(draft.tokenizer) == tokenizer_fingerprint(embedded_tokenizer)
    assert tokenizer_fingerprint(load_tokenizer(resolve_model(ALIAS))) == tokenizer_fingerprint(
        embedded_tokenizer
    )
    target = Engine.from_hf(
        embedded_hf, embedded_tokenizer, EngineConfig(max_sessions=2, max_seq_len=512), "target"
    )
    stops = stop_token_ids(embedded_tokenizer)
    prompt = encode_chat(embedded_tokenizer, [{"role": "user", "content": "What is a rainbow?"}])
    plain = LocalDecoder(TargetRunner(target, SessionTable(2)), None, stop_ids=stops)
    expected = plain.generate(prompt, 32, SamplingParams()).token_ids
    decoder = LocalDecoder(
        TargetRunner(target, SessionTable(2)),
        ModelDrafter(draft, SessionTable(2)),
        TreeSpec(),
        stops,
    )
    gen = decoder.generate(prompt, 32, SamplingParams())
    assert gen.token_ids == expected
    assert gen.stats.mean_accepted_length > 1.5  # the draft earns its keep
