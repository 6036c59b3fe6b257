/* kvlink's C helpers (kvlink.native builds and loads them, with _gate.c — tcp's grant gate
 * and the owner's serving loop — and _reader.c — tcp's reader inbox; nothing here holds
 * state but the driver's four entry points, bound once).
 *
 * post: a cuda_ipc lane's post in one call: the block ids into the launch's parameter buffer,
 * the copy's stream ordered after the caller's, the kernel launched, and its end marked by
 * the stream in the post's pinned status buffer (no completion event). A request's host time before its launch is
 * its latency, and on a serving host that time is cold: the same steps through numpy and
 * ctypes (two slice assignments, the argument slots, a stream query, two event calls and
 * cuLaunchKernel, each converting its arguments anew) cost more; the Python side keeps every
 * buffer written into. The driver's
 * functions are handed over as addresses (those kvlink.gpu.move's ctypes library resolved):
 * this file needs no CUDA header and builds on a machine without CUDA, where its tests give
 * it stand-ins.
 *
 * fingerprint: kvlink.holdboard.fingerprint of a block-id list, the same value as its numpy
 * form (tests/test_native_launch.py compares them): 26 us of a READ's path cold through
 * numpy and blake2b on one H200 host (bench/results/gpu_checks_launched_ids).
 *
 * move_extents: tcp's bytes between registered host memory and a socket, straight from the
 * extent array (its (addr, len) records are struct iovec's layout) through writev/readv with
 * the GIL released: the same through CPython's sendmsg/recvmsg_into made and took a
 * memoryview per extent and the GIL per call, which made a 16-block request (2560 extents of
 * 4 KiB) twice a plain socket's time (bench/results/e2e_request_cpu_tcp_d60d63b).
 *
 * sentinel_arm / sentinel_disarm: a hold board's alive word, which the kernel itself marks
 * when the producer dies (a robust futex of the board's sentinel thread), so the after-check
 * reads a word where it made a system call (the check cold 9.1 us against 12.8 by the
 * flock on one H200 host: bench/results/gpu_checks_alive_word/cold_calls.json).
 *
 * inside: the bounds check of an extent array against sorted ranges (registered regions,
 * a grant's window), which both sides of a tcp READ make before a byte moves: ~10 numpy
 * calls through kvlink.transport.RegionTable.locate, 19.5 us warm for a 16-block READ's
 * extents against 2.2 us for this one call (bench/results/bounds_check_3fc1440/).
 *
 * board_shows: kvlink.holdboard's after-check of one READ (the producer alive, its hold
 * still shown) in one call: 25 us to bind it and 26 to make it, cold, through Python's
 * steps on that host.
 */
#define PY_SSIZE_T_CLEAN
#include "_native.h"
#include <errno.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shared, void *stream,
                         void **params, void **extra);
typedef int (*query_fn)(void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*write_fn)(void *stream, uint64_t addr, uint32_t value, unsigned flags);

#define NOT_READY 600 /* CUDA_ERROR_NOT_READY */
#define END_WORD 4 /* a lane's end word, in words from its status word (kvlink.gpu.lane) */

static launch_fn cu_launch;
static query_fn cu_query;
static query_fn cu_event_query;
static record_fn cu_record;
static wait_fn cu_wait;
static write_fn cu_write;

static void *as_ptr(PyObject *o) { return (void *)(uintptr_t)PyLong_AsUnsignedLongLong(o); }

/* bind(cuLaunchKernel, cuStreamQuery, cuEventRecord, cuStreamWaitEvent,
 *      cuStreamWriteValue32_v2): their addresses */
static PyObject *bind_driver(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "bind takes the five driver functions' addresses");
    return NULL;
  }
  void *p[5];
  for (int i = 0; i < 5; ++i) {
    p[i] = as_ptr(args[i]);
    if (PyErr_Occurred()) return NULL;
    if (!p[i]) {
      PyErr_SetString(PyExc_ValueError, "a driver function's address is null");
      return NULL;
    }
  }
  cu_launch = (launch_fn)p[0];
  cu_query = (query_fn)p[1];
  cu_record = (record_fn)p[2];
  cu_wait = (wait_fn)p[3];
  cu_write = (write_fn)p[4];
  Py_RETURN_NONE;
}

/* bind_event_query(cuEventQuery's address) */
static PyObject *bind_event_query(PyObject *self, PyObject *addr) {
  void *p = as_ptr(addr);
  if (PyErr_Occurred()) return NULL;
  if (!p) {
    PyErr_SetString(PyExc_ValueError, "cuEventQuery's address is null");
    return NULL;
  }
  cu_event_query = (query_fn)p;
  Py_RETURN_NONE;
}

/* event_query(event) -> CUresult: cuEventQuery of a copy's completion event, the call every
 * poll of a READ in flight makes. Through ctypes it is a foreign call that converts its
 * argument: cold, about twice a C function's call (bench/results/cold_calls_alive). */
static PyObject *event_query(PyObject *self, PyObject *ev) {
  if (!cu_event_query) {
    PyErr_SetString(PyExc_RuntimeError, "event_query before bind_event_query()");
    return NULL;
  }
  void *e = as_ptr(ev);
  if (PyErr_Occurred()) return NULL;
  return PyLong_FromLong(cu_event_query(e));
}

/* lane_end(buffer, seq, checks) -> None | (failed, first, rows, missed)
 *
 * The look a poll takes at a lane's copy (kvlink.gpu.copy.Pending.done): its status buffer
 * (kvlink.gpu.copy._Pinned, at `buffer`: the status word, a digest lane's three check words,
 * the end word END_WORD words on) — None while the end word does not show the post's `seq`
 * (the stream writes it once the kernel has ended); once it does, in one call, whether the
 * status word shows `seq` (the device refused an extent), and, where `checks` (a digest lane)
 * and it did not, the check words: the first differing index, the rows compared, whether a
 * unit found none (else 0, 0, 0). Read through ctypes after the end word, the status and check
 * words cost a poll that sees a READ done ~4 us more at `sample` than at `off`, cold
 * (bench/results/gpu_session_5dc24ba/, stamps_io). */
static PyObject *lane_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "lane_end(buffer, seq, checks)");
    return NULL;
  }
  const int64_t *w = (const int64_t *)as_ptr(args[0]);
  const long long seq = PyLong_AsLongLong(args[1]);
  const int checks = PyObject_IsTrue(args[2]);
  if (PyErr_Occurred() || checks < 0) return NULL;
  if (!w) {
    PyErr_SetString(PyExc_ValueError, "a lane's status buffer is null");
    return NULL;
  }
  /* (the stream's write of the end word comes after the kernel's stores: read it first) */
  const int32_t end = __atomic_load_n((const int32_t *)(w + END_WORD), __ATOMIC_ACQUIRE);
  if ((long long)end != seq) Py_RETURN_NONE;
  const int failed = __atomic_load_n(&w[0], __ATOMIC_ACQUIRE) == seq;
  uint64_t first = 0, rows = 0, missed = 0;
  if (checks && !failed) {
    first = (uint64_t)__atomic_load_n(&w[1], __ATOMIC_ACQUIRE);
    rows = (uint64_t)__atomic_load_n(&w[2], __ATOMIC_ACQUIRE);
    missed = (uint64_t)__atomic_load_n(&w[3], __ATOMIC_ACQUIRE);
  }
  return Py_BuildValue("(NKKK)", PyBool_FromLong(failed), (unsigned long long)first,
                       (unsigned long long)rows, (unsigned long long)missed);
}

