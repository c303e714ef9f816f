"""``llmq bench policies``: compare scheduling policies on one trace and one fleet.

The lead's ``services/cli.py`` adds :data:`policies` to its ``bench`` group. Reading
options, printing (a rich table on stdout, a progress bar on stderr) and writing files
happen here; the work is :func:`services.sim.bench.run_bench` and, with ``--matrix``,
:func:`services.sim.report.run_matrix`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.common.settings import PROJECT_ROOT
from services.scheduler.policies.profile import DEFAULT_PROFILE, build_pipeline
from services.scheduler.settings import read_profile_file
from services.sim.bench import BenchConfig, ProgressFactory, run_bench
from services.sim.llmq import LlmqConfig
from services.sim.policies import POLICIES
from services.sim.simulator import check_heartbeat

TRACES = PROJECT_ROOT.parent / "shared" / "traces"
DEFAULT_TRACE = TRACES / "azure_llm_2023_conv.csv"
#: What ``--plot`` writes, chosen by the file's suffix (matplotlib's Agg canvas does all).
PLOT_FORMATS = (".png", ".svg", ".pdf")
#: The synthetic generator's length caps (``services.sim.workload.synthetic``).
_PROMPT_CAP, _OUTPUT_CAP = 8192, 2048
_SYNTHETIC_OPTIONS = ("synthetic_cv", "synthetic_prompt_mean", "synthetic_output_mean")


class FiniteFloat(click.FloatRange):
    """``click.FloatRange`` that refuses ``inf`` and ``nan`` (which ``float`` parses and a
    range lets through: ``nan`` compares false with every bound), as a usage error naming
    the option and the value."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


@click.command("policies")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_TRACE,
              show_default=True,
              help="Trace file, UTF-8: .csv in Azure's format (TIMESTAMP,ContextTokens,"
                   "GeneratedTokens; timestamps all dates, with or without a UTC offset, "
                   "or all numbers in seconds) or .jsonl in Mooncake's (one JSON object "
                   "per line, timestamps in ms).")
@click.option("--synthetic", is_flag=True,
              help="Synthetic arrivals instead of a trace: gamma inter-arrival times (Poisson "
                   "by default, see --synthetic-cv), lognormal lengths.")
@click.option("--synthetic-cv", type=FiniteFloat(min=0.001), default=1.0,
              show_default=True,
              help="With --synthetic: coefficient of variation of the inter-arrival times "
                   "(1 = Poisson, > 1 bursty, < 1 smoother than Poisson).")
@click.option("--synthetic-prompt-mean", type=FiniteFloat(min=1.0, max=_PROMPT_CAP),
              default=1000.0, show_default=True,
              help=f"With --synthetic: mean prompt length, tokens (lognormal, σ = 1, clipped "
                   f"to {_PROMPT_CAP:,}: a mean near the cap comes out lower).")
@click.option("--synthetic-output-mean", type=FiniteFloat(min=1.0, max=_OUTPUT_CAP),
              default=200.0, show_default=True,
              help=f"With --synthetic: mean output length, tokens (lognormal, σ = 1, clipped "
                   f"to {_OUTPUT_CAP:,}).")
@click.option("--requests", type=click.IntRange(min=2), default=None,
              help="Use only the first N requests (synthetic: how many; default 200000).")
@click.option("--policies", "policy_list", default=",".join(POLICIES), show_default=True,
              help="Comma-separated policies to compare: fifo-rr (one global FIFO, "
                   "round-robin), least-requests (fewest in flight on arrival), vllm-random "
                   "(random routing, FCFS engines, no admission), llmq.")
@click.option("--workers", type=click.IntRange(min=1), default=8, show_default=True,
              help="Simulated workers (engines of --profile), the same fleet for every "
                   "policy.")
@click.option("--profile", default="llama3-8b-h100", show_default=True, help="Engine profile.")
@click.option("--profiles-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Extra engine profiles (TOML, [profiles.NAME] tables) for --profile.")
@click.option("--load", type=FiniteFloat(min=0.0, min_open=True), default=0.85,
              show_default=True, help="Offered load ρ = λ / (N · μ).")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Seed of tenants, classes and routing draws (deterministic per seed).")
