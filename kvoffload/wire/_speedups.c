/* kvoffload.wire._speedups: the data plane's hot loops in C (issue 13 step 4).
 *
 * - crc32c / crc32c_copy: CRC32C (Castagnoli, the `crc32c` package's checksum), the second one
 *   copying while it sums, so a verified get reads its bytes once (_speedups_crc.c).
 * - parse_frame: a native-protocol frame header and the msgpack map of the commonest frames
 *   (_speedups_frames.c); anything else is left to the Python codec, which stays the reference.
 * - all_keys: whether a list or tuple holds only `bytes` keys of one size (the client's key
 *   lists), one pass in C.
 * - net_get_into / net_get_many_into / net_put / net_lookup: the sync `kv://` client's
 *   get_into, get_many_into, put, put_many and lookup as one call each
 *   (_speedups_net.c), handing anything unexpected back to the Python codec.
 *
 * fast.py picks this module or its pure-Python twin; the twin defines what is right.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_speedups.h"

/* ------------------------------------------------------------------ Python entry points */

/* Other threads run while a large buffer is summed; for a small one the switch costs more. */
#define RELEASE_GIL_AT (64 << 10)

static int crc_arg(PyObject *obj, uint32_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (v > 0xffffffffull) {
        PyErr_SetString(PyExc_ValueError, "crc must be a 32-bit unsigned integer");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer src;
    PyObject *crc_obj = NULL;
    uint32_t crc = 0;
    if (!PyArg_ParseTuple(args, "y*|O:crc32c", &src, &crc_obj)) return NULL;
    if (crc_obj && crc_arg(crc_obj, &crc) < 0) { PyBuffer_Release(&src); return NULL; }
    uint32_t reg = ~crc;
    if (src.len < RELEASE_GIL_AT) {
        reg = crc_update(reg, NULL, src.buf, (size_t)src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        reg = crc_update(reg, NULL, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLong(~reg);
}

static PyObject *py_crc32c_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    PyObject *crc_obj = NULL;
    uint32_t crc = 0;
    if (!PyArg_ParseTuple(args, "w*y*|O:crc32c_copy", &dst, &src, &crc_obj)) return NULL;
    PyObject *result = NULL;
    if (crc_obj && crc_arg(crc_obj, &crc) < 0) goto done;
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "crc32c_copy needs contiguous buffers");
        goto done;
    }
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes for %zd bytes", dst.len, src.len);
        goto done;
    }
    /* Overlap would make the copy's result depend on the order of the loads. */
    const uint8_t *s = src.buf, *d = dst.buf;
    if (src.len && d < s + src.len && s < d + src.len) {
        PyErr_SetString(PyExc_ValueError, "crc32c_copy buffers overlap");
        goto done;
    }
    uint32_t reg = ~crc;
    if (src.len < RELEASE_GIL_AT) {
        reg = crc_update(reg, dst.buf, src.buf, (size_t)src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        reg = crc_update(reg, dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    result = PyLong_FromUnsignedLong(~reg);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *py_crc_level(PyObject *self, PyObject *args) {
    int level;
    if (!PyArg_ParseTuple(args, "i:crc_level", &level)) return NULL;
    crc_init(level);
    return PyUnicode_FromString(crc_kind);
}

/* One pass where Python's check (two set(map(...)) passes) spent ~50 us on 1,000 keys. */
static PyObject *py_all_keys(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "On:all_keys", &seq, &size)) return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_FALSE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != size) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"all_keys", py_all_keys, METH_VARARGS,
     "all_keys(seq, size) -> bool: seq is a list or tuple of `bytes` (exactly) of `size` "
     "bytes each."},
    {"crc_level", py_crc_level, METH_VARARGS,
     "crc_level(n) -> str: use the best CRC32C loop up to n (0 table, 1 sse4.2, 2 vpclmulqdq, "
     "3 vpclmulqdq-512) "
     "that this CPU has; its name (tests compare all of them)."},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, crc=0) -> int: CRC32C of data."},
    {"crc32c_copy", py_crc32c_copy, METH_VARARGS,
     "crc32c_copy(dst, src, crc=0) -> int: copy src to the start of dst, return its CRC32C."},
    {"parse_frame", speedups_parse_frame, METH_VARARGS, speedups_parse_frame_doc},
    {"register", speedups_register, METH_VARARGS, speedups_register_doc},
    {"frame_head", speedups_frame_head, METH_VARARGS, speedups_frame_head_doc},
    {"net_get_into", speedups_net_get_into, METH_VARARGS, speedups_net_get_into_doc},
    {"net_put", speedups_net_put, METH_VARARGS, speedups_net_put_doc},
    {"net_lookup", speedups_net_lookup, METH_VARARGS, speedups_net_lookup_doc},
    {"net_get_many_into", speedups_net_get_many_into, METH_VARARGS,
     speedups_net_get_many_into_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__speedups(void) {
    crc_init(3);
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "hardware", crc_update != crc_portable) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
