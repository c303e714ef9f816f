"""NVML readings of the worker's GPU, when there is one (pynvml from nvidia-ml-py).

:meth:`NvmlProbe.open` returns None when NVML cannot start (no driver, no GPU, no
library): the worker then reports the engine's own figures. Every NVML call is guarded, so
a GPU that falls off the bus makes heartbeats fall back rather than the worker crash.
"""

from __future__ import annotations

import logging
from typing import Any

from services.worker.core.heartbeat import GpuSample

_log = logging.getLogger(__name__)


class NvmlProbe:
    """One NVML device handle; :meth:`sample` reads memory and utilisation."""

    def __init__(self, nvml: Any, handle: Any, index: int) -> None:
        self._nvml = nvml
        self._handle = handle
        self.index = index

    @classmethod
    def open(cls, index: int = 0) -> NvmlProbe | None:
        """A probe for device ``index``, or None when NVML or the device is unavailable."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError (no driver / library)
            _log.info("NVML unavailable (%s): VRAM figures come from the engine", exc)
            return None
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            _log.warning("NVML has no device %d (%s): VRAM figures come from the engine",
                         index, exc)
            _shutdown(pynvml)
            return None
        return cls(pynvml, handle, index)

    def sample(self) -> GpuSample | None:
        """Memory (bytes) and utilisation in [0, 1] now; None when the read fails."""
        try:
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            total, used = int(memory.total), int(memory.used)
        except Exception as exc:
            _log.warning("NVML memory read failed: %s", exc)
            return None
        try:
            util: float | None = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100
        except Exception:
            util = None  # some devices (MIG slices) do not report utilisation
        return GpuSample(total, min(used, total), util)

    def close(self) -> None:
        _shutdown(self._nvml)


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # already shut down, or the driver went away: nothing to free
        _log.debug("nvmlShutdown failed", exc_info=True)
