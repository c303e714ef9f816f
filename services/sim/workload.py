"""Workloads for the simulator and benchmarks: trace loaders, a synthetic generator,
tenant/priority attachment and load scaling. Pure code; randomness comes in as a seeded
``random.Random``.

Traces
    ``azure_llm_2023_{conv,code}.csv`` are real Azure LLM inference production traffic
    (Azure Public Dataset, CC-BY 4.0; cite: Patel et al., "Splitwise: Efficient generative
    LLM inference using phase splitting", ISCA 2024). Columns
    ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps like
    ``2023-11-16 18:17:03.9799600`` (7 fractional digits, more than ``datetime`` parses,
    so they are parsed by hand into integer nanoseconds), or with a UTC offset as in the
    2024 traces (``2024-05-10 00:00:00.009930+00:00``, or ``Z``), converted to UTC. Any
    CSV with these columns loads; a TIMESTAMP that is a plain number is taken in
    ``time_unit`` (default seconds). One file holds one kind of timestamp — numbers,
    dates without an offset, or dates with one — since a mix has no common clock.
    JSONL traces in Mooncake's format, one ``{"timestamp", "input_length",
    "output_length"}`` object per line (other keys ignored), have timestamps in
    milliseconds there, so ``time_unit`` defaults to ``"ms"`` for them.
    Arrivals are returned sorted, relative to the earliest (t = 0), ``idx`` = position in
    arrival order (the file order for the sorted shipped traces). Files are UTF-8. A bad
    row raises ``TraceFormatError`` naming file, line and column.

Classes
    ``attach_classes`` gives each request a tenant drawn from a Zipf law over
    ``tenants`` names (P(rank k) ∝ k^-s, s = 1.1: a few heavy tenants, a long tail) and a
    priority drawn from ``class_mix`` (default 10 % high, 60 % normal, 30 % low). Lanes
    are llmq's decision and are not set here.

Load
    Offered load ρ = λ / (N · μ): λ the arrival rate (requests/s), N the number of
    engines, μ the saturated completion rate of one engine for this workload's length mix
    (``services.worker.engines.sim.capacity.saturated_capacity``). Because μ is measured
    for the same mix, ρ = 1 means arrivals bring work exactly as fast as a saturated fleet
    clears it. ``scale_to_load`` stretches or compresses inter-arrival times (keeping the
    trace's burstiness) so that λ = ρ · N · μ, with λ = (n − 1) / (last − first arrival).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any, Final, Literal

from schemas.common import PRIORITIES, Priority
from services.ingest.core import AdmissionConfig
from services.worker.engines.sim.capacity import saturated_capacity
from services.worker.engines.sim.model import EngineProfile

TimeUnit = Literal["s", "ms", "us", "ns"]
_NS_PER_UNIT: Final[dict[str, int]] = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
CSV_COLUMNS: Final = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
JSONL_KEYS: Final = ("timestamp", "input_length", "output_length")
#: A numeric timestamp past ±10^30 ns (~3·10^13 years) is refused: no trace spans that, and
#: arrivals in seconds must stay finite floats.
_MAX_NS: Final = 10**30
DEFAULT_CLASS_MIX: Final[Mapping[Priority, float]] = {"high": 0.1, "normal": 0.6, "low": 0.3}


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names file, line and column."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload. ``arrival_s`` is relative to the workload's start."""

    idx: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: str = "default"
    priority: Priority = "normal"


