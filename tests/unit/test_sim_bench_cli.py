"""``llmq bench policies``: options refused up front, errors in one line, strict JSON, the
synthetic workload's options, the plot, and the baselines' context limit."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.sim.bench import BenchConfig, prepare
from services.sim.cli import json_text
from services.sim.cli import policies as bench_policies
from services.sim.fleet import REJECTED, make_jobs
from services.sim.llmq import LlmqConfig
from services.sim.plot import plot_cdfs
from services.sim.policies import POLICIES
from services.sim.simulator import ClockResolutionError, SimulationError, Simulator
from services.sim.workload import TraceRequest, synthetic
from services.worker.engines.sim import get_profile

FLOAT_OPTIONS = ("--load", "--kv-link-gbps", "--heartbeat-s", "--timeout-s", "--kv-margin",
                 "--max-tokens-slack", "--synthetic-cv", "--synthetic-prompt-mean",
                 "--synthetic-output-mean")
#: Those with no upper bound, where ``inf`` is in range and must be refused as not finite.
UNBOUNDED = ("--load", "--kv-link-gbps", "--heartbeat-s", "--timeout-s", "--max-tokens-slack",
             "--synthetic-cv")


def _main(args: list[str]) -> tuple[int, str]:
    """Through the root command, which turns operator errors into one line."""
    from services.cli import main

    result = CliRunner().invoke(main, ["bench", "policies", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(("option", "value"), [
    *((o, "nan") for o in FLOAT_OPTIONS), *((o, "inf") for o in UNBOUNDED),
    ("--timeout-s", "Infinity"),
])
def test_a_non_finite_float_option_is_a_usage_error_naming_it(option: str, value: str) -> None:
    result = CliRunner().invoke(bench_policies, ["--synthetic", "--requests", "20", "-q",
                                                 option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': '{value}' is not a finite number" in result.output
    assert "Traceback" not in result.output


def test_a_span_past_the_clock_is_one_line_not_a_traceback() -> None:
    code, output = _main(["--synthetic", "--requests", "50", "--policies", "fifo-rr",
                          "--load", "1e-9", "-q"])
    assert code == 1, output
    assert output.startswith("Error: invalid input: t=") and "nanosecond resolution" in output
    assert "raise --load" in output and len(output.strip().splitlines()) == 1


def test_the_clock_error_is_an_input_error_and_still_a_simulation_error() -> None:
    assert issubclass(ClockResolutionError, ValueError)
    assert issubclass(ClockResolutionError, SimulationError)
    assert not issubclass(SimulationError, ValueError)  # a broken invariant stays a bug


def test_a_stray_quote_in_the_trace_is_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "quote.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n1,\"2,3\n"
                     + "".join(f"{i},5,6\n" for i in range(2, 20_000)))
    code, output = _main(["--trace", str(trace), "-q"])
    assert code == 1
    assert output.startswith(f"Error: invalid input: {trace}:3: unreadable CSV")
    assert len(output.strip().splitlines()) == 1


def test_an_infinite_profile_number_is_one_line(tmp_path: Path) -> None:
    profiles = tmp_path / "p.toml"
    profiles.write_text(
        "[profiles.x]\nbeta0_us = inf\nbeta1_us_per_prefill_token = 17.25\n"
        "beta2_us_per_decode_token = 6.0\nnum_blocks = 64\nkv_bytes_per_token = 131072\n"
        'source = "test"\n')
    code, output = _main(["--synthetic", "--requests", "20", "--profiles-file", str(profiles),
                          "--profile", "x", "-q"])
    assert code == 1
    assert output.strip() == (f"Error: invalid input: {profiles}: profiles.x.beta0_us must be "
                              "a finite number, got inf")


def test_json_is_strict_a_non_finite_figure_is_null() -> None:
    text = json_text({"a": math.nan, "b": [1.5, math.inf, -math.inf], "c": {"d": None, "e": 2}})

    def refuse(token: str) -> None:
        raise AssertionError(f"not strict JSON: {token}")

    assert json.loads(text, parse_constant=refuse) == {
        "a": None, "b": [1.5, None, None], "c": {"d": None, "e": 2}}


def test_the_written_json_is_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every option is finite now, so no run makes a NaN; a stand-in run shows the writer
    # would not pass one on.
    doc = {"policies": {}, "config": {"load": 0.85, "odd": math.nan}, "elapsed_s": 0.1}
    monkeypatch.setattr("services.sim.cli.run_bench", lambda config, progress: (doc, {}))
    out = tmp_path / "run.json"
    result = CliRunner().invoke(bench_policies, ["--synthetic", "-q", "--json", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text(), parse_constant=lambda t: pytest.fail(t))
    assert written["config"] == {"load": 0.85, "odd": None}


def test_synthetic_options_shape_the_workload_and_default_to_todays() -> None:
    n = 4000
    bursty = prepare(BenchConfig(synthetic=True, requests=n, synthetic_cv=3.0,
                                 synthetic_prompt_mean=300.0, synthetic_output_mean=50.0))
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(bursty.requests)]
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(3.0, rel=0.15)
    assert statistics.fmean(r.prompt_tokens for r in bursty.requests) == pytest.approx(
        300, rel=0.1)
    assert statistics.fmean(r.output_tokens for r in bursty.requests) == pytest.approx(
        50, rel=0.1)
    # The defaults draw exactly what --synthetic drew before the options existed.
    default = prepare(BenchConfig(synthetic=True, requests=300)).requests
    plain = synthetic(300, random.Random(1), rate_rps=1.0)
    assert [(r.prompt_tokens, r.output_tokens) for r in default] == [
        (r.prompt_tokens, r.output_tokens) for r in plain]


def test_synthetic_options_reach_the_json(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    result = CliRunner().invoke(bench_policies, [
        "--synthetic", "--synthetic-cv", "2.5", "--synthetic-prompt-mean", "400",
        "--synthetic-output-mean", "80", "--requests", "200", "--workers", "2",
        "--policies", "fifo-rr", "-q", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["synthetic"] == {
        "cv": 2.5, "prompt_mean": 400.0, "output_mean": 80.0}


@pytest.mark.parametrize(("args", "says"), [
    (["--synthetic-cv", "2"], "--synthetic-cv only shapes a synthetic workload: add --synthetic"),
    (["--synthetic-prompt-mean", "9", "--synthetic-output-mean", "9"],
     "--synthetic-prompt-mean, --synthetic-output-mean only shape a synthetic workload"),
    (["--synthetic", "--synthetic-prompt-mean", "9000"], "not in the range 1.0<=x<=8192"),
    (["--synthetic", "--synthetic-cv", "0"],
     "'--synthetic-cv': 0.0 is not in the range x>=0.001"),
    (["--synthetic", "--synthetic-cv", "1e-170"], "is not in the range x>=0.001"),
    (["--synthetic", "--policies", ","], "no policy given; known: fifo-rr"),
    (["--synthetic", "--policies", "llmq,fifo-rr,llmq"], "llmq given more than once"),
    (["--synthetic", "--policies", "llmq,nope,x"], "unknown nope, x; known"),
    (["--synthetic", "--plot", "out.xyz"], "out.xyz: want a file ending in .png, .svg, .pdf"),
    (["--synthetic", "--plot", "noext"], "noext: want a file ending in .png"),
    (["--matrix", "--synthetic-cv", "2"], "drop --synthetic-cv"),
])
def test_options_refused_before_the_run(args: list[str], says: str) -> None:
    result = CliRunner().invoke(bench_policies, [*args, "--requests", "20", "-q"])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())  # rich may wrap the message


def test_a_bad_plot_suffix_is_found_before_the_trace_is_read(tmp_path: Path) -> None:
    result = CliRunner().invoke(bench_policies, ["--trace", str(tmp_path / "missing.csv"),
                                                 "--plot", str(tmp_path / "out.jpg"), "-q"])
    assert result.exit_code == 2 and "--plot" in result.output, result.output


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_a_plot_with_an_empty_lane_draws_without_warnings(tmp_path: Path, suffix: str) -> None:
    # pytest turns warnings into errors: matplotlib warned on the empty panel's legend.
    out = tmp_path / f"cdf{suffix}"
    plot_cdfs({"fifo-rr": {"short": ([1.0, 2.0], [0.5, 1.0]), "long": ([], [])},
               "llmq": {"short": ([0.5, 1.0], [0.5, 1.0]), "long": ([], [])}}, out)
    assert out.stat().st_size > 1000
    assert out.read_bytes()[:4] == {".png": b"\x89PNG", ".svg": b"<?xm", ".pdf": b"%PDF"}[suffix]


def _rejected(name: str, requests: list[TraceRequest], slack: float = 1.0) -> list[int]:
    profile = get_profile("llama3-8b-h100")  # Llama-3.1-8B: max_model_len 131,072
    jobs = make_jobs(requests, profile, max_tokens_slack=slack, model=profile.model)
    policy = POLICIES[name](random.Random(1), LlmqConfig())
    Simulator(jobs, profile, ["any", "any"], policy).run()
    return [j.idx for j in jobs if j.state == REJECTED and j.reject_code == "too_large"]


def test_every_policy_refuses_a_request_past_max_model_len() -> None:
    # 131,100 tokens fit the 467,280-token KV pool but not the model's context; 131,072 do.
    # llmq's admission always refused it; the baselines now refuse it the same way.
    requests = [TraceRequest(0, 0.0, 131_000, 100), TraceRequest(1, 0.5, 131_000, 72),
                TraceRequest(2, 1.0, 100, 10)]
    assert {name: _rejected(name, requests) for name in POLICIES} == {
        name: [0] for name in POLICIES}


@pytest.mark.parametrize("name", ["fifo-rr", "least-requests", "vllm-random"])
def test_the_baselines_judge_max_tokens_not_the_true_output(name: str) -> None:
    # prompt + output = 131,050 fits, prompt + max_tokens (×2 slack) = 131,100 does not: vLLM
    # refuses what is asked for, before it knows the output.
    assert _rejected(name, [TraceRequest(0, 0.0, 131_000, 50)], slack=2.0) == [0]


@pytest.mark.parametrize(("text", "says"), [
    ('filters = ["model-match"]\n', "filters: must include ['lane-pool'"),
    ("pd_overflow_tokens = -3\n", "pd_overflow_tokens: must be an int >= 0, got -3"),
    ("candidates = 8\nbogus = 1\n", "bogus: unknown profile key"),
    ("x = [\n", "Invalid value (at end of document)"),
])
def test_a_bad_scheduler_profile_is_refused_before_the_run(
    tmp_path: Path, text: str, says: str
) -> None:
    """As the live scheduler refuses it at start: one line naming the file and the setting."""
    path = tmp_path / "profile.toml"
    path.write_text(text)
    code, output = _main(["--synthetic", "--requests", "20", "-q", "--scheduler-profile",
                          str(path)])
    assert code == 2, output
    flat = " ".join(output.split())
    assert "--scheduler-profile" in flat and str(path) in flat and says in flat
    assert "Traceback" not in output
    missing = tmp_path / "none.toml"
    code, output = _main(["--synthetic", "--requests", "20", "-q", "--scheduler-profile",
                          str(missing)])
    assert code == 2 and "No such file" in output


def test_the_scheduler_profile_runs_llmq_and_reaches_the_json(tmp_path: Path) -> None:
    """The file's settings are llmq's (pd_overflow_tokens here: a long request goes whole to
    the decode worker as soon as every prefill worker has a prompt waiting, or never), the
    rest keep the defaults, and the JSON says which file it was."""
    runs = {}
    for name, overflow in (("eager", 1), ("never", 0)):
        path, out = tmp_path / f"{name}.toml", tmp_path / f"{name}.json"
        path.write_text(f"pd_overflow_tokens = {overflow}\n")
        result = CliRunner().invoke(bench_policies, [
            "--synthetic", "--requests", "400", "--workers", "3", "--pools", "pd", "--load",
            "0.95", "--policies", "llmq", "-q", "--scheduler-profile", str(path),
            "--json", str(out)])
        assert result.exit_code == 0, result.output
        doc = json.loads(out.read_text())
        assert doc["config"]["scheduler_profile"] == str(path)
        profile = doc["config"]["llmq"]["profile"]
        assert profile["pd_overflow_tokens"] == overflow
        assert profile["candidates"] == 8  # a key the file leaves out keeps its default
        runs[name] = doc["policies"]["llmq"]["lanes"]
    assert runs["eager"] != runs["never"]


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_path_inside_a_file_is_refused_before_the_run(
    tmp_path: Path, option: str
) -> None:
    """Found by an audit: the folder check passed for a regular file ("a.json/x.json"), and
    the run ended, results lost, in a NotADirectoryError traceback."""
    a_file = tmp_path / "a.json"
    a_file.write_text("{}")
    target = a_file / ("x.png" if option == "--plot" else "x.json")
    code, output = _main(["--synthetic", "--requests", "20", "-q", option, str(target)])
    assert code == 2, output
    assert "is not a folder this user may write in" in " ".join(output.split())


def test_a_number_past_what_a_float_holds_is_one_line() -> None:
    """--load 1e-300 stretches the arrivals past any float: an OverflowError traceback."""
    code, output = _main(["--requests", "200", "--policies", "fifo-rr", "--load", "1e-300",
                          "-q"])
    assert code == 1, output
    assert output.startswith("Error: invalid input:") and len(output.strip().splitlines()) == 1
