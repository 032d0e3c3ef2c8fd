"""loadtest/: the Locust file loads with its users and options. The headless run
against a live server is in test_live.py.

Locust runs as a subprocess: importing it here would let gevent patch this
test process's sockets.
"""

from __future__ import annotations

import subprocess

from tests.deploy.conftest import REPO, tool


def test_locustfile_has_both_users_and_its_options():
    """--list loads the file; its own options must parse (unknown ones are an error)."""
    options = ["--max-tokens", "8", "--prompt-mix", "short:1,long:1", "--model", "m"]
    listed = subprocess.run(
        [tool("locust"), "-f", "loadtest/locustfile.py", *options, "--api-key", "k", "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert {"ChatStreamUser", "CompletionUser"} <= set(listed.stdout.split())
