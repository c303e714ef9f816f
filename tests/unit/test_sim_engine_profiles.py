"""Shipped and user engine profiles, and the shipped profiles on real traffic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.sim.workload import load_csv_trace
from services.worker.engines.sim.capacity import latency_alone, saturated_capacity
from services.worker.engines.sim.model import (
    EngineProfile,
    SeqEvent,
    SimEngineCore,
    SimRequest,
    to_ns,
)
from services.worker.engines.sim.profiles import get_profile, load_profiles

# The shared traces sit beside the checkout (DESIGN.md, "Data"): <root>/../shared/traces.
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
needs_traces = pytest.mark.skipif(
    not (TRACES / "azure_llm_2023_conv.csv").exists(), reason=f"no shared traces at {TRACES}"
)
GiB = 2**30


@pytest.mark.parametrize(
    ("name", "betas_us", "weights_params", "kv_bytes"),
    [
        ("llama3-8b-h100", (5752.705, 17.2509, 5.9991), 8_030_261_248, 131_072),
        ("llama3-8b-a100", (16441.532, 47.8374, 18.2056), 8_030_261_248, 131_072),
        ("qwen2.5-7b-a100", (10041.674, 81.1210, 59.9862), 7_615_616_512, 57_344),
    ],
)
def test_shipped_profiles(
    name: str, betas_us: tuple[float, float, float], weights_params: int, kv_bytes: int
) -> None:
    p = load_profiles()[name]
    got = (p.beta0_s, p.beta1_s_per_prefill_tok, p.beta2_s_per_decode_tok)
    assert got == pytest.approx(tuple(b * 1e-6 for b in betas_us))
    assert p.kv_bytes_per_token == kv_bytes
    # num_blocks = (80 GiB × 0.9 − bf16 weights) / (KV bytes per token × block size)
    assert p.num_blocks == math.floor((80 * GiB * 0.9 - 2 * weights_params) / (kv_bytes * 16))
    assert (p.block_size, p.max_num_seqs, p.max_num_batched_tokens) == (16, 256, 8192)
    assert "BLIS" in p.source and p.model


def test_user_profiles_add_and_replace(tmp_path: Path) -> None:
    extra = tmp_path / "mine.toml"
    extra.write_text(
        "[profiles.tiny]\nbeta0_us = 100\nbeta1_us_per_prefill_token = 1.5\n"
        "beta2_us_per_decode_token = 0.5\nnum_blocks = 64\nkv_bytes_per_token = 1024\n"
        'max_num_seqs = 4\nmax_num_batched_tokens = 128\nsource = "made up"\n'
        "[profiles.llama3-8b-h100]\nbeta0_us = 6000\nbeta1_us_per_prefill_token = 17\n"
        "beta2_us_per_decode_token = 6\nnum_blocks = 1000\nkv_bytes_per_token = 131072\n"
        'source = "recalibrated"\n'
    )
    profiles = load_profiles(extra)
    assert profiles["tiny"].beta0_s == pytest.approx(100e-6)
    assert profiles["tiny"].model == "tiny" and profiles["tiny"].block_size == 16
    assert profiles["llama3-8b-h100"].num_blocks == 1000
    assert "llama3-8b-a100" in profiles
    assert get_profile("tiny", extra).max_num_seqs == 4


_GOOD = {
    "beta0_us": "100",
    "beta1_us_per_prefill_token": "1",
    "beta2_us_per_decode_token": "1",
    "num_blocks": "10",
    "kv_bytes_per_token": "10",
    "source": '"x"',
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"beta0_us": "0"}, "profiles.foo.beta0_us must be > 0"),
        ({"beta2_us_per_decode_token": "-1"}, "profiles.foo.beta2_us_per_decode_token must be > 0"),
        ({"num_blocks": "1.5"}, "profiles.foo.num_blocks must be an integer"),
        ({"beta1_us_per_prefill_token": '"fast"'}, "beta1_us_per_prefill_token must be a number"),
        ({"num_blocks": None}, "profiles.foo.num_blocks is required"),
        ({"beta0": "1"}, r"profiles.foo: unknown key\(s\) beta0"),
        ({"max_num_batched_tokens": "100"}, "max_num_batched_tokens must be >= max_num_seqs"),
        ({"source": '""'}, "profiles.foo.source must be a non-empty string"),
    ],
)
def test_bad_user_profile_names_the_field(
    tmp_path: Path, change: dict[str, str | None], message: str
) -> None:
    table = {**_GOOD, **change}
    body = "".join(f"{k} = {v}\n" for k, v in table.items() if v is not None)
    extra = tmp_path / "bad.toml"
    extra.write_text("[profiles.foo]\n" + body)
    with pytest.raises(ValueError, match=message):
        load_profiles(extra)


def test_unreadable_profile_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[profiles.foo\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_profiles(broken)
    empty = tmp_path / "empty.toml"
    empty.write_text("title = 'nothing'\n")
    with pytest.raises(ValueError, match=r"\[profiles.NAME\]"):
        load_profiles(empty)
    with pytest.raises(ValueError, match="unknown engine profile 'nope'"):
        get_profile("nope")


def test_latency_alone_on_h100() -> None:
    p = get_profile("llama3-8b-h100")
    ttft, e2e = latency_alone(p, 1000, 200)
    assert ttft == pytest.approx(5752.705e-6 + 1000 * 17.2509e-6, abs=1e-6)
    assert e2e == pytest.approx(ttft + 199 * (5752.705e-6 + 5.9991e-6), abs=1e-6)


def _replay(mode: str, reqs: list[SimRequest]) -> list[SeqEvent]:
    core = SimEngineCore(get_profile("llama3-8b-h100"))
    events: list[SeqEvent] = []
    for r in reqs:
        if mode == "advance":
            events += core.advance(r.arrival_s)
        else:
            while core.has_work and to_ns(core.next_step_s or 0.0) < to_ns(r.arrival_s):
                events += core.step(core.next_step_s or 0.0).events
        core.add(r, r.arrival_s)
    if mode == "advance":
        return events + core.advance(None)
    while core.has_work:
        events += core.step(core.next_step_s or 0.0).events
    return events


@needs_traces
@pytest.mark.parametrize("speedup", [4, 60])
def test_fast_forward_equals_stepping_on_real_traffic(speedup: int) -> None:
    # 400 Azure conversation requests, time compressed: 4× (≈ 22 req/s, below the
    # engine's ~37 req/s: mostly quiet decode runs) and 60× (≈ 330 req/s: a long queue,
    # full batches, a prefill in almost every step).
    trace = load_csv_trace(TRACES / "azure_llm_2023_conv.csv")[:400]
    reqs = [
        SimRequest(r.idx, r.prompt_tokens, r.output_tokens, r.arrival_s / speedup) for r in trace
    ]
    stepped = _replay("step", reqs)
    assert _replay("advance", reqs) == stepped
    assert sum(e.kind == "finished" for e in stepped) == 400


@needs_traces
def test_saturated_capacity_on_the_conversation_mix() -> None:
    trace = load_csv_trace(TRACES / "azure_llm_2023_conv.csv")
    lengths = [(r.prompt_tokens, r.output_tokens) for r in trace[:2048]]
    cap = saturated_capacity(get_profile("llama3-8b-h100"), lengths)
    # Prefill-bound: ≈ 1155 prompt tokens per request at 17.25 µs → ~50 req/s at most.
    assert 20 < cap.requests_per_s < 60
    assert cap.prompt_tokens_per_s * 17.2509e-6 < 1.0  # prefill alone fits in wall time


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"beta0_us": "inf"}, r"bad\.toml: profiles\.foo\.beta0_us must be a finite number, "
                              r"got inf"),
        ({"beta1_us_per_prefill_token": "nan"}, "beta1_us_per_prefill_token must be a finite"),
        ({"beta2_us_per_decode_token": "1" + "0" * 400},
         r"beta2_us_per_decode_token must be a finite number, got 100000000000\.\.\. \(too "),
        ({"block_size": "65536"}, r"profiles\.foo\.block_size must be <= 1024 tokens, got 65536"),
        ({"block_size": "100000000"}, r"block_size must be <= 1024"),
    ],
)
def test_non_finite_numbers_and_huge_blocks_are_refused_naming_file_and_key(
    tmp_path: Path, change: dict[str, str], message: str
) -> None:
    body = "".join(f"{k} = {v}\n" for k, v in {**_GOOD, **change}.items())
    extra = tmp_path / "bad.toml"
    extra.write_text("[profiles.foo]\n" + body)
    with pytest.raises(ValueError, match=message):
        load_profiles(extra)


def test_the_block_size_bound_is_1024_tokens(tmp_path: Path) -> None:
    def load(block_size: int) -> int:
        body = "".join(f"{k} = {v}\n" for k, v in {**_GOOD, "block_size": block_size}.items())
        extra = tmp_path / "big.toml"
        extra.write_text("[profiles.foo]\n" + body)
        return load_profiles(extra)["foo"].block_size

    assert load(1024) == 1024
    with pytest.raises(ValueError, match="block_size must be <= 1024 tokens, got 1025"):
        load(1025)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("beta0_s", math.inf, "beta0_s must be finite"),
    ("beta2_s_per_decode_tok", math.nan, "beta2_s_per_decode_tok must be finite"),
    ("block_size", 2048, "block_size must be <= 1024"),
])
def test_engine_profile_refuses_what_the_file_loader_refuses(
    field: str, value: float, message: str
) -> None:
    good = dict(name="x", beta0_s=0.005, beta1_s_per_prefill_tok=1e-5,
                beta2_s_per_decode_tok=1e-5, num_blocks=10)
    with pytest.raises(ValueError, match=message):
        EngineProfile(**{**good, field: value})  # type: ignore[arg-type]


def test_a_profile_file_that_is_not_utf8_names_file_and_line(tmp_path: Path) -> None:
    body = "".join(f"{k} = {v}\n" for k, v in _GOOD.items())
    extra = tmp_path / "latin1.toml"
    extra.write_bytes(b"# profiles\n[profiles.foo]\n" + body.encode() + b'model = "caf\xe9"\n')
    with pytest.raises(ValueError, match=r"latin1\.toml:9: not UTF-8 text \(byte 0xe9\)"):
        load_profiles(extra)