/* n ids into out: from a list of ints (converted here, each through __index__: a float or a
 * string raises TypeError, an id past 64 bits OverflowError), or from a 1-D C-contiguous
 * buffer of 8-byte signed integers (a numpy int64 array, array.array('q')); anything else, or
 * another count, raises ValueError. Either way nothing is launched: the caller converts the
 * ids itself (kvlink.worker: a general READ says what is wrong with them). A list is what a
 * scheduler hands over, and converting it here costs less than numpy's conversion before the
 * call, cold (bench/results/gpu_checks_61d7f7e_stamps: 31 us for both lists). */
/* How many ids `o` holds (a list: its length; a buffer: its int64 count, `view` then held:
 * release it), or -1 with ValueError where it is neither a list nor a 1-D C-contiguous
 * buffer of 8-byte signed integers. */
static Py_ssize_t count_ids(PyObject *o, Py_buffer *view, const char *side) {
  if (PyList_CheckExact(o)) return PyList_GET_SIZE(o);
  if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s ids: a list of ints or an int64 array, not %s", side,
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  const char *f = view->format ? view->format : "B";
  if (*f == '<' || *f == '=' || *f == '@') ++f;
  if (view->ndim != 1 || view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
    PyErr_Format(PyExc_ValueError, "%s ids: expected int64, got a buffer of format %s and "
                 "%d dimensions", side, f, view->ndim);
    PyBuffer_Release(view);
    return -1;
  }
  return view->len / 8;
}

static int write_ids(PyObject *o, int64_t *out, Py_ssize_t n, const char *side) {
  Py_buffer view;
  Py_ssize_t got = count_ids(o, &view, side);
  if (got < 0) return -1;
  int list = PyList_CheckExact(o);
  if (got != n) {
    PyErr_Format(PyExc_ValueError, "%s ids: expected %zd, got %zd", side, n, got);
    if (!list) PyBuffer_Release(&view);
    return -1;
  }
  if (!list) {
    memcpy(out, view.buf, (size_t)n * 8);
    PyBuffer_Release(&view);
    return 0;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i >= PyList_GET_SIZE(o)) {  // an __index__ that shrank the list under us
      PyErr_Format(PyExc_ValueError, "%s ids: the list changed while read", side);
      return -1;
    }
    PyObject *item = PyList_GET_ITEM(o, i);
    Py_INCREF(item);  // (an __index__ runs Python code)
    long long v = PyLong_AsLongLong(item);
    Py_DECREF(item);
    if (v == -1 && PyErr_Occurred()) return -1;
    out[i] = v;
  }
  return 0;
}

/* splitmix64's finaliser (kvlink.sampling.mix) */
static inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

#define FP_SEED 0x6B766C696E6B6670ULL /* "kvlinkfp" (kvlink.holdboard._FP_SEED) */

/* the fingerprint of `ids` into *out (ids as write_ids takes them); -1 with an exception set */
static int fingerprint_of(PyObject *ids, uint64_t *out) {
  Py_buffer view;
  Py_ssize_t n = count_ids(ids, &view, "fingerprint:");
  if (n < 0) return -1;
  int list = PyList_CheckExact(ids);
  int64_t *v = list ? PyMem_Malloc((size_t)(n ? n : 1) * 8) : (int64_t *)view.buf;
  if (!v) {
    PyErr_NoMemory();
    return -1;
  }
  if (list && write_ids(ids, v, n, "fingerprint:") < 0) {
    PyMem_Free(v);
    return -1;
  }
  uint64_t h = 0;
  for (Py_ssize_t i = 0; i < n; ++i) h += mix64((uint64_t)v[i] ^ mix64((uint64_t)i ^ FP_SEED));
  if (list)
    PyMem_Free(v);
  else
    PyBuffer_Release(&view);
  *out = mix64(h ^ (uint64_t)n);
  return 0;
}

/* fingerprint(ids) -> int: sum over positions i of mix(id_i ^ mix(i ^ SEED)) (mod 2**64),
 * then mix(sum ^ n) — ids as a list of ints or a 1-D int64 buffer (write_ids' rules) */
static PyObject *fingerprint(PyObject *self, PyObject *ids) {
  uint64_t fp;
  if (fingerprint_of(ids, &fp) < 0) return NULL;
  return PyLong_FromUnsignedLongLong(fp);
}

/* A hold board's alive word (kvlink.holdboard.ALIVE_AT in its header): the producer's
 * sentinel thread's id while it lives. The thread registers the word with the kernel as a
 * robust futex it owns (set_robust_list): whenever that thread ends — the process killed,
 * however — the kernel, on its way out and before the process's files (its GPU memory, its
 * flock) are released, replaces the id with FUTEX_OWNER_DIED. So a word that shows an id
 * and no FUTEX_OWNER_DIED means the producer has not begun to die; anything else (0: no
 * sentinel, a closed board, an older producer) is settled by the flock. */
#define ALIVE_AT 32

static int alive_word(const char *map) {
  uint32_t a = __atomic_load_n((const uint32_t *)(map + ALIVE_AT), __ATOMIC_ACQUIRE);
  return (a & FUTEX_TID_MASK) != 0 && !(a & FUTEX_OWNER_DIED);
}

static __thread struct robust_list_head *armed_head;  // the sentinel's, freed at disarm

/* sentinel_arm(map) -> thread id: on the board's sentinel thread (kvlink.holdboard), which
 * then only waits: registers the alive word of `map` (the producer's writable mapping) as
 * this thread's robust list and stores the thread's id in it. The mapping must stay mapped
 * until sentinel_disarm, on the same thread (the kernel reads the list when the thread
 * ends). The thread must hold no robust pthread mutex: its list is replaced. */
static PyObject *sentinel_arm(PyObject *self, PyObject *map) {
  Py_buffer view;
  if (PyObject_GetBuffer(map, &view, PyBUF_WRITABLE) < 0) return NULL;
  if (view.len < ALIVE_AT + 4) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "the mapping is shorter than a board's header");
    return NULL;
  }
  uint32_t *word = (uint32_t *)((char *)view.buf + ALIVE_AT);
  PyBuffer_Release(&view);  // (the caller keeps it mapped: see above)
  struct robust_list_head *head = malloc(sizeof *head + sizeof(struct robust_list));
  if (!head) return PyErr_NoMemory();
  struct robust_list *entry = (struct robust_list *)(head + 1);
  head->list.next = entry;
  entry->next = &head->list;
  head->futex_offset = (long)((char *)word - (char *)entry);
  head->list_op_pending = NULL;
  if (syscall(SYS_set_robust_list, head, sizeof *head)) {
    free(head);
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  free(armed_head);  // (one armed before on this thread: no longer registered)
  armed_head = head;  // the kernel reads it until disarm, or when the thread ends
  long tid = syscall(SYS_gettid);
  __atomic_store_n(word, (uint32_t)tid & FUTEX_TID_MASK, __ATOMIC_RELEASE);
  return PyLong_FromLong(tid);
}

/* sentinel_disarm(): on the sentinel thread, before the board's mapping goes: an empty robust
 * list, so the kernel reads nothing of the mapping when the thread ends. */
