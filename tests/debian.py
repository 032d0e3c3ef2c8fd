"""Tools from Debian's packages for the tests that drive real ones (Prometheus, Chromium)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def debian_tool(command: str, package: str | None = None) -> str:
    """The path of `command`, installed with `apt-get install PACKAGE` when it is not on PATH.

    Skips the test when it cannot be installed (no apt-get, not root, no network)."""
    package = package or command
    found = shutil.which(command)
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip(f"{command} is not installed and there is no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip(f"{command} is not installed; `apt-get install {package}` needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-q"]
    install = [*apt, "install", "-y", "--no-install-recommends", package]

    def run(command):
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)

    result = run(install)
    if result.returncode != 0:  # no package lists yet, or stale ones
        update = run([*apt, "update"])
        if update.returncode != 0:
            pytest.skip(f"apt-get update failed (no network?): {update.stderr.strip()[-500:]}")
        result = run(install)
    found = shutil.which(command)
    assert found, f"apt-get install {package} failed:\n{result.stdout[-2000:]}{result.stderr}"
    return found
