"""Layer-wise push vs a whole-request push vs no transfer, with a prefill that computes layer by
layer, through the public API (KVWorker.push with ``layers``), bytes verified.

    python bench/layerwise.py --device cuda            # one GPU, two processes, cuda_ipc
    .venv/bin/python bench/layerwise.py --device cpu --small   # a smoke run over tcp

The prefill's "forward" is a stand-in workload per layer sized like one Llama-3-70B TP8 rank's
layer prefilling 4096 tokens (QKV, O, gate/up and down projections: ~0.9 TFLOP a layer in
bf16 on the GPU; ``--small`` shrinks everything for a CPU smoke run), followed by writing that
layer's K/V blocks (a pattern unique to request, layer, K|V, block, element). Modes, interleaved
request by request:

- ``none``: the forward alone (its time is the baseline of the slowdown);
- ``whole``: the forward, then ``push(msg, ids, lease)`` of every layer at once;
- ``layered``: ``push(msg, ids, lease, layers=(l, l + g))`` right after layer group ``l`` is
  enqueued (``--group`` layers a push; stream-ordered, no host sync in the forward);
- ``one``: the forward, then a whole push of the last layer alone (a second pair of workers
  registered on that layer's cache): one layer's transfer through the public API, with every
  per-push cost a layer-wise push's last range also pays.

Reported per mode (medians): the forward's time (CUDA events on the GPU), the *exposed*
transfer — from the forward's end to the decode's poll that reports the request finished (one
clock: both processes on one host, ``time.perf_counter``) — and two readings of "one layer's
transfer": the ``one`` mode's exposed time (measured), and one layer's share of the whole push
(the whole push's exposed time / layers: amortized, stricter, as earlier runs reported it).
Goals (issue 23): exposed <= 1.5x one layer's transfer, forward slowed <= 5 %. JSON to
bench/results/layerwise_<device>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import sys
import time
import traceback
from typing import Any

from _common import write_result

BS, DIM = 16, 128
MODES = ("none", "whole", "layered", "one")


def _geometry(small: bool) -> dict[str, int]:
    if small:
        return {"layers": 8, "heads": 1, "blocks": 16, "hidden": 256, "ffn": 512, "tokens": 64}
    # one TP8 rank of Llama-3-70B: 1 KV head; hidden 8192; per rank QKV 1280, O 1024 -> 8192,
    # gate+up 2 x 3584, down 3584 -> 8192; 4096 tokens = 256 blocks of 16
    return {"layers": 80, "heads": 1, "blocks": 256, "hidden": 8192, "ffn": 3584,
            "tokens": 4096}


class Model:
    """Per-layer stand-in compute and a KV cache ``(layers, 2, blocks, 16, heads, 128)``."""

    def __init__(self, geo: dict[str, int], nblocks: int, device: str, compute: bool) -> None:
        import torch

        self.torch, self.geo, self.device = torch, geo, device
        dt = torch.bfloat16
        self.cache = torch.zeros((geo["layers"], 2, nblocks, BS, geo["heads"], DIM), dtype=dt,
                                 device=device)
        self.i16 = self.cache.view(torch.int16)
        if compute:
            h, f, t = geo["hidden"], geo["ffn"], geo["tokens"]
            g = torch.Generator(device=device).manual_seed(0)
            self.x = torch.randn((t, h), dtype=dt, device=device, generator=g)
            self.w_qkv = torch.randn((h, 1280 * h // 8192 or 1), dtype=dt, device=device,
                                     generator=g) / h ** 0.5
            self.w_o = torch.randn((self.w_qkv.shape[1] * 4 // 5 or 1, h), dtype=dt,
                                   device=device, generator=g) / h ** 0.5
            self.w_up = torch.randn((h, 2 * f), dtype=dt, device=device, generator=g) / h ** .5
            self.w_down = torch.randn((f, h), dtype=dt, device=device, generator=g) / f ** .5

    def spec(self, last_only: bool = False) -> Any:
        """The cache's spec; ``last_only``: of the last layer alone (the one-layer push)."""
        from kvlink.layout import KVCacheSpec

        layers = range(self.geo["layers"])[-1:] if last_only else range(self.geo["layers"])
        return KVCacheSpec.from_tensors([self.cache[i] for i in layers],
                                        total_kv_heads=self.geo["heads"], dtype="bfloat16")

    def layer(self, li: int, req_no: int, ids: Any) -> None:
        """One layer: the projections, then this request's K/V pattern into its blocks."""
        torch = self.torch
        qkv = self.x @ self.w_qkv
        y = qkv[:, :self.w_o.shape[0]] @ self.w_o
        up = (self.x + y) @ self.w_up
        f = self.w_down.shape[0]
        _ = (torch.nn.functional.silu(up[:, :f]) * up[:, f:]) @ self.w_down
        self.i16[li, :, ids] = pattern(req_no, li, ids, self.geo["heads"], self.device)


