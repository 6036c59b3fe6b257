/* The owner's side of tcp in C: the grant gate, and a serving loop that answers peers' READs
 * and takes their WRITEs and notifications without the GIL.
 *
 * Why: tcp's serving thread is a Python thread, and a thread coming back from C waits for the
 * GIL — up to a switch interval (5 ms) where the process's own Python is busy, which a
 * prefill running its forward is (for the READs it serves) and a decode running its step
 * loop is (for the pushes it takes), and for seconds where that Python gives the GIL up and
 * takes it back in a tight loop (a convoy: bench/results/tcp_busy_peers/convoy_*). A request
 * that needs nothing but the checks below is served here from its header's first byte to
 * its last byte moved (a WRITE's "ok" sent, its notification queued for the owner's caller:
 * _notes.c), and the loop goes on to the next header: the GIL is never taken. Anything else
 * (a refusal, a header in another shape) is handed to Python, which decodes it with msgspec
 * and serves or refuses it as before.
 *
 * The gate (kvlink.grants.Grants' C side) holds, under one mutex, the windows granted under
 * each ticket and, in each connection's state words (a small uint32 array the connection
 * keeps, layout below: kvlink.grants names the same words), whether it is serving and under
 * which ticket. A check and the mark that the connection is serving are one step under that
 * mutex, and so are a revoke and the cut of the connections serving its ticket: a READ or a
 * WRITE is either refused or seen by the revoke (which stops it between socket calls through
 * the halt word). The mutex is never held across a socket call or while waiting for the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include "_native.h"
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TICKET_MAX 64 /* bytes of a ticket (kvlink.grants: 16) */
#define TOO_LONG (TICKET_MAX + 1) /* a ticket's length past TICKET_MAX: never granted */

/* A connection's state words (kvlink.grants.STATE_WORDS). HALT first: it is the halt word
 * move_extents and kvl_move read between socket calls. */
enum {
  S_HALT = 0,   /* nonzero: stop before the next socket call (fenced, or its ticket revoked) */
  S_FENCED = 1, /* the connection's agent was fenced: serve nothing more */
  S_BUSY = 2,   /* serving a request, under the ticket below */
  S_TLEN = 3,   /* the ticket's length */
  S_TICKET = 4, /* the ticket's bytes */
  S_WORDS = S_TICKET + TICKET_MAX / 4
};

/* what a check answers (kvlink.grants turns them into reasons) */
enum { OK = 0, NO_GRANT = 1, OTHER_OP = 2, OUTSIDE = 3, FENCED = 4 };

typedef struct window {
  struct window *next; /* (the bucket's chain) */
  int op;              /* kvlink.transport.Op: 0 READ, 1 WRITE */
  Py_ssize_t n;        /* ranges [lo[r], hi[r]), sorted, disjoint */
  uint64_t *lo, *hi;
  size_t tlen;
  unsigned char ticket[TICKET_MAX];
} window_t;

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t quiet; /* a connection stopped serving (gate_wait) */
  window_t **bucket;
  size_t nbucket, count;
} gate_t;

static void window_free(window_t *w) {
  free(w->lo);
  free(w->hi);
  free(w);
}

static size_t hash(const unsigned char *t, size_t len) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < len; ++i) h = (h ^ t[i]) * 1099511628211ull;
  return (size_t)h;
}

/* The link that points at `t`'s window, or at the NULL ending its chain (under g->mu). */
static window_t **find(gate_t *g, const unsigned char *t, size_t len) {
  window_t **at = &g->bucket[hash(t, len) & (g->nbucket - 1)];
  while (*at && !((*at)->tlen == len && memcmp((*at)->ticket, t, len) == 0)) at = &(*at)->next;
  return at;
}

static void grow(gate_t *g) { /* (under g->mu) twice the buckets, where it can */
  size_t n = g->nbucket * 2;
  window_t **b = calloc(n, sizeof *b);
  if (!b) return; /* longer chains, still correct */
  for (size_t i = 0; i < g->nbucket; ++i) {
    for (window_t *w = g->bucket[i], *next; w; w = next) {
      next = w->next;
      window_t **head = &b[hash(w->ticket, w->tlen) & (n - 1)];
      w->next = *head;
      *head = w;
    }
  }
  free(g->bucket);
  g->bucket = b;
  g->nbucket = n;
}

/* Whether op on x[0..nx) is granted under ticket `t` (under g->mu). */
static int admits(gate_t *g, const unsigned char *t, size_t tlen, int op, const uint64_t *x,
                  Py_ssize_t nx) {
  const window_t *w = *find(g, t, tlen);
  if (!w) return NO_GRANT;
  if (w->op != op) return OTHER_OP;
  if (nx && (w->n == 0 || kvl_inside(w->lo, w->hi, w->n, x, nx, NULL) >= 0)) return OUTSIDE;
  return OK;
}

