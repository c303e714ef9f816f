"""Discrete-event simulator of an llmq fleet (bench): drives the same pure core as the
live services over many ``sim`` engines.

Modules:

* ``workload`` — real traces (Azure LLM 2023, Mooncake JSONL), synthetic arrivals,
  tenants and priorities, scaling to a target offered load;
* ``fleet`` — the per-request job records and the simulated workers (one calibrated
  ``SimEngineCore`` each: the single cost model every policy runs on);
* ``simulator`` — the event loop (arrivals, engine wake-ups, finishes, heartbeats);
* ``policies`` — the baselines (fifo-rr, least-requests, vllm-random) and the registry;
  ``llmq`` — llmq itself: ingest's ``admit`` and the scheduler's ``schedule`` unchanged;
* ``pools`` — how llmq labels workers short / long / any for a workload;
* ``metrics``, ``bench``, ``report``, ``plot``, ``cli`` — figures, one comparison run,
  the {trace × load} matrix, CDF plots and ``llmq bench policies``.

Callers: the ``llmq bench policies`` command and the tests. Nothing here performs I/O
except ``workload`` (reading a trace), ``cli`` and ``plot`` (writing results).
"""
