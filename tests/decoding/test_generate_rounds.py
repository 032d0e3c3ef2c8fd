"""`specsplit generate --rounds`: one line per round, then the totals, then the text."""

from __future__ import annotations

import json
import re

import pytest

from tests.gateway.helpers import write_tiny_model
from workers.tools import generate

ROUND = re.compile(
    r"round +(\d+)  drafted +(\d+)  accepted +(\d+)  bonus (\".*?\") +[\d.]+ ms  \+(.*)"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("generate") / "tiny")


def run(tiny, capsys, *extra: str) -> tuple[str, str]:
    prompt = "one two three one two three one two three one two"
    generate.main(["--target-model", str(tiny), "--prompt", prompt, "--max-tokens", "20", *extra])
    out = capsys.readouterr()
    return out.out, out.err


def test_rounds_print_each_round_then_totals_then_the_text(tiny, capsys):
    out, _ = run(tiny, capsys, "--rounds")
    lines = out.splitlines()
    rounds = [ROUND.fullmatch(line) for line in lines[:-2]]
    assert rounds and all(rounds), lines
    assert [int(r[1]) for r in rounds] == list(range(1, len(rounds) + 1))
    assert all(int(r[3]) <= int(r[2]) for r in rounds)
    assert sum(int(r[2]) for r in rounds) > 0  # the n-gram draft found the repetition
    added = "".join(json.loads(r[5]) for r in rounds)
    assert lines[-2].startswith(f"total    20 tokens in {len(rounds)} rounds")
    plain, _ = run(tiny, capsys)
    assert lines[-1] == plain.strip() == added.strip()


def test_rounds_with_json_keep_stdout_one_object(tiny, capsys):
    out, err = run(tiny, capsys, "--rounds", "--json", "--acceptance", "threshold")
    reply = json.loads(out)
    assert reply["stats"]["acceptance"] == "threshold" and reply["stats"]["lossless"] is False
    assert err.splitlines()[-1].startswith("total")
