"""The arithmetic of ``llmq top`` on metric text: parsing, counter increases and rates
(resets, new series, endpoints missing from a scrape), histogram sums and quantiles with
PromQL's ``histogram_quantile`` semantics."""

from __future__ import annotations

import math

import pytest

from services.ops.promtext import (
    Bucket,
    Scrape,
    gauge_by,
    histogram_quantile,
    histograms,
    increases,
    parse_scrape,
    rate,
    window_histograms,
)

INF = math.inf


def counter(name: str, *series: tuple[str, float]) -> str:
    """Exposition text of counter ``name`` with ``(label text, value)`` series."""
    lines = [f"# TYPE {name} counter"]
    lines += [f"{name}_total{{{labels}}} {value}" for labels, value in series]
    return "\n".join(lines) + "\n"


def histogram(name: str, *series: tuple[str, list[tuple[str, float]], float]) -> str:
    """Exposition text of histogram ``name``: ``(label text, [(le, count)], sum)`` series."""
    lines = [f"# TYPE {name} histogram"]
    for labels, buckets, total in series:
        sep = "," if labels else ""
        lines += [f'{name}_bucket{{{labels}{sep}le="{le}"}} {n}' for le, n in buckets]
        lines += [f"{name}_sum{{{labels}}} {total}", f"{name}_count{{{labels}}} {buckets[-1][1]}"]
    return "\n".join(lines) + "\n"


def scrape(text: str, at: float, source: str = "svc") -> Scrape:
    return parse_scrape(text, source, at)


def test_parse_keeps_sample_names_and_sorted_labels() -> None:
    s = scrape(counter("llmq_x", ('b="2",a="1"', 3.0)) + "# TYPE g gauge\ng 4\n", 0.0)
    assert s.samples == {("llmq_x_total", (("a", "1"), ("b", "2"))): 3.0, ("g", ()): 4.0}
    assert s.has("g") and not s.has("llmq_x")
    assert list(s.values("llmq_x_total", {"a": "1"})) == [((("a", "1"), ("b", "2")), 3.0)]
    assert list(s.values("llmq_x_total", {"a": "2"})) == []


def test_parse_rejects_what_is_not_exposition_text() -> None:
    with pytest.raises(ValueError):
        parse_scrape("<html>not metrics</html>\n", "svc", 0.0)


@pytest.mark.parametrize(("before", "after", "expected"), [
    pytest.param([('o="done"', 10.0)], [('o="done"', 15.0)], {"done": 5.0}, id="grows"),
    pytest.param([('o="done"', 10.0)], [('o="done"', 10.0)], {"done": 0.0}, id="flat"),
    pytest.param([('o="done"', 10.0)], [('o="done"', 3.0)], {"done": 3.0}, id="reset"),
    pytest.param([('o="done"', 10.0)], [('o="done"', 12.0), ('o="timeout"', 2.0)],
                 {"done": 2.0, "timeout": 2.0}, id="new series counts from 0"),
    pytest.param([('o="done"', 10.0), ('o="x"', 1.0)], [('o="done"', 10.0)], {"done": 0.0},
                 id="vanished series is not negative"),
])
def test_increases(before: list[tuple[str, float]], after: list[tuple[str, float]],
                   expected: dict[str, float]) -> None:
    prev = scrape(counter("r", *before), 0.0)
    cur = scrape(counter("r", *after), 1.0)
    got = {dict(labels)["o"]: v for labels, v in increases(prev, cur, "r_total")}
    assert got == expected


def test_rate_sums_endpoints_over_their_window() -> None:
    prev = {"a": scrape(counter("r", ('o="done"', 10.0)), 100.0, "a"),
            "b": scrape(counter("r", ('o="done"', 0.0), ('o="x"', 5.0)), 100.0, "b")}
    cur = {"a": scrape(counter("r", ('o="done"', 30.0)), 102.0, "a"),
           "b": scrape(counter("r", ('o="done"', 4.0), ('o="x"', 9.0)), 102.0, "b"),
           # answered only now: no window for it, so it adds nothing
           "c": scrape(counter("r", ('o="done"', 1000.0)), 102.0, "c")}
    assert rate(prev, cur, "r_total") == pytest.approx((20 + 4 + 4) / 2)
    assert rate(prev, cur, "r_total", {"o": "done"}) == pytest.approx((20 + 4) / 2)
    assert rate(prev, cur, "r_total", {"o": "none"}) == 0.0  # exposed, nothing matched
    assert rate(prev, cur, "other_total") is None  # nobody exposes it
    assert rate({}, cur, "r_total") is None  # one scrape is not a rate


