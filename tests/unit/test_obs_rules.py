"""Alert rules and scrape config of infra/prometheus/.

Two tiers. The pure-Python checks always run: every rule is complete (expr, for,
labels.severity, annotations summary + description), every metric it reads is a family of
services/common/metrics.py (so a renamed metric breaks this test, not a silent alert), every
alert has a firing and a non-firing case in alerts_test.yml, and the scrape targets are the
ports the local stack gives its services. The promtool checks run the real rule engine
(`promtool check rules|config`, `promtool test rules`) when infra/promtool/build.sh has
built the binary into .llmq/cache/promtool/, and skip with that instruction otherwise.

:func:`known_series` and :func:`promql_metric_names` are shared with the dashboard test.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.registry import CollectorRegistry

from services.common import metrics
from services.common.settings import Settings
from services.stack import StackConfig, stack_services

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "infra" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
ALERTS_TEST = PROM_DIR / "alerts_test.yml"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
#: Where infra/promtool/build.sh puts the binary (it honours LLMQ_HOME the same way).
PROMTOOL = Settings().cache_dir / "promtool" / "promtool"

#: Series that Prometheus itself makes, not llmq.
PROMETHEUS_SERIES = frozenset({"up"})
SEVERITIES = frozenset({"critical", "warning"})

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "offset", "bool", "inf", "nan", "atan2",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def family_series(registry: CollectorRegistry = metrics.REGISTRY) -> dict[str, frozenset[str]]:
    """``{family: the series names a PromQL query may read of it}``, for llmq's families.

    Counters are queried as ``<name>_total``; histograms as ``_bucket``/``_sum``/``_count``;
    gauges by name. (The ``_created`` series of counters and histograms are left out on
    purpose: nothing should alert on process start times.)
    """
    out: dict[str, frozenset[str]] = {}
    for family in registry.collect():
        suffixes = _SUFFIXES.get(family.type)
        assert suffixes is not None, f"unexpected family type {family.type} of {family.name}"
        out[family.name] = frozenset(family.name + suffix for suffix in suffixes)
    return out


def known_series() -> frozenset[str]:
    """Every series name of :func:`family_series`."""
    return frozenset().union(*family_series().values())


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a small lexer, enough for our rules).

    Strings, label matchers, range/subquery brackets and grouping clauses are removed; what
    is left that looks like an identifier, is not a keyword and is not called like a
    function is a metric name. Identifiers glued to a digit (``5m``, ``1e-6``) or a ``$``
    (Grafana variables) are not names.
    """
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = _GROUPING.sub(" ", s)
    names: set[str] = set()
    for m in _IDENT.finditer(s):
        word = m.group(0)
        if word.lower() in _KEYWORDS or s[m.end():].lstrip().startswith("("):
            continue
        if m.start() > 0 and s[m.start() - 1].isdigit():
            continue
        names.add(word)
    return names


@pytest.mark.parametrize(("expr", "names"), [
    ("up == 0", {"up"}),
    ('sum by (code) (rate(llmq_rejections_total{code="rate_limited"}[5m]))',
     {"llmq_rejections_total"}),
    ("histogram_quantile(0.9, sum by (le) (rate(x_bucket[$__rate_interval])))", {"x_bucket"}),
    ("a / on (topic) group_left b > 1e-6 and c offset 5m", {"a", "b", "c"}),
    ('absent(m{job="x"}) or vector(0)', {"m"}),
    ("sum(x) by (le) unless y", {"x", "y"}),
    ('max(deriv(q[5m:1m])) > bool 2 or label_replace(z, "a", "$1", "b", "(.*)")', {"q", "z"}),
])
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_known_series_follow_the_family_types() -> None:
    families = family_series()
    assert families["llmq_requests"] == {"llmq_requests_total"}
    assert families["llmq_queue_wait_seconds"] == {
        "llmq_queue_wait_seconds_bucket", "llmq_queue_wait_seconds_sum",
        "llmq_queue_wait_seconds_count"}
    assert families["llmq_queue_depth"] == {"llmq_queue_depth"}
    assert "llmq_requests_created" not in known_series()


