"""The worker's pure core: plain code over plain values, ``now`` passed in, no I/O.

- ``batching``: token deltas → chunks (flush every N tokens or M seconds);
- ``dedupe``: which ``(request_id, attempt)`` to run, drop or supersede; recent cancels;
- ``deadline``: deadlines and the timings of a finished request;
- ``offsets``: which assignment offset is safe to commit with requests finishing out of order;
- ``heartbeat``: engine capacity (+ GPU sample) → the fields of a heartbeat;
- ``rate``: recent tokens per second;
- ``handoffs``: the hand-offs whose prompt KV a prefill worker may still hold.

Callers: ``services.worker.app`` and ``services.worker.runner`` (and tests). Imports nothing
from Kafka, HTTP, vLLM or NVML (tests/unit/test_worker_core.py checks it).
"""

from services.worker.core.batching import Chunk, ChunkBatcher
from services.worker.core.deadline import Timing, deadline_of, timing
from services.worker.core.dedupe import AttemptLedger, RecentCancels, Verdict
from services.worker.core.handoffs import HeldHandoffs
from services.worker.core.heartbeat import GpuSample, HeartbeatFields, heartbeat_fields
from services.worker.core.offsets import OffsetTracker, decode_done, encode_done
from services.worker.core.rate import RateMeter

__all__ = [
    "AttemptLedger",
    "Chunk",
    "ChunkBatcher",
    "GpuSample",
    "HeartbeatFields",
    "HeldHandoffs",
    "OffsetTracker",
    "RateMeter",
    "RecentCancels",
    "Timing",
    "Verdict",
    "deadline_of",
    "decode_done",
    "encode_done",
    "heartbeat_fields",
    "timing",
]