static void enter(uint32_t *s, const unsigned char *t, size_t tlen) { /* (under g->mu) */
  memcpy(&s[S_TICKET], t, tlen);
  s[S_TLEN] = (uint32_t)tlen;
  s[S_BUSY] = 1;
  s[S_HALT] = 0; /* (not fenced: enter checked) */
}

/* The gate's one check-and-mark step (gate_enter's, serve_frames'): why `op` on x[0..nx)
 * under ticket `t` may not be served by the connection `s` (NULL: only the check), or OK with
 * `s` marked serving under `t` — one step under g->mu, so a revoke sees it or the check fails.
 * Unchecked (no require_grants) only a fence refuses; a ticket too long to hold is then
 * served as none. */
static int check_in(gate_t *g, uint32_t *s, const unsigned char *t, size_t tlen, int op,
                    const uint64_t *x, Py_ssize_t nx, int check) {
  const int known = tlen != TOO_LONG;
  pthread_mutex_lock(&g->mu);
  int code = s && s[S_FENCED] ? FENCED
           : !check           ? OK
           : known            ? admits(g, t, tlen, op, x, nx)
                              : NO_GRANT;
  if (code == OK && s) enter(s, t, known ? tlen : 0);
  pthread_mutex_unlock(&g->mu);
  return code;
}

static void leave(gate_t *g, uint32_t *s) { /* (under g->mu) */
  s[S_BUSY] = 0;
  s[S_TLEN] = 0;
  pthread_cond_broadcast(&g->quiet);
}

/* A granted request's bytes moved (`send`: a READ's `prefix` and bytes; else a WRITE's
 * received), resumed after an EINTR (signal handlers run on Python's main thread), stopped
 * between socket calls by the state's halt word; then the connection leaves the gate (waiters
 * woken) — where it ran, without the GIL: the gate shows it serving only while it may still be
 * inside a socket call, never while it waits to take the GIL back (a revoke's grace would
 * otherwise cut a connection whose bytes all moved, failing the peer's next request). */
static void move_and_leave(gate_t *g, uint32_t *s, int fd, int send, const uint64_t *ext,
                           Py_ssize_t n, int timeout_ms, const char *prefix, size_t plen,
                           kvl_move_t *m) {
  *m = (kvl_move_t){0};
  do {
    kvl_move(fd, send, ext, n, LLONG_MAX, timeout_ms, prefix, plen, &s[S_HALT], NULL, m);
    plen = 0;
  } while (!m->err && !m->timed_out && !m->closed && !m->halted && m->index < n);
  pthread_mutex_lock(&g->mu);
  leave(g, s);
  pthread_mutex_unlock(&g->mu);
}

static int serving(const uint32_t *s, const unsigned char *t, size_t tlen) {
  return s[S_BUSY] && s[S_TLEN] == tlen && memcmp(&s[S_TICKET], t, tlen) == 0;
}

/* ------------------------------------------------------------------ arguments */

static void gate_destroy(PyObject *capsule) {
  gate_t *g = PyCapsule_GetPointer(capsule, "kvlink.gate");
  if (!g) return;
  for (size_t i = 0; i < g->nbucket; ++i) {
    for (window_t *w = g->bucket[i], *next; w; w = next) {
      next = w->next;
      window_free(w);
    }
  }
  free(g->bucket);
  pthread_cond_destroy(&g->quiet);
  pthread_mutex_destroy(&g->mu);
  free(g);
}

static gate_t *as_gate(PyObject *o) { return PyCapsule_GetPointer(o, "kvlink.gate"); }

/* A ticket argument, copied; one past TICKET_MAX bytes (a peer's, in a request) has length
 * TOO_LONG and no bytes: no window is ever granted under it (gate_grant refuses it). */
static int as_ticket(PyObject *o, unsigned char *t, size_t *len) {
  Py_buffer v;
  if (PyObject_GetBuffer(o, &v, PyBUF_C_CONTIGUOUS) < 0) return -1;
  *len = v.len > TICKET_MAX ? TOO_LONG : (size_t)v.len;
  if (*len != TOO_LONG) memcpy(t, v.buf, *len);
  PyBuffer_Release(&v);
  return 0;
}

