/* What kvlink's C sources share (kvlink.native compiles them into one module): the socket
 * steps of tcp's byte mover, used by move_extents/recv_frame (_native.c), by the owner's
 * serving loop (_gate.c) and by the reader's (_reader.c). Every function here runs without
 * the GIL. */
#ifndef KVLINK_NATIVE_H
#define KVLINK_NATIVE_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define KVL_HIDDEN __attribute__((visibility("hidden")))
#define PREFIX_MAX 256 /* bytes of a prefix (a tcp answer's frame: tens) */

/* Where a move stopped, and why. */
typedef struct {
  Py_ssize_t index;  /* in/out: the extent, and the byte of it, to move next */
  uint64_t offset;
  int err;           /* errno of a socket error */
  int closed;        /* the peer closed the connection (a read of 0 bytes) */
  int timed_out;     /* a wait passed timeout_ms */
  int halted;        /* `halt` showed nonzero before a socket call */
  int differs;       /* receiving: the bytes before the extents were not the prefix */
  char head[PREFIX_MAX]; /* (what came instead of the prefix) */
} kvl_move_t;

/* Move the bytes of `ext` (n (addr, len) uint64 pairs, checked by the caller) from
 * m->index/m->offset through `fd`: see move_extents in _native.c. */
KVL_HIDDEN void kvl_move(int fd, int send, const uint64_t *ext, Py_ssize_t n,
                         long long budget, int timeout_ms, const char *prefix, size_t plen,
                         const volatile uint32_t *halt, uint32_t *done, kvl_move_t *m);

/* One frame (a 4-byte little-endian length, then its body) into a malloc'd buffer: see
 * recv_frame in _native.c. Returns 0 (`*body`, `*len` set: free it), 1 timed out (`*waited`:
 * before its first byte), 2 closed, -1 an error (errno), 3 announced past `limit` (`*len`). */
KVL_HIDDEN int kvl_recv_frame(int fd, long long limit, int first_ms, int rest_ms, char **body,
                              uint32_t *len, int *waited);

/* kvl_recv_frame's answer `r` (its errno `err`) as Python's: the body (bytes), None where the
 * peer closed, the announced length (int) past the limit, or NULL with TimeoutError or
 * OSError set. Needs the GIL. */
KVL_HIDDEN PyObject *kvl_frame_result(int r, int err, int waited, const char *body,
                                      uint32_t len);

/* Whether `m` failed on the socket (an error, a timeout): then OSError or TimeoutError is
 * set. Needs the GIL. */
KVL_HIDDEN int kvl_move_failed(const kvl_move_t *m);

/* The first extent of x[0..nx) that lies in no range [lo[r], hi[r]) (sorted, disjoint), or
 * -1; each extent's range into out[i] where `out` is not NULL. */
KVL_HIDDEN Py_ssize_t kvl_inside(const uint64_t *lo, const uint64_t *hi, Py_ssize_t nr,
                                 const uint64_t *x, Py_ssize_t nx, Py_ssize_t *out);

/* The owner's queue of notifications (_notes.c): the serving loop pushes what a peer
 * notified (agent and notification, copied; -1 out of memory, 1 dropped: the queue is full),
 * the caller takes them. */
typedef struct kvl_notes kvl_notes_t;
KVL_HIDDEN kvl_notes_t *kvl_as_notes(PyObject *o); /* (needs the GIL) */
KVL_HIDDEN int kvl_notes_push(kvl_notes_t *q, const char *agent, size_t alen, const char *note,
                              size_t nlen);

/* The grant gate's and serving loop's functions (_gate.c), the reader's inbox (_reader.c)
 * and the notifications' queue (_notes.c), added to the module at init. */
extern PyMethodDef kvl_gate_methods[];
extern PyMethodDef kvl_reader_methods[];
extern PyMethodDef kvl_notes_methods[];
extern PyMethodDef kvl_digest_methods[]; /* _digest.c */

#endif
