"""Trace files the loaders used to refuse or garble: UTC offsets, mixed timestamp kinds,
stray quotes, encodings, JSON arrays; and the context limit every policy applies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from services.sim.workload import (
    TraceFormatError,
    context_limit,
    fleet_capacity_rps,
    load_csv_trace,
    load_trace,
)
from services.worker.engines.sim import EngineProfile, get_profile

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _csv(tmp_path: Path, rows: str, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + rows, encoding="utf-8")
    return path


def _arrivals(path: Path) -> list[tuple[float, int]]:
    return [(r.arrival_s, r.prompt_tokens) for r in load_trace(path)]


def test_utc_offsets_and_z_are_converted_to_one_clock(tmp_path: Path) -> None:
    # The 2024 Azure traces' form first; then the same instant + 0.5 s written three other
    # ways, and one a second later in +0530: all land on UTC.
    path = _csv(tmp_path, (
        "2024-05-10 00:00:00.009930+00:00,10,1\n"
        "2024-05-10T02:00:00.50993+02:00,11,1\n"
        "2024-05-09 23:00:00.509930-01:00,12,1\n"
        "2024-05-10 00:00:00.509930Z,13,1\n"
        "2024-05-10 05:30:01.009930+0530,14,1\n"
    ))
    got = _arrivals(path)
    assert [p for _, p in got] == [10, 11, 12, 13, 14]
    assert [t for t, _ in got] == pytest.approx([0.0, 0.5, 0.5, 0.5, 1.0], abs=1e-12)


def test_offset_timestamps_keep_seven_fractional_digits_exact(tmp_path: Path) -> None:
    path = _csv(tmp_path, (
        "2023-11-16 23:59:59.9999999+00:00,1,1\n"
        "2023-11-17 00:00:00.0000001Z,2,1\n"
    ))
    assert _arrivals(path)[1][0] == pytest.approx(2e-7, abs=1e-15)


@pytest.mark.parametrize(("rows", "line", "says"), [
    ("1.5,1,1\n2023-11-16 18:00:00,1,1\n", 3, "a date and time without a UTC offset, but "
                                             "line 2 has a plain number"),
    ("2023-11-16 18:00:00,1,1\n\n2023-11-16 18:00:01,1,1\n7,1,1\n", 5,
     "a plain number, but line 2 has a date"),
    ("2024-05-10 00:00:00,1,1\n2024-05-10 00:00:01+00:00,1,1\n", 3,
     "a date and time with a UTC offset, but line 2 has a date and time without"),
])
def test_a_mix_of_timestamp_kinds_is_refused_at_the_first_odd_line(
    tmp_path: Path, rows: str, line: int, says: str
) -> None:
    path = _csv(tmp_path, rows, "mix.csv")
    with pytest.raises(TraceFormatError, match=rf"mix\.csv:{line}: column 'TIMESTAMP': .*{says}"):
        load_trace(path)


def test_malformed_dates_and_offsets_name_the_formats(tmp_path: Path) -> None:
    for stamp in ("2024-05-10 00:00:00+24:00", "2024-05-10 00:00:00+1:00",
                  "2024-05-10 00:00:00+00:0x", "2024-05-10 00:00:00 UTC",
                  "2024-05-10 0x:00:00", "2024-05-10", "2024-05-10 00:00:00Zulu"):
        with pytest.raises(TraceFormatError, match=r"t\.csv:2: column 'TIMESTAMP': expected "
                           r"'YYYY-MM-DD HH:MM:SS\[\.fffffff\]\[Z\|\+HH:MM\]'"):
            load_trace(_csv(tmp_path, f"{stamp},1,1\n"))


def test_a_stray_quote_swallowing_the_file_names_its_line(tmp_path: Path) -> None:
    rows = "0,1,1\n" + '1,"2,3\n' + "".join(f"{i},5,6\n" for i in range(2, 20_000))
    path = _csv(tmp_path, rows, "quote.csv")
    with pytest.raises(TraceFormatError, match=r"quote\.csv:3: unreadable CSV .*double quote"):
        load_trace(path)


def test_a_short_stray_quote_names_the_line_it_opens_on(tmp_path: Path) -> None:
    path = _csv(tmp_path, '0,1,1\n1,"2,3\n4,5,6\n', "quote.csv")
    with pytest.raises(TraceFormatError, match=r"quote\.csv:3: expected 3 cells, got 2 "
                                               r"\(a quoted cell runs past this line"):
        load_trace(path)


@pytest.mark.parametrize("text", [
    HEADER + '1, "2", 3\n2 , "4" , 5\n',
    '"TIMESTAMP", "ContextTokens", "GeneratedTokens"\n1, "2", 3\n2, "4", "5"\n',
])
def test_cells_may_be_quoted_after_a_space(tmp_path: Path, text: str) -> None:
    path = tmp_path / "pad.csv"
    path.write_text(text, encoding="utf-8")
    got = [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in load_csv_trace(path)]
    assert got == [(0.0, 2, 3), (1.0, 4, 5)]


@pytest.mark.parametrize(("name", "head", "line"), [
    ("latin1.csv", HEADER + "0,1,1\n1,2,2\n", 4),
    ("latin1.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n', 2),
])
def test_a_file_that_is_not_utf8_names_file_and_line(
    tmp_path: Path, name: str, head: str, line: int
) -> None:
    path = tmp_path / name
    tail = b"2,3,3 # caf\xe9\n" if name.endswith(".csv") else b'{"timestamp": 1, "caf\xe9": 1}\n'
    path.write_bytes(head.encode() + tail)
    with pytest.raises(TraceFormatError, match=rf"{name}:{line}: not UTF-8 text \(byte 0xe9"):
        load_trace(path)


def test_jsonl_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    lines = [{"timestamp": 1000, "input_length": 5, "output_length": 1},
             {"timestamp": 1500, "input_length": 6, "output_length": 2}]
    path.write_text("\ufeff" + "\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    assert _arrivals(path) == [(0.0, 5), (0.5, 6)]


@pytest.mark.parametrize("text", [
    '[\n  {"timestamp": 0, "input_length": 1, "output_length": 1}\n]\n',
    '[{"timestamp": 0, "input_length": 1, "output_length": 1}]\n',
])
def test_a_json_array_is_told_to_be_jsonl(tmp_path: Path, text: str) -> None:
    path = tmp_path / "trace.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TraceFormatError,
                       match=r"trace\.json:1: expected one JSON object per line \(JSONL\)"):
        load_trace(path)


def test_a_pretty_printed_object_is_told_to_be_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{\n"timestamp": 0, "input_length": 1, "output_length": 1\n}\n')
    with pytest.raises(TraceFormatError, match=r"trace\.jsonl:1: not JSON: .*one JSON object "
                                               r"per line"):
        load_trace(path)


def _profile(model: str, num_blocks: int) -> EngineProfile:
    base = get_profile("llama3-8b-h100")
    return EngineProfile(name="p", beta0_s=base.beta0_s,
                         beta1_s_per_prefill_tok=base.beta1_s_per_prefill_tok,
                         beta2_s_per_decode_tok=base.beta2_s_per_decode_tok,
                         num_blocks=num_blocks, model=model)


@pytest.mark.parametrize(("model", "num_blocks", "limit"), [
    ("meta-llama/Llama-3.1-8B-Instruct", 29_205, 131_072),  # max_model_len < KV pool
    ("meta-llama/Llama-3.1-8B-Instruct", 1_000, 16_001),  # a KV pool under it
    ("Qwen/Qwen2.5-7B-Instruct", 29_205, 32_768),
    ("some-unknown-model", 29_205, 29_205 * 16 + 1),  # no max_model_len known: the pool
])
def test_the_context_limit_is_the_smaller_of_max_model_len_and_kv(
    model: str, num_blocks: int, limit: int
) -> None:
    assert context_limit(_profile(model, num_blocks)) == limit


def test_capacity_is_measured_on_requests_within_the_models_context(tmp_path: Path) -> None:
    path = _csv(tmp_path, "0,140000,10\n1,200000,5\n")
    requests = load_trace(path)
    with pytest.raises(ValueError, match=r"131072-token context \(max_model_len\) of "
                                         r"profile 'llama3-8b-h100'"):
        fleet_capacity_rps(get_profile("llama3-8b-h100"), 1, requests, random.Random(1))


@pytest.mark.parametrize(("rows", "line", "says"), [
    (f"0,10,5\n1,10,{2**31}\n", 3, "more than the most a row may give (2,147,483,647)"),
    ("0,10,5\n１２,10,5\n", 3, "TIMESTAMP"),  # full-width digits, as token counts refuse them
    ("0,10,5\n1_000,10,5\n", 3, "TIMESTAMP"),
])
def test_numbers_past_what_a_row_may_give_are_refused_naming_the_line(
    tmp_path: Path, rows: str, line: int, says: str
) -> None:
    """Found by an audit: a 300-digit output count ended in an OverflowError traceback;
    float() read '１２' and '1_000' as timestamps that the token columns refuse."""
    with pytest.raises(TraceFormatError) as err:
        load_trace(_csv(tmp_path, rows))
    assert f"t.csv:{line}:" in str(err.value) and says in str(err.value)


def test_the_header_may_follow_blank_lines_but_not_name_a_column_twice(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("\n\n" + HEADER + "0,10,5\n", encoding="utf-8")
    assert _arrivals(path) == [(0.0, 10)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,TIMESTAMP\n0,10,5,9\n")
    with pytest.raises(TraceFormatError, match=r"t\.csv:1: column 'TIMESTAMP': the header "
                                               r"names it more than once"):
        load_trace(path)


def test_the_load_is_that_of_the_requests_that_can_run(tmp_path: Path) -> None:
    """μ is measured on the requests an engine can hold; found by an audit, λ counted the
    others too, so with a tenth too large the runnable load was 0.9 ρ."""
    rows = "".join(f"{i},{150_000 if i % 10 == 0 else 500},50\n" for i in range(200))
    from services.sim.bench import BenchConfig, prepare

    workload = prepare(BenchConfig(trace=_csv(tmp_path, rows), load=0.8))
    limit = context_limit(workload.profile)
    fits = [r for r in workload.requests if r.prompt_tokens + r.output_tokens <= limit]
    assert len(fits) == 180
    span = workload.requests[-1].arrival_s - workload.requests[0].arrival_s
    offered = (len(workload.requests) - 1) / span
    assert offered * len(fits) / len(workload.requests) == pytest.approx(
        0.8 * workload.capacity_rps, rel=1e-6)