/* A buffer of whole `item`-byte items (`writable` where asked), at least `min` of them. */
static int as_items(PyObject *o, Py_buffer *v, Py_ssize_t item, Py_ssize_t min, int writable,
                    const char *what) {
  if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
    return -1;
  if (v->len % item || v->len / item < min) {
    PyErr_Format(PyExc_ValueError, "%s: %zd bytes (whole %zd-byte items, at least %zd)", what,
                 v->len, item, min);
    PyBuffer_Release(v);
    return -1;
  }
  return 0;
}

static int nargs_are(Py_ssize_t nargs, Py_ssize_t want, const char *usage) {
  if (nargs == want) return 0;
  PyErr_SetString(PyExc_TypeError, usage);
  return -1;
}

/* ------------------------------------------------------------------ the gate */

/* gate_new() -> capsule: an empty gate (freed with the capsule). */
static PyObject *gate_new(PyObject *self, PyObject *unused) {
  gate_t *g = calloc(1, sizeof *g);
  if (g) g->bucket = calloc(g->nbucket = 64, sizeof *g->bucket);
  pthread_condattr_t a;
  if (!g || !g->bucket || pthread_condattr_init(&a)) {
    if (g) free(g->bucket);
    free(g);
    return PyErr_NoMemory();
  }
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&g->quiet, &a);
  pthread_condattr_destroy(&a);
  pthread_mutex_init(&g->mu, NULL);
  PyObject *capsule = PyCapsule_New(g, "kvlink.gate", gate_destroy);
  if (!capsule) {
    pthread_cond_destroy(&g->quiet);
    pthread_mutex_destroy(&g->mu);
    free(g->bucket);
    free(g);
  }
  return capsule;
}

/* gate_grant(gate, ticket, op, starts, ends): `ticket` may do `op` inside the ranges
 * [starts[r], ends[r]) (uint64, sorted, disjoint: kvlink.grants.merge), replacing what it
 * had. */
static PyObject *gate_grant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 5, "gate_grant(gate, ticket, op, starts, ends)") < 0) return NULL;
  gate_t *g = as_gate(args[0]);
  unsigned char t[TICKET_MAX];
  size_t tlen;
  int op = (int)PyLong_AsLong(args[2]);
  if (!g || as_ticket(args[1], t, &tlen) < 0 || PyErr_Occurred()) return NULL;
  if (tlen == TOO_LONG) {
    PyErr_Format(PyExc_ValueError, "ticket: more than %d bytes", TICKET_MAX);
    return NULL;
  }
  Py_buffer lo, hi;
  if (as_items(args[3], &lo, 8, 0, 0, "starts") < 0) return NULL;
  if (as_items(args[4], &hi, 8, lo.len / 8, 0, "ends") < 0) {
    PyBuffer_Release(&lo);
    return NULL;
  }
  if (hi.len != lo.len) {
    PyErr_Format(PyExc_ValueError, "%zd starts but %zd ends", lo.len / 8, hi.len / 8);
    PyBuffer_Release(&lo);
    PyBuffer_Release(&hi);
    return NULL;
  }
  window_t *w = calloc(1, sizeof *w);
  size_t bytes = (size_t)lo.len ? (size_t)lo.len : 1;
  if (w) {
    w->lo = malloc(bytes);
    w->hi = malloc(bytes);
  }
  if (!w || !w->lo || !w->hi) {
    if (w) window_free(w);
    PyBuffer_Release(&lo);
    PyBuffer_Release(&hi);
    return PyErr_NoMemory();
  }
  w->op = op;
  w->n = lo.len / 8;
  memcpy(w->lo, lo.buf, (size_t)lo.len);
  memcpy(w->hi, hi.buf, (size_t)lo.len);
  memcpy(w->ticket, t, tlen);
  w->tlen = tlen;
  PyBuffer_Release(&lo);
  PyBuffer_Release(&hi);
  window_t *old;
  pthread_mutex_lock(&g->mu);
  window_t **at = find(g, t, tlen);
  old = *at;
  w->next = old ? old->next : NULL;
  *at = w;
  if (!old && ++g->count > 2 * g->nbucket) grow(g);
  pthread_mutex_unlock(&g->mu);
  if (old) window_free(old);
  Py_RETURN_NONE;
}

/* gate_revoke(gate, ticket) -> bool: its window gone (whether it had one). */
static PyObject *gate_revoke(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 2, "gate_revoke(gate, ticket)") < 0) return NULL;
  gate_t *g = as_gate(args[0]);
  unsigned char t[TICKET_MAX];
  size_t tlen;
  if (!g || as_ticket(args[1], t, &tlen) < 0) return NULL;
  if (tlen == TOO_LONG) Py_RETURN_FALSE;
  pthread_mutex_lock(&g->mu);
  window_t **at = find(g, t, tlen), *old = *at;
  if (old) {
    *at = old->next;
    --g->count;
  }
  pthread_mutex_unlock(&g->mu);
  if (old) window_free(old);
  return PyBool_FromLong(old != NULL);
}

