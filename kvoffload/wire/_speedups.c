/* kvoffload.wire._speedups: the data plane's hot loops in C (issue 13 step 4).
 *
 * - crc32c / crc32c_copy: CRC32C (Castagnoli, the `crc32c` package's checksum), the second one
 *   copying while it sums, so a verified get reads its bytes once. SSE4.2 `crc32` when the CPU
 *   has it (three interleaved streams), a byte table otherwise.
 * - parse_frame: a native-protocol frame header and the msgpack map of the commonest frames
 *   (crc_frames.c); anything else is left to the Python codec, which stays the reference.
 *
 * fast.py picks this module or its pure-Python twin; the twin defines what is right.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_speedups.h"

/* ------------------------------------------------------------------ CRC32C, portable */

static uint32_t table[256];      /* one byte at a time, reflected polynomial 0x82F63B78 */
static uint32_t shift_tab[4][256]; /* the register advanced over SPAN zero bytes, per byte */

#define SPAN 1024 /* bytes per stream in the interleaved loop */

static uint32_t sw_update(uint32_t reg, const uint8_t *p, size_t n) {
    while (n--) reg = table[(reg ^ *p++) & 0xff] ^ (reg >> 8);
    return reg;
}

/* The register is linear in its start value over zero bytes: build the SPAN-byte advance as
 * a table from the 32 single-bit starts (combines the interleaved streams' registers). */
static void build_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[i] = c;
    }
    static const uint8_t zeros[SPAN];
    uint32_t bit[32];
    for (int b = 0; b < 32; b++) bit[b] = sw_update(1u << b, zeros, SPAN);
    for (int byte = 0; byte < 4; byte++)
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t out = 0;
            for (int b = 0; b < 8; b++)
                if (v & (1u << b)) out ^= bit[byte * 8 + b];
            shift_tab[byte][v] = out;
        }
}

static inline uint32_t shift_span(uint32_t r) {
    return shift_tab[0][r & 0xff] ^ shift_tab[1][(r >> 8) & 0xff] ^
           shift_tab[2][(r >> 16) & 0xff] ^ shift_tab[3][r >> 24];
}

static uint32_t sw_copy(uint32_t reg, uint8_t *dst, const uint8_t *src, size_t n) {
    if (dst) memcpy(dst, src, n);
    return sw_update(reg, src, n);
}

/* ------------------------------------------------------------------ CRC32C, SSE4.2 */

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define HAVE_HW 1

/* Three streams of SPAN bytes hide the instruction's 3-cycle latency. `copy` is a constant
 * in each caller below, so the compiler drops the stores from the sum-only loop. */
__attribute__((target("sse4.2"), always_inline)) static inline uint32_t
hw_loop(uint32_t reg, uint8_t *dst, const uint8_t *src, size_t n, const int copy) {
    uint64_t w0, w1, w2;
    while (n >= 3 * SPAN) {
        uint64_t a = reg, b = 0, c = 0;
        for (size_t i = 0; i < SPAN; i += 8) {
            memcpy(&w0, src + i, 8);
            memcpy(&w1, src + SPAN + i, 8);
            memcpy(&w2, src + 2 * SPAN + i, 8);
            a = _mm_crc32_u64(a, w0);
            b = _mm_crc32_u64(b, w1);
            c = _mm_crc32_u64(c, w2);
            if (copy) {
                memcpy(dst + i, &w0, 8);
                memcpy(dst + SPAN + i, &w1, 8);
                memcpy(dst + 2 * SPAN + i, &w2, 8);
            }
        }
        /* reg after a|b|c = shift(shift(a) ^ b) ^ c, shift = advance over SPAN zero bytes */
        reg = shift_span(shift_span((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
        src += 3 * SPAN;
        if (copy) dst += 3 * SPAN;
        n -= 3 * SPAN;
    }
    uint64_t r = reg;
    for (; n >= 8; n -= 8, src += 8) {
        memcpy(&w0, src, 8);
        r = _mm_crc32_u64(r, w0);
        if (copy) { memcpy(dst, &w0, 8); dst += 8; }
    }
    reg = (uint32_t)r;
    for (; n; n--) {
        if (copy) *dst++ = *src;
        reg = _mm_crc32_u8(reg, *src++);
    }
    return reg;
}

/* dst NULL: sum only. */
__attribute__((target("sse4.2"))) static uint32_t hw_copy(uint32_t reg, uint8_t *dst,
                                                            const uint8_t *src, size_t n) {
    return dst ? hw_loop(reg, dst, src, n, 1) : hw_loop(reg, NULL, src, n, 0);
}
#else
#define HAVE_HW 0
#endif

static uint32_t (*update_copy)(uint32_t, uint8_t *, const uint8_t *, size_t) = sw_copy;
static int hardware = 0;

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
        reg = update_copy(reg, NULL, src.buf, (size_t)src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        reg = update_copy(reg, NULL, src.buf, (size_t)src.len);
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
        reg = update_copy(reg, dst.buf, src.buf, (size_t)src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        reg = update_copy(reg, dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
    }
    result = PyLong_FromUnsignedLong(~reg);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, crc=0) -> int: CRC32C of data."},
    {"crc32c_copy", py_crc32c_copy, METH_VARARGS,
     "crc32c_copy(dst, src, crc=0) -> int: copy src to the start of dst, return its CRC32C."},
    {"parse_frame", speedups_parse_frame, METH_VARARGS, speedups_parse_frame_doc},
    {"register", speedups_register, METH_VARARGS, speedups_register_doc},
    {"frame_head", speedups_frame_head, METH_VARARGS, speedups_frame_head_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__speedups(void) {
    build_tables();
#if HAVE_HW
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) { update_copy = hw_copy; hardware = 1; }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "hardware", hardware) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
