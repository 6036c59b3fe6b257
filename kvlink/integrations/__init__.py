"""Engine integrations. ``kvlink.integrations.vllm`` is the vLLM connector, a package whose
``connector`` and ``metrics`` are the only modules that import vLLM; the others hold its logic
without importing vLLM, so they stay testable."""