/* gate_len(gate) -> the windows it holds. */
static PyObject *gate_len(PyObject *self, PyObject *gate) {
  gate_t *g = as_gate(gate);
  if (!g) return NULL;
  pthread_mutex_lock(&g->mu);
  size_t n = g->count;
  pthread_mutex_unlock(&g->mu);
  return PyLong_FromSize_t(n);
}

/* gate_enter(gate, state, ticket, op, extents, check) -> code
 *
 * A connection (`state`: its S_WORDS words) starts serving `op` on `extents` under
 * `ticket`: OK, marked serving under it in the same step as the check (where `check`: else
 * only FENCED is checked); or why not (NO_GRANT, OTHER_OP, OUTSIDE, FENCED), nothing marked.
 * With a None `state`, only the check (gate_check). */
static PyObject *gate_enter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 6, "gate_enter(gate, state, ticket, op, extents, check)") < 0)
    return NULL;
  gate_t *g = as_gate(args[0]);
  unsigned char t[TICKET_MAX];
  size_t tlen;
  int op = (int)PyLong_AsLong(args[3]);
  int check = PyObject_IsTrue(args[5]);
  if (!g || as_ticket(args[2], t, &tlen) < 0 || PyErr_Occurred() || check < 0) return NULL;
  Py_buffer sv, xv;
  int have_state = args[1] != Py_None;
  if (have_state && as_items(args[1], &sv, 4, S_WORDS, 1, "state") < 0) return NULL;
  if (as_items(args[4], &xv, 16, 0, 0, "extents") < 0) {
    if (have_state) PyBuffer_Release(&sv);
    return NULL;
  }
  int code = check_in(g, have_state ? sv.buf : NULL, t, tlen, op, xv.buf, xv.len / 16, check);
  if (have_state) PyBuffer_Release(&sv);
  PyBuffer_Release(&xv);
  return PyLong_FromLong(code);
}

/* gate_leave(gate, state): the connection is no longer serving (gate_wait's waiters woken). */
static PyObject *gate_leave(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 2, "gate_leave(gate, state)") < 0) return NULL;
  gate_t *g = as_gate(args[0]);
  Py_buffer sv;
  if (!g || as_items(args[1], &sv, 4, S_WORDS, 1, "state") < 0) return NULL;
  pthread_mutex_lock(&g->mu);
  leave(g, sv.buf);
  pthread_mutex_unlock(&g->mu);
  PyBuffer_Release(&sv);
  Py_RETURN_NONE;
}

/* gate_fence(gate, state): the connection serves nothing more, and stops before its next
 * socket call. */
static PyObject *gate_fence(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 2, "gate_fence(gate, state)") < 0) return NULL;
  gate_t *g = as_gate(args[0]);
  Py_buffer sv;
  if (!g || as_items(args[1], &sv, 4, S_WORDS, 1, "state") < 0) return NULL;
  pthread_mutex_lock(&g->mu);
  uint32_t *s = sv.buf;
  s[S_FENCED] = 1;
  s[S_HALT] = 1;
  pthread_mutex_unlock(&g->mu);
  PyBuffer_Release(&sv);
  Py_RETURN_NONE;
}

/* The states of a sequence (each released by release_states). */
static Py_buffer *as_states(PyObject *seq, Py_ssize_t *n) {
  PyObject *fast = PySequence_Fast(seq, "states: a sequence of state arrays");
  if (!fast) return NULL;
  *n = PySequence_Fast_GET_SIZE(fast);
  Py_buffer *v = PyMem_Calloc((size_t)(*n ? *n : 1), sizeof *v);
  Py_ssize_t i = 0;
  if (!v) PyErr_NoMemory();
  for (; v && i < *n; ++i) {
    if (as_items(PySequence_Fast_GET_ITEM(fast, i), &v[i], 4, S_WORDS, 1, "state") < 0) break;
  }
  Py_DECREF(fast);
  if (v && i < *n) {
    while (i--) PyBuffer_Release(&v[i]);
    PyMem_Free(v);
    return NULL;
  }
  return v;
}

static void release_states(Py_buffer *v, Py_ssize_t n) {
  for (Py_ssize_t i = 0; i < n; ++i) PyBuffer_Release(&v[i]);
  PyMem_Free(v);
}

/* gate_cut(gate, ticket, states) -> [index]: those of `states` serving under `ticket`, each
 * told to stop before its next socket call. */
