"""Properties of the sim engine core: fast-forward ≡ stepping, KV and clock invariants."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.worker.engines.sim.model import (
    EngineProfile,
    SeqEvent,
    SimEngineCore,
    SimRequest,
    to_ns,
)

US = 1e-6


@dataclass(frozen=True)
class Action:
    """At ``t_us``: add a request, abort a sequence, or (``probe``) just advance to t."""

    t_us: int
    kind: str
    req: SimRequest | None = None
    seq_id: int = 0


@st.composite
def profiles(draw: st.DrawFn) -> EngineProfile:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 8))
    return EngineProfile(
        name="prop",
        beta0_s=draw(st.integers(1, 2000)) * US,
        beta1_s_per_prefill_tok=draw(st.integers(1, 50)) * US,
        beta2_s_per_decode_tok=draw(st.integers(1, 50)) * US,
        num_blocks=draw(st.integers(1, 80)),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 64)),
        kv_bytes_per_token=1,
        source="hypothesis",
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[EngineProfile, list[Action]]:
    profile = draw(profiles())
    cap = profile.max_seq_tokens()
    actions = []
    for seq_id in range(draw(st.integers(1, 12))):
        prompt = draw(st.integers(1, min(cap - 1, 80)))
        output = draw(st.integers(1, min(cap - prompt, 300)))
        t = draw(st.integers(0, 30_000))
        actions.append(Action(t, "add", SimRequest(seq_id, prompt, output, t * US)))
        if draw(st.integers(0, 9)) == 0:
            actions.append(Action(t + draw(st.integers(0, 20_000)), "abort", seq_id=seq_id))
    for _ in range(draw(st.integers(0, 6))):
        actions.append(Action(draw(st.integers(0, 60_000)), "probe"))
    actions.sort(key=lambda a: (a.t_us, a.kind != "add"))  # a sequence exists before its abort
    return profile, actions


Outcome = tuple[list[SeqEvent], dict[str, int], set[int]]


def _apply(core: SimEngineCore, action: Action, aborted: set[int]) -> None:
    if action.kind == "add":
        assert action.req is not None
        core.add(action.req, action.t_us * US)
    elif action.kind == "abort" and core.abort(action.seq_id):
        aborted.add(action.seq_id)


def _counters(core: SimEngineCore) -> dict[str, int]:
    return {
        "steps": core.steps,
        "preemptions": core.preemptions,
        "prefill": core.prefill_tokens,
        "decode": core.decode_tokens,
        "busy_ns": core.busy_ns,
        "free": core.free_blocks,
    }


def run_stepwise(profile: EngineProfile, actions: list[Action]) -> Outcome:
    """Reference: one ``step`` at a time, checking invariants after each."""
    core = SimEngineCore(profile)
    events: list[SeqEvent] = []
    aborted: set[int] = set()
    last_start = -1.0

    def step_before(limit_ns: int | None) -> None:
        nonlocal last_start
        while core.has_work:
            start = core.next_step_s
            assert start is not None
            if limit_ns is not None and to_ns(start) >= limit_ns:
                return
            result = core.step(start)
            assert result.start_s >= last_start  # monotone clock
            last_start = result.start_s
            assert 0 <= core.free_blocks <= profile.num_blocks
            assert core.free_blocks + core.blocks_held() == profile.num_blocks
            assert core.running <= profile.max_num_seqs
            assert result.prefill_tokens + result.decode_tokens <= profile.max_num_batched_tokens
            events.extend(result.events)

    for action in actions:
        step_before(to_ns(action.t_us * US))
        _apply(core, action, aborted)
    step_before(None)
    return events, _counters(core), aborted


def run_fast(profile: EngineProfile, actions: list[Action]) -> Outcome:
    core = SimEngineCore(profile)
    events: list[SeqEvent] = []
    aborted: set[int] = set()
    for action in actions:
        events += core.advance(action.t_us * US)
        # The jump's block accounting must agree with blocks recomputed from scratch.
        assert core.free_blocks + core.blocks_held() == profile.num_blocks
        _apply(core, action, aborted)
    events += core.advance(None)
    return events, _counters(core), aborted


PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(scenarios())
def test_fast_forward_is_identical_to_stepping(
    scenario: tuple[EngineProfile, list[Action]],
) -> None:
    profile, actions = scenario
    step_events, step_counters, step_aborted = run_stepwise(profile, actions)
    fast_events, fast_counters, fast_aborted = run_fast(profile, actions)
    # Integer-nanosecond clock: same events, same order, same times, exactly.
    assert fast_events == step_events
    assert fast_counters == step_counters
    assert fast_aborted == step_aborted


@PROPS
@given(scenarios())
def test_every_sequence_finishes_or_is_aborted_and_the_pool_drains(
    scenario: tuple[EngineProfile, list[Action]],
) -> None:
    profile, actions = scenario
    events, counters, aborted = run_stepwise(profile, actions)
    added = {a.req.seq_id: a.req for a in actions if a.req is not None}
    finished = {e.seq_id: e for e in events if e.kind == "finished"}
    assert set(finished) | aborted == set(added) and not set(finished) & aborted
    for seq_id, done in finished.items():
        assert done.generated == added[seq_id].max_output_tokens
        assert done.time_s >= added[seq_id].arrival_s
    assert counters["free"] == profile.num_blocks
    preempted = [e for e in events if e.kind == "preempted"]
    assert counters["preemptions"] == len(preempted)
    # Each first token precedes its finish, at most once per sequence.
    firsts = [e.seq_id for e in events if e.kind == "first_token"]
    assert len(firsts) == len(set(firsts))
    times = {(e.seq_id, e.kind): e.time_s for e in events}
    for seq_id in finished:
        assert times[(seq_id, "first_token")] <= times[(seq_id, "finished")]
