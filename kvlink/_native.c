/* kvlink's C helpers (kvlink.native builds and loads them; nothing here holds state but the
 * driver's four entry points, bound once).
 *
 * post: a cuda_ipc lane's post in one call: the block ids into the launch's parameter buffer,
 * the copy's stream ordered after the caller's, the kernel launched, its completion event
 * recorded. A request's host time before its launch is its latency, and on a serving host
 * that time is cold: the same steps through numpy and ctypes (two slice assignments, the
 * argument slots, a stream query, two event calls and cuLaunchKernel, each converting its
 * arguments anew) cost more; the Python side keeps every buffer written into. The driver's
 * functions are handed over as addresses (those kvlink.gpu.move's ctypes library resolved):
 * this file needs no CUDA header and builds on a machine without CUDA, where its tests give
 * it stand-ins.
 *
 * fingerprint: kvlink.holdboard.fingerprint of a block-id list, the same value as its numpy
 * form (tests/test_native_launch.py compares them): 26 us of a READ's path cold through
 * numpy and blake2b on one H200 host (bench/results/gpu_checks_launched_ids).
 *
 * board_shows: kvlink.holdboard's after-check of one READ (the producer alive, its hold
 * still shown) in one call: 25 us to bind it and 26 to make it, cold, through Python's
 * steps on that host.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shared, void *stream,
                         void **params, void **extra);
typedef int (*query_fn)(void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);

#define NOT_READY 600 /* CUDA_ERROR_NOT_READY */

static launch_fn cu_launch;
static query_fn cu_query;
static record_fn cu_record;
static wait_fn cu_wait;

static void *as_ptr(PyObject *o) { return (void *)(uintptr_t)PyLong_AsUnsignedLongLong(o); }

