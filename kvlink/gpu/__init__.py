"""Shared GPU machinery: what the ``cuda_ipc`` transport, host staging and the all-reduce use.

* :mod:`kvlink.gpu.ipc` — CUDA IPC handles through the driver API (export, open, map once per
  allocation); the all-reduce's shared buffers and the ``cuda_ipc`` transport's peer mappings.
* :mod:`kvlink.gpu.copy` — ``BatchCopier``: the batched device copy over extent tables, the data
  mover of ``cuda_ipc`` and of host staging (:mod:`kvlink.staging`).
* :mod:`kvlink.gpu.lane` — that copy bound once per peer pair (segment bases, maps, launch
  shape and constant arguments written in advance): a request writes its block offsets and
  launches (cuda_ipc's ``lane`` hook).
* :mod:`kvlink.gpu.move` — that copy's kernel in CUDA C (NVRTC), and the stream ordering after
  a caller's stream (driver calls).
* :mod:`kvlink.gpu.ends` — when copies posted on one stream should end (the estimate a poll
  waits on for a copy about to end: ``poll_grace_us``).
* :mod:`kvlink.gpu.kernels` — the same copy as a Triton kernel (the fallback, and the reference
  CI runs under Triton's interpreter).

It sits below the plugins and above the transport contract (``kvlink.transport``'s extents) and
imports no plugin. Importing the package, ``ipc``, ``copy``, ``move`` or ``ends`` touches
neither torch nor Triton nor CUDA (each loads them on first use); ``kernels`` imports Triton, so
it is imported only lazily, by ``copy`` at its first Triton launch.
"""