static PyObject *sentinel_disarm(PyObject *self, PyObject *unused) {
  static __thread struct robust_list_head empty;
  empty.list.next = &empty.list;
  empty.futex_offset = 0;
  empty.list_op_pending = NULL;
  if (syscall(SYS_set_robust_list, &empty, sizeof empty))
    return PyErr_SetFromErrno(PyExc_OSError);
  free(armed_head);
  armed_head = NULL;
  Py_RETURN_NONE;
}

/* alive_shown(map) -> bool: whether the board's alive word shows a live sentinel */
static PyObject *alive_shown(PyObject *self, PyObject *map) {
  Py_buffer view;
  if (PyObject_GetBuffer(map, &view, PyBUF_SIMPLE) < 0) return NULL;
  int alive = view.len >= ALIVE_AT + 4 && alive_word(view.buf);
  PyBuffer_Release(&view);
  return PyBool_FromLong(alive);
}

/* board_shows(map, offset, fd, generation, ids) -> bool: whether the producer is
 * alive — its alive word says so, else it still holds its board's lock (a shared flock of
 * ours would be refused) — and the slot
 * at `offset` of the board mapping `map` (an mmap: a closed one raises ValueError, and it
 * cannot be closed while this runs) shows (generation, the fingerprint of the block ids
 * `ids`, taken here: one call where the READ's records made two). Alive first, then the
 * generation loaded with acquire order before the fingerprint: the producer stores the
 * fingerprint first and clears the generation first (kvlink.holdboard's docstring). */
static PyObject *board_shows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "board_shows(map, offset, fd, generation, ids)");
    return NULL;
  }
  Py_ssize_t off = PyLong_AsSsize_t(args[1]);
  long fd = PyLong_AsLong(args[2]);
  uint64_t gen = PyLong_AsUnsignedLongLong(args[3]);
  uint64_t fp;
  if (PyErr_Occurred() || fingerprint_of(args[4], &fp) < 0) return NULL;
  if (fd < 0) Py_RETURN_FALSE;
  Py_buffer view;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
  if (off < 0 || off % 8 || off + 16 > view.len || view.len < ALIVE_AT + 4) {
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_ValueError, "slot offset %zd outside the board", off);
    return NULL;
  }
  int alive = alive_word(view.buf);  // (the offset check above covers the header)
  if (!alive) {
    if (flock((int)fd, LOCK_SH | LOCK_NB) == 0) {  // we got it: nobody holds it any more
      flock((int)fd, LOCK_UN);
    } else {
      alive = errno == EWOULDBLOCK || errno == EAGAIN;
    }
  }
  int shown = 0;
  if (alive) {
    uint64_t *w = (uint64_t *)((char *)view.buf + off);
    uint64_t g = __atomic_load_n(&w[0], __ATOMIC_ACQUIRE);
    uint64_t f = __atomic_load_n(&w[1], __ATOMIC_RELAXED);
    shown = g == gen && f == fp;
  }
  PyBuffer_Release(&view);
  return PyBool_FromLong(shown);
}

/* post(form, src_ids, dst_ids, stream, after, order_event, values)
 *
 * src_ids, dst_ids: lists of ints or int64 arrays (write_ids).
 * form: (function, table, slots, params, grid, threads, at, n, words, which, check, board,
 *   status, seq) as
 *   kvlink.gpu.lane.Lane._form builds it: the CUfunction; the addresses of the
 *   parameter table (int64 words), of the argument slots (int64) and of cuLaunchKernel's
 *   pointer array; the grid and block size; where the ids go in the table (source ids at
 *   `at`, destination ids after them) and how many (n); the table's size in words; a
 *   tuple of the slot indices `values` are written to, in order (-1: a value read here and
 *   written to no slot, as a digest lane's generation); which of `values` is the
 *   address of a digest lane's three check words (-1: none), set here to (all ones, 0, 0)
 *   before the launch (no mismatch, no rows compared, none missed) — from Python a foreign
 *   call of its own, ~13 us of a READ's post cold on one H200 host; and, for a digest lane,
 *   its hold board (else None): (the address here of the board's first slot, the slots'
 *   mask, which of `values` is the hold's generation, the argument slots for the hold's
 *   offset and bytes, the argument slot of the pick), which are read from the generation's
 *   slot (bytes 0 where it shows another), as kvlink.gpu.lane.board_slot reads them — so the
 *   kernel's units do not. Where that post's pick slot says `sample` (nonzero), the
 *   launcher also picks the blocks it checks (kvlink.sampling.picked: by the generation,
 *   the last block always) and writes the order the kernel takes them in after the ids
 *   (positions of the picked blocks first, then the others, each in order), and the count
 *   picked into the pick slot: see kvlink.gpu.lane.sample_order. Last, which of `values`
 *   is the address of the post's status word (-1: none), set to 0 here before the launch
 *   (the kernel stores the post's sequence number there where it refuses an extent), and
 *   its end word with it, END_WORD words on — from Python ctypes stores of their own on a
 *   READ's path before its launch; and which of `values` is the post's sequence number,
 *   which the stream writes into the end word once the kernel has ended
 *   (cuStreamWriteValue32, after the launch: the copy's completion, which a poll reads; an
 *   event recorded here served until 783e09f; kvlink.gpu.lane.END_WORD).
 * stream: the copy's stream; after: the caller's stream (None: no order), waited for through
 *   order_event only where it has work pending (cuStreamQuery). Raises RuntimeError naming
 *   the step where the driver refused one: before the launch nothing of this copy was
 *   enqueued; "marking the end" and "signalling" come after it.
 * signal (optional, a push's WRITE into a landing board, kvlink.landing): (the kv_signal
 *   function, the flag's device address, the value it must show, the value it takes), launched
 *   after the copy and before its end mark — so the status word it reads (the copy refused
 *   nothing) is not handed back before it has read it: kvlink.gpu.move.CudaMove.signal's
 *   launch, one call less on a push's host path than Python's.
 * start (optional, a copy timed on the device: kvlink.gpu.copy.BatchCopier.device_times): a
 *   timing event recorded on the copy's stream right before the launch, after the order's
 *   wait — so the copy's time is the kernel's (recorded before this call, a timed copy also
 *   held the host's steps up to its launch, and whatever else ran there:
 *   bench/results/gpu_stamps_7c35336/). A copy is not failed for its timing: where the
 *   driver refuses that record, the post goes on untimed.
 * Returns True where `start` was recorded, else False.
 */
