/* The reader's side of tcp in C: a peer's READs taken without the GIL.
 *
 * Why: a tcp peer's thread is a Python thread. A READ's header goes out on the caller's
 * thread, but the thread that takes the answer and the bytes had to wake from a Python wait
 * first, which waits for the GIL — up to a switch interval (5 ms) where the caller's own
 * Python is busy between polls, which a decode's step loop is. Here the peer's thread parks
 * in C instead (take_reads, the GIL released) on an inbox of READs the caller queued as it
 * sent their headers: each one's answer and bytes are taken straight into its extents, and
 * its landed word set for poll(), with no Python run between. The thread returns to Python
 * only for what C does not handle: an answer other than the "ok" it expects (a refusal), a
 * socket error or timeout, or the caller asking for Python (a WRITE, a notification, a READ
 * of another kind queued behind, or close) once the inbox is empty.
 *
 * The inbox copies each READ's extents (the caller's array may go before the bytes land);
 * its landed word belongs to the caller, who keeps it until the READ is retired (its count
 * of retired READs: inbox_retired). */
#define PY_SSIZE_T_CLEAN
#include "_native.h"
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  uint64_t *ext; /* (addr, len) pairs, a copy */
  Py_ssize_t n;
  uint32_t *landed; /* set to 1 once every byte is in (the caller's word) */
} job_t;

/* the inbox's mode: who takes the peer's answers */
enum { PYTHON = 0, C = 1 };

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t more; /* a job queued, or Python asked for */
  job_t *ring;
  size_t cap, head, count; /* jobs ring[head .. head + count) (mod cap), oldest first */
  uint64_t retired;        /* jobs done (landed) or dropped since the inbox was made */
  int mode;                /* C: inbox_push takes jobs; PYTHON: it refuses them */
  int python;              /* asked for Python: take_reads returns once the inbox is empty */
} inbox_t;

static void job_free(job_t *j) {
  free(j->ext);
  j->ext = NULL;
}

static void inbox_destroy(PyObject *capsule) {
  inbox_t *b = PyCapsule_GetPointer(capsule, "kvlink.inbox");
  if (!b) return;
  for (size_t i = 0; i < b->count; ++i) job_free(&b->ring[(b->head + i) % b->cap]);
  free(b->ring);
  pthread_cond_destroy(&b->more);
  pthread_mutex_destroy(&b->mu);
  free(b);
}

static inbox_t *as_inbox(PyObject *o) { return PyCapsule_GetPointer(o, "kvlink.inbox"); }

static void drop_head(inbox_t *b) { /* (under b->mu) */
  job_free(&b->ring[b->head]);
  b->head = (b->head + 1) % b->cap;
  --b->count;
  ++b->retired;
}

/* inbox_new() -> capsule: an empty inbox, in Python's mode. */
static PyObject *inbox_new(PyObject *self, PyObject *unused) {
  inbox_t *b = calloc(1, sizeof *b);
  if (b) b->ring = calloc(b->cap = 64, sizeof *b->ring);
  if (!b || !b->ring) {
    if (b) free(b->ring);
    free(b);
    return PyErr_NoMemory();
  }
  pthread_mutex_init(&b->mu, NULL);
  pthread_cond_init(&b->more, NULL);
  PyObject *capsule = PyCapsule_New(b, "kvlink.inbox", inbox_destroy);
  if (!capsule) {
    pthread_cond_destroy(&b->more);
    pthread_mutex_destroy(&b->mu);
    free(b->ring);
    free(b);
  }
  return capsule;
}

/* inbox_push(inbox, extents, landed) -> bool: a READ queued for the parked thread (its header
 * is the caller's to send, after this); False, nothing queued, where the inbox is in Python's
 * mode (the thread takes its answers in Python: queue it there). */
