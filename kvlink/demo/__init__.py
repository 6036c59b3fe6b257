"""The standalone two-process demo: deterministic KV data, serve (prefill) and pull (decode)."""
