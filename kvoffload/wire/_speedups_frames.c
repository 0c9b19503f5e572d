/* The native protocol's commonest frames in C: Get, Exists, Put requests and the GetResult,
 * PutDone, ExistsResult answers (frames.py documents the 24-byte header).
 *
 * parse_frame only *recognises*: it returns None for anything it does not take whole (another
 * frame type, a msgpack encoding a Python encoder would not choose, a bad magic, a value the
 * validators reject, a frame not yet complete), and the Python codec then parses that frame
 * and raises its usual errors. So it can never be less strict than native_fields.py; it builds
 * exactly the event the Python decoder would (tests compare them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_speedups.h"

#define HEAD 24
#define MAX_UINT 0x7fffffffffffffffull /* native_fields._MAX_LENGTH */

enum { T_KEY, T_UINT, T_OPT_UINT, T_OPT_KEY, T_BOOL, T_NIL }; /* T_NIL: only None taken */

typedef struct { const char *name; int type, required; } Field;
typedef struct {
    int op, response;
    Field fields[4]; /* in the event's field order, after request_id */
    int nfields;
    PyObject *cls;
    PyObject *descr[6]; /* request_id, then the fields' slot descriptors */
} Kind;

/* The order is fast.py's KINDS. */
static Kind kinds[] = {
    {3, 0, {{"key", T_KEY, 1}}, 1, NULL, {NULL}},                               /* Get */
    {4, 0, {{"key", T_KEY, 1}}, 1, NULL, {NULL}},                               /* Exists */
    {2, 0, {{"key", T_KEY, 1}, {"length", T_UINT, 1}, {"parent", T_OPT_KEY, 0},
            {"durable", T_BOOL, 0}}, 4, NULL, {NULL}},                          /* Put */
    {3, 1, {{"length", T_OPT_UINT, 1}}, 1, NULL, {NULL}},                       /* GetResult */
    {2, 1, {{NULL, 0, 0}}, 0, NULL, {NULL}},                                    /* PutDone */
    {4, 1, {{"found", T_BOOL, 1}}, 1, NULL, {NULL}},                            /* ExistsResult */
};
#define NKINDS ((int)(sizeof kinds / sizeof kinds[0]))

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* One msgpack value of `type` at *pp (< e); a new reference, or NULL (not taken, no error). */
static PyObject *value(const uint8_t **pp, const uint8_t *e, int type) {
    const uint8_t *p = *pp;
    uint8_t b = *p;
    if (b == 0xc0 && (type == T_OPT_UINT || type == T_OPT_KEY || type == T_NIL)) {
        *pp = p + 1;
        Py_RETURN_NONE;
    }
    if (type == T_BOOL && (b == 0xc2 || b == 0xc3)) {
        *pp = p + 1;
        return PyBool_FromLong(b == 0xc3);
    }
    if ((type == T_KEY || type == T_OPT_KEY) && b == 0xc4) { /* bin 8 of 16 bytes */
        if (e - p < 18 || p[1] != 16) return NULL;
        *pp = p + 18;
        return PyBytes_FromStringAndSize((const char *)p + 2, 16);
    }
    if (type != T_UINT && type != T_OPT_UINT) return NULL;
    uint64_t v;
    int n; /* bytes after the type byte */
    if (b < 0x80) { v = b; n = 0; }
    else if (b >= 0xcc && b <= 0xcf) { n = 1 << (b - 0xcc); if (e - p < 1 + n) return NULL;
                                       v = be(p + 1, n); }
    else if (b >= 0xd0 && b <= 0xd3) { n = 1 << (b - 0xd0); if (e - p < 1 + n) return NULL;
                                       v = be(p + 1, n); if (v >> (8 * n - 1)) return NULL; }
    else return NULL; /* negative fixint and the rest: the validators say what is wrong */
    if (v > MAX_UINT) return NULL;
    *pp = p + 1 + n;
    return PyLong_FromUnsignedLongLong(v);
}

