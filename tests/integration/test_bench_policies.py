"""`llmq bench policies` end to end on a slice of the real Azure conversation trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.sim.cli import TRACES, policies

CONV = TRACES / "azure_llm_2023_conv.csv"
needs_trace = pytest.mark.skipif(not CONV.exists(), reason=f"no shared trace at {CONV}")

LANE_KEYS = {"e2e_p50_s", "e2e_p99_s", "ttft_p99_s", "wait_p99_s", "slowdown_p99", "completed",
             "completed_tokens_per_s", "e2e_p99_with_rejections_s", "rejection_rate"}
CLASS_KEYS = {"wait_p99_s", "wait_max_s", "e2e_p99_s"}
POLICY_KEYS = {"lanes", "classes", "kv_preemptions", "rejections", "aging_bound_s",
               "max_service_s", "wall_s"}


@needs_trace
def test_policies_on_a_conv_slice_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    result = CliRunner().invoke(
        policies,
        ["--trace", str(CONV), "--requests", "2000", "--workers", "4", "--load", "0.85",
         "--seed", "1", "--json", str(out), "--plot", str(png)],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert set(doc) == {"policies", "config", "elapsed_s"}
    assert list(doc["policies"]) == ["fifo-rr", "least-requests", "vllm-random", "llmq"]
    for name, p in doc["policies"].items():
        assert set(p) >= POLICY_KEYS, name
        assert set(p["lanes"]) == {"short", "long"}
        assert set(p["classes"]) == {"high", "normal", "low"}
        for lane in p["lanes"].values():
            assert set(lane) >= LANE_KEYS
        for klass in p["classes"].values():
            assert set(klass) >= CLASS_KEYS
        done = sum(lane["completed"] for lane in p["lanes"].values())
        assert done + sum(p["rejections"].values()) == 2000
    llmq = doc["policies"]["llmq"]
    assert llmq["kv_preemptions"] == 0 and llmq["aging_bound_s"] == 60.0
    assert doc["config"]["requests"] == 2000 and doc["config"]["workers"] == 4
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "Lanes" in result.output and "llmq" in result.output  # the table


@needs_trace
def test_policies_subset_quiet_prints_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(
        policies,
        ["--requests", "300", "--workers", "2", "--policies", "llmq,fifo-rr", "--quiet",
         "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert result.output == ""
    assert list(json.loads(out.read_text())["policies"]) == ["llmq", "fifo-rr"]


@needs_trace
def test_matrix_renders_one_markdown_table(tmp_path: Path) -> None:
    md = tmp_path / "m.md"
    result = CliRunner().invoke(
        policies, ["--matrix", "--requests", "300", "--workers", "2", "--quiet",
                   "--markdown", str(md)],
    )
    assert result.exit_code == 0, result.output
    lines = md.read_text().splitlines()
    rows = [line for line in lines if line.startswith("| con") or line.startswith("| cod")]
    assert len(rows) == 6  # {conv, code} × {0.6, 0.85, 0.95}
    assert lines[0].startswith("| trace | load |")


def test_unknown_policy_is_a_usage_error() -> None:
    result = CliRunner().invoke(policies, ["--synthetic", "--policies", "nope"])
    assert result.exit_code == 2
    assert "unknown" in result.output


def test_synthetic_run_needs_no_trace(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    result = CliRunner().invoke(
        policies, ["--synthetic", "--requests", "400", "--workers", "3", "--quiet",
                   "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["source"] == "synthetic"
    # A trace with it would be ignored: refused.
    both = CliRunner().invoke(policies, ["--synthetic", "--trace", str(out)])
    assert both.exit_code == 2 and "drop --trace" in both.output


def test_the_llmq_cli_registers_the_command() -> None:
    from services.cli import main

    result = CliRunner().invoke(main, ["bench", "policies", "--help"])
    assert result.exit_code == 0, result.output
    assert "--synthetic" in result.output


@needs_trace
def test_matrix_over_seeds_renders_a_table_per_seed_and_their_ranges(tmp_path: Path) -> None:
    md, out = tmp_path / "m.md", tmp_path / "m.json"
    result = CliRunner().invoke(
        policies, ["--matrix", "--seeds", "1,2", "--requests", "300", "--workers", "2",
                   "--quiet", "--markdown", str(md), "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    text = md.read_text()
    assert [line for line in text.splitlines() if line.startswith("### ")] == [
        "### Seed 1", "### Seed 2", "### Across seeds"]
    ranges = text.split("### Across seeds")[1].splitlines()
    rows = [line for line in ranges if line.startswith(("| conv", "| code"))]
    assert len(rows) == 6 and all("/2)" in row for row in rows)
    docs = json.loads(out.read_text())
    assert [d["config"]["seed"] for d in docs] == [1] * 6 + [2] * 6


@pytest.mark.parametrize(("args", "says"), [
    (["--seeds", "1,2"], "add --matrix"),
    (["--matrix", "--seed", "2", "--seeds", "1,2"], "not both"),
    (["--matrix", "--seeds", "1,x"], "integers"),
    (["--matrix", "--plot", "p.png"], "drop --plot"),
    (["--matrix", "--load", "0.5"], "drop --load"),
    (["--matrix", "--synthetic"], "drop --synthetic"),
    (["--synthetic", "--markdown", "m.md"], "add --matrix"),
])
def test_options_the_mode_would_ignore_are_refused(args: list[str], says: str) -> None:
    result = CliRunner().invoke(policies, args)
    assert result.exit_code == 2 and says in result.output


def test_an_unwritable_output_is_refused_before_the_run(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "out.json"
    result = CliRunner().invoke(policies, ["--synthetic", "--json", str(missing)])
    assert result.exit_code == 2
    assert "is not a folder this user may write in" in " ".join(result.output.split())


def test_a_bad_trace_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from services.cli import main

    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    result = CliRunner().invoke(main, ["bench", "policies", "--trace", str(empty), "-q"])
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: invalid input: {empty}: no requests"


def test_a_request_no_engine_can_hold_is_refused_not_a_crash(tmp_path: Path) -> None:
    # A 1,024-token KV pool; one request of 2,031 tokens among small ones: every policy
    # refuses it too_large, the capacity measurement skips it.
    profiles = tmp_path / "tiny.toml"
    profiles.write_text(
        "[profiles.tiny]\nbeta0_us = 5752.7\nbeta1_us_per_prefill_token = 17.25\n"
        "beta2_us_per_decode_token = 6.0\nnum_blocks = 64\nblock_size = 16\n"
        "max_num_seqs = 16\nmax_num_batched_tokens = 2048\nkv_bytes_per_token = 131072\n"
        'source = "test"\n')
    trace = tmp_path / "big1.csv"
    rows = [f"{i * 0.1:.1f},{2000 if i == 3 else 40},{31 if i == 3 else 8}" for i in range(40)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "out.json"
    result = CliRunner().invoke(policies, [
        "--trace", str(trace), "--profiles-file", str(profiles), "--profile", "tiny",
        "--workers", "2", "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert len(doc["policies"]) == 4
    assert all(p["rejections"] == {"too_large": 1} for p in doc["policies"].values())
