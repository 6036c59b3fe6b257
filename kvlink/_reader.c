/* The initiator's side of tcp in C: a peer's READs and WRITEs run without the GIL.
 *
 * Why: a tcp peer's thread is a Python thread. A READ's header goes out on the caller's
 * thread, but the thread that takes the answer and the bytes had to wake from a Python wait
 * first, which waits for the GIL — up to a switch interval (5 ms) where the caller's own
 * Python is busy between polls, which a decode's step loop is. Here the peer's thread parks
 * in C instead (run_inbox, the GIL released) on an inbox of jobs the caller queued: each
 * READ's answer and bytes are taken straight into its extents, each WRITE's header and bytes
 * sent from them and its answer taken, and the job's landed word set for poll(), with no
 * Python run between. The thread returns to Python only for what C does not handle: an
 * answer other than the "ok" it expects (a refusal), a socket error or timeout, or the caller
 * asking for Python (a notification, a transfer of another kind queued behind, or close)
 * once the inbox is empty.
 *
 * Who sends a job's header: a READ's goes out on the caller's thread, inside inbox_push,
 * while no job ahead of it still has a header to send and no other caller is sending one —
 * its answer then comes as soon as the owner has it, and READs posted one after another are
 * all on the wire at once. That send never blocks: the caller sends what the connection
 * takes at once (all of it, but where the owner has stopped reading: a hung host, a paused
 * process, or its buffers full of earlier headers) and hands the rest to this thread, which
 * waits for either the owner's answer or that hand-over before it reads. A WRITE's header
 * and bytes are sent here, in turn (the caller's thread is not held for a payload), and so is
 * every header queued behind one that is unsent: two senders never interleave on the socket.
 * Each job is sent only once every answer before it was taken, so this thread never writes a
 * payload while the owner waits to write an answer to it.
 *
 * The inbox copies each job's extents and header (the caller's may go before the bytes
 * move); its landed word belongs to the caller, who keeps it until the job is retired (its
 * count of retired jobs: inbox_state). */
#define PY_SSIZE_T_CLEAN
#include "_native.h"
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

typedef struct {
  uint64_t *ext; /* (addr, len) pairs, a copy */
  Py_ssize_t n;
  uint32_t *landed; /* set to 1 once every byte moved and was answered (the caller's word) */
  char *hdr;        /* the framed header this thread sends (a copy), or NULL: sent already */
  size_t hlen;
  int write;        /* a WRITE: its bytes follow its header, its answer follows them */
  uint64_t *flag;   /* a WRITE's landing signal (kvlink.landing), or NULL: this word */
  uint64_t expect, value; /* moved from expect to value once it is answered, before landed */
} job_t;

/* the inbox's mode: who takes the peer's answers */
enum { PYTHON = 0, C = 1 };

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t more; /* a job queued, or Python asked for */
  job_t *ring;
  size_t cap, head, count; /* jobs ring[head .. head + count) (mod cap), oldest first */
  size_t unsent;           /* jobs queued whose header this thread is still to send */
  uint64_t retired;        /* jobs done (landed) or dropped since the inbox was made */
  int mode;                /* C: inbox_push takes jobs; PYTHON: it refuses them */
  int python;              /* asked for Python: run_inbox returns once the inbox is empty */
  int sending;             /* a caller is inside its send of job `sending_seq`'s header */
  uint64_t sending_seq;    /* (jobs are numbered from 0 as pushed: retired + index) */
  int wake[2];             /* a pipe: a caller's send returned (what run_inbox polls beside
                              the socket while the job it runs is that send's) */
} inbox_t;

static void job_free(job_t *j) {
  free(j->ext);
  free(j->hdr);
  j->ext = NULL;
  j->hdr = NULL;
}

static void inbox_destroy(PyObject *capsule) {
  inbox_t *b = PyCapsule_GetPointer(capsule, "kvlink.inbox");
  if (!b) return;
  for (size_t i = 0; i < b->count; ++i) job_free(&b->ring[(b->head + i) % b->cap]);
  free(b->ring);
  close(b->wake[0]);
  close(b->wake[1]);
  pthread_cond_destroy(&b->more);
  pthread_mutex_destroy(&b->mu);
  free(b);
}

static inbox_t *as_inbox(PyObject *o) { return PyCapsule_GetPointer(o, "kvlink.inbox"); }