static PyObject *post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 7 || nargs > 9 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 14 ||
      !PyTuple_Check(args[6]) ||
      (nargs >= 8 && args[7] != Py_None &&
       (!PyTuple_Check(args[7]) || PyTuple_GET_SIZE(args[7]) != 4))) {
    PyErr_SetString(PyExc_TypeError,
                    "post(form, src_ids, dst_ids, stream, after, order_event, values[, signal"
                    "[, start]]), form a 14-tuple, signal None or (function, flag, expect, "
                    "value), start a timing event or None");
    return NULL;
  }
  void *start = NULL;  // a timing event, recorded right before the launch (see above)
  if (nargs == 9 && args[8] != Py_None) {
    start = as_ptr(args[8]);
    if (PyErr_Occurred()) return NULL;
  }
  /* kv_signal's arguments (status, seq, flag, expect, value): read before anything is
   * written, like the rest (static: the GIL is held throughout, and the driver copies them
   * at the launch) */
  static int64_t sig_vals[5];
  static void *sig_params[5];
  void *sig_fn = NULL;
  if (nargs >= 8 && args[7] != Py_None) {
    sig_fn = as_ptr(PyTuple_GET_ITEM(args[7], 0));
    for (int i = 0; i < 3; ++i)
      sig_vals[2 + i] = (int64_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args[7], 1 + i));
    if (PyErr_Occurred()) return NULL;
    if (!sig_fn) {
      PyErr_SetString(PyExc_ValueError, "the signal's function is null");
      return NULL;
    }
  }
  if (!cu_launch) {
    PyErr_SetString(PyExc_RuntimeError, "post before bind()");
    return NULL;
  }
  PyObject *const *form = &PyTuple_GET_ITEM(args[0], 0);
  void *fn = as_ptr(form[0]);
  int64_t *table = (int64_t *)as_ptr(form[1]);
  int64_t *slots = (int64_t *)as_ptr(form[2]);
  void **params = (void **)as_ptr(form[3]);
  unsigned grid = (unsigned)PyLong_AsUnsignedLong(form[4]);
  unsigned threads = (unsigned)PyLong_AsUnsignedLong(form[5]);
  Py_ssize_t at = PyLong_AsSsize_t(form[6]), n = PyLong_AsSsize_t(form[7]);
  Py_ssize_t words = PyLong_AsSsize_t(form[8]);
  PyObject *which = form[9];
  Py_ssize_t check = PyLong_AsSsize_t(form[10]);
  Py_ssize_t status = PyLong_AsSsize_t(form[12]);
  Py_ssize_t seq_at = PyLong_AsSsize_t(form[13]);
  const uint64_t *slots0 = NULL;  // a digest lane's hold board: see above
  uint64_t mask = 0;
  Py_ssize_t gen_at = -1, at_slot = -1, len_slot = -1, pick_slot = -1;
  if (form[11] != Py_None) {
    PyObject *b = form[11];
    if (!PyTuple_Check(b) || PyTuple_GET_SIZE(b) != 6) {
      PyErr_SetString(PyExc_TypeError,
                      "the form's board: (slots, mask, generation, at, len, pick)");
      return NULL;
    }
    slots0 = (const uint64_t *)as_ptr(PyTuple_GET_ITEM(b, 0));
    mask = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(b, 1));
    gen_at = PyLong_AsSsize_t(PyTuple_GET_ITEM(b, 2));
    at_slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(b, 3));
    len_slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(b, 4));
    pick_slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(b, 5));
  }
  void *stream = as_ptr(args[3]);
  void *order = as_ptr(args[5]);
  if (PyErr_Occurred()) return NULL;
  if (!PyTuple_Check(which) || PyTuple_GET_SIZE(which) != PyTuple_GET_SIZE(args[6])) {
    PyErr_SetString(PyExc_ValueError, "values: one for each of the form's slots");
    return NULL;
  }
  if (check < -1 || check >= PyTuple_GET_SIZE(which) || status < -1 ||
      status >= PyTuple_GET_SIZE(which) || seq_at < -1 || seq_at >= PyTuple_GET_SIZE(which) ||
      (status < 0) != (seq_at < 0)) {
    PyErr_Format(PyExc_ValueError,
                 "check words at value %zd, status word at %zd, sequence number at %zd, of %zd",
                 check, status, seq_at, PyTuple_GET_SIZE(which));
    return NULL;
  }
  if (slots0 && (gen_at < 0 || gen_at >= PyTuple_GET_SIZE(which) || at_slot < 0 ||
                 len_slot < 0 || pick_slot < 0)) {
    PyErr_Format(PyExc_ValueError, "the board's generation at value %zd, offset, bytes and "
                 "pick at slots %zd, %zd and %zd", gen_at, at_slot, len_slot, pick_slot);
    return NULL;
  }
  if (at < 0 || n <= 0 || at + (slots0 ? 3 : 2) * n > words) {
    PyErr_Format(PyExc_ValueError, "%zd ids at word %zd do not fit a table of %zd words", n,
                 at, words);
    return NULL;
  }
  Py_ssize_t k = PyTuple_GET_SIZE(which);
  int64_t vals[32];
  Py_ssize_t idx[32];
  if (k > 32) {
    PyErr_SetString(PyExc_ValueError, "more than 32 argument slots");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < k; ++i) {  // all read before anything is written
    idx[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(which, i));
    PyObject *v = PyTuple_GET_ITEM(args[6], i);
    vals[i] = PyBool_Check(v) ? (v == Py_True) : (int64_t)PyLong_AsLongLong(v);
    if (PyErr_Occurred()) return NULL;
  }
  if (sig_fn && (status < 0 || !vals[status])) {
    PyErr_SetString(PyExc_ValueError, "a signal needs the post's status word");
    return NULL;
  }
  if (write_ids(args[1], table + at, n, "source") < 0 ||
      write_ids(args[2], table + at + n, n, "destination") < 0)
    return NULL;  // (the table's ids only: written again by the next post)
  for (Py_ssize_t i = 0; i < k; ++i)  // (-1: a value read here only, see the form)
    if (idx[i] >= 0) slots[idx[i]] = vals[i];
  if (status >= 0 && vals[status]) {  // (pinned host memory the kernel writes)
    volatile int64_t *word = (volatile int64_t *)(uintptr_t)vals[status];
    word[0] = 0;
    word[END_WORD] = 0;
  }
  if (check >= 0 && vals[check]) {  // (pinned host memory the kernel reads and writes)
    uint64_t *words = (uint64_t *)(uintptr_t)vals[check];
    words[0] = ~(uint64_t)0;
    words[1] = words[2] = 0;
  }
  if (slots0) {  // where the hold lies, as its slot shows now (the producer's shared memory)
    const uint64_t gen = (uint64_t)vals[gen_at];
    const uint64_t *w = slots0 + 4 * (gen & mask);
    const int shown = __atomic_load_n(&w[0], __ATOMIC_ACQUIRE) == gen;
    slots[at_slot] = shown ? (int64_t)w[2] : 0;
    slots[len_slot] = shown ? (int64_t)w[3] : 0;
    if (slots[pick_slot]) {  // `sample`: the picked blocks' positions first (see above)
      const int64_t *src = table + at;
      int64_t *order = table + at + 2 * n;
      Py_ssize_t k = 0, u = n;  // picked from the front; the others from the back, reversed
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (i == n - 1 || mix64((uint64_t)src[i] ^ gen) % 64 == 0) order[k++] = i;
        else order[--u] = i;
      }
      for (Py_ssize_t lo = k, hi = n - 1; lo < hi; ++lo, --hi) {  // (u == k: back in order)
        const int64_t x = order[lo];
        order[lo] = order[hi];
        order[hi] = x;
      }
      slots[pick_slot] = k;
    }
  }
  const char *step = NULL;
  int rc = 0;
  if (args[4] != Py_None) {  // after the caller's stream: only where it has work pending
    void *after = as_ptr(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (after != stream) {
      rc = cu_query(after);
      if (rc == NOT_READY) {
        rc = cu_record(order, after);
        if (rc) step = "ordering the copy after the caller's stream (cuEventRecord)";
        else if ((rc = cu_wait(stream, order, 0)))
          step = "ordering the copy after the caller's stream (cuStreamWaitEvent)";
      } else if (rc) {
        step = "querying the caller's stream (cuStreamQuery)";
      }
    }
  }
  int timed = 0;
  if (!step && start) timed = cu_record(start, stream) == 0;  // (refused: untimed, not failed)
  if (!step && (rc = cu_launch(fn, grid, 1, 1, threads, 1, 1, 0, stream, params, NULL)))
    step = "cuLaunchKernel";
  if (!step && sig_fn) {  // (a status word is what tells the signal the copy refused nothing)
    sig_vals[0] = vals[status];
    sig_vals[1] = vals[seq_at];
    for (int i = 0; i < 5; ++i) sig_params[i] = &sig_vals[i];
    if ((rc = cu_launch(sig_fn, 1, 1, 1, 1, 1, 1, 0, stream, sig_params, NULL)))
      step = "signalling the landing (cuLaunchKernel(kv_signal)), after the launch";
  }
  if (!step && status >= 0 && vals[status] &&
      (rc = cu_write(stream, (uint64_t)vals[status] + 8 * END_WORD, (uint32_t)vals[seq_at], 0)))
    step = "marking the end (cuStreamWriteValue32), after the launch";
  if (step) {
    PyErr_Format(PyExc_RuntimeError, "%s failed with CUDA error %d", step, rc);
    return NULL;
  }
  return PyBool_FromLong(timed);
}


