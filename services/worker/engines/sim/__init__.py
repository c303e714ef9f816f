"""The ``sim`` engine: a calibrated continuous-batching model of one vLLM instance.

Pure code (no clock, no I/O, no randomness). ``model.SimEngineCore`` is the engine state
and cost model; ``capacity`` derives reference latencies and saturated throughput from it;
``profiles`` loads calibrations shipped in ``profiles.toml`` or supplied by users. The
live worker wraps the core in an async engine that sleeps for each step; the
discrete-event simulator (services/sim) drives the same core with ``advance``.
"""

from services.worker.engines.sim.capacity import EngineCapacity, latency_alone, saturated_capacity
from services.worker.engines.sim.model import (
    EngineProfile,
    SeqEvent,
    SimEngineCore,
    SimRequest,
    StepResult,
)
from services.worker.engines.sim.profiles import get_profile, load_profiles

__all__ = [
    "EngineCapacity",
    "EngineProfile",
    "SeqEvent",
    "SimEngineCore",
    "SimRequest",
    "StepResult",
    "get_profile",
    "latency_alone",
    "load_profiles",
    "saturated_capacity",
]