@click.option("--pools", type=click.Choice(["latency", "proportional", "hybrid", "any", "pd"]),
              default="latency",
              show_default=True, help="How llmq splits the fleet: latency (short pool as cool as "
                                      "the long one allows), proportional (equal utilization), "
                                      "hybrid (lane pools + one shared worker), any (all "
                                      "shared, 3:1), or pd (prefill and decode workers, KV "
                                      "handed off).")
@click.option("--kv-link-gbps", type=FiniteFloat(min=0.0, min_open=True), default=25.0,
              show_default=True, help="With --pools pd: KV transfer between workers, GB/s.")
@click.option("--heartbeat-s", type=FiniteFloat(min=0.0, min_open=True), default=1.0,
              show_default=True, help="llmq's heartbeat and queue-status period.")
@click.option("--timeout-s", type=FiniteFloat(min=0.0, min_open=True), default=120.0,
              show_default=True, help="Request timeout: admission horizon and queue deadline.")
@click.option("--kv-margin", type=FiniteFloat(0.0, 1.0, max_open=True), default=0.05,
              show_default=True, help="llmq ledger's KV safety margin.")
@click.option("--scheduler-profile", type=click.Path(dir_okay=False, path_type=Path),
              default=None,
              help="llmq's placement profile (TOML): the file the live scheduler reads from "
                   "LLMQ_SCHEDULER_PROFILE_FILE (filters, scorers, picker, candidates, "
                   "params, spill, pd_overflow_tokens; missing keys keep the defaults). "
                   "Only llmq runs it; the baselines keep theirs.")
@click.option("--engine-priority/--no-engine-priority", default=True, show_default=True,
              help="llmq's engines serve their waiting queue by class (vLLM's "
                   "--scheduling-policy priority) instead of FCFS.")
@click.option("--max-tokens-slack", type=FiniteFloat(min=1.0), default=1.0,
              show_default=True, help="max_tokens = ceil(true output × slack).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the figures as JSON here.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Write latency CDFs per policy (short and long lanes) here: a .png, "
                   ".svg or .pdf file, by its suffix.")
@click.option("--matrix", is_flag=True,
              help="Run {conv, code} × {0.6, 0.85, 0.95} and render one markdown table "
                   "(one per seed with --seeds).")
@click.option("--markdown", type=click.Path(dir_okay=False, path_type=Path),
              help="With --matrix: write the markdown table here.")
