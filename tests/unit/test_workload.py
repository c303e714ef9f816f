"""Trace loaders, class attachment, load scaling and the synthetic generator."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from collections import Counter
from pathlib import Path

import pytest

from services.sim.workload import (
    TraceFormatError,
    TraceRequest,
    arrival_rate,
    attach_classes,
    fleet_capacity_rps,
    load_csv_trace,
    load_jsonl_trace,
    load_trace,
    scale_to_load,
    scale_to_rate,
    synthetic,
    tenant_names,
)
from services.worker.engines.sim.profiles import get_profile

# The shared traces sit beside the checkout (DESIGN.md, "Data"): <root>/../shared/traces.
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
needs_traces = pytest.mark.skipif(
    not (TRACES / "azure_llm_2023_conv.csv").exists(), reason=f"no shared traces at {TRACES}"
)


@needs_traces
@pytest.mark.parametrize(
    ("name", "rows", "first", "last_arrival_s"),
    [
        ("azure_llm_2023_conv.csv", 19_366, (374, 44), 3501.721937),
        ("azure_llm_2023_code.csv", 8_819, (4808, 10), 3435.948056),
    ],
)
def test_loads_the_shared_azure_traces(
    name: str, rows: int, first: tuple[int, int], last_arrival_s: float
) -> None:
    trace = load_trace(TRACES / name)
    assert len(trace) == rows
    assert (trace[0].prompt_tokens, trace[0].output_tokens) == first
    assert trace[0].arrival_s == 0.0
    assert trace[-1].arrival_s == pytest.approx(last_arrival_s, abs=1e-9)
    assert [r.idx for r in trace] == list(range(rows))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(trace))
    assert {(r.tenant, r.priority) for r in trace} == {("default", "normal")}


def test_seven_fractional_digits_are_kept(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9999999,10,2\n"
        "2023-11-17 00:00:00.0000001,11,3\n"
        "2023-11-16 23:59:59.5,12,4\n"  # out of order: sorted, stable
    )
    trace = load_csv_trace(f)
    assert [r.prompt_tokens for r in trace] == [12, 10, 11]
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 0.4999999, 0.5000001], abs=1e-12)


@pytest.mark.parametrize(("unit", "step_s"), [("ns", 1e-9), ("us", 1e-6)])
def test_integer_timestamps_are_exact(tmp_path: Path, unit: str, step_s: float) -> None:
    """Epochs in ns or µs are past a float's 53 bits: parsed through float, arrivals
    1 ns (or 1 µs) apart would collapse or be off by up to 256 ns."""
    base = 1_700_000_000_000_000_000 // {"ns": 1, "us": 1000}[unit]
    f = tmp_path / "epoch.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        f"{base + 3},8,1\n{base + 1},6,1\n{base},5,1\n"
    )
    trace = load_csv_trace(f, time_unit=unit)  # type: ignore[arg-type]
    assert [r.prompt_tokens for r in trace] == [5, 6, 8]
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, step_s, 3 * step_s], rel=1e-9)


def test_any_csv_with_the_columns_loads(tmp_path: Path) -> None:
    f = tmp_path / "other.csv"
    f.write_text(
        "GeneratedTokens,Extra,ContextTokens,TIMESTAMP\r\n5,x,7,100.5\r\n6,y,8,101\r\n\r\n"
    )
    trace = load_trace(f)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (0.0, 7, 5),
        (0.5, 8, 6),
    ]
    assert load_csv_trace(f, time_unit="ms")[1].arrival_s == pytest.approx(0.0005)


def test_jsonl_in_mooncake_format(tmp_path: Path) -> None:
    f = tmp_path / "mooncake.jsonl"
    lines = [
        {"timestamp": 1000, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2]},
        {"timestamp": 3500, "input_length": 10, "output_length": 1},
    ]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    trace = load_trace(f)  # milliseconds by default
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (0.0, 6955, 52),
        (2.5, 10, 1),
    ]
    assert load_jsonl_trace(f, time_unit="s")[1].arrival_s == 2500.0
    assert load_trace(f, time_unit="us")[1].arrival_s == pytest.approx(0.0025)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:00:00.0,abc,3", r"bad\.csv:3: column 'ContextTokens'"),
        ("2023-11-16 18:00:00.0,5,-3", r"bad\.csv:3: column 'GeneratedTokens'"),
        ("2023-11-16 18:00:00.0,0,3", r"bad\.csv:3: column 'ContextTokens'.*positive"),
        ("2023-13-16 18:00:00.0,5,3", r"bad\.csv:3: column 'TIMESTAMP'"),
        ("yesterday,5,3", r"bad\.csv:3: column 'TIMESTAMP'"),
        ("2023-11-16 18:00:00.0,5", r"bad\.csv:3: .*expected 3 cells, got 2"),
        # str.isdigit takes '²', which int() refuses; int() refuses over 4,300 digits too.
        ("2023-11-16 18:00:00.0,\u00b2,3", r"bad\.csv:3: column 'ContextTokens'"),
        ("2023-11-16 18:00:00.\u00b2,5,3", r"bad\.csv:3: column 'TIMESTAMP'"),
        ("2023-11-16 18:00:00.0,5," + "9" * 5000, r"bad\.csv:3: column 'GeneratedTokens'"),
        ("1" + "0" * 300 + ",5,3", r"bad\.csv:3: column 'TIMESTAMP'.*out of range"),
    ],
)
def test_bad_csv_rows_name_file_line_and_column(tmp_path: Path, row: str, message: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 17:00:00.0,1,1\n{row}\n")
    with pytest.raises(TraceFormatError, match=message):
        load_trace(f)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:2: not JSON"),
        ("[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
        ('{"timestamp": 1, "input_length": 5}', r"bad\.jsonl:2: column 'output_length': missing"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1}', "column 'timestamp'"),
        ('{"timestamp": 1, "input_length": 5.5, "output_length": 1}', "column 'input_length'"),
        ('{"timestamp": 1, "input_length": 5, "output_length": true}', "column 'output_length'"),
        # JSON that Python's parser gives up on: over 4,300 digits, nesting past recursion.
        ('{"timestamp": 1' + "0" * 5000 + "}", r"bad\.jsonl:2: unreadable JSON"),
        ("[" * 100_000 + "]" * 100_000, r"bad\.jsonl:2: unreadable JSON"),
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "output_length": 1}',
         r"column 'timestamp'.*out of range"),
    ],
)
def test_bad_jsonl_lines_name_file_line_and_key(tmp_path: Path, line: str, message: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n' + line + "\n")
    with pytest.raises(TraceFormatError, match=message):
        load_trace(f)


def test_unusable_files(tmp_path: Path) -> None:
    header_only = tmp_path / "empty.csv"
    header_only.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(header_only)
    wrong_header = tmp_path / "wrong.csv"
    wrong_header.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceFormatError, match=r"wrong\.csv:1: column 'TIMESTAMP'"):
        load_trace(wrong_header)
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(tmp_path / "trace.parquet")


def _base(n: int) -> list[TraceRequest]:
    return [TraceRequest(i, float(i), 10, 10) for i in range(n)]


def test_classes_are_deterministic_for_a_seed() -> None:
    a = attach_classes(_base(500), random.Random(7))
    b = attach_classes(_base(500), random.Random(7))
    c = attach_classes(_base(500), random.Random(8))
    assert a == b and a != c


def test_class_mix_and_zipf_tenants_on_a_large_sample() -> None:
    n = 100_000
    reqs = attach_classes(_base(n), random.Random(1))
    mix = Counter(r.priority for r in reqs)
    assert mix["high"] / n == pytest.approx(0.10, abs=0.005)
    assert mix["normal"] / n == pytest.approx(0.60, abs=0.005)
    assert mix["low"] / n == pytest.approx(0.30, abs=0.005)
    tenants = Counter(r.tenant for r in reqs)
    assert set(tenants) == set(tenant_names(20))
    # Zipf(1.1): P(rank 1) = 1 / Σ k^-1.1 ≈ 0.2704, and rank 1 / rank 2 = 2^1.1 ≈ 2.14.
    top = tenants["tenant-00"] / n
    assert top == pytest.approx(1 / sum(k**-1.1 for k in range(1, 21)), abs=0.005)
    assert tenants["tenant-00"] / tenants["tenant-01"] == pytest.approx(2**1.1, rel=0.05)


def test_custom_class_mix_and_validation() -> None:
    reqs = attach_classes(_base(100), random.Random(0), tenants=3, class_mix={"high": 1.0})
    assert {r.priority for r in reqs} == {"high"}
    assert {r.tenant for r in reqs} <= {"tenant-0", "tenant-1", "tenant-2"}
    with pytest.raises(ValueError, match="sum to 1"):
        attach_classes(_base(3), random.Random(0), class_mix={"high": 0.5})


@needs_traces
def test_scaling_yields_the_target_rate() -> None:
    trace = load_trace(TRACES / "azure_llm_2023_code.csv")
    scaled = scale_to_rate(trace, 40.0)
    assert arrival_rate(scaled) == pytest.approx(40.0, rel=1e-12)
    # Burstiness is kept: every gap shrinks by the same factor.
    factor = scaled[-1].arrival_s / trace[-1].arrival_s
    assert scaled[123].arrival_s == pytest.approx(trace[123].arrival_s * factor)
    loaded = scale_to_load(trace, 0.8, fleet_capacity_rps=50.0)
    assert arrival_rate(loaded) == pytest.approx(40.0, rel=1e-12)
    with pytest.raises(ValueError):
        scale_to_rate(trace[:1], 1.0)


@needs_traces
def test_fleet_capacity_is_n_times_one_engine() -> None:
    trace = load_trace(TRACES / "azure_llm_2023_conv.csv")
    profile = get_profile("llama3-8b-h100")
    one = fleet_capacity_rps(profile, 1, trace, random.Random(3))
    assert fleet_capacity_rps(profile, 10, trace, random.Random(3)) == pytest.approx(10 * one)
    assert 20 < one < 60


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_synthetic_rate_burstiness_and_lengths(cv: float) -> None:
    reqs = synthetic(
        20_000,
        random.Random(5),
        rate_rps=10.0,
        cv=cv,
        prompt_mean=500,
        output_mean=100,
        prompt_sigma=0.5,
        output_sigma=0.5,
    )
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(reqs)]
    assert reqs[0].arrival_s == 0.0
    assert 1 / statistics.fmean(gaps) == pytest.approx(10.0, rel=0.05)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.08)
    assert statistics.fmean(r.prompt_tokens for r in reqs) == pytest.approx(500, rel=0.03)
    assert statistics.fmean(r.output_tokens for r in reqs) == pytest.approx(100, rel=0.03)
    assert all(1 <= r.prompt_tokens <= 8192 and 1 <= r.output_tokens <= 2048 for r in reqs)
    assert synthetic(50, random.Random(5), rate_rps=10.0, cv=cv) == synthetic(
        50, random.Random(5), rate_rps=10.0, cv=cv
    )


@pytest.mark.parametrize("text", [
    "TIMESTAMP, ContextTokens, GeneratedTokens\n0.0, 10, 5\n1.0, 20, 6\n",
    '"TIMESTAMP","ContextTokens","GeneratedTokens"\n"0.0","10","5"\n"1.0","20","6"\n',
    "\ufeffGeneratedTokens,Extra,TIMESTAMP,ContextTokens\r\n5,x,0.0,10\r\n6,y,1.0,20\r\n",
])
def test_csv_cells_may_be_quoted_padded_and_reordered(tmp_path: Path, text: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text, encoding="utf-8")
    got = [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in load_trace(path)]
    assert got == [(0.0, 10, 5), (1.0, 20, 6)]