# -- alerts.yml, pure ------------------------------------------------------------------------

def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _rules() -> Iterator[dict[str, Any]]:
    for group in _load(ALERTS)["groups"]:
        yield from group["rules"]


RULES = list(_rules())


def test_alerts_file_shape() -> None:
    groups = [g["name"] for g in _load(ALERTS)["groups"]]
    assert len(groups) == len(set(groups)), "group names must be unique"
    names = [r["alert"] for r in RULES]
    assert len(names) == len(set(names)), "alert names must be unique"
    assert all(re.fullmatch(r"Llmq[A-Z][A-Za-z]+", n) for n in names), names


def test_the_issue_s_alerts_exist() -> None:
    names = {r["alert"] for r in RULES}
    assert {"LlmqQueueDepthRising", "LlmqQueueWaitHigh", "LlmqRateLimitSpike",
            "LlmqWorkerDown", "LlmqWorkerLost", "LlmqConsumerLagGrowing",
            "LlmqDeadLetters"} <= names


@pytest.mark.parametrize("rule", RULES, ids=[r["alert"] for r in RULES])
def test_rule_is_complete(rule: dict[str, Any]) -> None:
    assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}
    assert re.fullmatch(r"\d+[smh]", str(rule["for"])), rule["for"]
    assert rule["labels"]["severity"] in SEVERITIES
    notes = rule["annotations"]
    assert set(notes) == {"summary", "description"}
    assert "\n" not in notes["summary"] and len(notes["summary"]) <= 120
    # A runbook says what happened and what to do: a paragraph, not a restated summary.
    assert len(notes["description"]) >= 200, notes["description"]


@pytest.mark.parametrize("rule", RULES, ids=[r["alert"] for r in RULES])
def test_rule_reads_only_known_metrics(rule: dict[str, Any]) -> None:
    names = promql_metric_names(rule["expr"])
    assert names, f"no metric found in {rule['expr']!r}"
    unknown = names - known_series() - PROMETHEUS_SERIES
    assert not unknown, f"{rule['alert']} reads {sorted(unknown)}, not in common/metrics.py"


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    doc = _load(ALERTS_TEST)
    assert doc["rule_files"] == ["alerts.yml"]
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in doc["tests"]:
        for check in test["alert_rule_test"]:
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in RULES}
    assert names - fires == set(), "alerts without a case that fires"
    assert names - quiet == set(), "alerts without a case that must stay quiet"
    assert (fires | quiet) <= names, "tests for alerts that do not exist"


# -- prometheus.yml, pure --------------------------------------------------------------------

def _job_for(service: str) -> str:
    return "llmq-worker" if service.startswith("worker-") else f"llmq-{service}"


def test_scrape_targets_are_the_stack_s_metrics_ports() -> None:
    """prometheus.yml scrapes exactly the ports `llmq up` gives the default stack."""
    config = _load(PROM_CONFIG)
    assert config["rule_files"] == ["alerts.yml"]
    scraped: dict[str, dict[str, int]] = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                scraped.setdefault(job["job_name"], {})[static["labels"]["service"]] = int(
                    target.rsplit(":", 1)[1])
    expected: dict[str, dict[str, int]] = {}
    for spec in stack_services(StackConfig()):
        port = int(dict(spec.env)["LLMQ_METRICS_PORT"])
        expected.setdefault(_job_for(spec.name), {})[spec.name] = port
    assert scraped == expected


# -- the real rule engine --------------------------------------------------------------------

def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not PROMTOOL.exists():
        pytest.skip(f"promtool not built at {PROMTOOL}: run infra/promtool/build.sh "
                    "(Go + module proxy, several minutes once)")
    return subprocess.run([str(PROMTOOL), *args], cwd=PROM_DIR, capture_output=True,
                          text=True, timeout=120, check=False)


def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config() -> None:
    result = _promtool("check", "config", PROM_CONFIG.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = _promtool("test", "rules", ALERTS_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