static PyObject *inbox_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "inbox_push(inbox, extents, landed)");
    return NULL;
  }
  inbox_t *b = as_inbox(args[0]);
  if (!b) return NULL;
  Py_buffer xv, lv;
  if (PyObject_GetBuffer(args[1], &xv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  if (xv.len % 16) {
    PyBuffer_Release(&xv);
    PyErr_Format(PyExc_ValueError, "extents: %zd bytes are not whole (addr, len) pairs",
                 xv.len);
    return NULL;
  }
  if (PyObject_GetBuffer(args[2], &lv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
    PyBuffer_Release(&xv);
    return NULL;
  }
  job_t j = {malloc(xv.len ? (size_t)xv.len : 1), xv.len / 16, lv.len >= 4 ? lv.buf : NULL};
  if (j.ext) memcpy(j.ext, xv.buf, (size_t)xv.len);
  PyBuffer_Release(&xv);
  PyBuffer_Release(&lv);
  if (!j.landed) {
    free(j.ext);
    PyErr_SetString(PyExc_ValueError, "landed: fewer than 4 bytes");
    return NULL;
  }
  if (!j.ext) return PyErr_NoMemory();
  int taken = 0, oom = 0;
  pthread_mutex_lock(&b->mu);
  if (b->mode == C && !b->python) {
    if (b->count == b->cap) { /* twice the room, in order */
      job_t *grown = malloc(2 * b->cap * sizeof *grown);
      if (grown) {
        for (size_t i = 0; i < b->count; ++i) grown[i] = b->ring[(b->head + i) % b->cap];
        free(b->ring);
        b->ring = grown;
        b->head = 0;
        b->cap *= 2;
      } else {
        oom = 1;
      }
    }
    if (!oom) {
      b->ring[(b->head + b->count++) % b->cap] = j;
      taken = 1;
      pthread_cond_signal(&b->more);
    }
  }
  pthread_mutex_unlock(&b->mu);
  if (!taken) free(j.ext);
  if (oom) return PyErr_NoMemory();
  return PyBool_FromLong(taken);
}

/* inbox_open(inbox): C's mode: inbox_push takes READs (the thread is about to park in
 * take_reads; READs pushed before it gets there wait for it). */
static PyObject *inbox_open(PyObject *self, PyObject *inbox) {
  inbox_t *b = as_inbox(inbox);
  if (!b) return NULL;
  pthread_mutex_lock(&b->mu);
  b->mode = C;
  b->python = 0;
  pthread_mutex_unlock(&b->mu);
  Py_RETURN_NONE;
}

/* inbox_python(inbox): the thread is wanted in Python: take_reads returns once it has taken
 * every READ queued before this (their answers come first), and the inbox takes no more. */
static PyObject *inbox_python(PyObject *self, PyObject *inbox) {
  inbox_t *b = as_inbox(inbox);
  if (!b) return NULL;
  pthread_mutex_lock(&b->mu);
  b->python = 1;
  pthread_cond_signal(&b->more);
  pthread_mutex_unlock(&b->mu);
  Py_RETURN_NONE;
}

/* inbox_state(inbox) -> (queued, retired): READs still queued (the oldest first is being
 * taken), and READs retired since the inbox was made. */
static PyObject *inbox_state(PyObject *self, PyObject *inbox) {
  inbox_t *b = as_inbox(inbox);
  if (!b) return NULL;
  pthread_mutex_lock(&b->mu);
  size_t count = b->count;
  unsigned long long retired = b->retired;
  pthread_mutex_unlock(&b->mu);
  return Py_BuildValue("(nK)", (Py_ssize_t)count, retired);
}

/* inbox_drop(inbox, all) -> int: the oldest queued READ retired unlanded (all: every one;
 * Python failed them); how many. */
static PyObject *inbox_drop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "inbox_drop(inbox, all)");
    return NULL;
  }
  inbox_t *b = as_inbox(args[0]);
  int all = PyObject_IsTrue(args[1]);
  if (!b || all < 0) return NULL;
  Py_ssize_t n = 0;
  pthread_mutex_lock(&b->mu);
  while (b->count && (all || !n)) {
    drop_head(b);
    ++n;
  }
  pthread_mutex_unlock(&b->mu);
  return PyLong_FromSsize_t(n);
}

