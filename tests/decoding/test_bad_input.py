"""Bad input gets a clear error, never a crash or a hang."""

import os
import subprocess
import sys

import pytest
import torch

from tests.engine.tiny import tiny_engine
from workers.draft.ngram import NgramDrafter
from workers.engine.sessions import SessionTable
from workers.loop.inprocess import LocalDecoder
from workers.protocol import VerifyCall
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree, TreeError
from workers.target.runner import TargetRunner

GREEDY = SamplingParams()


@pytest.fixture
def runner():
    return TargetRunner(tiny_engine(slots=2), SessionTable(2))


def test_empty_prompt(runner):
    with pytest.raises(ValueError, match="empty"):
        LocalDecoder(runner, NgramDrafter(SessionTable(2))).generate([], 4, GREEDY)


def test_prompt_beyond_context(runner):
    (result,) = runner.verify([VerifyCall("s", 0, [1] * 300, TokenTree.empty(), GREEDY)])
    assert isinstance(result, ValueError) and "context" in str(result)
    assert not runner.table.sessions  # refused before a slot was taken


@pytest.mark.parametrize("parents", [[-1, 5], [-1, 1], [1, -1]])
def test_malformed_tree_is_refused(parents):
    """Parent out of range, or not an earlier node (a cycle or forward reference)."""
    with pytest.raises(TreeError, match="parent"):
        TokenTree(torch.tensor([3, 4]), torch.tensor(parents))


def test_bad_tree_fails_alone_and_the_batch_is_served(runner):
    bad = TokenTree(torch.tensor([3, 500]), torch.tensor([-1, 0]))  # 500 is outside the vocab
    good = VerifyCall("good", 0, [5, 6, 7], TokenTree.empty(), GREEDY)
    results = runner.verify([VerifyCall("bad", 0, [5, 6, 7], bad, GREEDY), good])
    assert isinstance(results[0], TreeError) and "500" in str(results[0])
    assert results[1].emitted  # the well-formed call in the same batch went through
    assert "bad" not in runner.table.sessions  # validation happens before any slot is taken


def test_token_outside_vocabulary(runner):
    (result,) = runner.verify([VerifyCall("s", 0, [1, 10_000], TokenTree.empty(), GREEDY)])
    assert isinstance(result, ValueError) and "vocabulary" in str(result)


def test_unknown_model_fails_with_one_clear_message(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECSPLIT_MODEL_CACHE": str(tmp_path)}
    args = ["generate", "--prompt", "hi", "--target-model", "no-such-org/no-such-model"]
    proc = subprocess.run(
        [sys.executable, "-m", "workers.tools.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "no-such-org/no-such-model" in proc.stderr and "not found" in proc.stderr
    assert "Traceback" not in proc.stderr