# ---- loaders -------------------------------------------------------------------------
def _fail(path: Path, line: int, column: str, problem: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{line}: column {column!r}: {problem}")


def _digits(text: str) -> int | None:
    """``text`` as an integer when it is ASCII digits only, else None. (``str.isdigit``
    alone takes '²', which ``int`` refuses; ``int`` refuses over 4,300 digits too.)"""
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:
        return None


#: The most tokens a trace's row may give for a prompt or an output: far past any model's
#: context, and small enough for every cost and KV computation to stay exact.
MAX_TRACE_TOKENS: Final = 2**31 - 1


def _tokens(path: Path, line: int, column: str, raw: object) -> int:
    if isinstance(raw, str):
        value = _digits(raw.strip())
    else:
        value = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
    if value is None or value < 1:
        raise _fail(path, line, column, f"expected a positive integer, got {raw!r}")
    if value > MAX_TRACE_TOKENS:
        raise _fail(path, line, column, f"{value} tokens is more than the most a row may "
                                        f"give ({MAX_TRACE_TOKENS:,})")
    return value


def _number_ns(path: Path, line: int, column: str, raw: float, unit: str) -> int:
    """``raw`` ``unit``s in integer ns: exact for an int, a float rounded."""
    scaled = raw * _NS_PER_UNIT[unit]
    if not -_MAX_NS <= scaled <= _MAX_NS:
        raise _fail(path, line, column, f"{raw!r} {unit} is out of range")
    return round(scaled)


#: What a CSV timestamp is; one file holds one kind (a mix cannot be put on one clock).
_NUMBER: Final = "a plain number"
_NAIVE: Final = "a date and time without a UTC offset"
_AWARE: Final = "a date and time with a UTC offset"
_DATE_FORMAT: Final = "'YYYY-MM-DD HH:MM:SS[.fffffff][Z|+HH:MM]'"


def _timestamp_ns(path: Path, line: int, raw: str, unit: str) -> tuple[int, str]:
    """(integer ns, kind) of ``raw``: ``YYYY-MM-DD HH:MM:SS[.fraction]`` (space or ``T``),
    optionally ending in ``Z`` or a UTC offset ``±HH:MM`` (``±HHMM``, ``±HH``) — then
    converted to UTC, so rows with different offsets land on one clock — or a plain
    number in ``unit``. An integer is taken exactly: as a float, epochs in ns or µs that
    differ by under ~200 ns would collapse into one arrival."""
    text = raw.strip()
    exact = _digits(text)
    if exact is not None:
        return _number_ns(path, line, CSV_COLUMNS[0], exact, unit), _NUMBER
    try:
        # ASCII only, as the token counts: float() also takes '１２', '١٢' and '1_000'.
        value = float(text) if text.isascii() and "_" not in text else math.nan
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return _number_ns(path, line, CSV_COLUMNS[0], value, unit), _NUMBER
    parsed = _date_ns(text)
    if parsed is None:
        raise _fail(
            path, line, CSV_COLUMNS[0], f"expected {_DATE_FORMAT} or a number, got {raw!r}"
        )
    return parsed


def _date_ns(text: str) -> tuple[int, str] | None:
    """(ns since 0001-01-01 UTC, kind) of a date and time, or None if it is not one. The
    fraction is kept to the nanosecond (the 2023 Azure traces have 7 digits, more than
    ``datetime`` parses); finer digits are dropped."""
    day, _, clock = text.replace("T", " ", 1).partition(" ")
    clock, offset_s = _split_offset(clock.strip())
    hms, _, frac = clock.partition(".")
    ymd = [_digits(x) for x in day.split("-")]
    parts = [_digits(x) for x in hms.split(":")]
    if len(ymd) != 3 or len(parts) != 3 or None in ymd or None in parts:
        return None
    if frac and _digits(frac) is None:  # '²' is a digit to isdigit; _digits refuses it
        return None
    y, mo, d = (x or 0 for x in ymd)
    h, mi, s = (x or 0 for x in parts)
    if not (h < 24 and mi < 60 and s < 61):
        return None
    try:
        days = date(y, mo, d).toordinal()
    except ValueError:
        return None
    frac_ns = int(frac[:9].ljust(9, "0")) if frac else 0
    local = (days * 86400 + h * 3600 + mi * 60 + s) * 10**9 + frac_ns
    if offset_s is None:
        return local, _NAIVE
    return local - offset_s * 10**9, _AWARE


def _split_offset(clock: str) -> tuple[str, int | None]:
    """(``clock`` without its zone, the zone's offset from UTC in seconds or None).
    ``Z`` is UTC; ``±HH:MM``, ``±HHMM`` and ``±HH`` are offsets (under 24 h). Anything
    else after a sign leaves the clock as it is (and it then fails to parse)."""
    if clock[-1:] in ("Z", "z"):
        return clock[:-1].rstrip(), 0
    for sign in ("+", "-"):
        head, found, zone = clock.rpartition(sign)
        if not found:
            continue
        hours, minutes = zone.split(":", 1) if ":" in zone else (zone[:2], zone[2:] or "00")
        h, m = _digits(hours), _digits(minutes)
        if h is None or m is None or len(hours) != 2 or len(minutes) != 2 or h > 23 or m > 59:
            return clock, None
        return head.rstrip(), (h * 3600 + m * 60) * (1 if sign == "+" else -1)
    return clock, None


def _finish(path: Path, rows: list[tuple[int, int, int]]) -> list[TraceRequest]:
    if not rows:
        raise TraceFormatError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])  # stable: ties keep file order
    t0 = rows[0][0]
    return [
        TraceRequest(idx=i, arrival_s=(t - t0) / 1e9, prompt_tokens=p, output_tokens=o)
        for i, (t, p, o) in enumerate(rows)
    ]


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> TraceFormatError:
    """The error for a file that is not UTF-8 text, naming the first line that is not.
    (Decoding reads ahead in chunks, so where it failed says little about the line; UTF-8
    never puts a newline byte inside a character, so each line decodes on its own.)"""
    with path.open("rb") as fh:
        for line_no, data in enumerate(fh, start=1):
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as bad:
                byte = data[bad.start]
                return TraceFormatError(
                    f"{path}:{line_no}: not UTF-8 text (byte 0x{byte:02x} at column "
                    f"{bad.start + 1}); save the trace as UTF-8"
                )
    return TraceFormatError(f"{path}: not UTF-8 text ({exc.reason}); save the trace as UTF-8")


