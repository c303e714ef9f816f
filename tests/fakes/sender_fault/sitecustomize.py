"""FAULT INJECTION (test-only): Python imports this module at start when this folder is on
``PYTHONPATH`` (:func:`env`). Once the file named by ``LLMQ_TEST_SENDER_FAULT`` exists,
aiokafka's sender fails its next produce request with ``OutOfOrderSequenceNumber``, the
error that ends aiokafka's sender task for good (an idempotent producer after the broker
lost records it had acknowledged, possible with one replica). The broker is real and
nothing else changes; before the file exists every request goes through.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_TRIGGER = os.environ.get("LLMQ_TEST_SENDER_FAULT")

if _TRIGGER:
    from aiokafka.errors import OutOfOrderSequenceNumber
    from aiokafka.producer.sender import Sender

    _real = Sender._send_produce_req

    async def _send_produce_req(self: Any, node_id: int, batches: Any) -> Any:
        if Path(str(_TRIGGER)).exists():
            raise OutOfOrderSequenceNumber()
        return await _real(self, node_id, batches)

    Sender._send_produce_req = _send_produce_req  # type: ignore[method-assign]