@click.option("--seeds", "seed_list", metavar="N,N,...",
              help="With --matrix: run the grid once per seed (e.g. 1,2,3), a table each, "
                   "then each target's range across the seeds and at how many it holds.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
def policies(
    trace: Path, synthetic: bool, synthetic_cv: float, synthetic_prompt_mean: float,
    synthetic_output_mean: float, requests: int | None, policy_list: str, workers: int,
    profile: str, profiles_file: Path | None, load: float, seed: int, pools: str,
    kv_link_gbps: float, heartbeat_s: float, timeout_s: float, kv_margin: float,
    scheduler_profile: Path | None, engine_priority: bool,
    max_tokens_slack: float, json_out: Path | None, plot: Path | None, matrix: bool,
    markdown: Path | None, seed_list: str | None, quiet: bool,
) -> None:
    """Compare fifo-rr, least-requests, vllm-random and llmq on the same arrivals and fleet.

    Prints per-lane and per-class latency percentiles, throughput, rejections and KV
    preemptions; --json writes them all. Examples:

    \b
        llmq bench policies --workers 8 --load 0.85 --seed 1 --json out.json --plot out.png
        llmq bench policies --synthetic --requests 200000 --workers 1000 --policies llmq
        llmq bench policies --synthetic --synthetic-cv 4 --requests 20000 --workers 16
        llmq bench policies --matrix --markdown matrix.md
        llmq bench policies --matrix --seeds 1,2,3 --markdown seeds.md
        llmq bench policies --pools pd --scheduler-profile my-profile.toml
    """
    ctx = click.get_current_context()
    _check_combination(ctx, matrix, synthetic, plot, markdown)
    seeds = _seeds(ctx, seed_list, matrix)
    _check_synthetic(ctx, synthetic)
    for path, hint in ((json_out, "--json"), (plot, "--plot"), (markdown, "--markdown")):
        if path is not None and not _writable(path):
            # Found out now, not after minutes of simulation.
            raise click.BadParameter(f"cannot write {path}: {path.parent}/ is not a folder "
                                     "this user may write in, or the file is read-only",
                                     param_hint=hint)
    if plot is not None and plot.suffix.lower() not in PLOT_FORMATS:
        raise click.BadParameter(
            f"{plot.name}: want a file ending in {', '.join(PLOT_FORMATS)} (the suffix picks "
            "the format)", param_hint="--plot")
    names = _policy_names(policy_list)
    try:
        check_heartbeat(heartbeat_s)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--heartbeat-s") from None
    if not synthetic and not matrix and not trace.exists():
        raise click.BadParameter(f"{trace} does not exist", param_hint="--trace")
    llmq = LlmqConfig(heartbeat_s=heartbeat_s, timeout_s=timeout_s, kv_safety_margin=kv_margin,
                      engine_priority=engine_priority,
                      profile=_scheduler_profile(scheduler_profile))
    base = BenchConfig(
        trace=None if synthetic else trace, synthetic=synthetic, requests=requests,
        workers=workers, profile=profile, profiles_file=profiles_file, load=load, seed=seed,
        policies=names,
        pools=pools,  # type: ignore[arg-type]  # click.Choice guarantees a PoolMode
        kv_link_gbps=kv_link_gbps, max_tokens_slack=max_tokens_slack, llmq=llmq,
        synthetic_cv=synthetic_cv, synthetic_prompt_mean=synthetic_prompt_mean,
        synthetic_output_mean=synthetic_output_mean, scheduler_profile=scheduler_profile,
    )
    show = not quiet and sys.stderr.isatty()
    if matrix:
        _run_matrix(base, seeds or (seed,), markdown, json_out, show, quiet)
        return
    with _progress(show) as factory:
        doc, runs = run_bench(base, factory)
    if json_out is not None:
        json_out.write_text(json_text(doc), "utf-8")
    if plot is not None:
        from services.sim.plot import plot_cdfs

        plot_cdfs({name: run.cdf for name, run in runs.items()}, plot, title=_title(doc))
    if not quiet:
        render_tables(doc, _stdout())


def _check_combination(
    ctx: click.Context, matrix: bool, synthetic: bool, plot: Path | None, markdown: Path | None
) -> None:
    """Refuse options the chosen mode would silently ignore."""
    if not matrix:
        if markdown is not None:
            raise click.UsageError("--markdown writes the --matrix table; add --matrix")
        return
    fixed = ["--synthetic"] if synthetic else []
    fixed += ["--plot"] if plot is not None else []
    fixed += [
        f"--{name.replace('_', '-')}"
        for name in ("trace", "load", "policies", *_SYNTHETIC_OPTIONS)
        if ctx.get_parameter_source(
            "policy_list" if name == "policies" else name
        ) is ParameterSource.COMMANDLINE
    ]
    if fixed:
        raise click.UsageError(
            f"--matrix runs the fixed grid (the conv and code traces × loads 0.6, 0.85, 0.95, "
            f"all four policies, no plot): drop {', '.join(fixed)}"
        )


def _check_synthetic(ctx: click.Context, synthetic: bool) -> None:
    """Refuse the synthetic generator's options without --synthetic, and a trace with it
    (either would be ignored)."""
    if synthetic and ctx.get_parameter_source("trace") is ParameterSource.COMMANDLINE:
        raise click.UsageError("--synthetic generates the arrivals: drop --trace (or run the "
                               "trace without --synthetic)")
    given = [f"--{name.replace('_', '-')}" for name in _SYNTHETIC_OPTIONS
             if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
    if given and not synthetic:
        one = len(given) == 1
        raise click.UsageError(f"{', '.join(given)} only shape{'s' if one else ''} a synthetic "
                               f"workload: add --synthetic, or drop {'it' if one else 'them'}")


def _writable(path: Path) -> bool:
    """Whether ``path`` can be written: its folder is one (not a file: ``a.json/x.json``)
    and writable, and the file, if there, is writable too."""
    parent = path.parent
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        return False
    return not path.exists() or (path.is_file() and os.access(path, os.W_OK))


def _scheduler_profile(path: Path | None) -> dict[str, object]:
    """The profile llmq's scheduler runs: ``path`` read and checked as the live scheduler
    checks it at start (every problem a usage error naming the file and the setting), or
    the default profile."""
    if path is None:
        return dict(DEFAULT_PROFILE)
    try:
        raw = read_profile_file(path)
        build_pipeline(raw)
    except (OSError, ValueError) as exc:  # ConfigError and tomllib's errors are ValueErrors
        raise click.BadParameter(f"{path}: {exc}", param_hint="--scheduler-profile") from None
    return {**DEFAULT_PROFILE, **raw}  # as the pipeline merges it: the JSON shows it all


def _policy_names(policy_list: str) -> tuple[str, ...]:
    """The policies of ``--policies``, in order; unknown, repeated or none: a usage error."""
    names = tuple(p.strip() for p in policy_list.split(",") if p.strip())
    known = ", ".join(POLICIES)
    if not names:
        raise click.BadParameter(f"no policy given; known: {known}", param_hint="--policies")
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(unknown)}; known: {known}",
                                 param_hint="--policies")
    twice = sorted({p for p in names if names.count(p) > 1})
    if twice:
        raise click.BadParameter(f"{', '.join(twice)} given more than once (each policy runs "
                                 "once)", param_hint="--policies")
    return names


