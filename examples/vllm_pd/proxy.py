"""A small prefill/decode proxy for vLLM + KVLinkConnector (standard library only).

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. send the request to a prefill server with ``max_tokens=1``, no streaming, and
   ``kv_transfer_params={"do_remote_decode": true, ...}``: it computes the prompt's KV, holds the
   blocks and answers the ``kv_transfer_params`` a decode server needs to pull them;
2. send the original request to a decode server with those ``kv_transfer_params`` and relay its
   answer (streamed or not) to the client.

The same contract as vLLM's NixlConnector toy proxy, so either proxy works with either connector.
Prefill and decode servers are picked round-robin.

``--layerwise`` (prefill with ``"layerwise": true``, decode with ``"mode": "push"``): the
decode must know its blocks before the prefill computes, so the proxy mints a push key and
sends the decode its request first (``remote_request_id`` = the key, no block ids,
``kvlink_mode: push``), then the prefill its own (``kvlink_push_key`` = the key); the prefill
streams the KV layer by layer into the decode's blocks during its forward. The prefill's
kvlink address (engine id, side channel) comes from its first answer: until a prefill has
answered once, its requests take the sequential flow. Contract: docs/layerwise.md.

    python examples/vllm_pd/proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000 [--layerwise]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import threading
import urllib.parse
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")
#: what a decode needs of a prefill before it answered, learnt from its kv_transfer_params
ADDRESS_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
IDLE_TIMEOUT = 75.0  #: seconds a silent client's connection is kept (nginx's keepalive_timeout)

log = logging.getLogger("kvlink.proxy")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server gets it."""
    out = dict(body)
    out["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


def layerwise_bodies(body: dict[str, Any], address: dict[str, Any], key: str,
                     decode_params: dict[str, Any] | None = None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill body, decode body) of the layer-wise flow for one request: both name ``key``;
    the decode's params point at the prefill (``address``: its :data:`ADDRESS_KEYS`) with no
    block ids, and ask to be pushed into."""
    prefill = prefill_body(body)
    prefill["kv_transfer_params"]["kvlink_push_key"] = key
    decode = dict(body)
    decode["kv_transfer_params"] = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [],
        "remote_request_id": key, **address, **(decode_params or {}), "kvlink_mode": "push",
    }
    return prefill, decode


class UpstreamError(RuntimeError):
    """A server answered other than 200: its status and body, which the proxy passes on
    where the fault is the client's (4xx: a model name or max_tokens it refused)."""

    def __init__(self, url: str, status: int, body: bytes) -> None:
        super().__init__(f"{url} answered {status}: {body[:500]!r}")
        self.status, self.body = status, body


def _connection(base: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    return conn, u.path.rstrip("/")


def post_json(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              timeout: float = 600.0) -> dict[str, Any]:
    conn, prefix = _connection(base, timeout)
    try:
        conn.request("POST", prefix + path, json.dumps(body).encode(),
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise UpstreamError(base + path, resp.status, data)
        out: dict[str, Any] = json.loads(data)
        return out
    finally:
        conn.close()


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0,
                 decode_params: dict[str, Any] | None = None, layerwise: bool = False,
                 idle_timeout: float = IDLE_TIMEOUT) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode server")
        #: the layer-wise flow (decode first, see the module docstring)
        self.layerwise = layerwise
        #: prefill URL -> its kvlink address (ADDRESS_KEYS), from its first answer
        self.addresses: dict[str, dict[str, Any]] = {}
        #: requests sent each way, for checks: "sequential", "layerwise"
        self.flows: dict[str, int] = {"sequential": 0, "layerwise": 0}
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._lock = threading.Lock()
        self.timeout = timeout
        #: seconds a client's connection may be silent (between requests, or not reading its
        #: answer) before the proxy closes it: each connection holds a thread
        self.idle_timeout = idle_timeout
        #: merged into the kv_transfer_params the decode gets (e.g. {"kvlink_mode": "push"})
        self.decode_params = dict(decode_params or {})

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._prefill), next(self._decode)

    def learn(self, prefill: str, params: dict[str, Any] | None) -> None:
        """Remember a prefill's kvlink address from kv_transfer_params it answered."""
        if params and all(params.get(k) is not None for k in ADDRESS_KEYS):
            with self._lock:
                self.addresses[prefill] = {k: params[k] for k in ADDRESS_KEYS}

    def address(self, prefill: str) -> dict[str, Any] | None:
        with self._lock:
            return self.addresses.get(prefill)

    def count(self, flow: str) -> None:
        with self._lock:
            self.flows[flow] += 1

    def handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = proxy.idle_timeout  # (the client's socket: an idle keep-alive ends)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, payload: dict[str, Any] | bytes) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path in ("/health", "/healthcheck"):
                    self._reply(200, {"status": "ok"})
                else:
                    self._reply(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:
                self._answering = False  # (one handler serves a keep-alive connection's posts)
                if self.path not in ROUTES:
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(n) or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError(f"a JSON object, not {type(body).__name__}")
                except ValueError as exc:  # (json's errors are ValueErrors)
                    self._reply(400, {"error": f"the request body is not a JSON object: {exc}"})
                    return
                try:
                    api = self.path.removeprefix("/v1")
                    prefill, decode = proxy.pick()
                    headers = {"X-Request-Id": self.headers.get("X-Request-Id")
                               or str(uuid.uuid4())}
                    if self.headers.get("Authorization"):
                        headers["Authorization"] = self.headers["Authorization"]
                    address = proxy.address(prefill) if proxy.layerwise else None
                    if address is not None:
                        self._layerwise(prefill, decode, api, body, address, headers)
                        return
                    first = post_json(prefill, "/v1" + api, prefill_body(body), headers,
                                      proxy.timeout)
                    params = first.get("kv_transfer_params")
                    proxy.learn(prefill, params)
                    proxy.count("sequential")
                    if params:
                        body["kv_transfer_params"] = {**params, **proxy.decode_params}
                    self._relay(decode, "/v1" + api, body, headers)
                except Exception as exc:  # the client gets the reason, the proxy keeps serving
                    if self._answering:
                        # the decode's answer was under way: a second response in its body
                        # would corrupt it; the client sees the stream end unterminated
                        log.warning("decode answer cut short: %s: %s", type(exc).__name__, exc)
                        self.close_connection = True
                        return
                    if isinstance(exc, UpstreamError) and 400 <= exc.status < 500:
                        # the client's fault (a model name, max_tokens): vLLM's own answer
                        self._reply(exc.status, exc.body)
                        return
                    self._reply(502, {"error": f"{type(exc).__name__}: {exc}"})

            def _layerwise(self, prefill: str, decode: str, api: str, body: dict[str, Any],
                           address: dict[str, Any], headers: dict[str, str]) -> None:
                """Decode first (it allocates and sends its block ids), then the prefill,
                whose answer only confirms it ran: the decode's answer is the client's. A
                prefill that fails leaves the decode to its push_timeout (then recomputed or
                failed by its kv_load_failure_policy)."""
                key = f"kvlw-{uuid.uuid4().hex}"
                pre, dec = layerwise_bodies(body, address, key, proxy.decode_params)

                def run_prefill() -> None:
                    try:
                        proxy.learn(prefill, post_json(prefill, "/v1" + api, pre, headers,
                                                       proxy.timeout).get("kv_transfer_params"))
                    except Exception as exc:  # the decode's answer says what came of it
                        log.warning("layer-wise prefill of %s failed: %s", key, exc)

                thread = threading.Thread(target=run_prefill, daemon=True)
                proxy.count("layerwise")
                try:
                    self._relay(decode, "/v1" + api, dec, headers, sent=thread.start)
                finally:
                    if thread.is_alive():
                        thread.join(proxy.timeout)

            def _relay(self, base: str, path: str, body: dict[str, Any],
                       headers: dict[str, str],
                       sent: Callable[[], None] | None = None) -> None:
                """Relay ``body``'s answer from ``base``; ``sent``: called once the request
                is sent, before its answer is awaited (the layer-wise flow's prefill)."""
                conn, prefix = _connection(base, proxy.timeout)
                try:
                    conn.request("POST", prefix + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})
                    if sent is not None:
                        sent()
                    resp = conn.getresponse()
                    self._answering = True  # (from here on the client's response is under way)
                    self.send_response(resp.status)
                    self.send_header("Content-Type",
                                     resp.getheader("Content-Type", "application/json"))
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while True:
                        chunk = resp.read1(65536)
                        if not chunk:
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                finally:
                    conn.close()

        return Handler


def serve(prefill: list[str], decode: list[str], host: str = "127.0.0.1", port: int = 8000,
          timeout: float = 600.0, decode_params: dict[str, Any] | None = None,
          layerwise: bool = False, idle_timeout: float = IDLE_TIMEOUT) -> ThreadingHTTPServer:
    """Bind the proxy (``port=0``: any free port); call ``serve_forever`` on the result (its
    ``proxy`` attribute is the :class:`Proxy`).

    ``decode_params`` are added to the ``kv_transfer_params`` every decode request gets: with
    KVLinkConnector, ``{"kvlink_mode": "pull"}`` or ``"push"`` picks the mode per request.
    ``layerwise``: the decode-first flow (module docstring, docs/layerwise.md).
    ``idle_timeout``: a client connection silent this long is closed (a thread each).
    """
    proxy = Proxy(prefill, decode, timeout, decode_params, layerwise, idle_timeout)
    server = ThreadingHTTPServer((host, port), proxy.handler())
    server.daemon_threads = True
    server.proxy = proxy  # type: ignore[attr-defined]
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill server base URL(s)")
    ap.add_argument("--decode", nargs="+", required=True, help="decode server base URL(s)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--decode-params", type=json.loads, default=None,
                    help='JSON merged into the decode\'s kv_transfer_params, e.g. '
                         '\'{"kvlink_mode": "push"}\'')
    ap.add_argument("--layerwise", action="store_true",
                    help="decode first, then the prefill, which streams the KV layer by layer "
                         "(prefill: layerwise true; decode: mode push); docs/layerwise.md")
    ap.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT,
                    help="seconds a silent client connection is kept (default %(default)s)")
    args = ap.parse_args()
    server = serve(args.prefill, args.decode, args.host, args.port,
                   decode_params=args.decode_params, layerwise=args.layerwise,
                   idle_timeout=args.idle_timeout)
    print(f"proxy on http://{args.host}:{server.server_address[1]} -> prefill {args.prefill}, "
          f"decode {args.decode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