class _CsvRows:
    """The records of a CSV file as (line the record starts on, cells). A quoting error
    (a stray double quote whose cell swallows the lines after it until it passes the csv
    module's field limit) and a file that is not UTF-8 raise ``TraceFormatError`` naming
    the line."""

    def __init__(self, path: Path, fh: Any) -> None:
        # skipinitialspace: ``1, "2", 3`` is three cells 1, 2, 3 (a space before a quote
        # would otherwise keep the quotes in the cell).
        self._reader = csv.reader(fh, skipinitialspace=True)
        self._path = path

    def __iter__(self) -> Iterator[tuple[int, list[str]]]:
        reader = self._reader
        while True:
            first = reader.line_num + 1
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                raise TraceFormatError(
                    f"{self._path}:{first}: unreadable CSV ({exc}); look for an unbalanced "
                    "double quote on this line"
                ) from None
            except UnicodeDecodeError as exc:
                raise _not_utf8(self._path, exc) from None
            yield first, cells


def load_csv_trace(path: Path, *, time_unit: TimeUnit = "s") -> list[TraceRequest]:
    """Azure-format CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``; extra columns in any
    order ok; cells may be quoted and padded with spaces; a byte-order mark is skipped).
    Timestamps are all dates or all numbers (see :func:`_timestamp_ns`); a row whose kind
    differs from the first row's is an error naming it. The file must be UTF-8."""
    with path.open(encoding="utf-8-sig", newline="") as fh:
        records = iter(_CsvRows(path, fh))
        # The header is the first line with anything on it (blank lines are skipped
        # everywhere, as between rows).
        head_line, head = next(((n, c) for n, c in records if any(x.strip() for x in c)),
                               (1, []))
        header = [cell.strip() for cell in head]
        missing = [c for c in CSV_COLUMNS if c not in header]
        if missing:
            raise _fail(path, head_line, missing[0], f"header lacks it (found {header})")
        twice = [c for c in CSV_COLUMNS if header.count(c) > 1]
        if twice:
            raise _fail(path, head_line, twice[0], "the header names it more than once")
        ts_i, ctx_i, gen_i = (header.index(c) for c in CSV_COLUMNS)
        rows: list[tuple[int, int, int]] = []
        first_kind: tuple[int, str] | None = None
        for line_no, cells in records:
            if not any(cell.strip() for cell in cells):
                continue
            if len(cells) != len(header):
                spans = any("\n" in cell or "\r" in cell for cell in cells)
                hint = " (a quoted cell runs past this line: an unbalanced quote?)" if spans else ""
                raise TraceFormatError(
                    f"{path}:{line_no}: expected {len(header)} cells, got {len(cells)}{hint}"
                )
            ts, kind = _timestamp_ns(path, line_no, cells[ts_i].strip(), time_unit)
            if first_kind is None:
                first_kind = (line_no, kind)
            elif kind != first_kind[1]:
                raise _fail(
                    path, line_no, CSV_COLUMNS[0],
                    f"{cells[ts_i].strip()!r} is {kind}, but line {first_kind[0]} has "
                    f"{first_kind[1]}; one trace needs one kind of timestamp",
                )
            rows.append(
                (
                    ts,
                    _tokens(path, line_no, CSV_COLUMNS[1], cells[ctx_i].strip()),
                    _tokens(path, line_no, CSV_COLUMNS[2], cells[gen_i].strip()),
                )
            )
    return _finish(path, rows)