/* bind(cuLaunchKernel, cuStreamQuery, cuEventRecord, cuStreamWaitEvent): their addresses */
static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "bind takes the four driver functions' addresses");
    return NULL;
  }
  void *p[4];
  for (int i = 0; i < 4; ++i) {
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
  Py_RETURN_NONE;
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

/* splitmix64's finaliser (kvlink.integrity._mix, the kernels' kv_mix) */
static inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

#define FP_SEED 0x6B766C696E6B6670ULL /* "kvlinkfp" (kvlink.holdboard._FP_SEED) */

/* fingerprint(ids) -> int: sum over positions i of mix(id_i ^ mix(i ^ SEED)) (mod 2**64),
 * then mix(sum ^ n) — ids as a list of ints or a 1-D int64 buffer (write_ids' rules) */
static PyObject *fingerprint(PyObject *self, PyObject *ids) {
  Py_buffer view;
  Py_ssize_t n = count_ids(ids, &view, "fingerprint:");
  if (n < 0) return NULL;
  int list = PyList_CheckExact(ids);
  int64_t *v = list ? PyMem_Malloc((size_t)(n ? n : 1) * 8) : (int64_t *)view.buf;
  if (!v) return PyErr_NoMemory();
  if (list && write_ids(ids, v, n, "fingerprint:") < 0) {
    PyMem_Free(v);
    return NULL;
  }
  uint64_t h = 0;
  for (Py_ssize_t i = 0; i < n; ++i) h += mix64((uint64_t)v[i] ^ mix64((uint64_t)i ^ FP_SEED));
  if (list)
    PyMem_Free(v);
  else
    PyBuffer_Release(&view);
  return PyLong_FromUnsignedLongLong(mix64(h ^ (uint64_t)n));
}

/* board_shows(map, offset, fd, generation, fingerprint) -> bool: whether the producer still
 * holds its board's lock (a shared flock of ours would be refused: it is alive) and the slot
 * at `offset` of the board mapping `map` (an mmap: a closed one raises ValueError, and it
 * cannot be closed while this runs) shows (generation, fingerprint). Alive first, then the
 * generation loaded with acquire order before the fingerprint: the producer stores the
 * fingerprint first and clears the generation first (kvlink.holdboard's docstring). */
static PyObject *board_shows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "board_shows(map, offset, fd, generation, fingerprint)");
    return NULL;
  }
  Py_ssize_t off = PyLong_AsSsize_t(args[1]);
  long fd = PyLong_AsLong(args[2]);
  uint64_t gen = PyLong_AsUnsignedLongLong(args[3]);
  uint64_t fp = PyLong_AsUnsignedLongLong(args[4]);
  if (PyErr_Occurred()) return NULL;
  if (fd < 0) Py_RETURN_FALSE;
  Py_buffer view;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
  if (off < 0 || off % 8 || off + 16 > view.len) {
    PyBuffer_Release(&view);
    PyErr_Format(PyExc_ValueError, "slot offset %zd outside the board", off);
    return NULL;
  }
  int alive;
  if (flock((int)fd, LOCK_SH | LOCK_NB) == 0) {  // we got it: nobody holds it any more
    flock((int)fd, LOCK_UN);
    alive = 0;
  } else {
    alive = errno == EWOULDBLOCK || errno == EAGAIN;
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

/* post(form, src_ids, dst_ids, stream, after, order_event, done_event, values)
 *
 * src_ids, dst_ids: lists of ints or int64 arrays (write_ids).
 * form: (function, table, slots, params, grid, threads, at, n, words, which) as
 *   kvlink.gpu.lane.Lane.native_form builds it: the CUfunction; the addresses of the
 *   parameter table (int64 words), of the argument slots (int64) and of cuLaunchKernel's
 *   pointer array; the grid and block size; where the ids go in the table (source ids at
 *   `at`, destination ids after them) and how many (n); the table's size in words; and a
 *   tuple of the slot indices `values` are written to, in order.
 * stream: the copy's stream; after: the caller's stream (None: no order), waited for through
 *   order_event only where it has work pending (cuStreamQuery); done_event: recorded after
 *   the kernel. Raises RuntimeError naming the step where the driver refused one: before the
 *   launch nothing of this copy was enqueued; "recording the completion" comes after it.
 */
static PyObject *post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 8 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 10 ||
      !PyTuple_Check(args[7])) {
    PyErr_SetString(PyExc_TypeError,
                    "post(form, src_ids, dst_ids, stream, after, order_event, done_event, "
                    "values)");
    return NULL;
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
  void *stream = as_ptr(args[3]);
  void *order = as_ptr(args[5]);
  void *done = as_ptr(args[6]);
  if (PyErr_Occurred()) return NULL;
  if (!PyTuple_Check(which) || PyTuple_GET_SIZE(which) != PyTuple_GET_SIZE(args[7])) {
    PyErr_SetString(PyExc_ValueError, "values: one for each of the form's slots");
    return NULL;
  }
  if (at < 0 || n <= 0 || at + 2 * n > words) {
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
    PyObject *v = PyTuple_GET_ITEM(args[7], i);
    vals[i] = PyBool_Check(v) ? (v == Py_True) : (int64_t)PyLong_AsLongLong(v);
    if (PyErr_Occurred()) return NULL;
  }
  if (write_ids(args[1], table + at, n, "source") < 0 ||
      write_ids(args[2], table + at + n, n, "destination") < 0)
    return NULL;  // (the table's ids only: written again by the next post)
  for (Py_ssize_t i = 0; i < k; ++i) slots[idx[i]] = vals[i];
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
  if (!step && (rc = cu_launch(fn, grid, 1, 1, threads, 1, 1, 0, stream, params, NULL)))
    step = "cuLaunchKernel";
  if (!step && (rc = cu_record(done, stream)))
    step = "recording the completion (cuEventRecord), after the launch";
  if (step) {
    PyErr_Format(PyExc_RuntimeError, "%s failed with CUDA error %d", step, rc);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(launch, query, record, wait): the driver functions' addresses"},
    {"post", (PyCFunction)(void (*)(void))post, METH_FASTCALL,
     "post(form, src_ids, dst_ids, stream, after, order_event, done_event, values)"},
    {"board_shows", (PyCFunction)(void (*)(void))board_shows, METH_FASTCALL,
     "board_shows(map, offset, fd, generation, fingerprint): a READ's after-check"},
    {"fingerprint", (PyCFunction)fingerprint, METH_O,
     "fingerprint(ids): kvlink.holdboard.fingerprint of a list of ints or an int64 array"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvlink_native",
                                    "kvlink's C helpers (kvlink.native).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kvlink_native(void) { return PyModule_Create(&module); }
