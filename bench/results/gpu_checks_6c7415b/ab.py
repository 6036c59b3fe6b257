"""bench/e2e_request.py or integrity_overhead.py with owed reports not sent by read() when
KV_POLICY=B (experiment: A/B of where owed reports leave)."""
import os, runpy, sys
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
if os.environ.get("KV_POLICY") == "B":
    from kvlink.worker import peering, requests
    orig_start, orig_sl = requests._Requests._start, peering._Peering._send_later
    def _start(self, *a, **k):
        self._no_later = True
        try:
            return orig_start(self, *a, **k)
        finally:
            self._no_later = False
    def _send_later(self):
        if getattr(self, "_no_later", False):
            return None
        return orig_sl(self)
    requests._Requests._start, peering._Peering._send_later = _start, _send_later
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
runpy.run_path(os.path.join(os.getcwd(), "bench", script), run_name="__main__")
