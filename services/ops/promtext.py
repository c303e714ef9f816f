"""Prometheus text exposition as plain samples, and the arithmetic ``llmq top`` does on it.

Pure: parsing goes through ``prometheus_client.parser``; the rest is dictionaries and
floats, so the tests are tables of metric text. The semantics follow Prometheus where they
overlap, so ``llmq top`` and the Grafana dashboard agree:

- :func:`increases` is ``increase()`` between two scrapes of one endpoint without the
  extrapolation: a value lower than before is a counter reset (the new value is the
  increase), and a series absent from the earlier scrape counts from 0 (prometheus_client
  creates a labelled child on its first ``inc``, so its whole value happened in between);
- :func:`histogram_quantile` is PromQL's ``histogram_quantile`` over cumulative buckets:
  linear interpolation inside the bucket holding the rank, the lowest bucket starting at
  0, and the largest finite bound when the rank falls in ``+Inf``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

#: Sorted ``(label, value)`` pairs: hashable, and equal for equal label sets.
Labels = tuple[tuple[str, str], ...]
#: One cumulative bucket: (upper bound ``le``, observations ≤ it).
Bucket = tuple[float, float]

INF: Final = math.inf


@dataclass(frozen=True, slots=True)
class Scrape:
    """Every sample of one endpoint at one moment: ``{(sample name, labels): value}``.

    ``at`` is when the scrape was taken (seconds on a monotonic clock; only differences
    matter). Sample names are as exposed: ``x_total``, ``h_bucket``, ``h_sum``, ...
    """

    source: str
    at: float
    samples: Mapping[tuple[str, Labels], float]

    def values(self, name: str, where: Mapping[str, str] | None = None
               ) -> Iterator[tuple[Labels, float]]:
        """``(labels, value)`` of every sample called ``name`` whose labels match ``where``."""
        for (sample, labels), value in self.samples.items():
            if sample == name and matches(labels, where):
                yield labels, value

    def has(self, name: str) -> bool:
        return any(sample == name for sample, _ in self.samples)


def matches(labels: Labels, where: Mapping[str, str] | None) -> bool:
    """True when every ``label=value`` of ``where`` is among ``labels``."""
    if not where:
        return True
    have = dict(labels)
    return all(have.get(k) == v for k, v in where.items())


def parse_scrape(text: str, source: str, at: float) -> Scrape:
    """Parse exposition text; ValueError when it is not valid exposition format."""
    samples: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return Scrape(source, at, MappingProxyType(samples))


def increases(prev: Scrape, cur: Scrape, name: str, where: Mapping[str, str] | None = None
              ) -> Iterator[tuple[Labels, float]]:
    """Per series of ``cur``: how much counter (or cumulative bucket) ``name`` grew since
    ``prev`` (module docstring: resets and new series)."""
    for labels, value in cur.values(name, where):
        before = prev.samples.get((name, labels))
        if before is None or value < before:
            yield labels, value
        else:
            yield labels, value - before


def rate(prev: Mapping[str, Scrape], cur: Mapping[str, Scrape], name: str,
         where: Mapping[str, str] | None = None) -> float | None:
    """Σ over endpoints scraped both times of increase / elapsed, per second.

    None when no endpoint scraped both times exposes ``name`` (no data, which is not 0).
    """
    total: float | None = None
    for source, now in cur.items():
        before = prev.get(source)
        if before is None or now.at <= before.at or not now.has(name):
            continue
        grown = sum(v for _, v in increases(before, now, name, where))
        total = (total or 0.0) + grown / (now.at - before.at)
    return total


def gauge_by(scrapes: Iterable[Scrape], name: str, by: Sequence[str],
             where: Mapping[str, str] | None = None) -> dict[tuple[str, ...], float]:
    """``sum by (by) (name)`` over every endpoint; a missing label groups as ``""``."""
    out: dict[tuple[str, ...], float] = {}
    for scrape in scrapes:
        for labels, value in scrape.values(name, where):
            have = dict(labels)
            key = tuple(have.get(label, "") for label in by)
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram, summed over series: cumulative buckets, sum and count."""

    buckets: tuple[Bucket, ...]
    sum: float
    count: float

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)

    @property
    def mean(self) -> float | None:
        return None if self.count <= 0 else self.sum / self.count