def json_text(doc: object) -> str:
    """``doc`` as strict JSON text (RFC 8259 has no NaN or Infinity). Every figure should
    be finite once the options are; should one not be, it is written as ``null`` — what
    a figure with no value (a percentile over no requests) already is — never as a token
    other JSON readers refuse."""
    return json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n"


def _finite(x: object) -> object:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _seeds(ctx: click.Context, seed_list: str | None, matrix: bool) -> tuple[int, ...]:
    """The seeds of ``--seeds`` (none: the empty tuple), checked."""
    if seed_list is None:
        return ()
    if not matrix:
        raise click.UsageError("--seeds repeats the --matrix grid; add --matrix (or run "
                               "one cell per --seed)")
    if ctx.get_parameter_source("seed") is ParameterSource.COMMANDLINE:
        raise click.UsageError("give --seed or --seeds, not both")
    try:
        seeds = tuple(dict.fromkeys(int(s) for s in seed_list.split(",") if s.strip()))
    except ValueError:
        raise click.BadParameter(f"{seed_list!r}: want integers separated by commas, "
                                 "e.g. 1,2,3", param_hint="--seeds") from None
    if not seeds:
        raise click.BadParameter("no seed given", param_hint="--seeds")
    return seeds


def _run_matrix(
    base: BenchConfig, seeds: tuple[int, ...], markdown: Path | None, json_out: Path | None,
    show: bool, quiet: bool,
) -> None:
    from services.sim.report import Cell, render_markdown, render_seed_ranges, run_matrix

    by_seed: dict[int, list[Cell]] = {}
    with _progress(show) as factory:
        for seed in seeds:
            by_seed[seed] = run_matrix(replace(base, seed=seed), TRACES, factory)
    if len(seeds) == 1:
        text = render_markdown(by_seed[seeds[0]], replace(base, seed=seeds[0]))
    else:
        parts = [f"### Seed {seed}\n\n{render_markdown(cells, replace(base, seed=seed))}"
                 for seed, cells in by_seed.items()]
        text = "\n".join([*parts, f"### Across seeds\n\n{render_seed_ranges(by_seed)}"])
    if markdown is not None:
        markdown.write_text(text, "utf-8")
    if json_out is not None:  # each document names its seed (config.seed)
        docs = [cell.doc for cells in by_seed.values() for cell in cells]
        json_out.write_text(json_text(docs), "utf-8")
    if not quiet:
        click.echo(text)