#define IOV_WINDOW 1024 /* IOV_MAX on Linux */
/* buffers handed to one sendmsg/readv: the kernel takes (copies, checks) every one it is
 * handed while a call moves at most a socket buffer's worth, so more cost more than they
 * move: 64 was the best of 16-256 for tcp's memoryview path (bench/results/tcp_window_ab) */
#define IOV_PER_CALL 64

/* Wait up to timeout_ms (-1: forever) for `fd` to take (send) or give bytes: 0 ready, 1 timed
 * out, -1 an error (errno). EINTR is waited through: these waits are bounded by the timeout,
 * and the caller's Python runs its signal handlers once the call returns. No GIL needed. */
static int wait_fd(int fd, int send, int timeout_ms) {
  struct pollfd p = {fd, send ? POLLOUT : POLLIN, 0};
  for (;;) {
    int r = poll(&p, 1, timeout_ms);
    if (r > 0) return 0;
    if (r == 0) return 1;
    if (errno != EINTR) return -1;
  }
}

static int64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Move `len` bytes of `buf` through `fd` (send, or receive into it), waiting up to
 * timeout_ms for each step, and (`deadline`, now_ms()'s clock; 0: none) no later than it:
 * 0 done, 1 timed out, 2 closed by the peer (a read of 0 bytes), -1 an error (errno);
 * `*halted` set and 0 returned where `halt` shows nonzero first. */
static int move_all(int fd, int send, char *buf, size_t len, int timeout_ms, int64_t deadline,
                    const volatile uint32_t *halt, int *halted) {
  size_t done = 0;
  while (done < len) {
    if (halt && *halt) {
      *halted = 1;
      return 0;
    }
    ssize_t got = send ? sendto(fd, buf + done, len - done, MSG_NOSIGNAL, NULL, 0)
                       : recv(fd, buf + done, len - done, MSG_DONTWAIT);
    if (got > 0) {
      done += (size_t)got;
    } else if (got == 0) {
      return 2;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int wait = timeout_ms;
      if (deadline) {
        int64_t left = deadline - now_ms();
        if (left <= 0) return 1;
        if (wait < 0 || left < wait) wait = (int)left;
      }
      int w = wait_fd(fd, send, wait);
      if (w) return w;
    } else if (errno != EINTR) {
      return -1;
    }
  }
  return 0;
}

KVL_HIDDEN void kvl_move(int fd, int send, const uint64_t *ext, Py_ssize_t n,
                         long long budget, int timeout_ms, const char *prefix, size_t plen,
                         const volatile uint32_t *halt, uint32_t *done, kvl_move_t *m) {
  static const uint32_t no_halt = 0;
  if (!halt) halt = &no_halt;
  Py_ssize_t index = m->index;
  uint64_t offset = m->offset;
  struct iovec iov[IOV_WINDOW];  // the window: iov[at..k) still to move
  int at = 0, k = 0;
  Py_ssize_t fill = index;  // the next extent not in the window yet
  uint64_t skip = offset;   // (of the first one only)
  long long moved = 0;
  if (plen) {
    int r = move_all(fd, send, send ? (char *)prefix : m->head, plen, timeout_ms, 0, halt,
                     &m->halted);
    if (r < 0) m->err = errno;
    m->timed_out = r == 1;
    m->closed = r == 2;
    m->differs = !r && !m->halted && !send && memcmp(m->head, prefix, plen) != 0;
  }
  while (!m->err && !m->timed_out && !m->closed && !m->halted && !m->differs && index < n &&
         moved < budget) {
    if (*halt) {
      m->halted = 1;
      break;
    }
    if (k - at < IOV_WINDOW / 4 && fill < n) {  // topped up, not rebuilt: a call may move
      if (at) {                                  // only a few of its buffers
        memmove(iov, iov + at, (size_t)(k - at) * sizeof *iov);
        k -= at;
        at = 0;
      }
      for (; fill < n && k < IOV_WINDOW; ++fill, skip = 0) {  // (empty extents skipped)
        if (ext[2 * fill + 1] == skip) continue;
        iov[k].iov_base = (char *)(uintptr_t)ext[2 * fill] + skip;
        iov[k].iov_len = (size_t)(ext[2 * fill + 1] - skip);
        ++k;
      }
    }
    if (at == k) {  // only empty extents left
      index = n;
      offset = 0;
      break;
    }
    ssize_t got;
    if (send) {  // (MSG_NOSIGNAL: a closed peer is EPIPE, not a signal)
      struct msghdr msg = {0};
      msg.msg_iov = iov + at;
      msg.msg_iovlen = (size_t)(k - at < IOV_PER_CALL ? k - at : IOV_PER_CALL);
      got = sendmsg(fd, &msg, MSG_NOSIGNAL);
    } else {
      got = readv(fd, iov + at, k - at < IOV_PER_CALL ? k - at : IOV_PER_CALL);
    }
    if (got < 0) {
      if (errno == EINTR) break;  // back to Python: its signal handlers run
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        struct pollfd p = {fd, send ? POLLOUT : POLLIN, 0};
        int r = poll(&p, 1, timeout_ms);
        if (r == 0) {
          m->timed_out = 1;
          break;
        }
        if (r < 0 && errno != EINTR) {
          m->err = errno;
          break;
        }
        if (r < 0) break;
        continue;
      }
      m->err = errno;
      break;
    }
    if (got == 0) {  // (a send of nonempty buffers never moves nothing: as closed)
      m->closed = 1;
      break;
    }
    moved += got;
    for (size_t g = (size_t)got; g;) {  // the window past what moved
      if (g >= iov[at].iov_len) {
        g -= iov[at++].iov_len;
      } else {
        iov[at].iov_base = (char *)iov[at].iov_base + g;
        iov[at].iov_len -= g;
        g = 0;
      }
    }
    while (got > 0 && index < n) {  // past what moved: whole extents, then into one
      uint64_t left = ext[2 * index + 1] - offset;
      if ((uint64_t)got >= left) {
        got -= (ssize_t)left;
        ++index;
        offset = 0;
      } else {
        offset += (uint64_t)got;
        got = 0;
      }
    }
    while (index < n && ext[2 * index + 1] == 0) ++index;  // (empty ones after the last)
  }
  m->index = index;
  m->offset = offset;
  if (done && !m->err && !m->timed_out && !m->closed && !m->differs && index >= n)
    __atomic_store_n(done, 1u, __ATOMIC_RELEASE);
}

