"""Engine integrations. ``kvlink.integrations.vllm`` is the only module that imports vLLM;
the ``vllm_*`` helpers beside it hold its logic without importing vLLM, so they stay testable."""
