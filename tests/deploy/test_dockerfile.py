"""The Dockerfile: lint-clean under hadolint, and consistent with the code and deploy/.

No Docker engine here, so the image is not built; these checks are what can
be proven without one.
"""

from __future__ import annotations

import shlex
import subprocess

from gateway.settings import GatewaySettings
from tests.deploy.conftest import REPO, tool
from tests.deploy.test_manifests import build, container, environment
from workers.tools.cli import COMMANDS
from workers.worker import WorkerSettings


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def runtime_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def test_hadolint_passes():
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "style", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_multi_stage_with_a_torch_index_argument():
    steps = instructions()
    assert sum(word == "FROM" for word, _ in steps) >= 2
    args = [rest for word, rest in steps if word == "ARG"]
    assert any(a.startswith("TORCH_INDEX=") and a.endswith("/whl/cpu") for a in args)
    assert any(word == "COPY" and rest.startswith("--from=build") for word, rest in steps)


def test_exposed_ports_are_the_codes_defaults():
    exposed = {int(p) for word, rest in runtime_stage() if word == "EXPOSE" for p in rest.split()}
    expected = {GatewaySettings.model_fields["port"].default}
    for role in ("target", "draft"):
        options = WorkerSettings(role=role).server_options()
        expected |= {options.port, options.metrics_port, options.health_port}
    assert exposed == expected


def test_runs_as_the_deployments_user_with_the_model_cache_on_a_volume():
    stage = runtime_stage()
    (user,) = [rest for word, rest in stage if word == "USER"]
    uid, _, gid = user.partition(":")
    assert int(uid) > 0 and int(gid) > 0
    env = " ".join(rest for word, rest in stage if word == "ENV")
    values = dict(item.split("=", 1) for item in shlex.split(env) if "=" in item)
    cache = values["SPECSPLIT_MODEL_CACHE"]
    (volume,) = [rest for word, rest in stage if word == "VOLUME"]
    assert cache in volume
    docs = build("deploy/overlays/cpu")
    for component in ("gateway", "target", "draft"):
        c = container(docs, component)
        assert environment(docs, c)["SPECSPLIT_MODEL_CACHE"] == cache
        spec = next(
            d["spec"]["template"]["spec"]
            for d in docs
            if d["kind"] == "Deployment" and d["metadata"]["name"] == f"specsplit-{component}"
        )
        assert spec["securityContext"]["runAsUser"] == int(uid)
        assert spec["securityContext"]["runAsGroup"] == int(gid)
        assert c["args"][0] in COMMANDS


def test_entrypoint_is_the_cli_and_the_default_command_serves():
    stage = dict(runtime_stage())
    assert shlex.split(stage["ENTRYPOINT"].strip("[]").replace(",", " ")) == ["specsplit"]
    command = shlex.split(stage["CMD"].strip("[]").replace(",", " "))
    assert command[0] in COMMANDS and "0.0.0.0" in command


def test_dockerignore_keeps_what_the_build_copies():
    kept = {
        line.removeprefix("!").rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = set()
    for word, rest in instructions():
        if word == "COPY" and not rest.startswith("--from"):
            copied |= {s.removeprefix("./").rstrip("/") for s in rest.split()[:-1]}
    assert copied and copied <= kept, copied - kept