/* move_extents(fd, send, extents, index, offset, budget, timeout_ms[, prefix[, halt[, done]]])
 *   -> (index, offset) | None | bytes
 *
 * Moves the bytes of `extents` (a C-contiguous buffer of (addr, len) pairs of uint64: one
 * struct iovec each on LP64 Linux; kvlink_transports.tcp checked every one against its
 * registered memory first) from extent `index`, byte `offset` of it: written to the socket
 * `fd` (send true) or read from it into them. Returns where it stopped: at the end, or once
 * `budget` bytes moved (the caller checks whether to stop between calls), or at EINTR (the
 * caller's Python then runs its signal handlers), or where `halt` (a buffer whose first
 * uint32 another thread sets nonzero: a revoked grant) showed nonzero before a socket call.
 * None where the peer closed the connection (a read of 0 bytes). The GIL is released
 * throughout. A non-blocking socket (one with a Python timeout) waits up to timeout_ms (-1:
 * forever) in poll() for each call, then raises TimeoutError; a socket error raises OSError.
 *
 * `prefix` (bytes-like, at most PREFIX_MAX; None: none): sending, bytes written before the
 * extents (tcp's A answer and a READ's bytes in one call: every call costs its thread the GIL
 * once more, up to a switch interval where the process's own Python is busy); receiving, the
 * bytes expected before the extents — read (no more than their length), and where they
 * differ returned as they came (bytes), nothing else read (the owner's E answer: the caller
 * reads its rest and decodes it).
 *
 * `done` (a buffer of at least one uint32; None: none): set to 1 (a release store) once the
 * last extent's bytes have moved, before the GIL is taken back: a poll on another thread
 * sees a READ's bytes landed without waiting for this thread's Python to run again. */
static PyObject *move_extents(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 7 || nargs > 10) {
    PyErr_SetString(PyExc_TypeError, "move_extents(fd, send, extents, index, offset, budget, "
                    "timeout_ms[, prefix[, halt[, done]]])");
    return NULL;
  }
  int fd = (int)PyLong_AsLong(args[0]);
  int send = PyObject_IsTrue(args[1]);
  Py_ssize_t index = PyLong_AsSsize_t(args[3]);
  unsigned long long offset = PyLong_AsUnsignedLongLong(args[4]);
  long long budget = PyLong_AsLongLong(args[5]);
  int timeout_ms = (int)PyLong_AsLong(args[6]);
  if (PyErr_Occurred() || send < 0) return NULL;
  char expect[PREFIX_MAX];
  size_t plen = 0;
  if (nargs > 7 && args[7] != Py_None) {
    Py_buffer pv;
    if (PyObject_GetBuffer(args[7], &pv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (pv.len > PREFIX_MAX) {
      PyBuffer_Release(&pv);
      PyErr_Format(PyExc_ValueError, "prefix: %zd bytes, at most %d", pv.len, PREFIX_MAX);
      return NULL;
    }
    plen = (size_t)pv.len;
    memcpy(expect, pv.buf, plen);
    PyBuffer_Release(&pv);
  }
  const volatile uint32_t *halt = NULL;
  Py_buffer hv;
  int have_halt = nargs > 8 && args[8] != Py_None;
  if (have_halt) {
    if (PyObject_GetBuffer(args[8], &hv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (hv.len < 4) {
      PyBuffer_Release(&hv);
      PyErr_SetString(PyExc_ValueError, "halt: fewer than 4 bytes");
      return NULL;
    }
    halt = (const volatile uint32_t *)hv.buf;
  }
  Py_buffer dv;
  int have_done = nargs > 9 && args[9] != Py_None;
  if (have_done) {
    if (PyObject_GetBuffer(args[9], &dv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0 ||
        dv.len < 4) {
      if (!PyErr_Occurred()) {
        PyBuffer_Release(&dv);
        PyErr_SetString(PyExc_ValueError, "done: fewer than 4 bytes");
      }
      if (have_halt) PyBuffer_Release(&hv);
      return NULL;
    }
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[2], &view, PyBUF_C_CONTIGUOUS) < 0) {
    if (have_halt) PyBuffer_Release(&hv);
    if (have_done) PyBuffer_Release(&dv);
    return NULL;
  }
  if (view.len % 16) {
    PyBuffer_Release(&view);
    if (have_halt) PyBuffer_Release(&hv);
    if (have_done) PyBuffer_Release(&dv);
    PyErr_Format(PyExc_ValueError, "extents: %zd bytes is not a whole number of (addr, len) "
                 "pairs", view.len);
    return NULL;
  }
  const uint64_t *ext = (const uint64_t *)view.buf;
  Py_ssize_t n = view.len / 16;
  if (index < 0 || index > n || (index < n && offset > ext[2 * index + 1])) {
    PyBuffer_Release(&view);
    if (have_halt) PyBuffer_Release(&hv);
    if (have_done) PyBuffer_Release(&dv);
    PyErr_Format(PyExc_ValueError, "extent %zd byte %llu is outside %zd extents", index,
                 offset, n);
    return NULL;
  }
  kvl_move_t m = {.index = index, .offset = offset};
  Py_BEGIN_ALLOW_THREADS
  kvl_move(fd, send, ext, n, budget, timeout_ms, expect, plen, halt,
           have_done ? (uint32_t *)dv.buf : NULL, &m);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  if (have_halt) PyBuffer_Release(&hv);
  if (have_done) PyBuffer_Release(&dv);
  if (kvl_move_failed(&m)) return NULL;
  if (m.closed) Py_RETURN_NONE;
  if (m.differs) return PyBytes_FromStringAndSize(m.head, (Py_ssize_t)plen);
  return Py_BuildValue("(nK)", m.index, (unsigned long long)m.offset);
}


#define FRAME_GROW (1 << 20) /* a frame's body is buffered as it arrives past this */

KVL_HIDDEN int kvl_recv_frame(int fd, long long limit, int first_ms, int rest_ms, char **body,
                              uint32_t *len, int *waited) {
  unsigned char len4[4];
  char *buf = NULL;
  uint32_t n = 0;
  int halted = 0;
  int r = wait_fd(fd, 0, first_ms);
  *waited = r == 1;
  const int64_t deadline = rest_ms < 0 ? 0 : now_ms() + rest_ms;  // the whole frame's
  if (!r) r = move_all(fd, 0, (char *)len4, 4, rest_ms, deadline, NULL, &halted);
  if (!r) {
    n = (uint32_t)len4[0] | (uint32_t)len4[1] << 8 | (uint32_t)len4[2] << 16 |
        (uint32_t)len4[3] << 24;
    *len = n;
    if ((long long)n > limit) return 3;
  }
  size_t have = 0, cap = 0;
  while (!r && have < n) {  // grown as the bytes come, FRAME_GROW at a time
    if (have == cap) {
      size_t more = n - cap < FRAME_GROW ? n - cap : FRAME_GROW;
      char *grown = realloc(buf, cap + more);
      if (!grown) {
        errno = ENOMEM;
        r = -1;
        break;
      }
      buf = grown;
      cap += more;
    }
    r = move_all(fd, 0, buf + have, cap - have, rest_ms, deadline, NULL, &halted);
    if (!r) have = cap;
  }
  if (r) {
    int saved = errno;
    free(buf);
    errno = saved;
    return r;
  }
  *body = buf;
  return 0;
}

/* recv_frame(fd, limit, first_ms, rest_ms) -> bytes | int | None
 *
 * One tcp frame (a 4-byte little-endian length, then that many bytes) read with the GIL
 * released once: the first byte waited for up to first_ms (-1: forever: a kept-open peer may
 * be idle), the rest within rest_ms of it (a header once started must arrive whole). Returns
 * the body; the announced length (int) where it exceeds `limit` (nothing more read: the
 * caller answers and drops the connection); None where the peer closed it. A body past
 * FRAME_GROW is buffered as its bytes arrive, not at its announced size. TimeoutError,
 * OSError as move_extents. What the owner's serving thread waits in for a peer's next request
 * where it cannot serve them in C (serve_frames, _gate.c). */
static PyObject *recv_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "recv_frame(fd, limit, first_ms, rest_ms)");
    return NULL;
  }
  int fd = (int)PyLong_AsLong(args[0]);
  long long limit = PyLong_AsLongLong(args[1]);
  int first_ms = (int)PyLong_AsLong(args[2]), rest_ms = (int)PyLong_AsLong(args[3]);
  if (PyErr_Occurred()) return NULL;
  char *buf = NULL;
  uint32_t n = 0;
  int r, err = 0, waited = 0;
  Py_BEGIN_ALLOW_THREADS
  r = kvl_recv_frame(fd, limit, first_ms, rest_ms, &buf, &n, &waited);
  err = errno;
  Py_END_ALLOW_THREADS
  PyObject *out = kvl_frame_result(r, err, waited, buf, n);
  free(buf);
  return out;
}

