"""Experiment (not an llmq policy): the same fleet split into prefill and decode engines.

Why it exists: issue 4's short-lane ratios are missed because, on engines that run prefill
and decode together, a short request's decode steps carry other requests' prefill (an
8,192-token chunk makes a 6 ms step 147 ms). Splitwise (Patel et al., ISCA 2024, whose
Azure traces the benchmark replays) separates the two phases onto different machines.
This driver measures what that would do on the benchmark's own arrivals, fleet and cost
model, against the baselines of ``llmq bench policies`` run in the same process, with the
same metrics code (``services.sim.metrics.summarize``). It came before llmq could do
this; llmq now does (worker roles, hand-offs and this overflow rule in its core and
services: ``llmq bench policies --pools pd``, docs/benchmarks.md "Thirteenth round"). The
driver stays as the reference those figures were first measured with.

The model, deliberately simple (every engine is the same calibrated ``sim`` engine core):

* ``--prefill N`` engines run each prompt (short lane before long, as llmq's engine
  priority does; otherwise FCFS) and sample one token, as a vLLM prefill instance does
  (``max_tokens`` 1); a request goes to the prefill engine with the fewest prompt tokens
  queued or running.
* The KV cache then moves to a decode engine: 1 ms + 128 KiB a token at ``--gbps``
  (25 GB/s by default, one 200 Gb/s link; the figure hardly matters, see the docs).
* The other engines decode. A hand-off arrives as the whole request with all but the last
  prompt token already in KV (``SimRequest.cached_tokens``): it takes the prompt's blocks,
  recomputes the last prompt token and samples every output token, the first one
  included, as vLLM's decode instance does behind its P/D proxy (the prefill's token is
  discarded). A request goes to the decode engine with the fewest sequences.
* ``--overflow Q`` (Splitwise's mixed pool, one simple form): when every prefill engine
  has at least Q prompt tokens queued, a long-lane request goes whole to a decode engine
  that has no prompt of its own to compute (the one with the fewest sequences), which
  prefills and decodes it there. Without it the roles are fixed.
* No admission control, no classes. The driver moves in 5 ms steps; arrivals and
  hand-offs happen at their exact times, an engine may be up to one step ahead (as in
  ``services.sim.simulator``).

Run from the repository root::

    .venv/bin/python scripts/experiments/pd_split.py --trace code --load 0.85 --prefill 7
    .venv/bin/python scripts/experiments/pd_split.py --trace conv --load 0.95 --prefill 6 \\
        --overflow 8192
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.sim.bench import BenchConfig, Workload, _jobs, prepare, run_policy
from services.sim.fleet import COMPLETED, Job
from services.sim.metrics import summarize
from services.worker.engines.sim import SimEngineCore, SimRequest
from services.worker.engines.sim.model import SeqEvent

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
BASELINES = ("fifo-rr", "least-requests", "vllm-random")
KV_BYTES_PER_TOKEN = 131_072  # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def run_split(workload: Workload, config: BenchConfig, n_prefill: int, gbps: float,
              overflow: int | None = None, dt: float = 0.005) -> tuple[list[Job], Split]:
    """Every job through a prefill engine then a decode engine (or, with ``overflow``,
    whole on a decode engine); the jobs, and what the engines did."""
    jobs = _jobs(workload.requests, workload.profile, config)
    engines = [SimEngineCore(workload.profile) for _ in range(config.workers)]
    prefill, decode = range(n_prefill), range(n_prefill, config.workers)
    to_compute = [0] * config.workers  # prompt tokens placed on the engine, not yet computed
    whole: set[int] = set()  # jobs an overflow sent whole to a decode engine
    handoffs: list[tuple[float, int]] = []  # (KV arrives at the decode side, job index)
    remaining, next_arrival, now = len(jobs), 0, 0.0

    def on_events(k: int, events: list[SeqEvent]) -> None:
        nonlocal remaining
        for ev in events:
            job = jobs[ev.seq_id]
            on_decode_side = k >= n_prefill
            if ev.kind == "first_token" and on_decode_side:
                job.first_token_s = ev.time_s
                if ev.seq_id in whole:
                    to_compute[k] -= job.prompt
            elif ev.kind == "finished" and on_decode_side:
                job.finished_s, job.state = ev.time_s, COMPLETED
                remaining -= 1
            elif ev.kind == "finished":  # the prompt is computed: ship its KV
                to_compute[k] -= job.prompt
                transfer = 0.001 + job.prompt * KV_BYTES_PER_TOKEN / (gbps * 1e9)
                heapq.heappush(handoffs, (ev.time_s + transfer, ev.seq_id))

    def place(k: int, request: SimRequest, at: float) -> None:
        on_events(k, engines[k].advance(at))
        engines[k].add(request, at)

    def fewest_sequences(candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda e: engines[e].running + engines[e].waiting)

    while remaining:
        until = now + dt
        while next_arrival < len(jobs) and jobs[next_arrival].arrival_s < until:
            job = jobs[next_arrival]
            rank = 0 if job.lane == "short" else 1
            k = min(prefill, key=lambda i: (to_compute[i], engines[i].running))
            idle = [d for d in decode if to_compute[d] == 0]
            if overflow is not None and job.lane == "long" and to_compute[k] >= overflow \
                    and idle:
                k = fewest_sequences(idle)
                whole.add(job.idx)
                place(k, SimRequest(job.idx, job.prompt, job.output, job.arrival_s, rank),
                      job.arrival_s)
            else:
                place(k, SimRequest(job.idx, job.prompt, 1, job.arrival_s, rank), job.arrival_s)
            to_compute[k] += job.prompt
            job.dispatched_s, job.worker = job.arrival_s, k
            next_arrival += 1
        for k, engine in enumerate(engines):
            on_events(k, engine.advance(until))
        while handoffs and handoffs[0][0] < until:
            at, i = heapq.heappop(handoffs)
            job = jobs[i]
            place(fewest_sequences(decode), SimRequest(i, job.prompt, job.output, at,
                                                       cached_tokens=job.prompt - 1), at)
        for k in decode:
            on_events(k, engines[k].advance(until))
        now = until
    return jobs, Split(sum(e.preemptions for e in engines), len(whole))


class Split(NamedTuple):
    """What the engines did besides serving: KV preemptions, overflows sent whole."""

    preemptions: int
    overflowed: int


def _overflow(value: str) -> int | None:
    return None if value == "off" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=("conv", "code"), default="code")
    parser.add_argument("--load", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--prefill", type=int, nargs="+", default=[7],
                        help="prefill engines (the rest decode); several values: one run each")
    parser.add_argument("--gbps", type=float, default=25.0, help="KV transfer, GB/s")
    parser.add_argument("--overflow", type=_overflow, nargs="+", default=[None],
                        help="prompt tokens queued on every prefill engine above which a "
                             "long request goes whole to a decode engine, or 'off' (fixed "
                             "roles, the default); several values: one run each")
    args = parser.parse_args()
    config = BenchConfig(trace=TRACES / f"azure_llm_2023_{args.trace}.csv",
                         workers=args.workers, load=args.load, seed=args.seed)
    workload = prepare(config)
    base = {name: run_policy(name, workload, config).summary for name in BASELINES}
    fifo = base["fifo-rr"]["lanes"]
    best = min(base[n]["lanes"]["short"]["e2e_p99_s"] for n in BASELINES[1:])
    print(f"{args.trace} load {args.load} seed {args.seed}, {args.workers} workers: "
          f"fifo-rr short p99 {fifo['short']['e2e_p99_s']:.2f} s, best other {best:.2f} s, "
          f"fifo-rr long {fifo['long']['completed_tokens_per_s']:,.0f} tokens/s")
    for n_prefill in args.prefill:
        for overflow in args.overflow:
            jobs, split = run_split(workload, config, n_prefill, args.gbps, overflow)
            lanes = summarize(jobs, config.llmq.timeout_s)["lanes"]
            short_p99, long_p99 = lanes["short"]["e2e_p99_s"], lanes["long"]["e2e_p99_s"]
            long_ratio = (lanes["long"]["completed_tokens_per_s"]
                          / fifo["long"]["completed_tokens_per_s"])
            print(f"  {n_prefill} prefill / {args.workers - n_prefill} decode, overflow "
                  f"{overflow}: short p99 {short_p99:.2f} s (÷ fifo "
                  f"{short_p99 / fifo['short']['e2e_p99_s']:.3f}, ÷ best {short_p99 / best:.3f}), "
                  f"long tokens/s ÷ fifo {long_ratio:.3f}, long p99 {long_p99:.2f} s, "
                  f"sent whole {split.overflowed}, KV preemptions {split.preemptions}",
                  flush=True)


if __name__ == "__main__":
    main()
