/* kvoffload.core._core: the daemon's C core (issue 29). kvoffload/core/__init__.py loads it,
 * or leaves it out (KVOFFLOAD_PURE_PYTHON=1) so that the Python reference runs instead.
 *
 * - DramIndex (index.c): the C twin of kvstore.dram.DramIndex.
 * - HotGets (hot.c): a connection's DRAM Get hits served without the Python session.
 * - SlotRing (uring.c): a minimal io_uring for the SSD tier's slot I/O (issue 30).
 * - copy_crc32c: a cold SSD block copied into a get's buffer and summed in the same pass
 *   (issue 30), with the wire extension's CRC32C kernels (kvoffload/wire/_speedups_crc.c,
 *   compiled into this module too: kvstore may not import kvoffload.wire).
 * - hash_key: the SSD index's key hash (kvstore.ssd.keyhash.hash_key, its reference), four
 *   calls a cold block read, each a dozen Python big-int operations there (issue 30).
 */
#include "core.h"
#include "../wire/_speedups.h"

/* Below this the GIL hand-off costs more than the pass (as in kvoffload.wire._speedups). */
#define COPY_RELEASE_GIL_AT (64 << 10)

static PyObject *core_copy_crc32c(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy_crc32c", &dst, &src)) return NULL;
    PyObject *result = NULL;
    const uint8_t *s = src.buf, *d = dst.buf;
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "copy_crc32c needs contiguous buffers");
    } else if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes for %zd bytes", dst.len,
                     src.len);
    } else if (src.len && d < s + src.len && s < d + src.len) {
        /* Overlap would make the sum depend on the order of the loads and stores. */
        PyErr_SetString(PyExc_ValueError, "copy_crc32c buffers overlap");
    } else {
        uint32_t reg = 0xFFFFFFFFu;
        if (src.len < COPY_RELEASE_GIL_AT) {
            reg = crc_update(reg, dst.buf, s, (size_t)src.len);
        } else {
            Py_BEGIN_ALLOW_THREADS
            reg = crc_update(reg, dst.buf, s, (size_t)src.len);
            Py_END_ALLOW_THREADS
        }
        result = PyLong_FromUnsignedLong(~reg);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* Up to 8 bytes little-endian, as int.from_bytes(b[:8], "little") reads a short slice. */
static uint64_t le_prefix(const uint8_t *b, Py_ssize_t n) {
    uint64_t v = 0;
    for (Py_ssize_t i = n < 8 ? n : 8; i-- > 0;) v = (v << 8) | b[i];
    return v;
}

static PyObject *core_hash_key(PyObject *self, PyObject *key) {
    uint64_t lo, hi;
    if (PyBytes_CheckExact(key)) { /* the engine's keys: no buffer export */
        const uint8_t *k = (const uint8_t *)PyBytes_AS_STRING(key);
        Py_ssize_t n = PyBytes_GET_SIZE(key);
        lo = le_prefix(k, n);
        hi = n > 8 ? le_prefix(k + 8, n - 8) : 0;
    } else { /* a contiguous buffer of bytes (bytearray, memoryview of bytes): the engine
              * passes only bytes; wider items would be hashed by their bytes, not items */
        Py_buffer view;
        if (PyObject_GetBuffer(key, &view, PyBUF_SIMPLE) < 0) return NULL;
        const uint8_t *k = view.buf;
        lo = le_prefix(k, view.len);
        hi = view.len > 8 ? le_prefix(k + 8, view.len - 8) : 0;
        PyBuffer_Release(&view);
    }
    uint64_t h = lo ^ (hi * 0x9E3779B97F4A7C15ull); /* wraps as the reference's & _MASK64 */
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    return PyLong_FromUnsignedLongLong(h ^ (h >> 31));
}

static PyMethodDef core_methods[] = {
    {"hash_key", core_hash_key, METH_O,
     "hash_key(key: bytes) -> int: splitmix64 of the key's two 8-byte halves (little-endian)."},
    {"copy_crc32c", core_copy_crc32c, METH_VARARGS,
     "copy_crc32c(dst, src) -> int: copy src to the start of dst; the CRC32C of src, read "
     "once."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_core", NULL, -1, core_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
    if (core_index_init_strings() < 0 || core_hot_init() < 0 ||
        PyType_Ready(&DramIndexType) < 0 || PyType_Ready(&HotGetsType) < 0 ||
        PyType_Ready(&SlotRingType) < 0)
        return NULL;
    crc_init(3); /* the fastest CRC32C kernel this CPU has */
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&DramIndexType);
    if (PyModule_AddObject(m, "DramIndex", (PyObject *)&DramIndexType) < 0) {
        Py_DECREF(&DramIndexType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&HotGetsType);
    if (PyModule_AddObject(m, "HotGets", (PyObject *)&HotGetsType) < 0) {
        Py_DECREF(&HotGetsType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "HOT_OPS", CORE_HOT_OPS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SlotRingType);
    if (PyModule_AddObject(m, "SlotRing", (PyObject *)&SlotRingType) < 0) {
        Py_DECREF(&SlotRingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
