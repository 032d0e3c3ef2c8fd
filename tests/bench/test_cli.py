"""`specsplit bench KIND`: one registry of kinds, the suite when no kind is given."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.tools import cli
from workers.tools.bench import KINDS


def test_bench_help_lists_every_kind(capsys):
    cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "usage: specsplit bench [KIND]" in out and "(default: serve)" in out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    kinds = ["serve", "engine", "ceiling", "workers", "draft", "admission"]
    kinds += ["lossy", "prefill", "suffix", "paired", "gpu"]
    assert listed == kinds == list(KINDS)


def test_unknown_kind_exits_with_the_kinds():
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "speed"])
    message = str(exit_.value.code)
    assert message.startswith("specsplit bench: unknown kind 'speed'")
    assert all(kind in message for kind in KINDS)


def test_options_without_a_kind_go_to_the_suite(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help-unknown-flag"])
    assert exit_.value.code != 0
    assert "specsplit bench serve" in capsys.readouterr().err


def test_help_imports_no_command_module():
    """`specsplit --help` and `specsplit bench --help` stay fast: no torch, no kind's module."""
    code = (
        "import sys; from workers.tools import cli; cli.main(['--help']); "
        "cli.main(['bench', '--help']); "
        "assert 'torch' not in sys.modules and 'workers.tools.bench.suite' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_bench_lossy_agreement():
    from workers.tools.bench.lossy import Row
    from workers.tools.bench.measure import Timed

    def row(*texts: str) -> Row:
        return Row([Timed(0.0, end=1.0, tokens=4, text=t, stats={}) for t in texts])

    exact = row("the cat sat", "a dog")
    same, kept = row("the cat ran", "a dog").agreement(exact)
    assert same == 0.5 and kept == (8 / 11 + 1) / 2
    assert exact.tokens_per_s == 4.0 and exact.tau == 0.0
