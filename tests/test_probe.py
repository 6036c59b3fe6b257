"""`kvlink probe` against a real Prometheus exposition served over HTTP on loopback."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus_client absent")

from kvlink.cli import main  # noqa: E402
from kvlink.probe import achieved, baseline_gbps, parse_metrics, scrape  # noqa: E402


@pytest.fixture
def server() -> Iterator[tuple[str, object, object]]:
    reg = prometheus_client.CollectorRegistry()
    nbytes = prometheus_client.Counter("kvlink_recv_bytes", "b", ["engine"], registry=reg)
    secs = prometheus_client.Histogram("kvlink_recv_seconds", "s", ["engine"], registry=reg)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = prometheus_client.generate_latest(reg)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/metrics", nbytes, secs
    finally:
        httpd.shutdown()


def test_probe_reads_kvlink_series(server: tuple[str, object, object],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    url, nbytes, secs = server
    for engine, (b, s) in {"0": (3e9, 1.0), "1": (1e9, 1.0)}.items():
        nbytes.labels(engine).inc(b)  # type: ignore[attr-defined]
        secs.labels(engine).observe(s)  # type: ignore[attr-defined]
    before = scrape(url)
    res = achieved(None, before)
    assert res["bytes"] == 4e9 and res["transfer_seconds"] == 2.0 and res["pulls"] == 2
    assert res["gbps"] == pytest.approx(2.0)
    nbytes.labels("0").inc(1e9)  # type: ignore[attr-defined]
    secs.labels("0").observe(0.5)  # type: ignore[attr-defined]
    window = achieved(before, scrape(url))
    assert window["gbps"] == pytest.approx(2.0) and window["pulls"] == 1
    assert main(["probe", url, "--nic-gbit", "400", "--baseline", "/nonexistent.json"]) == 0
    out = capsys.readouterr().out
    assert "achieved" in out and "NIC" in out and "/nonexistent.json" in out
    assert "No such file" in out and "run `kvlink bench`" in out


def test_a_baseline_without_perftest_figures_uses_kvlink_s_own(tmp_path: Path) -> None:
    """A `kvlink bench --no-perftest` JSON (or one from a host without ucx_perftest) has
    kvlink's figures only: its best is the baseline (before: called "missing")."""
    bench = tmp_path / "bandwidth.json"
    bench.write_text(json.dumps({"points": [
        {"transport": "tcp", "op": "read", "block_bytes": 4096, "gbps": 1.5},
        {"transport": "nixl", "op": "write", "block_bytes": 1 << 20, "gbps": 6.25}]}))
    assert baseline_gbps(str(bench)) == (6.25, f"kvlink nixl write at {1 << 20} B")
    bench.write_text(json.dumps({"points": [
        {"block_bytes": 4096, "gbps": 1.5, "ucx_perftest_get_gbps": 2.0}]}))
    assert baseline_gbps(str(bench)) == (2.0, "ucx_perftest_get at 4096 B")
    bench.write_text(json.dumps({"points": []}))
    assert baseline_gbps(str(bench)) == f"{bench} has no bandwidth figure"
    bench.write_text("{")
    assert "is not a kvlink bench JSON" in str(baseline_gbps(str(bench)))


def test_parse_ignores_comments_and_sums_labels() -> None:
    text = "# HELP x y\nx_total{a=\"1\"} 2\nx_total{a=\"2\"} 3.5\nnan_metric NaN\n"
    got = parse_metrics(text)
    assert got["x_total"] == 5.5