def test_gauge_by_sums_over_endpoints() -> None:
    text_a = '# TYPE d gauge\nd{p="high",l="short"} 3\nd{p="low",l="long"} 1\n'
    text_b = '# TYPE d gauge\nd{p="high",l="short"} 4\nd{p="low"} 2\n'
    got = gauge_by([scrape(text_a, 0.0), scrape(text_b, 0.0)], "d", ("p", "l"))
    assert got == {("high", "short"): 7.0, ("low", "long"): 1.0, ("low", ""): 2.0}


@pytest.mark.parametrize(("q", "buckets", "expected"), [
    pytest.param(0.5, [(0.1, 0), (0.5, 10), (1.0, 10), (INF, 10)], 0.3, id="interpolates"),
    pytest.param(0.9, [(0.1, 0), (0.5, 10), (1.0, 10), (INF, 10)], 0.46, id="p90"),
    pytest.param(0.25, [(1.0, 4), (2.0, 8), (INF, 8)], 0.5, id="first bucket starts at 0"),
    pytest.param(0.9, [(1.0, 1), (2.0, 2), (INF, 10)], 2.0, id="rank in +Inf: largest bound"),
    pytest.param(1.0, [(1.0, 2), (2.0, 4), (INF, 4)], 2.0, id="q=1"),
    pytest.param(0.5, [(2.0, 4), (INF, 4), (1.0, 2)], 1.0, id="unsorted input"),
    pytest.param(0.5, [(1.0, 5), (2.0, 4), (INF, 10)], 1.0, id="non-monotonic is fixed"),
    pytest.param(0.25, [(-1.0, 2), (INF, 4)], -1.0, id="non-positive first bound"),
    pytest.param(0.5, [(1.0, 0), (INF, 0)], None, id="no observations"),
    pytest.param(0.5, [(1.0, 5), (2.0, 5)], None, id="no +Inf bucket"),
    pytest.param(0.5, [(INF, 3)], None, id="only +Inf"),
    pytest.param(0.5, [], None, id="empty"),
])
def test_histogram_quantile(q: float, buckets: list[Bucket], expected: float | None) -> None:
    got = histogram_quantile(q, buckets)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("q", [-0.1, 1.5])
def test_histogram_quantile_rejects_q_outside_0_1(q: float) -> None:
    with pytest.raises(ValueError):
        histogram_quantile(q, [(1.0, 1), (INF, 1)])


def _wait(lane: str, b: tuple[float, float, float], total: float
          ) -> tuple[str, list[tuple[str, float]], float]:
    return (f'priority="high",lane="{lane}"', [("0.1", b[0]), ("1.0", b[1]), ("+Inf", b[2])],
            total)


def test_histograms_sum_series_by_labels() -> None:
    s = scrape(histogram("w", _wait("short", (1, 3, 4), 2.0), _wait("long", (0, 2, 2), 1.5)),
               0.0)
    everything = histograms([s], "w")[()]
    assert everything.buckets == ((0.1, 1.0), (1.0, 5.0), (INF, 6.0))
    assert (everything.sum, everything.count) == (3.5, 6.0)
    by_lane = histograms([s], "w", ("lane",))
    assert by_lane[("short",)].count == 4 and by_lane[("long",)].mean == 0.75
    assert histograms([s], "absent") == {}


def test_window_histograms_are_the_observations_in_between() -> None:
    prev = {"s": scrape(histogram("w", _wait("short", (5, 8, 10), 4.0)), 0.0)}
    cur = {"s": scrape(histogram("w", _wait("short", (5, 18, 20), 7.0)), 1.0)}
    window = window_histograms(prev, cur, "w")[()]
    assert window.buckets == ((0.1, 0.0), (1.0, 10.0), (INF, 10.0))
    assert window.mean == pytest.approx(0.3)
    assert window.quantile(0.5) == pytest.approx(0.1 + 0.9 * 5 / 10)
    since_start = histograms(cur.values(), "w")[()]
    assert since_start.quantile(0.5) == pytest.approx(0.1 + 0.9 * (10 - 5) / 13)
    assert window_histograms({}, cur, "w") == {}
