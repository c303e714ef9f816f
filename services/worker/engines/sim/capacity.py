"""Reference latencies and saturated throughput of one ``sim`` engine.

``latency_alone`` is the denominator of slowdown (latency ÷ latency alone). On an idle
engine a request with P prompt and T output tokens runs ``ceil(P / M)`` prefill steps
(M = ``max_num_batched_tokens``; all full chunks but the last) and then T − 1 decode steps
of one token each::

    TTFT_alone = Σ_chunks (β0 + β1 · chunk)        E2E_alone = TTFT_alone + (T − 1)(β0 + β2)

computed in the core's integer nanoseconds, so it equals what ``SimEngineCore`` yields.

``saturated_capacity`` measures μ, the completed requests/s of one engine that always has
a backlog, for a given length mix. Method: queue ``n`` requests (the sample, repeated) at
t = 0, run to completion, and take the completion rate between the 10 % and 70 %
completion marks (every completion in (t_10%, t_70%] over t_70% − t_10%): after the
start-up transient (the first batch all finishing together) and before the backlog can
run out (with n ≥ 4 · max_num_seqs, at 70 % done at least 1.2 · max_num_seqs requests
remain, more than fit in the batch). A fleet of N identical engines then serves N · μ
requests/s of that mix. The requests measured are those that happened to finish in the
window; long ones are slightly under-represented near its end (a small bias at n ≫ batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.worker.engines.sim.model import EngineProfile, SimEngineCore, SimRequest, to_s


def latency_alone(
    profile: EngineProfile, prompt_tokens: int, output_tokens: int
) -> tuple[float, float]:
    """(TTFT, end-to-end latency) in seconds of the request alone on an idle engine."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("prompt_tokens and output_tokens must be >= 1")
    if prompt_tokens + output_tokens > profile.max_seq_tokens():
        raise ValueError(
            f"{prompt_tokens}+{output_tokens} tokens exceed the KV pool of {profile.name}"
        )
    b0, b1, b2 = profile.step_ns()
    full, rest = divmod(prompt_tokens, profile.max_num_batched_tokens)
    ttft = full * (b0 + b1 * profile.max_num_batched_tokens)
    if rest:
        ttft += b0 + b1 * rest
    e2e = ttft + (output_tokens - 1) * (b0 + b2)
    return to_s(ttft), to_s(e2e)


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """Saturated throughput of one engine for one length mix, over the measuring window."""

    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    requests_measured: int
    preemptions: int


def saturated_capacity(
    profile: EngineProfile,
    lengths: Sequence[tuple[int, int]],
    n_requests: int | None = None,
) -> EngineCapacity:
    """Completed requests/s (and tokens/s) of one engine with an endless backlog.

    ``lengths``: (prompt tokens, output tokens) pairs, used in order and repeated until
    ``n_requests`` (default ``max(8 · max_num_seqs, len(lengths))``) are queued.
    """
    if not lengths:
        raise ValueError("saturated_capacity needs at least one (prompt, output) pair")
    n = n_requests if n_requests is not None else max(8 * profile.max_num_seqs, len(lengths))
    if n < 4 * profile.max_num_seqs:
        raise ValueError(f"n_requests must be >= 4 * max_num_seqs = {4 * profile.max_num_seqs}")
    core = SimEngineCore(profile)
    for i in range(n):
        prompt, output = lengths[i % len(lengths)]
        core.add(SimRequest(i, prompt, output), 0.0)
    done = [e for e in core.advance(None) if e.kind == "finished"]
    # Completions come in bursts (a step can finish many), so count every completion in
    # (t_open, t_close] rather than a fixed number of events.
    t_open, t_close = done[n // 10].time_s, done[(7 * n) // 10].time_s
    span = t_close - t_open
    if span <= 0:
        raise ValueError("measuring window has zero length; use more requests")
    counted = [e for e in done if t_open < e.time_s <= t_close]
    prompt_sum = sum(lengths[e.seq_id % len(lengths)][0] for e in counted)
    output_sum = sum(lengths[e.seq_id % len(lengths)][1] for e in counted)
    return EngineCapacity(
        requests_per_s=len(counted) / span,
        prompt_tokens_per_s=prompt_sum / span,
        output_tokens_per_s=output_sum / span,
        requests_measured=len(counted),
        preemptions=core.preemptions,
    )
