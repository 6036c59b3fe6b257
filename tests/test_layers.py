"""The import layering of docs/design.md, checked over the source (ast, nothing imported).

Every module of ``kvlink`` and ``kvlink_transports`` has a layer; a module may import only
modules of its own layer or below, and the core never imports a plugin — except the edges in
:data:`EXCEPTIONS`, each with the reason it is still there (the layering issue removes them).
A new module must be given a layer here, so where it sits is a decision, not an accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: layer of each module, bottom (0) to top; a package's ``__init__`` is the package's name
LAYERS: dict[str, int] = {
    # 0: leaves — errors, facts about the host, state machines without I/O
    "kvlink": 0, "kvlink.errors": 0, "kvlink.hostid": 0, "kvlink.sockets": 0,
    "kvlink.holdboard": 0, "kvlink.leases": 0, "kvlink.options": 0, "kvlink.localkey": 0,
    "kvlink.shmfile": 0, "kvlink.native": 0, "kvlink.sampling": 0, "kvlink.arena": 0,
    # 1: the transport contract's types (regions, extents, runs)
    "kvlink.transport": 1,
    # 2: the model: what bytes go where
    "kvlink.headmap": 2, "kvlink.layout": 2, "kvlink.compat": 2,
    # 3: planning, the wire, capabilities, raw host memory; the shared GPU machinery over the
    # contract's extents (CUDA IPC handles, the batched device copy and its kernels), used by the
    # cuda_ipc plugin, host staging and the all-reduce
    "kvlink.plan": 3, "kvlink.wire": 3, "kvlink.grants": 3, "kvlink.hostmem": 3,
    "kvlink.gpu": 3, "kvlink.gpu.ipc": 3, "kvlink.gpu.move": 3, "kvlink.gpu.kernels": 3,
    "kvlink.gpu.copy": 3, "kvlink.gpu.lane": 3, "kvlink.gpu.ends": 3,
    # (and over it: the landing board a transport signals on, which page-locks itself for a
    # push's digests)
    "kvlink.landing": 3,
    # 4: what the wire carries about ownership and integrity (the digests, their kernels
    # launched through the driver); the side channel
    "kvlink.integrity": 4, "kvlink.integrity.weights": 4, "kvlink.integrity.levels": 4,
    "kvlink.integrity.host": 4, "kvlink.integrity.kernel": 4, "kvlink.integrity.device": 4,
    "kvlink.integrity.compute": 4, "kvlink.integrity.board": 4, "kvlink.integrity.checker": 4,
    "kvlink.push": 4, "kvlink.sidechannel": 4,
    "kvlink.sidechannel.framing": 4, "kvlink.sidechannel.auth": 4,
    "kvlink.sidechannel.server": 4, "kvlink.sidechannel.client": 4,
    # 5: sessions and peers
    "kvlink.channel": 5, "kvlink.peers": 5,
    # 6: shared data movers
    "kvlink.staging": 6,
    # 7: plugins (the transport contract's implementations and their machinery); the order
    # inside a plugin package is PACKAGES'
    "kvlink_transports": 7, "kvlink_transports.cuda_ipc": 7,
    "kvlink_transports._ucx": 7, "kvlink_transports._ucx.info": 7,
    "kvlink_transports._ucx.env": 7, "kvlink_transports._ucx.measure": 7,
    "kvlink_transports._ucx.connections": 7, "kvlink_transports._ucx.__main__": 7,
    "kvlink_transports.tcp": 7, "kvlink_transports.tcp.wire": 7,
    "kvlink_transports.tcp.memory": 7, "kvlink_transports.tcp.client": 7,
    "kvlink_transports.tcp.server": 7, "kvlink_transports.tcp.transport": 7,
    "kvlink_transports.nixl": 7, "kvlink_transports.nixl.agent": 7,
    "kvlink_transports.nixl.memory": 7, "kvlink_transports.nixl.wire": 7,
    "kvlink_transports.nixl.records": 7, "kvlink_transports.nixl.progress": 7,
    "kvlink_transports.nixl.requests": 7, "kvlink_transports.nixl.transfers": 7,
    "kvlink_transports.nixl.lanes": 7, "kvlink_transports.nixl.wireup": 7,
    "kvlink_transports.nixl.transport": 7,
    "kvlink_transports.mooncake": 7, "kvlink_transports.mooncake.wire": 7,
    "kvlink_transports.mooncake.calls": 7,
    "kvlink_transports.mooncake.peer": 7, "kvlink_transports.mooncake.transport": 7,
    # 8: the control plane's engine (reaches plugins only through the registry)
    "kvlink.worker": 8, "kvlink.worker.config": 8, "kvlink.worker.records": 8,
    "kvlink.worker.ledger": 8,
    "kvlink.worker.peering": 8, "kvlink.worker.holds": 8, "kvlink.worker.parts": 8,
    "kvlink.worker.requests": 8, "kvlink.worker.decode_push": 8,
    "kvlink.worker.prefill_push": 8, "kvlink.worker.engine": 8,
    # 9: integrations
    "kvlink.integrations": 9, "kvlink.integrations.vllm": 9,
    "kvlink.integrations.vllm.config": 9, "kvlink.integrations.vllm.metadata": 9,
    "kvlink.integrations.vllm.layout": 9, "kvlink.integrations.vllm.layerwise": 9,
    "kvlink.integrations.vllm.worker": 9, "kvlink.integrations.vllm.scheduler": 9,
    "kvlink.integrations.vllm.metrics": 9, "kvlink.integrations.vllm.connector": 9,
    # 10: tools users run, and the all-reduce (its own subsystem on top of the leaves)
    "kvlink.demo": 10, "kvlink.demo.data": 10, "kvlink.demo.proc": 10,
    "kvlink.demo.progress": 10, "kvlink.demo.roles": 10, "kvlink.demo.run": 10,
    "kvlink.demo.chaos": 10, "kvlink.cli": 10, "kvlink.doctor": 10, "kvlink.probe": 10,
    "kvlink.cli.options": 10, "kvlink.cli.transfer": 10, "kvlink.cli.bandwidth": 10,
    "kvlink.cli.diagnostics": 10, "kvlink.cli.__main__": 10,
    "kvlink.bench": 10, "kvlink.bench.wire": 10, "kvlink.bench.facts": 10,
    "kvlink.bench.baselines": 10, "kvlink.bench.server": 10, "kvlink.bench.client": 10,
    "kvlink.bench.report": 10,
    "kvlink.allreduce": 10, "kvlink.allreduce._dist": 10, "kvlink.allreduce.config": 10,
    "kvlink.allreduce.custom": 10, "kvlink.allreduce.dispatch": 10,
    "kvlink.allreduce.exceptions": 10, "kvlink.allreduce.ipc_buffers": 10,
    "kvlink.allreduce.kernels": 10, "kvlink.allreduce.shm": 10, "kvlink.allreduce.spin": 10,
    "kvlink.allreduce.symm": 10,
}
PLUGINS = 7

#: a plugin split into a package: its modules, bottom to top. One may import only those before
#: it; the face (``__init__``) stands above all of them unless placed in the list. A module
#: outside the package imports only its face, so the split stays the package's own business.
PACKAGES: dict[str, tuple[str, ...]] = {
    "kvlink_transports._ucx": ("info", "env", "measure", "connections", "__init__", "__main__"),
    "kvlink_transports.nixl": ("agent", "memory", "wire", "records", "progress", "requests",
                               "transfers", "wireup", "lanes", "transport"),
    "kvlink_transports.tcp": ("wire", "memory", "client", "server", "transport"),
    "kvlink_transports.mooncake": ("wire", "calls", "peer", "transport"),
    "kvlink.worker": ("config", "records", "ledger", "peering", "holds", "parts", "requests",
                      "decode_push", "prefill_push", "engine"),
    "kvlink.integrations.vllm": ("config", "metadata", "layout", "layerwise", "worker",
                                 "scheduler", "metrics", "connector"),
    "kvlink.sidechannel": ("framing", "auth", "server", "client"),
    "kvlink.integrity": ("weights", "levels", "host", "kernel", "device", "compute", "board",
                         "checker"),
    "kvlink.cli": ("options", "transfer", "bandwidth", "diagnostics", "__init__", "__main__"),
}

#: (importer, imported) -> why the edge is still there
EXCEPTIONS: dict[tuple[str, str], str] = {}
#: plugin modules tools may reach directly (their probes), until the contract exposes them
TOOL_PROBES = {"kvlink_transports._ucx"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in ("kvlink", "kvlink_transports"):
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports (``from a import b`` counts ``a.b`` where that is
    a module, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        found.update(n for n in names if n in known)
    return found


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(_modules()) - set(LAYERS))
    assert not missing, f"give these modules a layer in tests/test_layers.py: {missing}"


def test_imports_point_down_and_the_core_imports_no_plugin() -> None:
    mods = _modules()
    known = set(mods)
    bad = []
    for name, path in sorted(mods.items()):
        for dep in sorted(_imports(path, known) - {name}):
            if (name, dep) in EXCEPTIONS or dep not in LAYERS or name not in LAYERS:
                continue
            if LAYERS[dep] > LAYERS[name]:
                bad.append(f"{name} (layer {LAYERS[name]}) imports {dep} (layer {LAYERS[dep]})")
            elif (LAYERS[dep] == PLUGINS and LAYERS[name] not in (PLUGINS,)
                  and not (LAYERS[name] == 10 and dep in TOOL_PROBES)
                  and name != "kvlink_transports"):
                bad.append(f"{name} imports the plugin module {dep} (through the registry only)")
    assert not bad, "\n".join(bad)


def test_the_listed_exceptions_still_exist() -> None:
    """An exception that is gone must leave the list (so the list stays the truth)."""
    mods = _modules()
    known = set(mods)
    stale = [edge for edge in EXCEPTIONS if edge[1] not in _imports(mods[edge[0]], known)]
    assert not stale, f"remove from EXCEPTIONS: {stale}"


def _package_order(pkg: str) -> list[str]:
    order = list(PACKAGES[pkg])
    if "__init__" not in order:
        order.append("__init__")
    return [pkg if m == "__init__" else f"{pkg}.{m}" for m in order]


def test_every_package_module_has_a_place() -> None:
    mods = set(_modules())
    for pkg in PACKAGES:
        inner = {m for m in mods if m == pkg or m.startswith(pkg + ".")}
        placed = set(_package_order(pkg))
        assert inner == placed, f"{pkg}: order these in PACKAGES: {sorted(inner ^ placed)}"


def test_plugin_packages_import_down_and_through_their_face() -> None:
    mods = _modules()
    known = set(mods)
    bad = []
    for pkg in PACKAGES:
        order = _package_order(pkg)
        for name, path in sorted(mods.items()):
            deps = {d for d in _imports(path, known) - {name}
                    if d.startswith(pkg + ".")}
            if name in order:
                bad += [f"{name} imports {d}, above it in PACKAGES" for d in sorted(deps)
                        if d in order and order.index(d) > order.index(name)]
            else:
                bad += [f"{name} imports {d}: only the face {pkg} (from outside)"
                        for d in sorted(deps)]
    assert not bad, "\n".join(bad)
