"""The benchmark matrix: {conv, code} traces × loads {0.6, 0.85, 0.95}, one markdown table.

``run_matrix`` runs ``llmq bench policies`` once per cell (same fleet, profile, seed and
llmq settings as the base config) and ``render_markdown`` turns the results into one
table of the targets, each figure with its target and a ✓ or ✗:

=====================  ===========================================================
short p99 e2e ÷ fifo   llmq's short-lane P99 end-to-end latency ÷ fifo-rr's  ≤ 0.10
floor ÷ fifo           the short lane's P99 latency *alone* ÷ fifo-rr's short P99: no
                       policy goes below it, so above 0.10 the first target is out of
                       reach on that cell by construction
÷ best other           ... ÷ the best of least-requests and vllm-random       ≤ 0.50
long tok/s ÷ fifo      llmq's long-lane completed tokens/s ÷ fifo-rr's        ≥ 0.95
high queue p99         llmq's high class, P99 time in the scheduler's queue   ≤ 0.1 s
low max wait           llmq's low class, maximum wait (TTFT − TTFT alone)
                       ≤ aging bound + longest service time of the run
llmq preemptions       KV preemptions in llmq's engines                        = 0
=====================  ===========================================================

Rejections count against llmq: the short-lane ratios use P99 *with rejections* (a
rejected request counts as the full timeout), and the rejection rate is a column.

One seed is one draw of tenants and classes (and of the samples that size the pools and
measure capacity): at 0.95 the figures move by up to ±0.2 between seeds. With several
seeds, ``render_seed_ranges`` gives each target's range over them and at how many it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from services.sim.bench import BenchConfig, ProgressFactory, run_bench

TRACE_FILES: Final = {"conv": "azure_llm_2023_conv.csv", "code": "azure_llm_2023_code.csv"}
LOADS: Final = (0.6, 0.85, 0.95)
BASELINES: Final = ("least-requests", "vllm-random")
POLICY_NAMES: Final = ("fifo-rr", "least-requests", "vllm-random", "llmq")


@dataclass(frozen=True, slots=True)
class Cell:
    """One run of the matrix."""

    trace: str
    load: float
    doc: dict[str, Any]


def run_matrix(
    base: BenchConfig,
    traces_dir: Path,
    progress: ProgressFactory | None = None,
    *,
    traces: Sequence[str] = tuple(TRACE_FILES),
    loads: Sequence[float] = LOADS,
) -> list[Cell]:
    """Every (trace, load) cell with all four policies; the rest of ``base`` is kept."""
    cells = []
    for trace in traces:
        for load in loads:
            config = replace(
                base, trace=traces_dir / TRACE_FILES[trace], synthetic=False, load=load,
                policies=POLICY_NAMES,
            )
            doc, _ = run_bench(config, progress)
            cells.append(Cell(trace, load, doc))
    return cells


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    """The target figures of one run (None where a figure is missing)."""
    p = doc["policies"]
    llmq, fifo = p["llmq"], p["fifo-rr"]
    short = llmq["lanes"]["short"]
    mine = short["e2e_p99_with_rejections_s"]
    best_name = min(BASELINES, key=lambda n: p[n]["lanes"]["short"]["e2e_p99_s"] or 1e300)
    best = p[best_name]["lanes"]["short"]["e2e_p99_s"]
    fifo_short = fifo["lanes"]["short"]["e2e_p99_s"]
    floor = short.get("e2e_alone_p99_s")  # the same arrivals, so the same for every policy
    long_mine = llmq["lanes"]["long"]["completed_tokens_per_s"]
    long_fifo = fifo["lanes"]["long"]["completed_tokens_per_s"]
    low = llmq["classes"]["low"]
    bound = None
    if llmq["aging_bound_s"] is not None and llmq["max_service_s"] is not None:
        bound = llmq["aging_bound_s"] + llmq["max_service_s"]
    arrived = sum(lane["arrived"] for lane in llmq["lanes"].values())
    return {
        "short_p99": mine,
        "fifo_short_p99": fifo_short,
        "best_other": best_name,
        "best_other_short_p99": best,
        "ratio_fifo": _ratio(mine, fifo_short),
        "short_floor": floor,
        "floor_fifo": _ratio(floor, fifo_short),
        "ratio_best": _ratio(mine, best),
        "long_ratio": _ratio(long_mine, long_fifo),
        "high_queue_p99": llmq["classes"]["high"]["queue_p99_s"],
        "high_wait_p99": llmq["classes"]["high"]["wait_p99_s"],
        "low_wait_max": low["wait_max_s"],
        "low_bound": bound,
        "preemptions": llmq["kv_preemptions"],
        "baseline_preemptions": {n: p[n]["kv_preemptions"] for n in ("fifo-rr", *BASELINES)},
        "rejection_rate": llmq["rejected"] / arrived if arrived else 0.0,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ✓" if ok else " ✗")


def _num(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{unit}"


def _shown(x: float, ok: Callable[[float], bool], fmt: str) -> str:
    """``x`` as ``fmt`` prints it, with up to two more decimals where the printed value
    would read the other way than ``x`` itself (0.502 against ≤ 0.50: "0.502", not
    "0.50")."""
    text = f"{x:{fmt}}"
    if fmt.startswith(".") and fmt.endswith("f"):
        digits = int(fmt[1:-1])
        for more in (1, 2):
            if ok(float(text)) == ok(x):
                break
            text = f"{x:.{digits + more}f}"
    return text


def _judged(x: float | None, ok: Callable[[float], bool], fmt: str = ".2f",
            unit: str = "") -> str:
    """A figure with its ✓ or ✗ (nothing for a missing figure)."""
    return "—" if x is None else f"{_shown(x, ok, fmt)}{unit}{_mark(ok(x))}"


def render_markdown(cells: Sequence[Cell], base: BenchConfig) -> str:
    """One markdown table of every target in every cell, with a legend line."""
    head = (
        "| trace | load | llmq short p99 (s) | fifo-rr | best other | ÷ fifo ≤ 0.10 "
        "| floor ÷ fifo | ÷ best ≤ 0.50 | long tok/s ÷ fifo ≥ 0.95 | high queue p99 ≤ 0.1 s "
        "| high wait p99 | low max wait ≤ bound | llmq preempt = 0 | baseline preempt "
        "| llmq rejected |"
    )
    rows = [head, _rule(head)]
    for cell in cells:
        t = targets(cell.doc)
        ratio_fifo, ratio_best, long_ratio = t["ratio_fifo"], t["ratio_best"], t["long_ratio"]
        bound, low = t["low_bound"], t["low_wait_max"]
        pre = t["baseline_preemptions"]
        rows.append(
            "| " + " | ".join([
                cell.trace,
                f"{cell.load:g}",
                _num(t["short_p99"]),
                _num(t["fifo_short_p99"]),
                f"{_num(t['best_other_short_p99'])} ({t['best_other']})",
                _judged(ratio_fifo, lambda v: v <= 0.10),
                _floor(t["floor_fifo"]),
                _judged(ratio_best, lambda v: v <= 0.50),
                _judged(long_ratio, lambda v: v >= 0.95, ".3f"),
                _judged(t["high_queue_p99"], lambda v: v <= 0.1, ".3f", " s"),
                _num(t["high_wait_p99"], ".3f", " s"),
                f"{_num(low, '.1f')} ≤ {_num(bound, '.1f')} s"
                + _mark(None if low is None or bound is None else low <= bound),
                f"{t['preemptions']}" + _mark(t["preemptions"] == 0),
                " / ".join(f"{pre[n]}" for n in ("fifo-rr", *BASELINES)),
                f"{100 * t['rejection_rate']:.2f} %",
            ]) + " |"
        )
    legend = (
        f"\n{base.workers} workers, profile {base.profile}, seed {base.seed}, llmq pools "
        f"`{base.pools}`, heartbeat {base.llmq.heartbeat_s:g} s, timeout "
        f"{base.llmq.timeout_s:g} s, llmq's engines "
        f"{'by priority' if base.llmq.engine_priority else 'FCFS'} (the baselines' FCFS). "
        + (f"llmq's scheduler profile `{base.scheduler_profile.name}`. "
           if base.scheduler_profile is not None else "")
        + "Baseline preemptions: fifo-rr / least-requests / vllm-random. Floor: the short "
        "lane's P99 latency alone on an idle engine ÷ fifo-rr's short P99, the lowest "
        "÷ fifo any policy can reach.\n"
    )
    return "\n".join(rows) + "\n" + legend


def _floor(ratio: float | None) -> str:
    if ratio is None:
        return "—"
    return _num(ratio) + (" (out of reach)" if ratio > 0.10 else "")


def _rule(head: str) -> str:
    return "|" + "---|" * (head.count("|") - 1)


def render_seed_ranges(by_seed: Mapping[int, Sequence[Cell]]) -> str:
    """One markdown table: per cell, each target's range over the seeds, and at how many
    of them it holds (``k/n``)."""
    head = (
        "| trace | load | ÷ fifo ≤ 0.10 | floor ÷ fifo | ÷ best ≤ 0.50 "
        "| long tok/s ÷ fifo ≥ 0.95 | high queue p99 ≤ 0.1 s | low max wait ≤ bound "
        "| llmq preempt = 0 | llmq rejected |"
    )
    rows = [head, _rule(head)]
    seeds = list(by_seed)
    for i, first in enumerate(by_seed[seeds[0]]):
        cells = [by_seed[s][i] for s in seeds]
        if any((c.trace, c.load) != (first.trace, first.load) for c in cells):
            raise ValueError("every seed must run the same grid in the same order")
        ts = [targets(c.doc) for c in cells]

        def span(key: str, ok: Callable[[float], bool], fmt: str = ".2f", unit: str = "",
                 ts: list[dict[str, Any]] = ts, counted: bool = True) -> str:
            values = [t[key] for t in ts if t.get(key) is not None]
            if not values:
                return "—"
            lo, hi = _shown(min(values), ok, fmt), _shown(max(values), ok, fmt)
            shown = f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"  # equal as printed
            if not counted:  # a bound, not a target: at how many seeds it rules one out
                out = sum(not ok(v) for v in values)
                return shown + ("" if not out else " (out of reach)" if out == len(ts)
                                else f" (out of reach at {out}/{len(ts)})")
            # Out of every seed: one without the figure (nothing completed) holds nothing.
            return f"{shown} ({sum(ok(v) for v in values)}/{len(ts)})"

        low_ok = sum(t["low_wait_max"] is not None and t["low_bound"] is not None
                     and t["low_wait_max"] <= t["low_bound"] for t in ts)
        rows.append("| " + " | ".join([
            first.trace,
            f"{first.load:g}",
            span("ratio_fifo", lambda v: v <= 0.10),
            span("floor_fifo", lambda v: v <= 0.10, counted=False),
            span("ratio_best", lambda v: v <= 0.50),
            span("long_ratio", lambda v: v >= 0.95, ".3f"),
            span("high_queue_p99", lambda v: v <= 0.1, ".3f", " s"),
            f"{low_ok}/{len(ts)}",
            span("preemptions", lambda v: v == 0, "d"),
            f"{100 * max(t['rejection_rate'] for t in ts):.2f} % at most",
        ]) + " |")
    legend = (f"\nSeeds {', '.join(map(str, seeds))}: each figure's lowest–highest value, "
              "and (k/n) the seeds at which its target holds.\n")
    return "\n".join(rows) + "\n" + legend
