/* The owner's notifications, queued in C: what peers notified, in the order they arrived.
 *
 * Why: the owner's serving loop (serve_frames, _gate.c) serves a WRITE and a notification
 * without the GIL, and a notification is what tells the owner's caller a push ended. Were it
 * handed to Python on the serving thread, it would wait there for the GIL — up to a switch
 * interval where the caller's Python is busy (a decode's step loop), the very caller that
 * waits for it. Here the serving loop queues it under a mutex, and the caller's own
 * notifications() takes it (notes_take). Python's serving path (what C leaves to it) queues
 * here too, so one connection's notifications keep their order whichever side took them.
 *
 * Bounded: a caller that never takes them (a prefill: nothing notifies it in a pull) and a
 * peer that sends them anyway (it holds the memory key: a buggy or hostile decode) must not
 * grow the owner's memory without end. Past NOTES_MAX notes or NOTES_MAX_BYTES bytes queued,
 * a new one is dropped and counted (notes_dropped), the queue left as it was. */
#define PY_SSIZE_T_CLEAN
#include "_native.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct note {
  struct note *next;
  size_t alen, nlen;
  char bytes[]; /* the agent (UTF-8), then the notification */
} note_t;

#define NOTES_MAX 65536
#define NOTES_MAX_BYTES ((size_t)64 << 20)

struct kvl_notes {
  pthread_mutex_t mu;
  note_t *head, *tail; /* oldest first */
  size_t count, bytes; /* queued */
  unsigned long long dropped; /* refused, the queue full */
};

static void notes_destroy(PyObject *capsule) {
  kvl_notes_t *q = PyCapsule_GetPointer(capsule, "kvlink.notes");
  if (!q) return;
  for (note_t *n = q->head, *next; n; n = next) {
    next = n->next;
    free(n);
  }
  pthread_mutex_destroy(&q->mu);
  free(q);
}

KVL_HIDDEN kvl_notes_t *kvl_as_notes(PyObject *o) {
  return PyCapsule_GetPointer(o, "kvlink.notes");
}

KVL_HIDDEN int kvl_notes_push(kvl_notes_t *q, const char *agent, size_t alen, const char *note,
                              size_t nlen) {
  const size_t size = sizeof(note_t) + alen + nlen;
  pthread_mutex_lock(&q->mu);
  const int full = q->count >= NOTES_MAX || q->bytes + size > NOTES_MAX_BYTES;
  if (full) ++q->dropped;
  pthread_mutex_unlock(&q->mu);
  if (full) return 1; /* (dropped: the queue is as it was) */
  note_t *n = malloc(size);
  if (!n) return -1;
  n->next = NULL;
  n->alen = alen;
  n->nlen = nlen;
  memcpy(n->bytes, agent, alen);
  memcpy(n->bytes + alen, note, nlen);
  pthread_mutex_lock(&q->mu);
  if (q->tail) {
    q->tail->next = n;
  } else {
    q->head = n;
  }
  q->tail = n;
  ++q->count;
  q->bytes += size;
  pthread_mutex_unlock(&q->mu);
  return 0;
}

/* notes_new() -> capsule: an empty queue. */
static PyObject *notes_new(PyObject *self, PyObject *unused) {
  kvl_notes_t *q = calloc(1, sizeof *q);
  if (!q) return PyErr_NoMemory();
  pthread_mutex_init(&q->mu, NULL);
  PyObject *capsule = PyCapsule_New(q, "kvlink.notes", notes_destroy);
  if (!capsule) {
    pthread_mutex_destroy(&q->mu);
    free(q);
  }
  return capsule;
}

/* notes_push(notes, agent, note): queued after every one before it. */
static PyObject *notes_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "notes_push(notes, agent, note)");
    return NULL;
  }
  kvl_notes_t *q = kvl_as_notes(args[0]);
  Py_ssize_t alen;
  const char *agent = q ? PyUnicode_AsUTF8AndSize(args[1], &alen) : NULL;
  if (!agent) return NULL;
  Py_buffer nv;
  if (PyObject_GetBuffer(args[2], &nv, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  int r = kvl_notes_push(q, agent, (size_t)alen, nv.buf, (size_t)nv.len);
  PyBuffer_Release(&nv);
  if (r < 0) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

/* notes_take(notes) -> [(agent, note)]: every queued one, oldest first; the queue empty. */
static PyObject *notes_take(PyObject *self, PyObject *notes) {
  kvl_notes_t *q = kvl_as_notes(notes);
  if (!q) return NULL;
  pthread_mutex_lock(&q->mu);
  note_t *n = q->head;
  q->head = q->tail = NULL;
  q->count = q->bytes = 0;
  pthread_mutex_unlock(&q->mu);
  PyObject *out = PyList_New(0);
  for (note_t *next; n; n = next) {
    next = n->next;
    PyObject *item = out ? Py_BuildValue("(s#y#)", n->bytes, (Py_ssize_t)n->alen,
                                         n->bytes + n->alen, (Py_ssize_t)n->nlen)
                         : NULL;
    if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
    Py_XDECREF(item);
    free(n);
  }
  return out;
}

/* notes_dropped(notes) -> int: notifications refused so far, the queue full. */
static PyObject *notes_dropped(PyObject *self, PyObject *notes) {
  kvl_notes_t *q = kvl_as_notes(notes);
  if (!q) return NULL;
  pthread_mutex_lock(&q->mu);
  const unsigned long long dropped = q->dropped;
  pthread_mutex_unlock(&q->mu);
  return PyLong_FromUnsignedLongLong(dropped);
}

PyMethodDef kvl_notes_methods[] = {
    {"notes_new", (PyCFunction)notes_new, METH_NOARGS, "notes_new() -> an empty queue"},
    {"notes_push", (PyCFunction)(void (*)(void))notes_push, METH_FASTCALL,
     "notes_push(notes, agent, note): queued last"},
    {"notes_take", (PyCFunction)notes_take, METH_O,
     "notes_take(notes) -> [(agent, note)], oldest first"},
    {"notes_dropped", (PyCFunction)notes_dropped, METH_O,
     "notes_dropped(notes) -> notifications refused so far, the queue full"},
    {NULL, NULL, 0, NULL}};