/* The event for a whole frame at buf[start:end], or NULL with *taken = 0. */
static PyObject *parse(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end, uint64_t max_h,
                       uint64_t max_p, Py_ssize_t *next, PyObject **head) {
    const uint8_t *h = buf + start;
    if (end - start < HEAD || memcmp(h, "KVNP", 4) || h[4] != 1 || (le(h + 6, 2) & ~1ull))
        return NULL;
    int op = h[5], response = (int)le(h + 6, 2);
    uint64_t rid = le(h + 8, 4), hlen = le(h + 12, 4), plen = le(h + 16, 8);
    if (hlen > max_h || plen > max_p || (uint64_t)(end - start - HEAD) < hlen || rid == 0)
        return NULL;
    Kind *k = NULL;
    for (int i = 0; i < NKINDS; i++)
        if (kinds[i].op == op && kinds[i].response == response && kinds[i].cls) k = &kinds[i];
    if (!k) return NULL;
    const uint8_t *p = h + HEAD, *e = p + hlen;
    if (p == e || (*p & 0xf0) != 0x80) return NULL; /* a fixmap */
    int entries = *p++ & 0x0f;
    PyObject *vals[4] = {NULL, NULL, NULL, NULL};
    PyObject *event = NULL;
    for (int i = 0; i < entries; i++) {
        if (p == e || (*p & 0xe0) != 0xa0) goto out; /* a fixstr name */
        size_t len = *p & 0x1f;
        if ((size_t)(e - p - 1) < len + 1) goto out; /* the name and a value byte at least */
        int f = 0;
        while (f < k->nfields && !(strlen(k->fields[f].name) == len &&
                                   !memcmp(k->fields[f].name, p + 1, len))) f++;
        if (f == k->nfields || vals[f]) goto out; /* unknown or repeated */
        p += 1 + len;
        if (!(vals[f] = value(&p, e, k->fields[f].type))) goto out;
    }
    if (p != e) goto out;
    uint64_t declared = 0;
    for (int f = 0; f < k->nfields; f++) {
        if (!vals[f]) {
            if (k->fields[f].required) goto out;
            vals[f] = k->fields[f].type == T_BOOL ? Py_NewRef(Py_False) : Py_NewRef(Py_None);
        }
        if (!strcmp(k->fields[f].name, "length") && vals[f] != Py_None)
            declared = PyLong_AsUnsignedLongLong(vals[f]);
    }
    if (declared != plen) goto out;
    /* Build the frozen dataclass through its slots, as its validated __init__ would. */
    PyTypeObject *tp = (PyTypeObject *)k->cls;
    event = tp->tp_alloc(tp, 0);
    if (!event) goto out;
    PyObject *ridobj = PyLong_FromUnsignedLongLong(rid);
    int bad = !ridobj || Py_TYPE(k->descr[0])->tp_descr_set(k->descr[0], event, ridobj) < 0;
    Py_XDECREF(ridobj);
    for (int f = 0; f < k->nfields && !bad; f++)
        bad = Py_TYPE(k->descr[f + 1])->tp_descr_set(k->descr[f + 1], event, vals[f]) < 0;
    /* Put's last field (block_meta) is not parsed here: a frame naming it was refused above. */
    if (!bad && k->descr[k->nfields + 1])
        bad = Py_TYPE(k->descr[k->nfields + 1])
                  ->tp_descr_set(k->descr[k->nfields + 1], event, Py_None) < 0;
    if (!bad) *head = Py_BuildValue("(iiKKK)", op, response, (unsigned long long)rid,
                                     (unsigned long long)hlen, (unsigned long long)plen);
    if (bad || !*head) Py_CLEAR(event);
    *next = start + HEAD + (Py_ssize_t)hlen;
out:
    for (int f = 0; f < 4; f++) Py_XDECREF(vals[f]);
    return event;
}

/* An unsigned int argument no larger than `max`, checked as the Python codec's struct.pack and
 * validators would (the "K" format wraps negative and oversized values silently). */
static int as_uint(PyObject *o, unsigned long long max, unsigned long long *out) {
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "an int is required");
        return 0;
    }
    *out = PyLong_AsUnsignedLongLong(o);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    if (*out > max) {
        PyErr_SetString(PyExc_OverflowError, "int out of range");
        return 0;
    }
    return 1;
}

const char speedups_parse_frame_doc[] =
    "parse_frame(buf, start, end, max_header, max_payload) -> (event, next_start, head) | None";

PyObject *speedups_parse_frame(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t start, end;
    unsigned long long max_h, max_p;
    PyObject *oh, *op;
    if (!PyArg_ParseTuple(args, "y*nnOO", &buf, &start, &end, &oh, &op)) return NULL;
    if (!as_uint(oh, 0xffffffffffffffffull, &max_h) || !as_uint(op, 0xffffffffffffffffull, &max_p)) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (start < 0 || end < start || end > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "parse_frame: range outside the buffer");
        return NULL;
    }
    Py_ssize_t next = start;
    PyObject *head = NULL;
    PyObject *event = parse(buf.buf, start, end, max_h, max_p, &next, &head);
    PyBuffer_Release(&buf);
    if (!event) {
        if (PyErr_Occurred()) return NULL; /* out of memory: not the peer's fault */
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(NnN)", event, next, head);
}

