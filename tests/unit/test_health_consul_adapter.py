"""The py-consul adapter's HTTP calls, against a recording stub of Consul's agent API.

The stub (a tiny http.server on 127.0.0.1) is not Consul: it records each request and
answers 200, or 404 for ids listed in ``missing``, the way an agent answers for unknown
services and checks. It pins down what the adapter sends wherever no real ``consul`` is
available (tests/integration/test_health_consul.py runs the real thing when one is).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from services.health.consul_registry import ConsulRegistry
from services.health.registry import RegistryError, ServiceRegistration
from services.health.settings import ConsulAddress


class AgentStub:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, list[str]], Any]] = []
        self.missing: set[str] = set()
        self.services: dict[str, Any] = {}


@pytest.fixture
def stub() -> Iterator[tuple[AgentStub, ConsulAddress]]:
    state = AgentStub()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            state.requests.append((method, url.path, parse_qs(url.query), body))
            target = url.path.rsplit("/", 1)[-1]
            if target in state.missing:
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b"Unknown")
                return
            payload = json.dumps(state.services if url.path == "/v1/agent/services"
                                 else True).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_PUT(self) -> None:
            self._answer("PUT")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, ConsulAddress("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_register_sends_one_ttl_check_and_replaces_checks(
    stub: tuple[AgentStub, ConsulAddress]
) -> None:
    state, addr = stub
    ConsulRegistry(addr).register(ServiceRegistration(
        "llmq-worker", "w1", tags=("pool:short", "model:m"), meta=(("slot", "2"),),
        ttl_s=12.5))
    method, path, query, body = state.requests[-1]
    assert (method, path) == ("PUT", "/v1/agent/service/register")
    assert query["replace-existing-checks"] == ["true"]
    assert body == {"name": "llmq-worker", "id": "w1", "tags": ["pool:short", "model:m"],
                    "meta": {"slot": "2"}, "checks": [{"ttl": "12500ms"}]}


def test_checks_maintenance_and_listing(stub: tuple[AgentStub, ConsulAddress]) -> None:
    state, addr = stub
    reg = ConsulRegistry(addr)
    reg.set_check("w1", "passing", "beat 7")
    reg.set_check("w1", "critical", "stale")
    reg.set_maintenance("w1", "llmq: draining")
    reg.set_maintenance("w1", None)
    calls = [(p, q) for _, p, q, _ in state.requests]
    assert calls == [
        ("/v1/agent/check/pass/service:w1", {"note": ["beat 7"]}),
        ("/v1/agent/check/fail/service:w1", {"note": ["stale"]}),
        ("/v1/agent/service/maintenance/w1", {"enable": ["True"],
                                              "reason": ["llmq: draining"]}),
        ("/v1/agent/service/maintenance/w1", {"enable": ["False"]}),
    ]
    state.services = {"w1": {"Service": "llmq-worker"}, "h": {"Service": "llmq-health"}}
    assert reg.service_ids("llmq-worker") == {"w1"}


def test_unknown_ids(stub: tuple[AgentStub, ConsulAddress]) -> None:
    state, addr = stub
    state.missing = {"service:w9", "w9"}
    reg = ConsulRegistry(addr)
    with pytest.raises(RegistryError, match="consul refused"):
        reg.set_check("w9", "passing", "x")
    with pytest.raises(RegistryError):
        reg.set_maintenance("w9", "x")
    reg.deregister("w9")  # already gone: fine
    assert state.requests[-1][1] == "/v1/agent/service/deregister/w9"


def test_unreachable_agent() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as server:
        port = server.server_address[1]
    reg = ConsulRegistry(ConsulAddress("127.0.0.1", port), timeout_s=1.0)
    with pytest.raises(RegistryError, match=f"127.0.0.1:{port}"):
        reg.register(ServiceRegistration("llmq-worker", "w1"))