KVL_HIDDEN PyObject *kvl_frame_result(int r, int err, int waited, const char *body,
                                      uint32_t len) {
  if (r == 2) Py_RETURN_NONE;
  if (r == 1) {
    PyErr_SetString(PyExc_TimeoutError, waited ? "no frame in time" : "frame not complete in time");
    return NULL;
  }
  if (r < 0) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  if (r == 3) return PyLong_FromUnsignedLong(len);
  return PyBytes_FromStringAndSize(body ? body : "", (Py_ssize_t)len);
}

KVL_HIDDEN int kvl_move_failed(const kvl_move_t *m) {
  if (m->err) {
    errno = m->err;
    PyErr_SetFromErrno(PyExc_OSError);
    return 1;
  }
  if (m->timed_out) {
    PyErr_SetString(PyExc_TimeoutError, "timed out");
    return 1;
  }
  return 0;
}

/* `o` as a C-contiguous buffer (`view`: release it) of whole `itemsize`-byte items, writable
 * where asked (its format is not checked: the callers' numpy arrays); -1 with an exception
 * otherwise (ValueError naming `what` for a partial item). */
static int contiguous(PyObject *o, Py_buffer *view, Py_ssize_t itemsize, const char *what,
                      int writable) {
  if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
    return -1;
  if (view->len % itemsize) {
    PyErr_Format(PyExc_ValueError, "%s: %zd bytes are not whole %zd-byte items", what,
                 view->len, itemsize);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

KVL_HIDDEN Py_ssize_t kvl_inside(const uint64_t *lo, const uint64_t *hi, Py_ssize_t nr,
                                 const uint64_t *x, Py_ssize_t nx, Py_ssize_t *out) {
  Py_ssize_t r = -1;  // the last extent's range: requests run through ranges in order
  for (Py_ssize_t i = 0; i < nx; ++i) {
    const uint64_t a = x[2 * i], end = a + x[2 * i + 1];
    if (!(r >= 0 && a >= lo[r] && (r + 1 == nr || a < lo[r + 1]))) {
      Py_ssize_t l = 0, h = nr;  // the first range starting past a
      while (l < h) {
        const Py_ssize_t m = (l + h) >> 1;
        if (lo[m] <= a) l = m + 1; else h = m;
      }
      r = l - 1;
    }
    if (r < 0 || end < a || end > hi[r]) return i;
    if (out) out[i] = r;
  }
  return -1;
}

/* inside(starts, ends, extents, out) -> int
 *
 * Where each extent (addr, len: uint64 pairs, kvlink.transport.EXTENT_DTYPE) lies among the
 * ranges [starts[r], ends[r]) (uint64, sorted by start, disjoint: kvlink.transport.RegionTable,
 * kvlink.grants.Window): the last range starting at or before its address, which must hold
 * its end too (an end that wraps past 2**64 is outside). Writes each extent's range into `out`
 * (intp, one per extent; None: not wanted) and returns -1, or returns the index of the first
 * extent that lies in none (what `out` then holds is not to be used). The same answer as
 * RegionTable.locate's numpy path (tests/test_native_launch.py compares them). */
static PyObject *inside(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "inside(starts, ends, extents, out)");
    return NULL;
  }
  Py_buffer sv, ev, xv, ov;
  int have_out = args[3] != Py_None;
  if (contiguous(args[0], &sv, 8, "starts", 0) < 0) return NULL;
  if (contiguous(args[1], &ev, 8, "ends", 0) < 0) {
    PyBuffer_Release(&sv);
    return NULL;
  }
  if (contiguous(args[2], &xv, 16, "extents", 0) < 0) {
    PyBuffer_Release(&sv);
    PyBuffer_Release(&ev);
    return NULL;
  }
  if (have_out && contiguous(args[3], &ov, sizeof(Py_ssize_t), "out", 1) < 0) {
    PyBuffer_Release(&sv);
    PyBuffer_Release(&ev);
    PyBuffer_Release(&xv);
    return NULL;
  }
  const Py_ssize_t nr = sv.len / 8, nx = xv.len / 16;
  Py_ssize_t bad = -1;
  if (ev.len / 8 != nr) {
    PyErr_Format(PyExc_ValueError, "%zd starts but %zd ends", nr, ev.len / 8);
    bad = -2;
  } else if (have_out && ov.len / (Py_ssize_t)sizeof(Py_ssize_t) != nx) {
    PyErr_Format(PyExc_ValueError, "out holds %zd, not one per extent (%zd)",
                 ov.len / (Py_ssize_t)sizeof(Py_ssize_t), nx);
    bad = -2;
  } else {
    bad = kvl_inside(sv.buf, ev.buf, nr, xv.buf, nx, have_out ? ov.buf : NULL);
  }
  PyBuffer_Release(&sv);
  PyBuffer_Release(&ev);
  PyBuffer_Release(&xv);
  if (have_out) PyBuffer_Release(&ov);
  if (bad == -2) return NULL;
  return PyLong_FromSsize_t(bad);
}

