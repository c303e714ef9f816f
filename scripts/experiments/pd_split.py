"""Experiment (not an llmq policy): the same fleet split into prefill and decode engines.

Why it exists: issue 4's short-lane ratios are missed because, on engines that run prefill
and decode together, a short request's decode steps carry other requests' prefill (an
8,192-token chunk makes a 6 ms step 147 ms). Splitwise (Patel et al., ISCA 2024, whose
Azure traces the benchmark replays) separates the two phases onto different machines.
This driver measures what that would do on the benchmark's own arrivals, fleet and cost
model, against the baselines of ``llmq bench policies`` run in the same process, with the
same metrics code (``services.sim.metrics.summarize``). llmq does not do this: its
workers cannot hand a request's KV cache to another worker (docs/benchmarks.md, "Eleventh
round", says what building it would take).

The model, deliberately simple:

* ``--prefill N`` engines run each prompt (short lane before long, as llmq's engine
  priority does; otherwise FCFS) and produce the first token; a request goes to the
  prefill engine with the fewest prompt tokens queued or running.
* The KV cache then moves to a decode engine: 1 ms + 128 KiB a token at ``--gbps``
  (25 GB/s by default, one 200 Gb/s link; the figure hardly matters, see the docs).
* The other engines decode: the same calibrated engine with β1 ≈ 0 (the transferred
  prompt takes its KV blocks and step slots but is not computed again); a request goes to
  the decode engine with the fewest sequences. No admission control, no classes.
* The driver moves in 5 ms steps; arrivals and hand-offs happen at their exact times,
  an engine may be up to one step ahead (as in ``services.sim.simulator``).

Run from the repository root::

    .venv/bin/python scripts/experiments/pd_split.py --trace code --load 0.85 --prefill 7
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import sys
from pathlib import Path

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
              dt: float = 0.005) -> tuple[list[Job], int]:
    """Every job through prefill engines then decode engines; (jobs, KV preemptions)."""
    jobs = _jobs(workload.requests, workload.profile, config)
    decode_profile = dataclasses.replace(workload.profile, beta1_s_per_prefill_tok=1e-9)
    prefill = [SimEngineCore(workload.profile) for _ in range(n_prefill)]
    decode = [SimEngineCore(decode_profile) for _ in range(config.workers - n_prefill)]
    queued_prompt = [0] * n_prefill
    handoffs: list[tuple[float, int]] = []  # (KV arrives at the decode engine, job index)
    preemptions = 0
    next_arrival, remaining, now = 0, len(jobs), 0.0

    def prefill_events(k: int, events: list[SeqEvent]) -> None:
        nonlocal remaining
        for ev in events:
            job = jobs[ev.seq_id]
            if ev.kind != "finished":
                continue
            job.first_token_s = ev.time_s
            queued_prompt[k] -= job.prompt
            if job.output <= 1:
                job.finished_s, job.state = ev.time_s, COMPLETED
                remaining -= 1
            else:
                delay = 0.001 + job.prompt * KV_BYTES_PER_TOKEN / (gbps * 1e9)
                heapq.heappush(handoffs, (ev.time_s + delay, ev.seq_id))

    def decode_events(events: list[SeqEvent]) -> None:
        nonlocal remaining, preemptions
        for ev in events:
            if ev.kind == "preempted":
                preemptions += 1
            elif ev.kind == "finished":
                job = jobs[ev.seq_id]
                job.finished_s, job.state = ev.time_s, COMPLETED
                remaining -= 1

    while remaining:
        until = now + dt
        while next_arrival < len(jobs) and jobs[next_arrival].arrival_s < until:
            job = jobs[next_arrival]
            k = min(range(n_prefill), key=lambda i: (queued_prompt[i], prefill[i].running))
            prefill_events(k, prefill[k].advance(job.arrival_s))
            prefill[k].add(SimRequest(job.idx, job.prompt, 1, job.arrival_s,
                                      0 if job.lane == "short" else 1), job.arrival_s)
            queued_prompt[k] += job.prompt
            job.dispatched_s, job.worker = job.arrival_s, k
            next_arrival += 1
        for k, engine in enumerate(prefill):
            prefill_events(k, engine.advance(until))
        while handoffs and handoffs[0][0] < until:
            at, i = heapq.heappop(handoffs)
            job = jobs[i]
            d = min(range(len(decode)), key=lambda e: decode[e].running + decode[e].waiting)
            decode_events(decode[d].advance(at))
            decode[d].add(SimRequest(i, job.prompt, job.output - 1, at), at)
        for engine in decode:
            decode_events(engine.advance(until))
        now = until
    return jobs, preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=("conv", "code"), default="code")
    parser.add_argument("--load", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--prefill", type=int, nargs="+", default=[7],
                        help="prefill engines (the rest decode); several values: one run each")
    parser.add_argument("--gbps", type=float, default=25.0, help="KV transfer, GB/s")
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
        jobs, preempted = run_split(workload, config, n_prefill, args.gbps)
        lanes = summarize(jobs, config.llmq.timeout_s)["lanes"]
        short_p99, long_p99 = lanes["short"]["e2e_p99_s"], lanes["long"]["e2e_p99_s"]
        long_ratio = (lanes["long"]["completed_tokens_per_s"]
                      / fifo["long"]["completed_tokens_per_s"])
        print(f"  {n_prefill} prefill / {args.workers - n_prefill} decode: short p99 "
              f"{short_p99:.2f} s (÷ fifo {short_p99 / fifo['short']['e2e_p99_s']:.3f}, "
              f"÷ best {short_p99 / best:.3f}), long tokens/s ÷ fifo {long_ratio:.3f}, "
              f"long p99 {long_p99:.2f} s, KV preemptions {preempted}", flush=True)


if __name__ == "__main__":
    main()
