"""Engine capacity (+ an optional GPU sample) → the load fields of a ``WorkerHeartbeat``.

Rules (a heartbeat is the scheduler's only view of the worker, so it is complete and
consistent, never a delta):

- VRAM and utilisation come from NVML when a sample is given, else from the engine's own
  figures (0/0 and None when it has none).
- Free never exceeds total (the wire model rejects it): free KV and used VRAM are clamped,
  negative figures become 0.
- ``waiting`` adds the assignments the worker holds back (received, not yet handed to the
  engine) to the engine's own waiting queue.
- ``max_num_seqs`` is at least 1.
- Every figure stays within what the wire takes, so a heartbeat can always be built (a
  heartbeat that cannot be built stops the worker). A KV figure the wire cannot carry (a
  block size over 65,536, a pool over 2^63) makes the KV unknown: 0 total, so no new work
  comes (fail closed) while the worker keeps beating; counts are capped, a rate or
  utilisation that is not a number reads 0 / None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.worker.engines.base import EngineCapacity


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One NVML reading of the worker's GPU(s): bytes and utilisation in [0, 1]."""

    vram_total_bytes: int
    vram_used_bytes: int
    gpu_util: float | None


@dataclass(frozen=True, slots=True)
class HeartbeatFields:
    """The load part of a heartbeat, named exactly as ``WorkerHeartbeat``'s fields."""

    kv_total_tokens: int
    kv_free_tokens: int
    kv_total_bytes: int
    kv_free_bytes: int
    block_size: int
    vram_total_bytes: int
    vram_used_bytes: int
    gpu_util: float | None
    running: int
    waiting: int
    max_num_seqs: int
    tokens_per_s: float


_MAX_COUNT = (1 << 63) - 1  # schemas.base.Count
_MAX_BLOCK = 1 << 16  # WorkerHeartbeat.block_size
_MAX_SEQS = 1 << 20  # WorkerHeartbeat.max_num_seqs


def _within(value: int, total: int) -> int:
    return min(max(0, value), total)


def _count(value: int) -> int:
    return min(max(0, value), _MAX_COUNT)


def heartbeat_fields(cap: EngineCapacity, gpu: GpuSample | None = None,
                     held_back: int = 0, tokens_per_s: float | None = None) -> HeartbeatFields:
    """Map capacity to heartbeat fields (rules in the module docstring).

    ``tokens_per_s`` overrides the engine's figure (the worker measures what it streamed).
    """
    kv_total = max(0, cap.kv_total_tokens)
    kv_total_bytes = max(0, cap.kv_total_bytes)
    block_size = max(1, cap.block_size)
    if block_size > _MAX_BLOCK or kv_total > _MAX_COUNT or kv_total_bytes > _MAX_COUNT:
        kv_total = kv_total_bytes = 0  # unknown: fail closed (module docstring)
        block_size = min(block_size, _MAX_BLOCK)
    if gpu is not None:
        vram_total, vram_used, util = gpu.vram_total_bytes, gpu.vram_used_bytes, gpu.gpu_util
    else:
        vram_total, vram_used, util = cap.vram_total_bytes, cap.vram_used_bytes, cap.gpu_util
    vram_total = _count(vram_total)
    rate = cap.tokens_per_s if tokens_per_s is None else tokens_per_s
    return HeartbeatFields(
        kv_total_tokens=kv_total,
        kv_free_tokens=_within(cap.kv_free_tokens, kv_total),
        kv_total_bytes=kv_total_bytes,
        kv_free_bytes=_within(cap.kv_free_bytes, kv_total_bytes),
        block_size=block_size,
        vram_total_bytes=vram_total,
        vram_used_bytes=_within(vram_used, vram_total),
        gpu_util=None if util is None or math.isnan(util) else min(1.0, max(0.0, util)),
        running=_count(cap.running),
        waiting=_count(max(0, cap.waiting) + max(0, held_back)),
        max_num_seqs=min(max(1, cap.max_num_seqs), _MAX_SEQS),
        tokens_per_s=rate if math.isfinite(rate) and rate > 0.0 else 0.0,
    )
