"""A small prefill/decode proxy for vLLM + KVLinkConnector (standard library only).

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. send the request to a prefill server with ``max_tokens=1``, no streaming, and
   ``kv_transfer_params={"do_remote_decode": true, ...}``: it computes the prompt's KV, holds the
   blocks and answers the ``kv_transfer_params`` a decode server needs to pull them;
2. send the original request to a decode server with those ``kv_transfer_params`` and relay its
   answer (streamed or not) to the client.

The same contract as vLLM's NixlConnector toy proxy, so either proxy works with either connector.
Prefill and decode servers are picked round-robin.

    python examples/vllm_pd/proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")


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
            raise RuntimeError(f"{base}{path} answered {resp.status}: {data[:500]!r}")
        out: dict[str, Any] = json.loads(data)
        return out
    finally:
        conn.close()


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0,
                 decode_params: dict[str, Any] | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode server")
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._lock = threading.Lock()
        self.timeout = timeout
        #: merged into the kv_transfer_params the decode gets (e.g. {"kvlink_mode": "push"})
        self.decode_params = dict(decode_params or {})

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return next(self._prefill), next(self._decode)

    def handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
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
                if self.path not in ROUTES:
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(n) or b"{}")
                    api = self.path.removeprefix("/v1")
                    prefill, decode = proxy.pick()
                    headers = {"X-Request-Id": self.headers.get("X-Request-Id")
                               or str(uuid.uuid4())}
                    if self.headers.get("Authorization"):
                        headers["Authorization"] = self.headers["Authorization"]
                    first = post_json(prefill, "/v1" + api, prefill_body(body), headers,
                                      proxy.timeout)
                    params = first.get("kv_transfer_params")
                    if params:
                        body["kv_transfer_params"] = {**params, **proxy.decode_params}
                    self._relay(decode, "/v1" + api, body, headers)
                except Exception as exc:  # the client gets the reason, the proxy keeps serving
                    self._reply(502, {"error": f"{type(exc).__name__}: {exc}"})

            def _relay(self, base: str, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> None:
                conn, prefix = _connection(base, proxy.timeout)
                try:
                    conn.request("POST", prefix + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})
                    resp = conn.getresponse()
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
          timeout: float = 600.0, decode_params: dict[str, Any] | None = None
          ) -> ThreadingHTTPServer:
    """Bind the proxy (``port=0``: any free port); call ``serve_forever`` on the result.

    ``decode_params`` are added to the ``kv_transfer_params`` every decode request gets: with
    KVLinkConnector, ``{"kvlink_mode": "pull"}`` or ``"push"`` picks the mode per request.
    """
    server = ThreadingHTTPServer((host, port),
                                 Proxy(prefill, decode, timeout, decode_params).handler())
    server.daemon_threads = True
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
    args = ap.parse_args()
    server = serve(args.prefill, args.decode, args.host, args.port,
                   decode_params=args.decode_params)
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