static PyObject *gate_cut(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 3, "gate_cut(gate, ticket, states)") < 0) return NULL;
  gate_t *g = as_gate(args[0]);
  unsigned char t[TICKET_MAX];
  size_t tlen;
  Py_ssize_t n;
  if (!g || as_ticket(args[1], t, &tlen) < 0) return NULL;
  if (tlen == TOO_LONG) return PyList_New(0);  /* (no connection serves under one) */
  Py_buffer *v = as_states(args[2], &n);
  if (!v) return NULL;
  PyObject *out = PyList_New(0);
  pthread_mutex_lock(&g->mu);
  for (Py_ssize_t i = 0; out && i < n; ++i) {
    uint32_t *s = v[i].buf;
    if (!serving(s, t, tlen)) continue;
    s[S_HALT] = 1;
    PyObject *at = PyLong_FromSsize_t(i);
    if (!at || PyList_Append(out, at) < 0) Py_CLEAR(out);
    Py_XDECREF(at);
  }
  pthread_mutex_unlock(&g->mu);
  release_states(v, n);
  return out;
}

/* gate_wait(gate, ticket, states, timeout_ms) -> bool: whether, within timeout_ms, none of
 * `states` serves under `ticket` any more (the GIL released meanwhile). */
static PyObject *gate_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 4, "gate_wait(gate, ticket, states, timeout_ms)") < 0) return NULL;
  gate_t *g = as_gate(args[0]);
  unsigned char t[TICKET_MAX];
  size_t tlen;
  Py_ssize_t n;
  long long ms = PyLong_AsLongLong(args[3]);
  if (!g || as_ticket(args[1], t, &tlen) < 0 || PyErr_Occurred()) return NULL;
  if (tlen == TOO_LONG) Py_RETURN_TRUE;  /* (no connection serves under one) */
  Py_buffer *v = as_states(args[2], &n);
  if (!v) return NULL;
  int busy = 0;
  Py_BEGIN_ALLOW_THREADS
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  ms = ms < 0 ? 0 : ms;
  until.tv_sec += (time_t)(ms / 1000);
  until.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec += 1;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&g->mu);
  for (;;) {
    busy = 0;
    for (Py_ssize_t i = 0; i < n && !busy; ++i) busy = serving(v[i].buf, t, tlen);
    if (!busy || pthread_cond_timedwait(&g->quiet, &g->mu, &until) == ETIMEDOUT) break;
  }
  if (busy) { /* (the last look, after the timeout) */
    busy = 0;
    for (Py_ssize_t i = 0; i < n && !busy; ++i) busy = serving(v[i].buf, t, tlen);
  }
  pthread_mutex_unlock(&g->mu);
  Py_END_ALLOW_THREADS
  release_states(v, n);
  return PyBool_FromLong(!busy);
}

/* gate_serving(gate, state) -> bytes | None: the ticket the connection serves under. */
static PyObject *gate_serving(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 2, "gate_serving(gate, state)") < 0) return NULL;
  gate_t *g = as_gate(args[0]);
  Py_buffer sv;
  if (!g || as_items(args[1], &sv, 4, S_WORDS, 1, "state") < 0) return NULL;
  unsigned char t[TICKET_MAX];
  size_t tlen = 0;
  pthread_mutex_lock(&g->mu);
  const uint32_t *s = sv.buf;
  int busy = s[S_BUSY] != 0;
  if (busy) {
    tlen = s[S_TLEN] <= TICKET_MAX ? s[S_TLEN] : TICKET_MAX;
    memcpy(t, &s[S_TICKET], tlen);
  }
  pthread_mutex_unlock(&g->mu);
  PyBuffer_Release(&sv);
  if (!busy) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize((const char *)t, (Py_ssize_t)tlen);
}

/* ------------------------------------------------------------------ the serving loop */

/* A msgpack str's or bin's bytes at b[*at..len): their start and length, *at past them; 0
 * where b[*at] starts neither (`bin` picks which) or they run past the end. */
static int take(const unsigned char *b, size_t len, size_t *at, int bin,
                const unsigned char **out, size_t *n) {
  if (*at >= len) return 0;
  unsigned char c = b[(*at)++];
  size_t width;
  if (!bin && c >= 0xa0 && c <= 0xbf) {
    *n = c & 0x1f;
    width = 0;
  } else if (c == (bin ? 0xc4 : 0xd9)) {
    width = 1;
  } else if (c == (bin ? 0xc5 : 0xda)) {
    width = 2;
  } else if (c == (bin ? 0xc6 : 0xdb)) {
    width = 4;
  } else {
    return 0;
  }
  if (width) {
    if (len - *at < width) return 0;
    *n = 0;
    for (size_t i = 0; i < width; ++i) *n = *n << 8 | b[(*at)++];
  }
  if (len - *at < *n) return 0;
  *out = b + *at;
  *at += *n;
  return 1;
}

