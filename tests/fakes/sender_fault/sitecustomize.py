"""FAULT INJECTION (test-only): Python imports this module at start when this folder is on
``PYTHONPATH`` (:func:`env`). Once the file named by ``LLMQ_TEST_SENDER_FAULT`` exists,
every produce response the process reads says ``OUT_OF_ORDER_SEQUENCE_NUMBER`` (errno 45)
for each of its partitions: what an idempotent producer is answered once the broker lost
records it had acknowledged (possible with one replica), after which aiokafka fails every
later batch to that partition. ``LLMQ_TEST_SENDER_FAULT_CODE`` answers another error
instead (29: topic authorization failed, which no retry mends), and
``LLMQ_TEST_SENDER_FAULT_TOPIC`` only for the topics whose name contains it. The broker is
real and the request really went to it; only the answer is changed. Before the file exists
every answer is the broker's own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_TRIGGER = os.environ.get("LLMQ_TEST_SENDER_FAULT")
OUT_OF_ORDER_SEQUENCE_NUMBER = 45


def out_of_order(response: Any, code: int = OUT_OF_ORDER_SEQUENCE_NUMBER,
                 topic_part: str = "") -> Any:
    """``response`` (a ProduceResponse) with the error code of every partition of the
    topics whose name contains ``topic_part`` set to ``code``."""
    response.topics = [
        (topic, [(info[0], code, *info[2:]) if topic_part in topic else info
                 for info in partitions])
        for topic, partitions in response.topics
    ]
    return response


if _TRIGGER:
    from aiokafka.producer.sender import SendProduceReqHandler

    _real = SendProduceReqHandler.handle_response
    _code = int(os.environ.get("LLMQ_TEST_SENDER_FAULT_CODE", OUT_OF_ORDER_SEQUENCE_NUMBER))
    _topic_part = os.environ.get("LLMQ_TEST_SENDER_FAULT_TOPIC", "")

    def _handle_response(self: Any, response: Any) -> Any:
        if Path(str(_TRIGGER)).exists():
            response = out_of_order(response, _code, _topic_part)
        return _real(self, response)

    SendProduceReqHandler.handle_response = _handle_response  # type: ignore[method-assign]
