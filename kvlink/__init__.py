"""kvlink: KV-cache transfer between prefill and decode LLM instances.

Core modules import no transport library at load time; transports are plugins
(entry-point group ``kvlink.transports``). See README.md and docs/design.md.
"""

__version__ = "0.1.0"