def _le(labels: Labels) -> tuple[Labels, float] | None:
    have = dict(labels)
    bound = have.pop("le", None)
    if bound is None:
        return None
    return tuple(sorted(have.items())), float(bound)  # float("+Inf") is inf


def _group(labels: Labels, by: Sequence[str]) -> tuple[str, ...]:
    have = dict(labels)
    return tuple(have.get(label, "") for label in by)


def _assemble(parts: Iterable[tuple[str, Labels, float]], family: str, by: Sequence[str]
              ) -> dict[tuple[str, ...], Histogram]:
    """Sum ``(sample name, labels, value)`` of one family into a histogram per group."""
    buckets: dict[tuple[str, ...], dict[float, float]] = {}
    sums: dict[tuple[str, ...], float] = {}
    counts: dict[tuple[str, ...], float] = {}
    for sample, labels, value in parts:
        if sample == family + "_bucket":
            split = _le(labels)
            if split is None:
                continue
            rest, bound = split
            per = buckets.setdefault(_group(rest, by), {})
            per[bound] = per.get(bound, 0.0) + value
        elif sample == family + "_sum":
            key = _group(labels, by)
            sums[key] = sums.get(key, 0.0) + value
        elif sample == family + "_count":
            key = _group(labels, by)
            counts[key] = counts.get(key, 0.0) + value
    return {
        key: Histogram(tuple(sorted(per.items())), sums.get(key, 0.0), counts.get(key, 0.0))
        for key, per in buckets.items()
    }


def _suffixed(family: str) -> tuple[str, str, str]:
    return family + "_bucket", family + "_sum", family + "_count"


def histograms(scrapes: Iterable[Scrape], family: str, by: Sequence[str] = (),
               where: Mapping[str, str] | None = None) -> dict[tuple[str, ...], Histogram]:
    """The histogram ``family`` since each process started, summed by ``by`` labels."""
    parts = [(name, labels, value) for scrape in scrapes for name in _suffixed(family)
             for labels, value in scrape.values(name, where)]
    return _assemble(parts, family, by)


def window_histograms(prev: Mapping[str, Scrape], cur: Mapping[str, Scrape], family: str,
                      by: Sequence[str] = (), where: Mapping[str, str] | None = None
                      ) -> dict[tuple[str, ...], Histogram]:
    """The observations of ``family`` between the two scrapes of each endpoint."""
    parts = [(name, labels, value)
             for source, now in cur.items() if source in prev
             for name in _suffixed(family)
             for labels, value in increases(prev[source], now, name, where)]
    return _assemble(parts, family, by)


def histogram_quantile(q: float, buckets: Sequence[Bucket]) -> float | None:
    """PromQL ``histogram_quantile(q, ...)`` of cumulative ``(le, count)`` buckets.

    None when there is nothing to rank: no observation, or no ``+Inf`` bucket (Prometheus
    answers NaN for both). Counts that decrease with ``le`` (a scrape racing an observation)
    are raised to the running maximum, as Prometheus does.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    ordered = sorted(buckets)
    if not ordered or ordered[-1][0] != INF:
        return None
    fixed: list[Bucket] = []
    running = 0.0
    for bound, count in ordered:
        running = max(running, count)
        fixed.append((bound, running))
    total = fixed[-1][1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, (_, count) in enumerate(fixed) if count >= rank)
    if index == len(fixed) - 1:
        # The rank is in +Inf: the largest finite bound is the best answer there is.
        return fixed[-2][0] if len(fixed) > 1 else None
    upper, count = fixed[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = fixed[index - 1] if index > 0 else (0.0, 0.0)
    in_bucket = count - below
    if in_bucket <= 0:  # q = 0 over an empty first bucket: the bucket's start is the answer
        return lower
    return lower + (upper - lower) * (rank - below) / in_bucket