/* A request header this loop serves, its fields found in the frame's bytes. */
typedef struct {
  char op; /* 'R' READ, 'W' WRITE, 'N' notification */
  const unsigned char *agent, *ext, *note, *ticket;
  size_t alen, elen, nlen, tlen;
  int noted; /* it carries a notification (note[0..nlen)) */
} request_t;

/* Whether `b` is a request header in the one shape tcp's encoder gives it (kvlink_transports.
 * tcp.wire._Hdr, array_like: [version, op, agent, extents, notify, "", b"", ticket]) that
 * this loop serves — a READ (no notification), a WRITE (a notification with its last part,
 * or none), a notification (no extents, no ticket) — with an ASCII agent (its only string
 * that is not fixed; msgspec would check other UTF-8), at most `max_extents` whole extents
 * and a ticket of at most TICKET_MAX bytes; its fields found. Anything else is Python's to
 * decode. */
static int request_header(const unsigned char *b, size_t len, int version,
                          Py_ssize_t max_extents, request_t *h) {
  size_t at = 4;
  if (len < 4 || b[0] != 0x98 || b[1] != version || b[2] != 0xa1) return 0;
  h->op = (char)b[3];
  if (h->op != 'R' && h->op != 'W' && h->op != 'N') return 0;
  if (!take(b, len, &at, 0, &h->agent, &h->alen)) return 0;
  for (size_t i = 0; i < h->alen; ++i)
    if (h->agent[i] >= 0x80) return 0;
  if (!take(b, len, &at, 1, &h->ext, &h->elen) || h->elen % 16 ||
      (Py_ssize_t)(h->elen / 16) > max_extents)
    return 0;
  if (at >= len) return 0;
  h->noted = b[at] != 0xc0; /* (nil: none) */
  if (!h->noted) {
    ++at;
  } else if (h->op == 'R' || !take(b, len, &at, 1, &h->note, &h->nlen)) {
    return 0;
  }
  if (len - at < 3 || memcmp(b + at, "\xa0\xc4\x00", 3) != 0) return 0;
  at += 3;
  if (!take(b, len, &at, 1, &h->ticket, &h->tlen) || h->tlen > TICKET_MAX || at != len)
    return 0;
  return h->op != 'N' || (h->elen == 0 && h->tlen == 0);
}

/* The notification `h` carries, if any, queued for the owner's caller; -1 out of memory. */
static int queue_note(kvl_notes_t *notes, const request_t *h) {
  return h->noted ? kvl_notes_push(notes, (const char *)h->agent, h->alen,
                                   (const char *)h->note, h->nlen)
                  : 0;
}

/* serve_frames(fd, gate, state, starts, ends, check, limit, max_extents, version, rest_ms,
 *              timeout_ms, prefix, notes) -> bytes | str | int | None
 *
 * The owner's serving thread, on one connection, without the GIL: reads each request header
 * as recv_frame does (its first byte waited for as long as it takes, the rest within
 * rest_ms), and serves every request (request_header) whose extents lie in the registered
 * host memory [starts[r], ends[r]) and (`check`) in a window the gate holds for its ticket,
 * marked serving in the gate while its bytes move (each wait up to timeout_ms; stopped
 * between socket calls by the state's halt word): a READ's `prefix` (the "ok" answer) and
 * bytes sent in one kvl_move; a WRITE's bytes received, then the "ok" sent, then its
 * notification (if any) queued in `notes` for the owner's caller; a notification queued
 * there. Without `notes` (None) WRITEs and notifications are Python's. Returns, for Python
 * to handle, the first frame it does not serve that way (bytes: anything else, a request it
 * would refuse — Python checks it again and says why — or one past the memory it was given);
 * None where the peer closed the connection; the announced length (int) of a header past
 * `limit`; a str where it stopped the connection (fenced; its grant revoked mid-transfer).
 * TimeoutError, OSError as move_extents. */
