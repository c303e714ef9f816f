"""The Grafana dashboard and its provisioning (infra/grafana/).

The dashboard is valid for Grafana's file provisioning (uid, title, panels with ids, grid
positions, a Prometheus datasource, targets with ``expr``), every query reads only series
of services/common/metrics.py (or Prometheus's ``up``), and the issue's views are there:
queue depth and wait by class, TTFT/latency percentiles, the 429 rate, KV per worker,
decision latency. The provisioning files point where infra/compose.yml mounts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_obs_rules import (
    PROMETHEUS_SERIES,
    family_series,
    known_series,
    promql_metric_names,
)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "infra" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "llmq.json"
#: infra/compose.yml mounts infra/grafana/ here.
MOUNT = "/etc/grafana/provisioning/dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
#: Families deliberately left off the dashboard, with the reason.
NOT_ON_DASHBOARD: dict[str, str] = {}


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return doc


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


PANELS = [p for p in _panels(_dashboard()["panels"]) if p["type"] != "row"]
TARGETS = [(p["title"], t) for p in PANELS for t in p["targets"]]


def test_dashboard_header() -> None:
    doc = _dashboard()
    assert doc["uid"] == "llmq-overview" and doc["title"]
    assert isinstance(doc["schemaVersion"], int) and doc["schemaVersion"] >= 36
    (var,) = doc["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("DS_PROMETHEUS", "datasource",
                                                        "prometheus")


def test_panels_are_well_formed() -> None:
    every = list(_panels(_dashboard()["panels"]))
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in every:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, panel["title"]
    for panel in PANELS:
        assert panel["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"}
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(_dashboard()["panels"]):
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize(("title", "target"), TARGETS,
                         ids=[f"{title}:{t['refId']}" for title, t in TARGETS])
def test_target_reads_only_known_metrics(title: str, target: dict[str, Any]) -> None:
    assert target["datasource"] == DATASOURCE
    names = promql_metric_names(target["expr"])
    assert names, f"{title}: no metric in {target['expr']!r}"
    unknown = names - known_series() - PROMETHEUS_SERIES
    assert not unknown, f"{title} reads {sorted(unknown)}: not in services/common/metrics.py"


def test_the_issue_s_views_are_there() -> None:
    exprs = "\n".join(t["expr"] for _, t in TARGETS)
    for needle in (
        "sum by (priority, lane) (llmq_queue_depth)",
        "llmq_queue_wait_seconds_sum",
        "histogram_quantile(0.99, sum by (le) (rate(llmq_time_to_first_token_seconds_bucket",
        "histogram_quantile(0.9, sum by (le) (rate(llmq_request_duration_seconds_bucket",
        'llmq_rejections_total{code="rate_limited"}',
        "max by (worker) (llmq_worker_kv_utilization_ratio)",
        "llmq_schedule_decision_seconds_bucket",
    ):
        assert needle in exprs, needle


def test_dashboard_covers_every_family() -> None:
    """Every family of services/common/metrics.py is on some panel: a family added there
    fails here until the dashboard shows it (or it is listed in NOT_ON_DASHBOARD with why)."""
    used = {n for _, t in TARGETS for n in promql_metric_names(t["expr"])}
    missing = {family for family, series in family_series().items()
               if not series & used and family not in NOT_ON_DASHBOARD}
    assert not missing, f"families without a panel: {sorted(missing)}"


def test_provisioning_points_at_the_dashboard() -> None:
    provider = yaml.safe_load((GRAFANA / "dashboards.yml").read_text(encoding="utf-8"))
    assert provider["apiVersion"] == 1
    (entry,) = provider["providers"]
    assert entry["type"] == "file"
    path = Path(entry["options"]["path"])
    assert path.is_relative_to(MOUNT)
    assert (GRAFANA / path.relative_to(MOUNT) / DASHBOARD.name).is_file()
    sources = yaml.safe_load((GRAFANA / "datasources" / "prometheus.yml").read_text("utf-8"))
    (source,) = sources["datasources"]
    assert (source["type"], source["url"], source["isDefault"]) == (
        "prometheus", "http://127.0.0.1:9090", True)


def test_compose_listens_on_loopback_only_and_can_reach_the_services() -> None:
    """Published ports are on 127.0.0.1; Prometheus and Grafana, on the host's network to
    reach services bound to its loopback, listen on 127.0.0.1 too."""
    compose = yaml.safe_load((GRAFANA.parent / "compose.yml").read_text(encoding="utf-8"))
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    prometheus, grafana = compose["services"]["prometheus"], compose["services"]["grafana"]
    assert prometheus["network_mode"] == grafana["network_mode"] == "host"
    assert "--web.listen-address=127.0.0.1:9090" in prometheus["command"]
    assert grafana["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    targets = (GRAFANA.parent / "prometheus" / "prometheus.yml").read_text(encoding="utf-8")
    assert "host.docker.internal" not in targets