def pattern(req_no: int, layer: int, ids: Any, heads: int, device: str) -> Any:
    import torch

    n = int(ids.shape[0])
    el = torch.arange(BS * heads * DIM, dtype=torch.int32, device=device)
    kv = torch.arange(2, dtype=torch.int32, device=device).view(2, 1, 1)
    blk = ids.to(device=device, dtype=torch.int32).view(1, n, 1)
    v = (req_no * 7919 + layer * 131 + kv * 17 + blk * 3 + el.view(1, 1, -1)) % 32749
    return v.to(torch.int16).view(2, n, BS, heads, DIM)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------- the decode
def decode(cmd_q: Any, rep_q: Any, device: str, transport: str, geo: dict[str, int],
           profile: str | None = None, steps_flag: bool = False,
           integrity: str = "off") -> None:
    try:
        _decode(cmd_q, rep_q, device, transport, geo, profile, steps_flag, integrity)
    except BaseException as exc:
        rep_q.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


def _decode(cmd_q: Any, rep_q: Any, device: str, transport: str, geo: dict[str, int],
            profile: str | None, steps_flag: bool, integrity: str) -> None:
    import cProfile

    import torch

    from kvlink.worker import KVWorker, RemoteEngine, WorkerConfig

    if device.startswith("cuda"):
        torch.cuda.set_device(int(device.split(":")[1]))
    m = Model(geo, geo["blocks"] + 8, device, compute=False)
    w = KVWorker(WorkerConfig(engine_id="lw-d", transports=[transport], integrity=integrity))
    w.register(m.spec())
    w1 = KVWorker(WorkerConfig(engine_id="lw-d1", transports=[transport],
                               integrity=integrity))
    w1.register(m.spec(last_only=True))  # the "one" mode: a push of the last layer alone
    binds = [0]  # end checks bound for the push (one per prefill rank; more: a board closed)
    landed_s = [0.0]  # the last _poll_landed call's duration (the one that ends a push)
    # where the poll that ends a push spends its time: each step's last duration, kept when
    # that poll finished something (diagnostics: a few perf_counter calls a poll)
    steps: dict[str, float] = {}
    done_steps: dict[str, float] = {}

    def clocked(obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                steps[label] = time.perf_counter() - t0

        setattr(obj, name, call)

    for wk in (w, w1) if steps_flag else ():
        poll_landed = wk._poll_landed

        def timed(finished: set[str], poll_landed: Any = poll_landed) -> None:
            t0 = time.perf_counter()
            steps.clear()
            poll_landed(finished)
            if finished:
                landed_s[0] = time.perf_counter() - t0
                done_steps.clear()
                done_steps.update(steps)

        wk._poll_landed = timed  # type: ignore[method-assign]
        bind = wk._end_check

        def counted(aw: Any, slot: int, bind: Any = bind) -> Any:
            end = bind(aw, slot)
            binds[0] += end is not None
            return end

        wk._end_check = counted  # type: ignore[method-assign]
        clocked(wk, "_landed_on_board", "landed_on_board")
        clocked(wk, "_end_push", "end_push")
        clocked(wk, "_check_area", "check_area")  # (integrity on: the digests' check)
        clocked(wk.integrity, "check", "integrity_check")
    if steps_flag:  # (its parts: the blocks matched, the compare on the device)
        from kvlink import integrity as _integrity

        clocked(_integrity, "match", "integrity_match")
        clocked(_integrity, "_checked_on_gpu", "integrity_on_gpu")
    rep_q.put(("ready", w.side_port))
    main = w
    prof = cProfile.Profile() if profile else None
    while True:
        cmd = cmd_q.get()
        if cmd[0] == "stop":
            break
        _, req, port, req_no, mode = cmd
        layered, w = mode == "layered", (w1 if mode == "one" else main)
        first = geo["layers"] - 1 if mode == "one" else 0  # the layers this push writes
        lids = torch.arange(geo["blocks"], dtype=torch.int64) + 8
        m.i16[:, :, lids.to(device)] = -1
        _sync(device)
        w.expect_push(req, RemoteEngine("lw-p1" if mode == "one" else "lw-p", "127.0.0.1",
                                        port), lids.numpy(), timeout=60)
        rep_q.put(("asked", req))
        polls: list[float] = []
        binds[0] = 0
        after_flag = 0  # polls from every layer seen landed to the one that finished it
        t_flag = 0.0  # when every layer first showed landed (the board, or notes)
        if prof is not None and layered:
            prof.enable()
        while True:
            if not t_flag and w.layers_landed(req) == geo["layers"] - first:
                t_flag = time.perf_counter()
            t0 = time.perf_counter()
            done, failed = w.poll()
            polls.append(time.perf_counter() - t0)
            after_flag += bool(t_flag)
            if req in failed:
                if prof is not None:
                    prof.disable()
                rep_q.put(("error", f"push of {req} failed: {failed[req]}"))
                break
            if req in done:
                t_done = time.perf_counter()
                if prof is not None:
                    prof.disable()
                exp = torch.stack([pattern(req_no, li, torch.arange(geo["blocks"]),
                                           geo["heads"], device)
                                   for li in range(first, geo["layers"])])
                got = m.i16[first:, :, lids.to(device)]
                bad = int((got != exp).sum().item())
                rep_q.put(("done", req, t_done, bad, w.board_landed,
                           statistics.median(polls), t_flag or t_done,
                           (after_flag, binds[0], max(polls), polls[-1],
                            landed_s[0]), dict(done_steps)))
                break
    main.close()
    w1.close()
    if prof is not None:
        _write_profile(prof, f"{profile}.decode.txt")


def _write_profile(prof: Any, path: str) -> None:
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(40)
    st.print_callees("_poll_landed|_end_push|_landed_on_board")  # the poll that ends a push
    with open(path, "w") as f:
        f.write(buf.getvalue())
    prof.dump_stats(path.removesuffix(".txt") + ".pstats")


# --------------------------------------------------------------------------- the prefill
def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvlink.worker import KVWorker, WorkerConfig

    device = args.device_name
    geo = _geometry(args.small)
    if args.layers:
        geo["layers"] = args.layers
    ctx = mp.get_context("spawn")
    cmd_q, rep_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=decode, daemon=True,
                       args=(cmd_q, rep_q, device, args.transport, geo, args.profile,
                             args.steps, args.integrity))
    proc.start()

    def ask(want: str, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = rep_q.get(timeout=0.5)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"decode died ({proc.exitcode})") from None
                continue
            if got[0] == "error":
                raise RuntimeError(got[1])
            if got[0] == want:
                return got
        raise TimeoutError(f"decode did not answer {want!r}")

    m = Model(geo, geo["blocks"] + 8, device, compute=True)
    w = KVWorker(WorkerConfig(engine_id="lw-p", transports=[args.transport],
                              serve_pushes=True, lease_seconds=600.0,
                              integrity=args.integrity))
    w.register(m.spec())
    w1 = KVWorker(WorkerConfig(engine_id="lw-p1", transports=[args.transport],
                               serve_pushes=True, lease_seconds=600.0,
                               integrity=args.integrity))
    w1.register(m.spec(last_only=True))
    ask("ready")
    ids = torch.arange(geo["blocks"], dtype=torch.int64)
    ids_dev = ids.to(device)
    ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
        if device.startswith("cuda") else None
    out: dict[str, dict[str, list[float]]] = {
        k: {"forward": [], "exposed": [], "bad": [], "enqueued": [], "prefill_done": [],
            "decode_poll": [], "landed_seen": [], "polls_after_landed": [],
            "end_checks_bound": [], "slowest_poll": [], "done_poll": [],
            "done_poll_landed_part": []}
        # decode_poll: the median time of one decode poll() call; landed_seen: forward end ->
        # the decode's layers_landed() first showing every layer (its flags or notes)
        for k in MODES}
    host: dict[str, float] = {}
    board_landed: dict[str, int] = {}  # the decode's count after each mode's last request
    req_no = 0

    def forward(push_layer: Any) -> tuple[float, float]:
        """Every layer (``push_layer(l)`` after each), timed; returns (seconds, end clock)."""
        t0 = time.perf_counter()
        if ev is not None:
            ev[0].record()
        for li in range(geo["layers"]):
            m.layer(li, req_no, ids_dev)
            push_layer(li)
        host["enqueued"] = time.perf_counter() - t0  # the host's loop (the GPU may lag it)
        if ev is not None:
            ev[1].record()
            while not ev[1].query():  # spun, not synchronize(): its wake-up (tens of us) made
                pass  # the forward's end look later than the decode's report (exposed < 0)
            return ev[0].elapsed_time(ev[1]) / 1e3, time.perf_counter()
        return time.perf_counter() - t0, time.perf_counter()

    for i in range(args.warmup + args.requests):
        for mode in MODES:
            req_no += 1
            if mode == "none":
                secs, _ = forward(lambda li: None)
                if i >= args.warmup:
                    out[mode]["forward"].append(secs)
                    out[mode]["enqueued"].append(host["enqueued"])
                continue
            req = f"r{req_no}"
            wk = w1 if mode == "one" else w  # (a one-layer push: its own pair of workers)
            cmd_q.put(("push", req, wk.side_port, req_no, mode))
            ask("asked")
            deadline = time.monotonic() + 30
            msgs: list[Any] = []
            while not msgs:
                assert time.monotonic() < deadline, "no push request arrived"
                msgs = wk.push_requests()
                time.sleep(0.0005)
            (msg,) = msgs
            # held before its forward writes the KV (as the vLLM connector's layer-wise
            # flow holds): with integrity on, its pushes digest the blocks once written
            wk.hold(req, ids.numpy(), final=False)
            g = args.group

            def push_layer(li: int, msg: Any = msg, req: str = req, mode: str = mode,
                           g: int = g) -> None:
                last = li + 1 == geo["layers"]
                if mode != "layered" or ((li + 1) % g and not last):
                    return
                w.push(msg, ids.numpy(), lease=req, layers=((li // g) * g, li + 1))
                w.poll()  # takes the reports of ranges already done (never waits)

            secs, t_end = forward(push_layer)
            if mode in ("whole", "one"):
                wk.push(msg, ids.numpy(), lease=req)
            t_prefill = 0.0  # when the prefill saw its push finished (every range DONE)
            while True:  # drive our side until the decode says it is done
                if not t_prefill and any(f.endswith(f"/{req}") for f in wk.poll()[0]):
                    t_prefill = time.perf_counter()
                try:
                    got = rep_q.get_nowait()
                except queue.Empty:
                    time.sleep(0.0001)
                    continue
                if got[0] == "error":
                    raise RuntimeError(got[1])
                if got[0] == "done":
                    break
            _, _, t_done, bad, on_board, poll_s, t_flag, (after, bound, worst, last,
                                                          landed_poll), parts = got
            board_landed[mode] = on_board
            for _ in range(100):
                wk.poll()
                if not wk.pending():
                    break
                time.sleep(0.001)
            wk.released()
            if i >= args.warmup:
                out[mode]["forward"].append(secs)
                out[mode]["exposed"].append(t_done - t_end)
                out[mode]["enqueued"].append(host["enqueued"])
                out[mode]["prefill_done"].append((t_prefill or t_done) - t_end)
                out[mode]["bad"].append(bad)
                out[mode]["decode_poll"].append(poll_s)
                out[mode]["landed_seen"].append(t_flag - t_end)
                out[mode]["polls_after_landed"].append(after)
                out[mode]["end_checks_bound"].append(bound)
                out[mode]["slowest_poll"].append(worst)
                out[mode]["done_poll"].append(last)  # the poll that reported it finished
                out[mode]["done_poll_landed_part"].append(landed_poll)
                for step, secs_ in parts.items():  # the steps of the poll that ended it
                    out[mode].setdefault(f"done_poll_{step}", []).append(secs_)
        if i + 1 > args.warmup:
            print(f"  {i + 1 - args.warmup}/{args.requests}", flush=True)
    cmd_q.put(("stop",))
    proc.join(10)
    w.close()
    w1.close()
    med = {k: {m2: statistics.median(v) for m2, v in d.items() if v and m2 != "bad"}
           for k, d in out.items()}
    per_layer = med["whole"]["exposed"] / geo["layers"]
    base = med["none"]["forward"]
    res = {
        "geometry": geo, "group": args.group, "transport": args.transport,
        "integrity": args.integrity,
        "medians_s": med, "raw_s": out,
        "one_layer_share_of_whole_push_s": per_layer,
        "exposed_layered_over_one_layer": med["layered"]["exposed"] / per_layer,
        "one_layer_push_s": med["one"]["exposed"],
        "exposed_layered_over_one_layer_push": (med["layered"]["exposed"]
                                                / med["one"]["exposed"]),
        "forward_slowdown_layered": med["layered"]["forward"] / base - 1,
        "forward_slowdown_whole": med["whole"]["forward"] / base - 1,
        "exposed_layered_over_whole": med["layered"]["exposed"] / med["whole"]["exposed"],
        "mismatches": int(sum(sum(d["bad"]) for d in out.values())),
        # pushes the decode saw end on its landing board (kvlink.landing), not by note:
        # cumulative, as it stood after each mode's last request
        "decode_board_landed": board_landed,
        "goals": {"exposed <= 1.5x one layer's transfer (a one-layer push, measured)":
                  med["layered"]["exposed"] / med["one"]["exposed"] <= 1.5,
                  "exposed <= 1.5x one layer's share of the whole push (amortized)":
                  med["layered"]["exposed"] / per_layer <= 1.5,
                  "forward slowed <= 5 %": med["layered"]["forward"] / base - 1 <= 0.05},
    }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--transport", default=None, help="default: cuda_ipc on cuda, tcp on cpu")
    ap.add_argument("--small", action="store_true", help="a small geometry (CPU smoke run)")
    ap.add_argument("--group", type=int, default=1, help="layers per layer-wise push")
    ap.add_argument("--layers", type=int, default=0,
                    help="layers of the model (default: the geometry's, 80; 8 with --small)")
    ap.add_argument("--integrity", choices=("off", "sample", "full"), default="off",
                    help="both sides' level: a layer-wise push is then checked whole, its "
                    "digests taken range by range as it is pushed (docs/integrity.md)")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", action="store_true",
                    help="clock the steps of the decode's poll that ends a push (diagnostics: "
                         "its wrappers add their own cost to that poll and so to the exposed "
                         "time; off by default)")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="cProfile the decode's polls of the layer-wise pushes (every poll "
                         "from its push request to the one that reports it written) to "
                         "PREFIX.decode.txt (the figures then include the profiler's cost)")
    args = ap.parse_args()
    if args.group < 1:
        ap.error(f"--group must be >= 1, got {args.group}")
    args.transport = args.transport or ("cuda_ipc" if args.device == "cuda" else "tcp")
    args.device_name = f"cuda:{args.gpu}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device visible")
            sys.exit(2)
        torch.cuda.set_device(args.gpu)
    res = run(args)
    m = res["medians_s"]
    for mode in MODES:
        print(f"{mode:8s} forward {m[mode]['forward'] * 1e3:9.3f} ms   exposed "
              + (f"{m[mode]['exposed'] * 1e3:9.3f} ms (prefill saw it done after "
                 f"{m[mode]['prefill_done'] * 1e3:.3f} ms)" if "exposed" in m[mode] else
                 "        -")
              + f"   host loop {m[mode]['enqueued'] * 1e3:.3f} ms"
              + (f"   decode poll {m[mode]['decode_poll'] * 1e6:.1f} us, every layer seen "
                 f"landed after {m[mode]['landed_seen'] * 1e3:.3f} ms"
                 if "decode_poll" in m[mode] else ""))
    print(f"one layer's share of the whole push {res['one_layer_share_of_whole_push_s'] * 1e3:.3f}"
          f" ms; layered exposed / that share {res['exposed_layered_over_one_layer']:.2f}, "
          f"/ a one-layer push alone ({res['one_layer_push_s'] * 1e3:.3f} ms) "
          f"{res['exposed_layered_over_one_layer_push']:.2f}; "
          f"forward slowed {100 * res['forward_slowdown_layered']:.1f} % (whole: "
          f"{100 * res['forward_slowdown_whole']:.1f} %); mismatches {res['mismatches']}")
    for goal, met in res["goals"].items():
        print(f"  [{'MET' if met else 'NOT MET'}] {goal}")
    write_result(f"layerwise_{args.device}", res, args.out)
    if res["mismatches"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