static PyObject *serve_frames(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 13, "serve_frames(fd, gate, state, starts, ends, check, limit, "
                "max_extents, version, rest_ms, timeout_ms, prefix, notes)") < 0)
    return NULL;
  int fd = (int)PyLong_AsLong(args[0]);
  gate_t *g = as_gate(args[1]);
  int check = PyObject_IsTrue(args[5]);
  long long limit = PyLong_AsLongLong(args[6]);
  Py_ssize_t max_extents = PyLong_AsSsize_t(args[7]);
  int version = (int)PyLong_AsLong(args[8]);
  int rest_ms = (int)PyLong_AsLong(args[9]), timeout_ms = (int)PyLong_AsLong(args[10]);
  kvl_notes_t *notes = args[12] == Py_None ? NULL : kvl_as_notes(args[12]);
  if (!g || check < 0 || (!notes && args[12] != Py_None) || PyErr_Occurred()) return NULL;
  Py_buffer sv, lo, hi, pv;
  if (as_items(args[2], &sv, 4, S_WORDS, 1, "state") < 0) return NULL;
  if (as_items(args[3], &lo, 8, 0, 0, "starts") < 0) goto no_lo;
  if (as_items(args[4], &hi, 8, lo.len / 8, 0, "ends") < 0) goto no_hi;
  if (hi.len != lo.len) {
    PyErr_Format(PyExc_ValueError, "%zd starts but %zd ends", lo.len / 8, hi.len / 8);
    goto no_prefix;
  }
  if (PyObject_GetBuffer(args[11], &pv, PyBUF_C_CONTIGUOUS) < 0) goto no_prefix;
  if (pv.len > PREFIX_MAX) {
    PyErr_Format(PyExc_ValueError, "prefix: %zd bytes, at most %d", pv.len, PREFIX_MAX);
    goto bad_prefix;
  }
  uint32_t *s = sv.buf;
  char *body = NULL;
  uint64_t *ext = NULL; /* a request's extents, aligned (in the header they need not be) */
  size_t cap = 0;
  uint32_t len = 0;
  int r = 0, err = 0, waited = 0, oom = 0;
  const char *stop = NULL;  /* why the connection stops (a str for Python) */
  kvl_move_t m = {0};       /* the last move; its failure ends the loop */
  Py_BEGIN_ALLOW_THREADS
  for (;;) {
    free(body);
    body = NULL;
    r = kvl_recv_frame(fd, limit, -1, rest_ms, &body, &len, &waited);
    if (r) {
      err = errno;
      break;
    }
    request_t h;
    if (!request_header((const unsigned char *)body, len, version, max_extents, &h)) break;
    if (h.op != 'R' && !notes) break; /* (Python's) */
    if (s[S_FENCED]) {
      stop = "fenced";
      break;
    }
    if (h.op == 'N') {
      if (queue_note(notes, &h) < 0) {
        oom = 1;
        break;
      }
      continue;
    }
    if (h.elen > cap) {
      uint64_t *grown = realloc(ext, h.elen);
      if (!grown) {
        oom = 1;
        break;
      }
      ext = grown;
      cap = h.elen;
    }
    memcpy(ext, h.ext, h.elen);
    const Py_ssize_t n = (Py_ssize_t)(h.elen / 16);
    const int send = h.op == 'R';
    if (kvl_inside(lo.buf, hi.buf, lo.len / 8, ext, n, NULL) >= 0) break;
    if (check_in(g, s, h.ticket, h.tlen, !send, ext, n, check) != OK) break;
    move_and_leave(g, s, fd, send, ext, n, timeout_ms, pv.buf, send ? (size_t)pv.len : 0, &m);
    if (m.err || m.timed_out || m.closed) break;
    if (m.halted) {
      stop = s[S_FENCED] ? "fenced" : "access revoked mid-transfer";
      break;
    }
    if (send) continue;
    /* a WRITE's answer before its notification: seen first, the note could let the owner
     * finish and close while the writer still waits for it (as Python serves it) */
    m = (kvl_move_t){0};
    kvl_move(fd, 1, NULL, 0, LLONG_MAX, timeout_ms, pv.buf, (size_t)pv.len, NULL, NULL, &m);
    if (m.err || m.timed_out || m.closed) break;
    if (queue_note(notes, &h) < 0) {
      oom = 1;
      break;
    }
  }
  Py_END_ALLOW_THREADS
  free(ext);
  PyObject *out = NULL;
  if (oom) {
    PyErr_NoMemory();
  } else if (stop) {
    out = PyUnicode_FromString(stop);
  } else if (kvl_move_failed(&m)) {
    out = NULL;
  } else if (m.closed) {
    out = Py_NewRef(Py_None);
  } else {  /* (a frame for Python, or why none came) */
    out = kvl_frame_result(r, err, waited, body, len);
  }
  free(body);
  PyBuffer_Release(&pv);
  PyBuffer_Release(&hi);
  PyBuffer_Release(&lo);
  PyBuffer_Release(&sv);
  return out;
bad_prefix:
  PyBuffer_Release(&pv);
no_prefix:
  PyBuffer_Release(&hi);
no_hi:
  PyBuffer_Release(&lo);