static void drop_head(inbox_t *b) { /* (under b->mu) */
  if (b->ring[b->head].hdr) --b->unsent;
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
  if (pipe(b->wake) < 0) {
    free(b->ring);
    free(b);
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  for (int i = 0; i < 2; ++i) /* (a wake-up never blocks its caller; the reader drains) */
    fcntl(b->wake[i], F_SETFL, fcntl(b->wake[i], F_GETFL) | O_NONBLOCK);
  pthread_mutex_init(&b->mu, NULL);
  pthread_cond_init(&b->more, NULL);
  PyObject *capsule = PyCapsule_New(b, "kvlink.inbox", inbox_destroy);
  if (!capsule) {
    close(b->wake[0]);
    close(b->wake[1]);
    pthread_cond_destroy(&b->more);
    pthread_mutex_destroy(&b->mu);
    free(b->ring);
    free(b);
  }
  return capsule;
}

/* The caller's send of job `seq`'s header (inbox_push, the job queued): what the socket
 * takes without waiting; the rest, if any, becomes the job's header for the thread to send.
 * A caller is never held by an owner that stopped reading. */
static void caller_send(inbox_t *b, int fd, const char *hdr, size_t len, uint64_t seq) {
  size_t off = 0;
  Py_BEGIN_ALLOW_THREADS
  while (off < len) {
    ssize_t r = send(fd, hdr + off, len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0)
      off += (size_t)r;
    else if (r < 0 && errno == EINTR)
      continue;
    else
      break; /* full, or broken: the thread's send of the rest says which */
  }
  pthread_mutex_lock(&b->mu);
  if (off < len && seq - b->retired < b->count) { /* (still queued) */
    job_t *j = &b->ring[(b->head + (seq - b->retired)) % b->cap];
    j->hdr = malloc(len - off);
    if (j->hdr) {
      memcpy(j->hdr, hdr + off, len - off);
      j->hlen = len - off;
      ++b->unsent;
    } else {
      shutdown(fd, SHUT_RDWR); /* no room for the rest: the connection cannot go on */
    }
  }
  b->sending = 0;
  pthread_cond_broadcast(&b->more);
  pthread_mutex_unlock(&b->mu);
  (void)!write(b->wake[1], "", 1);
  Py_END_ALLOW_THREADS
}

/* inbox_push(inbox, extents, landed, header, write, signal, fd) -> int: a job queued for the
 * parked thread. `header`: the job's framed request (bytes); `write`: a WRITE (its bytes are
 * sent from `extents` after the header) or a READ (taken into them); `signal`: None, or a
 * WRITE's landing signal (address, expect, value): the 8-byte word at `address` (a landing
 * board's flag, mapped until the transport's threads have ended) compare-and-set from
 * `expect` to `value` once the owner said "ok", before the landed word; `fd`: the peer's
 * socket (the one the thread is parked on). 0: nothing queued, the inbox is in Python's mode
 * (the thread runs its jobs in Python: queue it there); 1: queued, and its header sent here,
 * on the caller's thread (a READ with no unsent header ahead and no other caller sending:
 * what the socket took at once, the rest handed to the thread); 2: queued, the thread sends
 * the header. */
static PyObject *inbox_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "inbox_push(inbox, extents, landed, header, write, signal, fd)");
    return NULL;
  }
  inbox_t *b = as_inbox(args[0]);
  int write = PyObject_IsTrue(args[4]);
  int fd = (int)PyLong_AsLong(args[6]);
  if (!b || write < 0 || PyErr_Occurred()) return NULL;
  unsigned long long flag = 0, expect = 0, value = 0;
  if (args[5] != Py_None &&
      !PyArg_ParseTuple(args[5], "KKK;signal: (address, expect, value)", &flag, &expect,
                        &value))
    return NULL;
  if (args[5] != Py_None && (!write || !flag || flag % 8)) {
    PyErr_SetString(PyExc_ValueError, "signal: a WRITE's, at an aligned nonzero address");
    return NULL;
  }
  Py_buffer xv, lv, hv;
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
  if (PyObject_GetBuffer(args[3], &hv, PyBUF_C_CONTIGUOUS) < 0) {
    PyBuffer_Release(&xv);
    PyBuffer_Release(&lv);
    return NULL;
  }
  /* (the header is copied only where this thread is to send it: under the lock, below) */
  job_t j = {malloc(xv.len ? (size_t)xv.len : 1), xv.len / 16, lv.len >= 4 ? lv.buf : NULL,
             NULL, (size_t)hv.len, write, (uint64_t *)(uintptr_t)flag, expect, value};
  if (j.ext) memcpy(j.ext, xv.buf, (size_t)xv.len);
  PyBuffer_Release(&xv);
  PyBuffer_Release(&lv);
  if (!j.landed || !j.hlen || !j.ext) {
    PyBuffer_Release(&hv);
    job_free(&j);
    if (!j.landed || !j.hlen) {
      PyErr_SetString(PyExc_ValueError, !j.landed ? "landed: fewer than 4 bytes"
                                                  : "header: empty");
      return NULL;
    }
    return PyErr_NoMemory();
  }
  int taken = 0, oom = 0;
  uint64_t seq = 0;
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
    if (!oom && (write || b->unsent || b->sending)) { /* ours to send, in turn: a copy */
      j.hdr = malloc(j.hlen);
      if (j.hdr)
        memcpy(j.hdr, hv.buf, j.hlen);
      else
        oom = 1;
    }
    if (!oom) { /* (else the caller sends it: nothing can be sent before it) */
      taken = j.hdr ? 2 : 1;
      if (j.hdr) {
        ++b->unsent;
      } else { /* the caller's, below: the thread sends no header until that send returned */
        b->sending = 1;
        b->sending_seq = seq = b->retired + b->count;
      }
      b->ring[(b->head + b->count++) % b->cap] = j;
      pthread_cond_signal(&b->more); /* (before the send: the thread waits for its answer) */
    }
  }
  pthread_mutex_unlock(&b->mu);
  if (taken == 1) caller_send(b, fd, hv.buf, (size_t)hv.len, seq);
  PyBuffer_Release(&hv);
  if (!taken) job_free(&j);
  if (oom) return PyErr_NoMemory();
  return PyLong_FromLong(taken);
}

