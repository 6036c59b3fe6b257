/* A lane's post in one call: the block ids into the launch's parameter buffer, the copy's
 * stream ordered after the caller's, the kernel launched, its completion event recorded.
 *
 * Why C: a request's host time before its launch is its latency, and on a serving host that
 * time is cold. The same steps through numpy and ctypes (two slice assignments, the argument
 * slots, a stream query, two event calls and cuLaunchKernel, each converting its arguments
 * anew) cost ~30 us cold before the kernel starts; here they are one call of a few
 * microseconds (bench/cold_calls.py, "launch"). Built and loaded by kvlink.gpu.native, which
 * falls back to the ctypes path where no compiler is found; nothing here holds state but the
 * driver's four entry points (bind), so the Python side keeps every buffer it writes into.
 *
 * The driver's functions are handed over as addresses (those kvlink.gpu.move's ctypes
 * library resolved): this file needs no CUDA header and builds on a machine without CUDA,
 * where its tests give it stand-ins.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/* n int64 ids from a 1-D C-contiguous buffer of 8-byte signed integers (a numpy int64 array,
 * array.array('q')), or NULL with ValueError: the caller converts first (a lane's ids are
 * int64 by contract: anything else is a bug above, never truncated here) */
static int take_ids(PyObject *o, Py_buffer *view, Py_ssize_t n, const char *side) {
  if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
  const char *f = view->format ? view->format : "B";
  if (*f == '<' || *f == '=' || *f == '@') ++f;
  if (view->ndim != 1 || view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l")) ||
      view->len != n * 8) {
    PyErr_Format(PyExc_ValueError, "%s ids: expected %zd int64, got a buffer of %zd bytes "
                 "(format %s, %d dimensions)", side, n, view->len, f, view->ndim);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

/* post(form, src_ids, dst_ids, stream, after, order_event, done_event, values)
 *
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
  Py_buffer src, dst;
  if (take_ids(args[1], &src, n, "source") < 0) return NULL;
  if (take_ids(args[2], &dst, n, "destination") < 0) {
    PyBuffer_Release(&src);
    return NULL;
  }
  memcpy(table + at, src.buf, (size_t)n * 8);
  memcpy(table + at + n, dst.buf, (size_t)n * 8);
  PyBuffer_Release(&src);
  PyBuffer_Release(&dst);
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
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvlink_launch",
                                    "A lane's post in one call (kvlink.gpu.native).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kvlink_launch(void) { return PyModule_Create(&module); }