def load_jsonl_trace(path: Path, *, time_unit: TimeUnit = "ms") -> list[TraceRequest]:
    """Mooncake-format JSONL: ``timestamp`` (default unit ms), ``input_length``,
    ``output_length`` per line — one JSON object per line, not one JSON array; UTF-8, a
    byte-order mark is skipped."""
    rows: list[tuple[int, int, int]] = []
    try:
        with path.open(encoding="utf-8-sig") as fh:
            for line_no, line in enumerate(fh, start=1):
                if line.strip():
                    rows.append(_jsonl_row(path, line_no, line, time_unit, not rows))
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from None
    return _finish(path, rows)


def _jsonl_row(
    path: Path, line_no: int, line: str, time_unit: TimeUnit, first: bool
) -> tuple[int, int, int]:
    if first and line.lstrip().startswith("["):
        raise TraceFormatError(
            f"{path}:{line_no}: expected one JSON object per line (JSONL), not a JSON array"
        )
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            f"{path}:{line_no}: not JSON: {exc.msg} (expected one JSON object per line: "
            "JSONL)"
        ) from None
    except (ValueError, RecursionError) as exc:
        # JSON past what Python reads: an integer over 4,300 digits, deep nesting.
        raise TraceFormatError(f"{path}:{line_no}: unreadable JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(
            f"{path}:{line_no}: expected a JSON object, one per line (JSONL), got "
            f"{type(obj).__name__}"
        )
    for key in JSONL_KEYS:
        if key not in obj:
            raise _fail(path, line_no, key, "missing")
    ts = obj["timestamp"]
    if (
        isinstance(ts, bool)
        or not isinstance(ts, int | float)
        or (isinstance(ts, float) and not math.isfinite(ts))  # isfinite(10**400) raises
    ):
        raise _fail(path, line_no, "timestamp", f"expected a number, got {ts!r}")
    return (
        _number_ns(path, line_no, "timestamp", ts, time_unit),
        _tokens(path, line_no, "input_length", obj["input_length"]),
        _tokens(path, line_no, "output_length", obj["output_length"]),
    )