/* inbox_open(inbox): C's mode: inbox_push takes jobs (the thread is about to park in
 * run_inbox; jobs pushed before it gets there wait for it). */
static PyObject *inbox_open(PyObject *self, PyObject *inbox) {
  inbox_t *b = as_inbox(inbox);
  if (!b) return NULL;
  pthread_mutex_lock(&b->mu);
  b->mode = C;
  b->python = 0;
  pthread_mutex_unlock(&b->mu);
  Py_RETURN_NONE;
}

/* inbox_python(inbox): the thread is wanted in Python: run_inbox returns once it has run
 * every job queued before this (their answers come first), and the inbox takes no more. */
static PyObject *inbox_python(PyObject *self, PyObject *inbox) {
  inbox_t *b = as_inbox(inbox);
  if (!b) return NULL;
  pthread_mutex_lock(&b->mu);
  b->python = 1;
  pthread_cond_signal(&b->more);
  pthread_mutex_unlock(&b->mu);
  Py_RETURN_NONE;
}

/* inbox_state(inbox) -> (queued, retired): jobs still queued (the oldest first is being
 * run), and jobs retired since the inbox was made. */
static PyObject *inbox_state(PyObject *self, PyObject *inbox) {
  inbox_t *b = as_inbox(inbox);
  if (!b) return NULL;
  pthread_mutex_lock(&b->mu);
  size_t count = b->count;
  unsigned long long retired = b->retired;
  pthread_mutex_unlock(&b->mu);
  return Py_BuildValue("(nK)", (Py_ssize_t)count, retired);
}

/* inbox_drop(inbox, all) -> int: the oldest queued job retired unlanded (all: every one;
 * Python failed them or queued them again); how many. */
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

/* Whether `m` stopped short of its extents' end: a socket error, a timeout, a close, or an
 * answer other than the prefix (an EINTR returns with none of them: moved on from there). */
static int stopped(const kvl_move_t *m) {
  return m->err || m->timed_out || m->closed || m->differs;
}

/* (under b->mu; returns under it) The oldest job's header is being sent by its caller: wait
 * until that send returned (the rest, if any, is then this thread's to send) or the owner's
 * answer is there to read (it answers once the whole header is in). */
static void await_caller(inbox_t *b, int fd, int timeout_ms, kvl_move_t *m) {
  *m = (kvl_move_t){0};
  while (b->sending && b->sending_seq == b->retired) {
    pthread_mutex_unlock(&b->mu);
    struct pollfd p[2] = {{fd, POLLIN, 0}, {b->wake[0], POLLIN, 0}};
    int r = poll(p, 2, timeout_ms), e = errno;
    char drained[64];
    while (read(b->wake[0], drained, sizeof drained) > 0) {
    }
    pthread_mutex_lock(&b->mu);
    if (r == 0) m->timed_out = 1;
    if (r < 0 && e != EINTR) m->err = e;
    if (r == 0 || m->err || p[0].revents) return;
  }
}

/* Every byte of ext[0..n) moved (send: to fd; else from it, after `prefix`), EINTR moved
 * past (signal handlers run on Python's main thread), `done` set at the end. */
static void move_whole(int fd, int send, const uint64_t *ext, Py_ssize_t n, int timeout_ms,
                       const char *prefix, size_t plen, uint32_t *done, kvl_move_t *m) {
  *m = (kvl_move_t){0};
  do {
    kvl_move(fd, send, ext, n, LLONG_MAX, timeout_ms, prefix, plen, NULL, done, m);
    plen = 0;
  } while (!stopped(m) && m->index < n);
}