no_lo:
  PyBuffer_Release(&sv);
  return NULL;
}

/* serve_move(fd, gate, state, extents, timeout_ms, prefix) -> bool | None
 *
 * A READ the owner's Python admitted into the gate (gate_enter marked `state` serving under
 * its ticket): `prefix` (the "ok" answer) and the bytes of `extents` (checked in registered host
 * memory by the caller) sent as serve_frames sends one, then the connection leaves the gate
 * before the GIL is taken back (move_and_leave: why). True once every byte moved; False where
 * the halt word stopped it (fenced, or its grant revoked mid-transfer); None where the peer
 * closed the connection. TimeoutError, OSError as move_extents. */
static PyObject *serve_move(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs_are(nargs, 6, "serve_move(fd, gate, state, extents, timeout_ms, prefix)") < 0)
    return NULL;
  int fd = (int)PyLong_AsLong(args[0]);
  gate_t *g = as_gate(args[1]);
  int timeout_ms = (int)PyLong_AsLong(args[4]);
  if (!g || PyErr_Occurred()) return NULL;
  Py_buffer sv, xv, pv;
  if (as_items(args[2], &sv, 4, S_WORDS, 1, "state") < 0) return NULL;
  if (as_items(args[3], &xv, 16, 0, 0, "extents") < 0) goto no_ext;
  if (PyObject_GetBuffer(args[5], &pv, PyBUF_C_CONTIGUOUS) < 0) goto no_prefix;
  if (pv.len > PREFIX_MAX) {
    PyErr_Format(PyExc_ValueError, "prefix: %zd bytes, at most %d", pv.len, PREFIX_MAX);
    PyBuffer_Release(&pv);
    goto no_prefix;
  }
  kvl_move_t m;
  Py_BEGIN_ALLOW_THREADS
  move_and_leave(g, sv.buf, fd, 1, xv.buf, xv.len / 16, timeout_ms, pv.buf, (size_t)pv.len, &m);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&pv);
  PyBuffer_Release(&xv);
  PyBuffer_Release(&sv);
  if (kvl_move_failed(&m)) return NULL;
  if (m.closed) Py_RETURN_NONE;
  return PyBool_FromLong(!m.halted);
no_prefix:
  PyBuffer_Release(&xv);
no_ext:
  PyBuffer_Release(&sv);
  return NULL;
}

PyMethodDef kvl_gate_methods[] = {
    {"gate_new", (PyCFunction)gate_new, METH_NOARGS, "gate_new() -> an empty grant gate"},
    {"gate_grant", (PyCFunction)(void (*)(void))gate_grant, METH_FASTCALL,
     "gate_grant(gate, ticket, op, starts, ends)"},
    {"gate_revoke", (PyCFunction)(void (*)(void))gate_revoke, METH_FASTCALL,
     "gate_revoke(gate, ticket) -> whether it had a window"},
    {"gate_len", (PyCFunction)gate_len, METH_O, "gate_len(gate) -> windows held"},
    {"gate_enter", (PyCFunction)(void (*)(void))gate_enter, METH_FASTCALL,
     "gate_enter(gate, state, ticket, op, extents, check) -> 0 or why not"},
    {"gate_leave", (PyCFunction)(void (*)(void))gate_leave, METH_FASTCALL,
     "gate_leave(gate, state)"},
    {"gate_fence", (PyCFunction)(void (*)(void))gate_fence, METH_FASTCALL,
     "gate_fence(gate, state)"},
    {"gate_cut", (PyCFunction)(void (*)(void))gate_cut, METH_FASTCALL,
     "gate_cut(gate, ticket, states) -> indices of those serving under it, halted"},
    {"gate_wait", (PyCFunction)(void (*)(void))gate_wait, METH_FASTCALL,
     "gate_wait(gate, ticket, states, timeout_ms) -> whether none serves under it"},
    {"gate_serving", (PyCFunction)(void (*)(void))gate_serving, METH_FASTCALL,
     "gate_serving(gate, state) -> the ticket it serves under, or None"},
    {"serve_frames", (PyCFunction)(void (*)(void))serve_frames, METH_FASTCALL,
     "serve_frames(fd, gate, state, starts, ends, check, limit, max_extents, version, "
     "rest_ms, timeout_ms, prefix, notes): serve READs and WRITEs until a frame for Python"},
    {"serve_move", (PyCFunction)(void (*)(void))serve_move, METH_FASTCALL,
     "serve_move(fd, gate, state, extents, timeout_ms, prefix) -> bool | None: a READ "
     "Python admitted, sent; the gate left before the GIL is taken back"},
    {NULL, NULL, 0, NULL}};