const char speedups_register_doc[] =
    "register(index, cls, names): the event class of KINDS[index] and its slot names "
    "(request_id first, then every field in order).";

PyObject *speedups_register(PyObject *self, PyObject *args) {
    int i;
    PyObject *cls, *names;
    if (!PyArg_ParseTuple(args, "iO!O!", &i, &PyType_Type, &cls, &PyTuple_Type, &names))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (i < 0 || i >= NKINDS || n < kinds[i].nfields + 1 || n > kinds[i].nfields + 2) {
        PyErr_SetString(PyExc_ValueError, "register: no such kind, or the wrong fields");
        return NULL;
    }
    PyObject *dict = ((PyTypeObject *)cls)->tp_dict;
    for (Py_ssize_t f = 0; f < n; f++) {
        PyObject *d = PyDict_GetItemWithError(dict, PyTuple_GET_ITEM(names, f));
        if (!d || !Py_TYPE(d)->tp_descr_set) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "register: not a slot");
            return NULL;
        }
        Py_XSETREF(kinds[i].descr[f], Py_NewRef(d));
    }
    Py_XSETREF(kinds[i].cls, Py_NewRef(cls));
    Py_RETURN_NONE;
}

const char speedups_frame_head_doc[] =
    "frame_head(op, request_id, name, value, payload_length) -> bytes: an answer's frame "
    "header and its one-entry msgpack map (no name: an empty map); value None, a bool or an "
    "unsigned int.";

PyObject *speedups_frame_head(PyObject *self, PyObject *args) {
    int op;
    unsigned long long rid, plen;
    const char *name = NULL;
    Py_ssize_t nlen = 0;
    PyObject *v, *orid, *oplen;
    if (!PyArg_ParseTuple(args, "iOz#OO", &op, &orid, &name, &nlen, &v, &oplen)) return NULL;
    if (!as_uint(orid, 0xffffffffull, &rid) || !as_uint(oplen, 0xffffffffffffffffull, &plen))
        return NULL;
    if (op < 0 || op > 255 || rid > 0xffffffffull || nlen > 31) {
        PyErr_SetString(PyExc_ValueError, "frame_head: field out of range");
        return NULL;
    }
    uint8_t out[HEAD + 1 + 32 + 9];
    uint8_t *p = out + HEAD;
    *p++ = name ? 0x81 : 0x80;
    if (name) {
        *p++ = 0xa0 | (uint8_t)nlen;
        memcpy(p, name, (size_t)nlen);
        p += nlen;
        if (v == Py_None) *p++ = 0xc0;
        else if (PyBool_Check(v)) *p++ = v == Py_True ? 0xc3 : 0xc2;
        else {
            unsigned long long x = PyLong_AsUnsignedLongLong(v);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
            /* msgpack's smallest unsigned form, as msgpack.packb chooses it */
            int n = x < 0x80 ? 0 : x <= 0xff ? 1 : x <= 0xffff ? 2 : x <= 0xffffffffull ? 4 : 8;
            if (n) *p++ = n == 1 ? 0xcc : n == 2 ? 0xcd : n == 4 ? 0xce : 0xcf;
            for (int i = n ? n - 1 : 0; n && i >= 0; i--) *p++ = (uint8_t)(x >> (8 * i));
            if (!n) *p++ = (uint8_t)x;
        }
    }
    uint64_t hlen = (uint64_t)(p - out - HEAD);
    memcpy(out, "KVNP", 4);
    out[4] = 1;
    out[5] = (uint8_t)op;
    out[6] = 1; /* FLAG_RESPONSE: only answers are built here */
    out[7] = 0;
    for (int i = 0; i < 4; i++) out[8 + i] = (uint8_t)(rid >> (8 * i));
    for (int i = 0; i < 4; i++) out[12 + i] = (uint8_t)(hlen >> (8 * i));
    for (int i = 0; i < 8; i++) out[16 + i] = (uint8_t)(plen >> (8 * i));
    return PyBytes_FromStringAndSize((const char *)out, p - out);
}
