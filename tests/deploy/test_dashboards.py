"""grafana/: the dashboards are well-formed, query only metrics the code exports,
and cover what the overview must show. That every panel query returns data
from a real Prometheus is proven in test_live.py.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.conftest import REPO, exported_metric_names

DASHBOARDS = sorted((REPO / "grafana/dashboards").glob("*.json"))
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")  # a metric name before its label matchers
NAME = re.compile(r"\bspecsplit_[a-z0-9_]+")
NAMESPACE_FILTER = 'namespace=~"$namespace"'
RATE_WINDOW = "2m"  # stands in for Grafana's $__rate_interval: covers the tests' traffic


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # panels inside collapsed rows
    return [p for p in out if p["type"] != "row"]


def queries() -> list[tuple[str, str, list[str]]]:
    """(dashboard file, panel title, [expr, ...]) of every panel."""
    out = []
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            out.append((path.name, panel["title"], [t["expr"] for t in panel["targets"]]))
    return out


def concrete(expr: str) -> str:
    """The query as Grafana sends it: variables replaced (namespace: All, i.e. .*)."""
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    expr = expr.replace("${namespace}", ".*").replace("$namespace", ".*")
    assert "$" not in expr, f"an unsubstituted variable in {expr}"
    return expr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path):
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["allValue"] == ".*"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboards_query_only_exported_metrics():
    exported = exported_metric_names()
    assert len(queries()) >= 20
    for name, title, exprs in queries():
        for expr in exprs:
            used = set(SELECTOR.findall(expr)) | set(NAME.findall(expr))
            assert used, f"{name} / {title}: no metric in {expr}"
            assert used <= exported, f"{name} / {title}: not exported: {used - exported}"
            # every selector filters on the namespace variable
            assert expr.count("{") == expr.count(NAMESPACE_FILTER), f"{name} / {title}: {expr}"


def test_overview_covers_the_issue():
    """The overview shows what an operator of speculative decoding looks at first."""
    overview = json.loads((REPO / "grafana/dashboards/specsplit-overview.json").read_text())
    text = json.dumps(overview)
    for metric in (
        "specsplit_requests_total",
        "specsplit_time_to_first_token_seconds_bucket",
        "specsplit_inter_token_latency_seconds_bucket",
        "specsplit_e2e_request_latency_seconds_bucket",
        "specsplit_generation_tokens_total",
        "specsplit_accepted_tokens_total",
        "specsplit_draft_tokens_total",
        "specsplit_verify_steps_total",
        "specsplit_accepted_tokens_per_position_total",
        "specsplit_live_sessions",
        "specsplit_num_requests_running",
        "specsplit_num_requests_waiting",
        "specsplit_request_queue_time_seconds_bucket",
        "specsplit_worker_up",
        "specsplit_worker_batch_size_bucket",
        "specsplit_round_phase_seconds_bucket",
    ):
        assert metric in text, metric
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(specsplit_time_to_first" in text


def test_provisioning_files_match_the_dashboards():
    datasources = yaml.safe_load(
        (REPO / "grafana/provisioning/datasources/specsplit.yaml").read_text()
    )
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    providers = yaml.safe_load(
        (REPO / "grafana/provisioning/dashboards/specsplit.yaml").read_text()
    )
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    for path in DASHBOARDS:
        variables = json.loads(path.read_text())["templating"]["list"]
        default = next(v for v in variables if v["name"] == "datasource")["current"]["value"]
        assert default == source["uid"]