def _stdout() -> Console:
    """Rich console on stdout; wide enough for the tables when it is not a terminal."""
    return Console() if sys.stdout.isatty() else Console(width=160)


@contextmanager
def _progress(show: bool) -> Iterator[ProgressFactory | None]:
    if not show:
        yield None
        return
    bar = Progress(
        TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=Console(stderr=True), transient=True,
    )
    with bar:
        def factory(name: str, total: int) -> Any:
            task = bar.add_task(name, total=total)
            return lambda n: bar.advance(task, n)

        yield factory


def _title(doc: dict[str, Any]) -> str:
    c = doc["config"]
    return f"{Path(c['source']).name} · {c['workers']} workers · {c['profile']} · load {c['load']}"


def _f(x: object, unit: str = "") -> str:
    if x is None:
        return "—"
    assert isinstance(x, int | float)
    return f"{x:.3g}{unit}" if abs(x) < 1000 else f"{x:,.0f}{unit}"


def render_tables(doc: dict[str, Any], console: Console) -> None:
    """The per-lane and per-class tables of one run."""
    lanes = Table(title=f"Lanes — {_title(doc)}")
    for col in ("policy", "lane", "done", "rej", "e2e p50", "e2e p99", "ttft p99", "wait p99",
                "slowdown p99", "tokens/s", "e2e p99 w/ rej"):
        lanes.add_column(col, justify="left" if col in ("policy", "lane") else "right")
    classes = Table(title="Classes")
    for col in ("policy", "class", "wait p99", "wait max", "queue max", "e2e p99", "rej"):
        classes.add_column(col, justify="left" if col in ("policy", "class") else "right")
    fleet = Table(title="Fleet")
    for col in ("policy", "KV preemptions", "rejections", "aging bound", "max service", "wall"):
        fleet.add_column(col, justify="left" if col == "policy" else "right")
    for name, p in doc["policies"].items():
        for lane, s in p["lanes"].items():
            lanes.add_row(name, lane, str(s["completed"]), str(s["rejected"]),
                          _f(s["e2e_p50_s"], "s"), _f(s["e2e_p99_s"], "s"),
                          _f(s["ttft_p99_s"], "s"), _f(s["wait_p99_s"], "s"),
                          _f(s["slowdown_p99"]), _f(s["completed_tokens_per_s"]),
                          _f(s["e2e_p99_with_rejections_s"], "s"))
        for klass, s in p["classes"].items():
            classes.add_row(name, klass, _f(s["wait_p99_s"], "s"), _f(s["wait_max_s"], "s"),
                            _f(s["queue_max_s"], "s"), _f(s["e2e_p99_s"], "s"),
                            str(s["rejected"]))
        rejections = ", ".join(f"{k} {v}" for k, v in p["rejections"].items()) or "0"
        fleet.add_row(name, str(p["kv_preemptions"]), rejections, _f(p["aging_bound_s"], "s"),
                      _f(p["max_service_s"], "s"), f"{p['wall_s']:.1f}s")
    first = next(iter(doc["policies"].values()), None)
    if first is not None:  # the same arrivals for every policy: one floor per lane
        floors = ", ".join(f"{lane} {_f(s.get('e2e_alone_p99_s'), 's')}"
                           for lane, s in first["lanes"].items())
        lanes.caption = ("e2e p99 alone on an idle engine (no policy's e2e p99 w/ rej is "
                         f"lower): {floors}")
    for table in (lanes, classes, fleet):
        console.print(table)