/* run_inbox(fd, inbox, prefix, timeout_ms) -> None | str | bytes
 *
 * The peer's thread, parked with the GIL released (inbox_open first): each job queued in the
 * inbox is run as it comes — its header sent where it is this thread's to send (and a
 * WRITE's bytes after it, from its extents), its answer expected as `prefix` (the "ok"),
 * a READ's bytes taken straight into its extents, its landed word set and the job retired —
 * until Python is asked for (inbox_python) with nothing queued: None, the inbox back in
 * Python's mode. Else, the job being run stays the oldest queued: bytes, the answer's first
 * bytes where they were not `prefix` (the caller reads on and retires it with inbox_drop);
 * "closed" where the peer closed the connection; TimeoutError, OSError as move_extents (a
 * WRITE's send cut short by an owner that refused it and closed: the caller may still read
 * its answer); the inbox in Python's mode in every case. */
static PyObject *run_inbox(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "run_inbox(fd, inbox, prefix, timeout_ms)");
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
  const Py_ssize_t plen = pv.len;
  kvl_move_t m = {0};
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&b->mu);
  for (;;) {
    while (!b->count && !b->python) pthread_cond_wait(&b->more, &b->mu);
    if (!b->count) break; /* Python asked for, nothing queued */
    await_caller(b, fd, timeout_ms, &m);
    if (stopped(&m)) break;
    job_t j = b->ring[b->head]; /* (stays queued while run: the oldest) */
    pthread_mutex_unlock(&b->mu);
    if (j.hdr) { /* ours to send: every answer before it is in */
      const uint64_t hx[2] = {(uint64_t)(uintptr_t)j.hdr, j.hlen};
      move_whole(fd, 1, hx, 1, timeout_ms, NULL, 0, NULL, &m);
      if (!stopped(&m) && j.write) move_whole(fd, 1, j.ext, j.n, timeout_ms, NULL, 0, NULL, &m);
      pthread_mutex_lock(&b->mu);
      if (stopped(&m)) break;
      free(b->ring[b->head].hdr); /* sent: a READ pushed from now on may be sent by its caller */
      b->ring[b->head].hdr = NULL;
      --b->unsent;
      pthread_mutex_unlock(&b->mu);
    }
    if (j.write) { /* its answer alone; then its signal (one writer per flag: in order) */
      move_whole(fd, 0, NULL, 0, timeout_ms, pv.buf, (size_t)plen, NULL, &m);
      if (!stopped(&m)) {
        uint64_t want = j.expect;
        if (j.flag)
          __atomic_compare_exchange_n(j.flag, &want, j.value, 0, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE);
        __atomic_store_n(j.landed, 1u, __ATOMIC_RELEASE);
      }
    } else
      move_whole(fd, 0, j.ext, j.n, timeout_ms, pv.buf, (size_t)plen, j.landed, &m);
    pthread_mutex_lock(&b->mu);
    if (stopped(&m)) break;
    drop_head(b); /* (landed: kvl_move set its word) */
  }
  b->mode = PYTHON;
  b->python = 0;
  while (b->sending) pthread_cond_wait(&b->more, &b->mu); /* (its socket is Python's now) */
  pthread_mutex_unlock(&b->mu);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&pv);
  if (kvl_move_failed(&m)) return NULL;
  if (m.closed) return PyUnicode_FromString("closed");
  if (m.differs) return PyBytes_FromStringAndSize(m.head, plen);
  Py_RETURN_NONE;
}

PyMethodDef kvl_reader_methods[] = {
    {"inbox_new", (PyCFunction)inbox_new, METH_NOARGS, "inbox_new() -> an empty READ inbox"},
    {"inbox_push", (PyCFunction)(void (*)(void))inbox_push, METH_FASTCALL,
     "inbox_push(inbox, extents, landed, header, write, signal, fd) -> 0, 1 sent here, 2"},
    {"inbox_open", (PyCFunction)inbox_open, METH_O,
     "inbox_open(inbox): inbox_push takes jobs from now on"},
    {"inbox_python", (PyCFunction)inbox_python, METH_O,
     "inbox_python(inbox): run_inbox returns once the inbox is empty"},
    {"inbox_state", (PyCFunction)inbox_state, METH_O,
     "inbox_state(inbox) -> (queued, retired)"},
    {"inbox_drop", (PyCFunction)(void (*)(void))inbox_drop, METH_FASTCALL,
     "inbox_drop(inbox, all) -> jobs retired unlanded"},
    {"run_inbox", (PyCFunction)(void (*)(void))run_inbox, METH_FASTCALL,
     "run_inbox(fd, inbox, prefix, timeout_ms): the peer's READs and WRITEs run in C"},
    {NULL, NULL, 0, NULL}};
