"""CUDA IPC handles through the driver API (ctypes on ``libcuda.so.1``), no compiler needed.

Why the driver API: ``libcuda.so.1`` is present wherever CUDA works (the runtime library's file
name and location vary by wheel), and it alone answers "which allocation contains this pointer"
(``cuMemGetAddressRange``), which an exporter needs because an IPC handle always names a whole
allocation: we export ``(handle of the allocation, offset of the pointer in it)``.

Used by the TP all-reduce (``kvlink.allreduce``) for its shared buffers and for CUDA-graph input
registration, and by the same-host ``cuda_ipc`` KV transport (``kvlink_transports.cuda_ipc``) for
the peers' KV caches. Rules that callers must know:

* A handle cannot be opened in the process that exported it (CUDA refuses); use the pointer.
  Processes on the *same* device can open each other's handles.
* Memory from ``cudaMallocAsync`` pools or PyTorch's ``expandable_segments`` allocator (virtual
  memory management) has no legacy IPC handle; exporting it raises :class:`CudaIpcError`.
* An opened mapping does not keep the exporter's memory alive: the exporter must not free it while
  peers use it.

Nothing here initialises CUDA at import time; the library is loaded on first use.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import threading
from typing import Any

from kvlink.errors import KVLinkError

IPC_HANDLE_BYTES = 64
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1


class CudaIpcError(KVLinkError):
    """A CUDA driver call for IPC failed (names the call, the error and the pointer).

    Not an ``AllReduceError``: the all-reduce and the ``cuda_ipc`` transport both use this
    module, and each turns the failure into its own error where it must."""


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_CUresult = ctypes.c_int
_CUdeviceptr = ctypes.c_uint64


class _Driver:
    """The handful of driver entry points we need, bound once with their C signatures."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaIpcError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from exc
        self._lib = lib

        def bind(names: tuple[str, ...], argtypes: list[Any]) -> Any:
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes = argtypes
                    fn.restype = _CUresult
                    return fn
            raise CudaIpcError(f"CUDA driver lacks {names[0]}")

        p = ctypes.POINTER
        self.cuInit = bind(("cuInit",), [ctypes.c_uint])
        self.cuGetErrorString = bind(("cuGetErrorString",), [_CUresult, p(ctypes.c_char_p)])
        self.cuCtxGetCurrent = bind(("cuCtxGetCurrent",), [p(ctypes.c_void_p)])
        self.cuCtxSetCurrent = bind(("cuCtxSetCurrent",), [ctypes.c_void_p])
        self.cuCtxGetDevice = bind(("cuCtxGetDevice",), [p(ctypes.c_int)])
        self.cuDeviceGet = bind(("cuDeviceGet",), [p(ctypes.c_int), ctypes.c_int])
        self.cuDevicePrimaryCtxRetain = bind(
            ("cuDevicePrimaryCtxRetain",), [p(ctypes.c_void_p), ctypes.c_int]
        )
        self.cuMemAlloc = bind(("cuMemAlloc_v2",), [p(_CUdeviceptr), ctypes.c_size_t])
        self.cuMemFree = bind(("cuMemFree_v2",), [_CUdeviceptr])
        self.cuMemGetAddressRange = bind(
            ("cuMemGetAddressRange_v2",),
            [p(_CUdeviceptr), p(ctypes.c_size_t), _CUdeviceptr],
        )
        self.cuIpcGetMemHandle = bind(("cuIpcGetMemHandle",), [p(_IpcMemHandle), _CUdeviceptr])
        self.cuIpcOpenMemHandle = bind(
            ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
            [p(_CUdeviceptr), _IpcMemHandle, ctypes.c_uint],
        )
        self.cuIpcCloseMemHandle = bind(("cuIpcCloseMemHandle",), [_CUdeviceptr])
        self.cuMemHostRegister = bind(("cuMemHostRegister_v2", "cuMemHostRegister"),
                                      [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint])
        self.cuMemHostUnregister = bind(("cuMemHostUnregister",), [ctypes.c_void_p])
        self.cuMemHostGetDevicePointer = bind(
            ("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
            [p(_CUdeviceptr), ctypes.c_void_p, ctypes.c_uint],
        )
        # a kernel's launch and its small copies on a stream (kvlink.integrity.kernel's check)
        self.cuLaunchKernel = bind(("cuLaunchKernel",), [ctypes.c_void_p] + [ctypes.c_uint] * 7
                                   + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p])
        self.cuMemsetD8Async = bind(("cuMemsetD8Async",), [_CUdeviceptr, ctypes.c_ubyte,
                                                           ctypes.c_size_t, ctypes.c_void_p])
        self.cuMemcpyHtoDAsync = bind(("cuMemcpyHtoDAsync_v2",), [
            _CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
        self.cuMemcpyDtoHAsync = bind(("cuMemcpyDtoHAsync_v2",), [
            ctypes.c_void_p, _CUdeviceptr, ctypes.c_size_t, ctypes.c_void_p])
        self.cuStreamSynchronize = bind(("cuStreamSynchronize",), [ctypes.c_void_p])
        self.check(self.cuInit(0), "cuInit")

    def error_string(self, code: int) -> str:
        msg = ctypes.c_char_p()
        if self.cuGetErrorString(code, ctypes.byref(msg)) == 0 and msg.value:
            return msg.value.decode(errors="replace")
        return "unknown error"

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise CudaIpcError(f"{what} failed: CUDA error {code} ({self.error_string(code)})")


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    """The process-wide driver binding (loaded lazily, so importing kvlink never touches CUDA)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context (the one PyTorch uses) current on this thread.

    Driver calls act on the calling thread's current context; a thread that has only used the
    runtime through PyTorch may have none yet, or another device's.
    """
    drv = driver()
    ctx = ctypes.c_void_p()
    drv.check(drv.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        cur = ctypes.c_int(-1)
        if drv.cuCtxGetDevice(ctypes.byref(cur)) == 0 and cur.value == device:
            return
    dev = ctypes.c_int()
    drv.check(drv.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
    primary = ctypes.c_void_p()
    drv.check(
        drv.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev.value), "cuDevicePrimaryCtxRetain"
    )
    drv.check(drv.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


def mem_alloc(nbytes: int) -> int:
    """A dedicated ``cuMemAlloc`` block: its own IPC handle, unaffected by allocator settings."""
    drv = driver()
    ptr = _CUdeviceptr()
    drv.check(drv.cuMemAlloc(ctypes.byref(ptr), nbytes), f"cuMemAlloc({nbytes})")
    return int(ptr.value)


def mem_free(ptr: int) -> None:
    drv = driver()
    drv.check(drv.cuMemFree(_CUdeviceptr(ptr)), f"cuMemFree(0x{ptr:x})")


def allocation_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the allocation that contains device pointer ``ptr``."""
    drv = driver()
    base = _CUdeviceptr()
    size = ctypes.c_size_t()
    drv.check(
        drv.cuMemGetAddressRange(ctypes.byref(base), ctypes.byref(size), _CUdeviceptr(ptr)),
        f"cuMemGetAddressRange(0x{ptr:x})",
    )
    return int(base.value), int(size.value)


_HOST_REGISTER_PORTABLE = 0x1
_HOST_REGISTER_DEVICEMAP = 0x2
_HOST_REGISTER_READ_ONLY = 0x8  # CU_MEMHOSTREGISTER_READ_ONLY


#: host mappings registered through :func:`host_register`: base -> [device pointer, users]
_registered: dict[int, list[int]] = {}
_registered_lock = threading.Lock()


def host_register(addr: int, nbytes: int, read_only: bool = False) -> int:
    """Page-lock ``nbytes`` of host memory at ``addr`` (a shared mapping: kvlink.landing, a
    producer's hold board) for every context, mapped into the device's address space;
    returns the device pointer. ``read_only``: a mapping without write access (the device
    only reads it). Counted per ``addr``: a mapping registered already (a landing board that
    a push's digests and its transport's signal both use) gives its pointer again, and
    :func:`host_unregister` lets it go when its last user does (CUDA refuses a second
    registration of the same pages)."""
    with _registered_lock:
        got = _registered.get(addr)
        if got is not None:
            got[1] += 1
            return got[0]
        drv = driver()
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP
        if read_only:
            flags |= _HOST_REGISTER_READ_ONLY
        drv.check(drv.cuMemHostRegister(addr, nbytes, flags),
                  f"cuMemHostRegister(0x{addr:x}, {nbytes})")
        dev = _CUdeviceptr()
        rc = drv.cuMemHostGetDevicePointer(ctypes.byref(dev), addr, 0)
        if rc:
            drv.cuMemHostUnregister(addr)
            drv.check(rc, f"cuMemHostGetDevicePointer(0x{addr:x})")
        _registered[addr] = [int(dev.value), 1]
        return int(dev.value)


def host_unregister(addr: int) -> None:
    """One user of :func:`host_register`'s ``addr`` let it go; unregistered with the last."""
    with _registered_lock:
        got = _registered.get(addr)
        if got is not None and got[1] > 1:
            got[1] -= 1
            return
        _registered.pop(addr, None)
        drv = driver()
        drv.check(drv.cuMemHostUnregister(addr), f"cuMemHostUnregister(0x{addr:x})")


_WIRE = struct.Struct(f"<{IPC_HANDLE_BYTES}sQQqq")


@dataclasses.dataclass(frozen=True)
class IpcHandle:
    """What a peer needs to map ``nbytes`` at a pointer of ours: allocation handle + offset.

    ``pid`` lets the opener refuse its own handles with a clear message instead of a CUDA error,
    ``device`` is the exporter's device ordinal (informational; ordinals differ between processes
    with different ``CUDA_VISIBLE_DEVICES``).
    """

    handle: bytes
    offset: int
    nbytes: int
    pid: int
    device: int

    def to_bytes(self) -> bytes:
        return _WIRE.pack(self.handle, self.offset, self.nbytes, self.pid, self.device)

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
        if len(data) != _WIRE.size:
            raise CudaIpcError(f"IPC handle record must be {_WIRE.size} bytes, got {len(data)}")
        handle, offset, nbytes, pid, device = _WIRE.unpack(data)
        return cls(bytes(handle), int(offset), int(nbytes), int(pid), int(device))


def export_pointer(ptr: int, nbytes: int, device: int) -> IpcHandle:
    """Export ``nbytes`` at device pointer ``ptr`` (inside any legacy-IPC-capable allocation)."""
    ensure_context(device)
    drv = driver()
    base, size = allocation_range(ptr)
    if ptr + nbytes > base + size:
        raise CudaIpcError(
            f"0x{ptr:x}+{nbytes} runs past its allocation 0x{base:x}+{size}; cannot export it"
        )
    raw = _IpcMemHandle()
    drv.check(
        drv.cuIpcGetMemHandle(ctypes.byref(raw), _CUdeviceptr(base)),
        f"cuIpcGetMemHandle(0x{base:x}) (expandable_segments or a cudaMallocAsync pool "
        "cannot be exported)",
    )
    # bytes(raw), not raw.reserved: a c_char array field stops at the first NUL byte.
    return IpcHandle(bytes(raw), ptr - base, nbytes, os.getpid(), device)


def export_tensor(tensor: Any) -> IpcHandle:
    """Export a CUDA tensor's bytes (from ``data_ptr()``, ``numel * element_size`` long)."""
    if tensor.device.type != "cuda":
        raise CudaIpcError(f"only CUDA tensors can be exported, got {tensor.device}")
    nbytes = tensor.numel() * tensor.element_size()
    return export_pointer(int(tensor.data_ptr()), nbytes, int(tensor.device.index or 0))


class IpcMapper:
    """Opens peers' handles once per allocation and closes them all together.

    Many exported pointers share one allocation (every graph input inside one caching-allocator
    segment), and an allocation can be mapped only once per context, so mappings are cached by
    the exporting process and the handle bytes with a reference count: each ``open`` takes one
    reference and each ``close`` drops one; the allocation is unmapped with the last. A handle of
    another process (an exporter restarted, say) never gets a mapping made for an earlier one.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self._bases: dict[tuple[int, bytes], int] = {}
        self._refs: dict[tuple[int, bytes], int] = {}
        self._lock = threading.Lock()

    def open(self, handle: IpcHandle) -> int:
        """Map ``handle`` (if not mapped yet) and return the pointer it describes."""
        if handle.pid == os.getpid():
            raise CudaIpcError(
                "a CUDA IPC handle cannot be opened in the process that exported it "
                f"(pid {handle.pid}); use the exporter's pointer directly"
            )
        key = (handle.pid, handle.handle)
        with self._lock:
            base = self._bases.get(key)
            if base is None:
                ensure_context(self.device)
                drv = driver()
                if len(handle.handle) != IPC_HANDLE_BYTES:
                    raise CudaIpcError(f"IPC handle must be {IPC_HANDLE_BYTES} bytes")
                raw = _IpcMemHandle.from_buffer_copy(handle.handle)
                ptr = _CUdeviceptr()
                drv.check(
                    drv.cuIpcOpenMemHandle(
                        ctypes.byref(ptr), raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                    ),
                    f"cuIpcOpenMemHandle(from pid {handle.pid}, device {handle.device})",
                )
                base = int(ptr.value)
                self._bases[key] = base
                self._refs[key] = 0
            self._refs[key] += 1
            return base + handle.offset

    def close(self, handle: IpcHandle) -> None:
        """Drop one reference; unmap the allocation when none are left."""
        key = (handle.pid, handle.handle)
        with self._lock:
            refs = self._refs.get(key, 0) - 1
            if refs > 0:
                self._refs[key] = refs
                return
            base = self._bases.pop(key, None)
            self._refs.pop(key, None)
        if base is not None:
            _close_base(base, self.device)

    def close_all(self) -> None:
        with self._lock:
            bases = list(self._bases.values())
            self._bases.clear()
            self._refs.clear()
        for base in bases:
            _close_base(base, self.device)

    def __len__(self) -> int:
        return len(self._bases)

    def refs(self, handle: IpcHandle) -> int:
        """References held on ``handle``'s mapping (0: not mapped)."""
        with self._lock:
            return self._refs.get((handle.pid, handle.handle), 0)


def _close_base(base: int, device: int) -> None:
    ensure_context(device)
    drv = driver()
    drv.check(drv.cuIpcCloseMemHandle(_CUdeviceptr(base)), f"cuIpcCloseMemHandle(0x{base:x})")


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` provider so torch can wrap a raw pointer (no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def tensor_from_pointer(ptr: int, nbytes: int, device: int) -> Any:
    """A uint8 CUDA tensor viewing ``nbytes`` at ``ptr`` (not owning it; ``.view(dtype)`` it).

    The caller keeps the memory alive (and mapped) for the tensor's lifetime.
    """
    import torch

    return torch.as_tensor(_CudaArray(ptr, nbytes), device=torch.device("cuda", device))


def open_tensor(mapper: IpcMapper, handle: IpcHandle) -> Any:
    """Map a peer's exported bytes and wrap them as a uint8 tensor on ``mapper.device``."""
    return tensor_from_pointer(mapper.open(handle), handle.nbytes, mapper.device)