def load_trace(path: Path, *, time_unit: TimeUnit | None = None) -> list[TraceRequest]:
    """By suffix: ``.csv`` → :func:`load_csv_trace` (unit s), ``.jsonl``/``.json`` →
    :func:`load_jsonl_trace` (unit ms). ``time_unit`` overrides the default."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return load_csv_trace(path, time_unit=time_unit or "s")
    if suffix in (".jsonl", ".json"):
        return load_jsonl_trace(path, time_unit=time_unit or "ms")
    raise TraceFormatError(f"{path}: unknown trace format {suffix!r} (want .csv or .jsonl)")


# ---- tenants and priorities ----------------------------------------------------------
def tenant_names(n: int) -> tuple[str, ...]:
    width = len(str(n - 1))
    return tuple(f"tenant-{i:0{width}d}" for i in range(n))


def attach_classes(
    requests: Sequence[TraceRequest],
    rng: random.Random,
    *,
    tenants: int = 20,
    zipf_exponent: float = 1.1,
    class_mix: Mapping[Priority, float] = DEFAULT_CLASS_MIX,
) -> list[TraceRequest]:
    """Copies of ``requests`` with a Zipf tenant and a priority each (deterministic for
    the rng's seed: one tenant draw then one priority draw per request, in order)."""
    if tenants < 1:
        raise ValueError("tenants must be >= 1")
    unknown = set(class_mix) - set(PRIORITIES)
    if unknown or any(w < 0 for w in class_mix.values()):
        raise ValueError(f"class_mix: unknown classes {unknown} or negative weights")
    if not math.isclose(sum(class_mix.values()), 1.0, abs_tol=1e-9):
        raise ValueError(f"class_mix must sum to 1, got {sum(class_mix.values())}")
    names = tenant_names(tenants)
    tenant_cum = _cumulative([k**-zipf_exponent for k in range(1, tenants + 1)])
    classes = [p for p in PRIORITIES if class_mix.get(p, 0.0) > 0]
    class_cum = _cumulative([class_mix[p] for p in classes])
    out = []
    for r in requests:
        tenant = rng.choices(names, cum_weights=tenant_cum)[0]
        priority = rng.choices(classes, cum_weights=class_cum)[0]
        out.append(replace(r, tenant=tenant, priority=priority))
    return out


def _cumulative(weights: Sequence[float]) -> list[float]:
    total, out = 0.0, []
    for w in weights:
        total += w
        out.append(total)
    return out


# ---- load ----------------------------------------------------------------------------
def arrival_rate(requests: Sequence[TraceRequest]) -> float:
    """Mean arrival rate (requests/s): (n − 1) gaps over the span first → last arrival."""
    if len(requests) < 2:
        raise ValueError("an arrival rate needs at least two requests")
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        raise ValueError("all requests arrive at once; the rate is undefined")
    return (len(requests) - 1) / span


def scale_to_rate(requests: Sequence[TraceRequest], rate_rps: float) -> list[TraceRequest]:
    """Same requests, inter-arrival times scaled so the mean rate is ``rate_rps``."""
    if not rate_rps > 0:
        raise ValueError(f"rate must be > 0, got {rate_rps}")
    factor = arrival_rate(requests) / rate_rps
    t0 = requests[0].arrival_s
    return [replace(r, arrival_s=(r.arrival_s - t0) * factor) for r in requests]


def scale_to_load(
    requests: Sequence[TraceRequest], load: float, fleet_capacity_rps: float,
    runnable: float = 1.0,
) -> list[TraceRequest]:
    """Scale arrivals so the offered load is ``load`` × ``fleet_capacity_rps``
    (λ = ρ · N · μ; ``fleet_capacity_rps`` = N · μ from :func:`fleet_capacity_rps`).
    ``runnable``: the share of ``requests`` that can run at all (:func:`runnable_share`);
    μ is measured on those, so they are the ones that arrive at ρ · N · μ (the rest, which
    every policy refuses on arrival, come on top)."""
    if not load > 0 or not fleet_capacity_rps > 0:
        raise ValueError("load and fleet capacity must be > 0")
    if not 0 < runnable <= 1:
        raise ValueError(f"runnable must be in (0, 1], got {runnable!r}")
    return scale_to_rate(requests, load * fleet_capacity_rps / runnable)


def runnable_share(profile: EngineProfile, requests: Sequence[TraceRequest]) -> float:
    """The share of ``requests`` whose prompt + output fits :func:`context_limit` (1.0 for
    none at all: :func:`fleet_capacity_rps` refuses that workload)."""
    if not requests:
        return 1.0
    limit = context_limit(profile)
    fits = sum(1 for r in requests if r.prompt_tokens + r.output_tokens <= limit)
    return fits / len(requests) if fits else 1.0


def context_limit(profile: EngineProfile) -> int:
    """The largest prompt + max_tokens an engine of ``profile`` accepts: its model's
    ``max_model_len`` in the registry llmq's admission reads (when the registry knows the
    model), capped by what the KV pool holds — vLLM will not start with a context its KV
    cannot hold, so its limit is the smaller of the two. Longer requests can never run:
    every policy refuses them ``too_large``."""
    shape = AdmissionConfig().registry.get(profile.model or profile.name)
    pool = profile.max_seq_tokens()
    return pool if shape is None else min(shape.max_model_len, pool)


def fleet_capacity_rps(
    profile: EngineProfile,
    engines: int,
    requests: Sequence[TraceRequest],
    rng: random.Random,
    sample_size: int = 2048,
) -> float:
    """N · μ: saturated requests/s of ``engines`` engines for this workload's length mix,
    μ measured on a random sample of ``sample_size`` requests (with replacement)."""
    if engines < 1 or not requests:
        raise ValueError("need at least one engine and one request")
    limit = context_limit(profile)
    runnable = [r for r in requests if r.prompt_tokens + r.output_tokens <= limit]
    if not runnable:
        what = (f"{limit - 1}-token KV pool of profile {profile.name!r}"
                if limit == profile.max_seq_tokens()
                else f"{limit}-token context (max_model_len) of profile {profile.name!r}'s "
                     f"model")
        raise ValueError(f"no request fits one engine: every prompt + output exceeds the {what}")
    if len(runnable) < len(requests):
        requests = runnable  # the rest can never run (every policy refuses them too_large)
    sample = [rng.choice(requests) for _ in range(sample_size)]
    lengths = [(r.prompt_tokens, r.output_tokens) for r in sample]
    n = max(sample_size, 4 * profile.max_num_seqs)
    return engines * saturated_capacity(profile, lengths, n_requests=n).requests_per_s


# ---- synthetic -----------------------------------------------------------------------
def synthetic(
    n: int,
    rng: random.Random,
    *,
    rate_rps: float,
    cv: float = 1.0,
    prompt_mean: float = 1000.0,
    prompt_sigma: float = 1.0,
    prompt_max: int = 8192,
    output_mean: float = 200.0,
    output_sigma: float = 1.0,
    output_max: int = 2048,
) -> list[TraceRequest]:
    """``n`` requests, first at t = 0. Inter-arrival times are gamma with mean 1/rate and
    coefficient of variation ``cv`` (shape 1/cv²; cv = 1 is Poisson, > 1 bursty, < 1
    smooth). Lengths are lognormal with the given mean and log-sigma (μ = ln mean − σ²/2),
    rounded and clipped to [1, max] (clipping lowers the realised mean slightly)."""
    if n < 1 or not rate_rps > 0 or not cv > 0:
        raise ValueError("n >= 1, rate_rps > 0 and cv > 0 are required")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate_rps * shape)
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(shape, scale)
        out.append(
            TraceRequest(
                idx=i,
                arrival_s=t,
                prompt_tokens=_lognormal_int(rng, prompt_mean, prompt_sigma, prompt_max),
                output_tokens=_lognormal_int(rng, output_mean, output_sigma, output_max),
            )
        )
    return out


def _lognormal_int(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return min(cap, max(1, round(rng.lognormvariate(mu, sigma))))
