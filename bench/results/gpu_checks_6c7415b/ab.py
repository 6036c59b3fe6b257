"""bench/e2e_request.py or integrity_overhead.py with owed reports not sent by read() when
KV_POLICY=B (an experiment: A/B of where owed reports leave; gpu_checks_6c7415b/README.md).

    KV_POLICY=A|B python3 ab.py e2e_request.py ARGS...   (from the repo root)
"""

import os
import runpy
import sys

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
if os.environ.get("KV_POLICY") == "B":
    from kvlink.worker import peering, requests

    orig_start, orig_later = requests._Requests._start, peering._Peering._send_later

    def _start(self, *a, **k):  # type: ignore[no-untyped-def]
        self._no_later = True
        try:
            return orig_start(self, *a, **k)
        finally:
            self._no_later = False

    def _send_later(self):  # type: ignore[no-untyped-def]
        if getattr(self, "_no_later", False):
            return None
        return orig_later(self)

    requests._Requests._start = _start  # type: ignore[method-assign]
    peering._Peering._send_later = _send_later  # type: ignore[method-assign]
script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(os.path.join(os.getcwd(), "bench", script), run_name="__main__")
