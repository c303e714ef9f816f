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
"""

from __future__ import annotations

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


def _within(value: int, total: int) -> int:
    return min(max(0, value), total)


def heartbeat_fields(cap: EngineCapacity, gpu: GpuSample | None = None,
                     held_back: int = 0, tokens_per_s: float | None = None) -> HeartbeatFields:
    """Map capacity to heartbeat fields (rules in the module docstring).

    ``tokens_per_s`` overrides the engine's figure (the worker measures what it streamed).
    """
    kv_total = max(0, cap.kv_total_tokens)
    kv_total_bytes = max(0, cap.kv_total_bytes)
    if gpu is not None:
        vram_total, vram_used, util = gpu.vram_total_bytes, gpu.vram_used_bytes, gpu.gpu_util
    else:
        vram_total, vram_used, util = cap.vram_total_bytes, cap.vram_used_bytes, cap.gpu_util
    vram_total = max(0, vram_total)
    rate = cap.tokens_per_s if tokens_per_s is None else tokens_per_s
    return HeartbeatFields(
        kv_total_tokens=kv_total,
        kv_free_tokens=_within(cap.kv_free_tokens, kv_total),
        kv_total_bytes=kv_total_bytes,
        kv_free_bytes=_within(cap.kv_free_bytes, kv_total_bytes),
        block_size=max(1, cap.block_size),
        vram_total_bytes=vram_total,
        vram_used_bytes=_within(vram_used, vram_total),
        gpu_util=None if util is None else min(1.0, max(0.0, util)),
        running=max(0, cap.running),
        waiting=max(0, cap.waiting) + max(0, held_back),
        max_num_seqs=max(1, cap.max_num_seqs),
        tokens_per_s=max(0.0, rate),
    )
