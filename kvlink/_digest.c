/* kvlink.integrity's digest of host planes in one call (kvlink.native builds it with
 * _native.c).
 *
 * digest(table, ids, weights, out, first_head, tokens, words): for every block position b,
 * plane p and head h of `out` (uint64 [n][planes][heads], C order), the sum modulo 2**64 over
 * (token t, word w) of the 8-byte word at table[p].address + ids[b] x block stride +
 * (first_head + h) x head stride + t x token stride + 8w, times weights[t][w] — what
 * kvlink.integrity.host.numpy_plane computes plane by plane (tests/test_integrity.py compares
 * them). `table`: int64 [planes][4] = (address, block stride, head stride, token stride) in
 * bytes, of views the caller owns and keeps alive (a worker's planes, fixed at register),
 * every address and stride 8-byte aligned; `ids` int64 [n], each inside its planes (the
 * caller's own, checked against its cache). Numpy gathers each plane's rows and sums them
 * with einsum, plane by plane; this reads each word once, in place, without the GIL: a
 * producer's digest of 1 GiB 321 -> 221 ms, `full` over tcp on 1 GiB +70.0 -> +32.7 % of the
 * same run's `off` on the 2-core VM (bench/results/integrity_overhead_cpu_c_digest_1f407ed/).
 */
#define PY_SSIZE_T_CLEAN
#include "_native.h"
#include <stdint.h>

static void digest_planes(const int64_t *table, Py_ssize_t planes, const int64_t *ids,
                          Py_ssize_t n, const uint64_t *weights, Py_ssize_t tokens,
                          Py_ssize_t words, Py_ssize_t first, Py_ssize_t heads,
                          uint64_t *out) {
  for (Py_ssize_t b = 0; b < n; ++b) {
    for (Py_ssize_t p = 0; p < planes; ++p) {
      const int64_t *row = table + 4 * p;
      const char *page = (const char *)(uintptr_t)row[0] + ids[b] * row[1];
      for (Py_ssize_t h = 0; h < heads; ++h) {
        const char *head = page + (first + h) * row[2];
        uint64_t acc = 0;
        for (Py_ssize_t t = 0; t < tokens; ++t) {
          const uint64_t *x = (const uint64_t *)(head + t * row[3]);
          const uint64_t *w = weights + t * words;
          for (Py_ssize_t i = 0; i < words; ++i) acc += x[i] * w[i];
        }
        out[(b * planes + p) * heads + h] = acc;
      }
    }
  }
}

static int buffer_of(PyObject *o, Py_buffer *view, const char *what, int writable) {
  if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
    return -1;
  if (view->len % 8) {
    PyErr_Format(PyExc_ValueError, "digest: %s holds %zd bytes, not whole 8-byte items", what,
                 view->len);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

static PyObject *digest(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "digest(table, ids, weights, out, first_head, tokens, words)");
    return NULL;
  }
  const Py_ssize_t first = PyLong_AsSsize_t(args[4]), tokens = PyLong_AsSsize_t(args[5]),
                   words = PyLong_AsSsize_t(args[6]);
  if (PyErr_Occurred()) return NULL;
  Py_buffer tv, iv, wv, ov;
  const char *what[4] = {"table", "ids", "weights", "out"};
  Py_buffer *views[4] = {&tv, &iv, &wv, &ov};
  int got = 0;
  for (; got < 4; ++got)
    if (buffer_of(args[got], views[got], what[got], got == 3) < 0) break;
  PyObject *result = NULL;
  if (got == 4) {
    const Py_ssize_t planes = tv.len / 32, n = iv.len / 8;
    const Py_ssize_t heads = planes && n ? ov.len / 8 / (planes * n) : 0;
    if (tv.len % 32 || first < 0 || tokens < 1 || words < 1 || wv.len / 8 != tokens * words
        || heads * planes * n * 8 != ov.len) {
      PyErr_Format(PyExc_ValueError,
                   "digest: shapes disagree (table %zd bytes, %zd ids, weights %zd for %zd x "
                   "%zd, out %zd bytes)", tv.len, n, wv.len / 8, tokens, words, ov.len);
    } else {
      Py_BEGIN_ALLOW_THREADS
      digest_planes(tv.buf, planes, iv.buf, n, wv.buf, tokens, words, first, heads, ov.buf);
      Py_END_ALLOW_THREADS
      result = Py_NewRef(Py_None);
    }
  }
  for (int i = 0; i < got; ++i) PyBuffer_Release(views[i]);
  return result;
}

PyMethodDef kvl_digest_methods[] = {
    {"digest", (PyCFunction)(void (*)(void))digest, METH_FASTCALL,
     "digest(table, ids, weights, out, first_head, tokens, words): kvlink.integrity's digest "
     "of host planes"},
    {NULL, NULL, 0, NULL}};