/* take_reads(fd, inbox, prefix, timeout_ms) -> None | str | bytes
 *
 * The peer's thread, parked with the GIL released (inbox_open first): each READ queued in
 * the inbox is taken as it comes — its answer expected as `prefix` (the "ok"), then its
 * bytes straight into its extents (kvl_move, each wait up to timeout_ms), its landed word set
 * and the READ retired — until Python is asked for (inbox_python) with nothing queued: None,
 * the inbox back in Python's mode. Else, the READ being taken stays the oldest queued: bytes,
 * the answer's first bytes where they were not `prefix` (the caller reads on and retires it
 * with inbox_drop); "closed" where the peer closed the connection; TimeoutError, OSError as
 * move_extents (the inbox in Python's mode in every case). */
static PyObject *take_reads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "take_reads(fd, inbox, prefix, timeout_ms)");
    return NULL;
  }
  int fd = (int)PyLong_AsLong(args[0]);
  inbox_t *b = as_inbox(args[1]);
  int timeout_ms = (int)PyLong_AsLong(args[3]);
  if (!b || PyErr_Occurred()) return NULL;
  Py_buffer pv;
  if (PyObject_GetBuffer(args[2], &pv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  if (pv.len > PREFIX_MAX) {
    PyBuffer_Release(&pv);
    PyErr_Format(PyExc_ValueError, "prefix: %zd bytes, at most %d", pv.len, PREFIX_MAX);
    return NULL;
  }
  const Py_ssize_t plen0 = pv.len;
  kvl_move_t m = {0};
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&b->mu);
  for (;;) {
    while (!b->count && !b->python) pthread_cond_wait(&b->more, &b->mu);
    if (!b->count) break; /* Python asked for, nothing queued */
    job_t j = b->ring[b->head]; /* (stays queued while taken: the oldest) */
    pthread_mutex_unlock(&b->mu);
    m = (kvl_move_t){0};
    size_t plen = (size_t)pv.len;
    do { /* (again after an EINTR: signal handlers run on Python's main thread) */
      kvl_move(fd, 0, j.ext, j.n, LLONG_MAX, timeout_ms, pv.buf, plen, NULL, j.landed, &m);
      plen = 0;
    } while (!m.err && !m.timed_out && !m.closed && !m.differs && m.index < j.n);
    pthread_mutex_lock(&b->mu);
    if (m.err || m.timed_out || m.closed || m.differs) break;
    drop_head(b); /* (landed: kvl_move set its word) */
  }
  b->mode = PYTHON;
  b->python = 0;
  pthread_mutex_unlock(&b->mu);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&pv);
  if (kvl_move_failed(&m)) return NULL;
  if (m.closed) return PyUnicode_FromString("closed");
  if (m.differs) return PyBytes_FromStringAndSize(m.head, plen0);
  Py_RETURN_NONE;
}

PyMethodDef kvl_reader_methods[] = {
    {"inbox_new", (PyCFunction)inbox_new, METH_NOARGS, "inbox_new() -> an empty READ inbox"},
    {"inbox_push", (PyCFunction)(void (*)(void))inbox_push, METH_FASTCALL,
     "inbox_push(inbox, extents, landed) -> whether the parked thread takes it"},
    {"inbox_open", (PyCFunction)inbox_open, METH_O,
     "inbox_open(inbox): inbox_push takes READs from now on"},
    {"inbox_python", (PyCFunction)inbox_python, METH_O,
     "inbox_python(inbox): take_reads returns once the inbox is empty"},
    {"inbox_state", (PyCFunction)inbox_state, METH_O,
     "inbox_state(inbox) -> (queued, retired)"},
    {"inbox_drop", (PyCFunction)(void (*)(void))inbox_drop, METH_FASTCALL,
     "inbox_drop(inbox, all) -> READs retired unlanded"},
    {"take_reads", (PyCFunction)(void (*)(void))take_reads, METH_FASTCALL,
     "take_reads(fd, inbox, prefix, timeout_ms): the peer's READs taken in C"},
    {NULL, NULL, 0, NULL}};
