"""The example proxy (examples/vllm_pd/proxy.py) when a server fails mid-answer.

The prefill and decode here are stand-ins (small HTTP servers speaking vLLM's answer shapes):
a decode dying in the middle of a streamed answer cannot be had from a real vLLM server on
demand. The proxy under test is the real one.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _proxy_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "kvlink_pd_proxy", ROOT / "examples" / "vllm_pd" / "proxy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _StandIn(BaseHTTPRequestHandler):
    """Prefill: answers kv_transfer_params. Decode: starts a chunked stream, sends one
    event, then its connection breaks (no terminating chunk), as a decode that died."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.role == "prefill":  # type: ignore[attr-defined]
            data = json.dumps({"kv_transfer_params": {"remote_engine_id": "e"}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"tok": 0}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)


IDLE = 1.0  # the proxy's idle_timeout here


@pytest.fixture
def proxy_url() -> Iterator[tuple[str, int]]:
    servers = []
    urls = []
    for role in ("prefill", "decode"):
        s = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
        s.role = role  # type: ignore[attr-defined]
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
        urls.append(f"http://127.0.0.1:{s.server_address[1]}")
    proxy = _proxy_module().serve([urls[0]], [urls[1]], port=0, idle_timeout=IDLE)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield "127.0.0.1", proxy.server_address[1]
    finally:
        for s in (*servers, proxy):
            s.shutdown()
            s.server_close()


def test_a_decode_dying_mid_stream_ends_the_clients_stream(proxy_url: tuple[str, int]) -> None:
    """The client gets the events that came, then the connection ends: no second response
    inside the first one's body (the proxy wrote "HTTP/1.1 502" after the 200's chunks) and
    no connection left open waiting (the client hung)."""
    body = b'{"prompt": "x", "stream": true}'
    with socket.create_connection(proxy_url, timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        got = b""
        while data := s.recv(65536):  # (a hang fails on the socket's timeout)
            got += data
    assert got.startswith(b"HTTP/1.1 200"), got
    assert b'data: {"tok": 0}' in got, got
    assert got.count(b"HTTP/1.1") == 1, got


def test_an_idle_keep_alive_client_is_closed(proxy_url: tuple[str, int]) -> None:
    """A client that keeps its connection open and silent after an answer (HTTP/1.1
    keep-alive) is closed after ``idle_timeout``: each connection holds one of the proxy's
    threads. Before, it held one until the client went (a client pool's idle connections: a
    thread each, for good)."""
    conn = http.client.HTTPConnection(*proxy_url, timeout=30)
    try:
        conn.request("GET", "/health")
        answer = conn.getresponse()
        assert answer.status == 200 and answer.read() == b'{"status": "ok"}'
        assert conn.sock is not None  # (kept open: HTTP/1.1, a Content-Length answer)
        t0 = time.monotonic()
        assert conn.sock.recv(1) == b"", "the proxy sent more than its answer"
        took = time.monotonic() - t0
    finally:
        conn.close()
    assert IDLE * 0.5 <= took < IDLE * 10, took