/* plan_runs(local_ids, remote_ids, local_base, remote_base, unit, local_blocks,
 *           remote_blocks, out_local, out_remote) -> int
 *
 * A request's extents on kvlink.plan's RUNS path (every segment's block stride is its unit)
 * in one call: the runs of block-id pairs consecutive on both sides, one extent per
 * (segment, run) at base + first id * unit, segment-major; an extent that starts where the
 * one before it ends on both sides (a seam: layers back to back, a request covering a
 * whole plane) is merged into it. Ids are int64, bases uint64 (one per segment), the outputs
 * (addr, len) uint64 pairs (kvlink.transport.EXTENT_DTYPE) with room for segments x ids.
 * Returns the count written, or -1 where an id is outside [0, local_blocks) or
 * [0, remote_blocks) (nothing usable written: the caller's numpy check names it). The same
 * extents as PlanTable's numpy path (tests/test_plan_table.py compares them), where its ~25
 * numpy calls cost a 16-block READ's plan 69 us cold against 21.5 here
 * (bench/results/plan_native/). */
static PyObject *plan_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "plan_runs(local_ids, remote_ids, local_base, "
                    "remote_base, unit, local_blocks, remote_blocks, out_local, out_remote)");
    return NULL;
  }
  const uint64_t unit = PyLong_AsUnsignedLongLong(args[4]);
  const long long lmax = PyLong_AsLongLong(args[5]), rmax = PyLong_AsLongLong(args[6]);
  if (PyErr_Occurred()) return NULL;
  static const int at[6] = {0, 1, 2, 3, 7, 8}, size[6] = {8, 8, 8, 8, 16, 16};
  static const char *const name[6] = {"local_ids", "remote_ids", "local_base", "remote_base",
                                      "out_local", "out_remote"};
  Py_buffer v[6];
  int held = 0;
  for (; held < 6; ++held)
    if (contiguous(args[at[held]], &v[held], size[held], name[held], held >= 4) < 0) break;
  Py_ssize_t result = -2;  // -2: an error is set
  Py_ssize_t stack[512], *starts = stack;
  if (held == 6) {
    const Py_ssize_t n = v[0].len / 8, segs = v[2].len / 8, room = v[4].len / 16;
    if (v[1].len / 8 != n || v[3].len / 8 != segs) {
      PyErr_Format(PyExc_ValueError, "%zd local ids but %zd remote, %zd local bases but %zd "
                   "remote", n, v[1].len / 8, segs, v[3].len / 8);
    } else if (v[5].len / 16 != room || room < n * segs) {
      PyErr_Format(PyExc_ValueError, "out_local, out_remote hold %zd, %zd extents, not "
                   "%zd each (segments x ids)", room, v[5].len / 16, n * segs);
    } else if (n + 1 > 512 && !(starts = PyMem_Malloc((size_t)(n + 1) * sizeof *starts))) {
      PyErr_NoMemory();
    } else {
      const int64_t *l = v[0].buf, *r = v[1].buf;
      const uint64_t *lb = v[2].buf, *rb = v[3].buf;
      uint64_t *ol = v[4].buf, *orm = v[5].buf;
      Py_ssize_t runs = 0;
      result = 0;
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (l[i] < 0 || l[i] >= lmax || r[i] < 0 || r[i] >= rmax) {
          result = -1;
          break;
        }
        if (!i || l[i] != l[i - 1] + 1 || r[i] != r[i - 1] + 1) starts[runs++] = i;
      }
      starts[runs] = n;
      for (Py_ssize_t j = 0; j < segs && result >= 0; ++j) {
        for (Py_ssize_t q = 0; q < runs; ++q) {
          const uint64_t la = lb[j] + (uint64_t)l[starts[q]] * unit;
          const uint64_t ra = rb[j] + (uint64_t)r[starts[q]] * unit;
          const uint64_t len = (uint64_t)(starts[q + 1] - starts[q]) * unit;
          Py_ssize_t k = result;
          if (k && ol[2 * k - 2] + ol[2 * k - 1] == la && orm[2 * k - 2] + orm[2 * k - 1] == ra) {
            ol[2 * k - 1] += len;  // a seam: the extent before goes on
            orm[2 * k - 1] += len;
            continue;
          }
          ol[2 * k] = la;
          ol[2 * k + 1] = len;
          orm[2 * k] = ra;
          orm[2 * k + 1] = len;
          result = k + 1;
        }
      }
      if (starts != stack) PyMem_Free(starts);
    }
  }
  for (int i = 0; i < held; ++i) PyBuffer_Release(&v[i]);
  if (result == -2) return NULL;
  return PyLong_FromSsize_t(result);
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind_driver, METH_FASTCALL,
     "bind(launch, query, record, wait, write): the driver functions' addresses"},
    {"bind_event_query", (PyCFunction)bind_event_query, METH_O,
     "bind_event_query(address): cuEventQuery's address"},
    {"event_query", (PyCFunction)event_query, METH_O,
     "event_query(event) -> CUresult of cuEventQuery"},
    {"lane_end", (PyCFunction)(void (*)(void))lane_end, METH_FASTCALL,
     "lane_end(buffer, seq, checks) -> None | (failed, first, rows, missed): a lane's end"},
    {"post", (PyCFunction)(void (*)(void))post, METH_FASTCALL,
     "post(form, src_ids, dst_ids, stream, after, order_event, values[, signal[, start]])"},
    {"board_shows", (PyCFunction)(void (*)(void))board_shows, METH_FASTCALL,
     "board_shows(map, offset, fd, generation, ids): a READ's after-check"},
    {"move_extents", (PyCFunction)(void (*)(void))move_extents, METH_FASTCALL,
     "move_extents(fd, send, extents, index, offset, budget, timeout_ms[, prefix[, halt]]): "
     "tcp's bytes"},
    {"recv_frame", (PyCFunction)(void (*)(void))recv_frame, METH_FASTCALL,
     "recv_frame(fd, limit, first_ms, rest_ms): one tcp frame's body"},
    {"sentinel_arm", (PyCFunction)sentinel_arm, METH_O,
     "sentinel_arm(map): this thread's robust futex is the board's alive word"},
    {"sentinel_disarm", (PyCFunction)sentinel_disarm, METH_NOARGS,
     "sentinel_disarm(): this thread's robust list emptied"},
    {"alive_shown", (PyCFunction)alive_shown, METH_O,
     "alive_shown(map): whether a board's alive word shows a live sentinel"},
    {"inside", (PyCFunction)(void (*)(void))inside, METH_FASTCALL,
     "inside(starts, ends, extents, out) -> index of the first extent outside, or -1"},
    {"plan_runs", (PyCFunction)(void (*)(void))plan_runs, METH_FASTCALL,
     "plan_runs(local_ids, remote_ids, local_base, remote_base, unit, local_blocks, "
     "remote_blocks, out_local, out_remote) -> extents written, or -1 (an id out of range)"},
    {"fingerprint", (PyCFunction)fingerprint, METH_O,
     "fingerprint(ids): kvlink.holdboard.fingerprint of a list of ints or an int64 array"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvlink_native",
                                    "kvlink's C helpers (kvlink.native).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kvlink_native(void) {
  PyObject *m = PyModule_Create(&module);
  if (m && (PyModule_AddFunctions(m, kvl_gate_methods) < 0 ||
            PyModule_AddFunctions(m, kvl_reader_methods) < 0 ||
            PyModule_AddFunctions(m, kvl_notes_methods) < 0 ||
            PyModule_AddFunctions(m, kvl_digest_methods) < 0))
    Py_CLEAR(m);
  return m;
}
