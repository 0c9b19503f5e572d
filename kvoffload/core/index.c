/* DramIndex in C: the twin of kvstore.dram.DramIndex (the Python reference; its docstring
 * defines the behaviour, tests/unit/kvstore/test_dram_index.py drives both with the same
 * operation sequences and compares every answer).
 *
 * The entries stay kvstore.dram.DramEntry objects: the engine reads and writes their fields
 * (pins, live, tick) in many places, so the index keeps them and changes them through their
 * slots, exactly as the Python one does. Key -> entry is a dict (CPython's own hash table, in
 * C); the touch ring is a growable array of entries, drained in order.
 *
 * Concurrency: every method runs under the GIL and expects the engine's lock held, like the
 * Python index. Nothing here releases the GIL, so no other thread sees a half-done change.
 */
#include "core.h"

#include <limits.h>
#include <structmember.h>

PyObject *core_str_pins, *core_str_live, *core_str_tick, *core_str_key, *core_str_staging,
    *core_str_offset, *core_str_length;

int core_index_init_strings(void) {
    core_str_pins = PyUnicode_InternFromString("pins");
    core_str_live = PyUnicode_InternFromString("live");
    core_str_tick = PyUnicode_InternFromString("tick");
    core_str_key = PyUnicode_InternFromString("key");
    core_str_staging = PyUnicode_InternFromString("staging");
    core_str_offset = PyUnicode_InternFromString("offset");
    core_str_length = PyUnicode_InternFromString("length");
    return (core_str_pins && core_str_live && core_str_tick && core_str_key && core_str_staging &&
            core_str_offset && core_str_length)
               ? 0
               : -1;
}

/* Python's ints do not wrap; the C counts refuse to (OverflowError, nothing changed). */
static int too_far(const char *what) {
    PyErr_Format(PyExc_OverflowError, "the %s would pass 64 bits", what);
    return -1;
}

/* entry.<name> += delta; the new count, or -1 with an error set. */
static int add_pins(PyObject *entry, long long delta, long long *out) {
    PyObject *pins = PyObject_GetAttr(entry, core_str_pins);
    if (pins == NULL) return -1;
    long long value = PyLong_AsLongLong(pins);
    Py_DECREF(pins);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (delta > 0 ? value > LLONG_MAX - delta : value < LLONG_MIN - delta)
        return too_far("pin count"); /* a wrapped count would free a pinned slot */
    PyObject *updated = PyLong_FromLongLong(value + delta);
    if (updated == NULL) return -1;
    int rc = PyObject_SetAttr(entry, core_str_pins, updated);
    Py_DECREF(updated);
    *out = value + delta;
    return rc;
}

/* The truth of entry.<name>: 1, 0, or -1 with an error set. */
static int attr_true(PyObject *entry, PyObject *name) {
    PyObject *value = PyObject_GetAttr(entry, name);
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* pinned.add(entry.key) (add != 0) or pinned.discard(entry.key). */
static int mark_pinned(DramIndex *self, PyObject *entry, int add) {
    PyObject *key = PyObject_GetAttr(entry, core_str_key);
    if (key == NULL) return -1;
    int rc = add ? PySet_Add(self->pinned, key) : PySet_Discard(self->pinned, key);
    Py_DECREF(key);
    return rc < 0 ? -1 : 0;
}

static void ring_clear(DramIndex *self) {
    Py_ssize_t n = self->ring_len;
    self->ring_len = 0;
    for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(self->ring[i]);
}

static PyObject *index_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":DramIndex", names)) return NULL;
    DramIndex *self = (DramIndex *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->entries = PyDict_New();
    self->pinned = PySet_New(NULL);
    if (self->entries == NULL || self->pinned == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int index_traverse(DramIndex *self, visitproc visit, void *arg) {
    Py_VISIT(self->entries);
    Py_VISIT(self->pinned);
    for (Py_ssize_t i = 0; i < self->ring_len; i++) Py_VISIT(self->ring[i]);
    return 0;
}

static int index_clear(DramIndex *self) {
    Py_CLEAR(self->entries);
    Py_CLEAR(self->pinned);
    ring_clear(self);
    return 0;
}

static void index_dealloc(DramIndex *self) {
    PyObject_GC_UnTrack(self);
    index_clear(self);
    PyMem_Free(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyObject *index_lookup(DramIndex *self, PyObject *key) {
    PyObject *entry = PyDict_GetItemWithError(self->entries, key);
    if (entry == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(entry);
    return entry;
}

static PyObject *index_next_tick(DramIndex *self, PyObject *unused) {
    if (self->tick == LLONG_MAX) {
        too_far("recency clock");
        return NULL;
    }
    return PyLong_FromLongLong(++self->tick);
}

PyObject *index_pin(DramIndex *self, PyObject *entry) {
    long long pins;
    /* read before the count changes: a pin that cannot tick changes nothing */
    PyObject *staging = PyObject_GetAttr(entry, core_str_staging);
    if (staging == NULL) return NULL;
    int staged = staging != Py_None;
    Py_DECREF(staging);
    int live = staged ? 0 : attr_true(entry, core_str_live);
    if (live < 0) return NULL;
    if (live && self->tick == LLONG_MAX) {
        too_far("recency clock");
        return NULL;
    }
    if (add_pins(entry, +1, &pins) < 0) return NULL;
    if (!live) return PyLong_FromLong(0); /* not (or no longer) in the books: no touch */
    if (self->ring_len == self->ring_cap) {
        Py_ssize_t cap = self->ring_cap ? 2 * self->ring_cap : 256;
        PyObject **grown = PyMem_Realloc(self->ring, (size_t)cap * sizeof(PyObject *));
        if (grown == NULL) return PyErr_NoMemory();
        self->ring = grown;
        self->ring_cap = cap;
    }
    PyObject *tick = PyLong_FromLongLong(self->tick + 1);
    if (tick == NULL) return NULL;
    int rc = PyObject_SetAttr(entry, core_str_tick, tick);
    Py_DECREF(tick);
    if (rc < 0) return NULL;
    self->tick++;
    Py_INCREF(entry);
    self->ring[self->ring_len++] = entry;
    if (mark_pinned(self, entry, 1) < 0) return NULL;
    return PyLong_FromSsize_t(self->ring_len);
}

PyObject *index_unpin(DramIndex *self, PyObject *entry) {
    long long pins;
    if (add_pins(entry, -1, &pins) < 0) return NULL;
    if (pins) Py_RETURN_FALSE;
    int live = attr_true(entry, core_str_live);
    if (live < 0) return NULL;
    if (!live) Py_RETURN_TRUE; /* the last pin of a dead entry: its slot may go */
    if (mark_pinned(self, entry, 0) < 0) return NULL;
    Py_RETURN_FALSE;
}

static PyObject *index_insert(DramIndex *self, PyObject *entry) {
    if (PyObject_SetAttr(entry, core_str_live, Py_True) < 0) return NULL;
    PyObject *key = PyObject_GetAttr(entry, core_str_key);
    if (key == NULL) return NULL;
    int rc = PyDict_SetItem(self->entries, key, entry);
    Py_DECREF(key);
    if (rc < 0) return NULL;
    int pinned = attr_true(entry, core_str_pins);
    if (pinned < 0 || mark_pinned(self, entry, pinned) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *index_remove(DramIndex *self, PyObject *key) {
    PyObject *entry = PyDict_GetItemWithError(self->entries, key);
    if (entry == NULL) {
        if (!PyErr_Occurred()) {
            PyObject *arg = PyTuple_Pack(1, key); /* KeyError(key), as dict.pop raises it */
            if (arg != NULL) {
                PyErr_SetObject(PyExc_KeyError, arg);
                Py_DECREF(arg);
            }
        }
        return NULL;
    }
    Py_INCREF(entry);
    if (PyDict_DelItem(self->entries, key) < 0 ||
        PyObject_SetAttr(entry, core_str_live, Py_False) < 0 ||
        PySet_Discard(self->pinned, key) < 0) {
        Py_DECREF(entry);
        return NULL;
    }
    return entry;
}

static PyObject *index_drain_touches(DramIndex *self, PyObject *unused) {
    PyObject *out = PyList_New(self->ring_len);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->ring_len; i++) PyList_SET_ITEM(out, i, self->ring[i]);
    self->ring_len = 0; /* the list took the ring's references */
    return out;
}

static PyObject *index_values(DramIndex *self, PyObject *unused) {
    PyObject *copy = PyDict_Values(self->entries);
    if (copy == NULL) return NULL;
    PyObject *it = PyObject_GetIter(copy);
    Py_DECREF(copy);
    return it;
}

static PyObject *index_retire(DramIndex *self, PyObject *unused) {
    PyObject *key, *entry;
    Py_ssize_t pos = 0;
    while (PyDict_Next(self->entries, &pos, &key, &entry))
        if (PyObject_SetAttr(entry, core_str_live, Py_False) < 0) return NULL;
    PyDict_Clear(self->entries);
    ring_clear(self);
    Py_RETURN_NONE;
}

static Py_ssize_t index_len(DramIndex *self) { return PyDict_Size(self->entries); }

static int index_contains(DramIndex *self, PyObject *key) {
    return PyDict_Contains(self->entries, key);
}

static PyMethodDef index_methods[] = {
    {"lookup", (PyCFunction)index_lookup, METH_O, "The live entry of a key, or None."},
    {"next_tick", (PyCFunction)index_next_tick, METH_NOARGS, "Bump the recency clock."},
    {"pin", (PyCFunction)index_pin, METH_O, "Pin an entry; how many hits are queued."},
    {"unpin", (PyCFunction)index_unpin, METH_O, "Drop a pin; True when the slot may go."},
    {"insert", (PyCFunction)index_insert, METH_O, "Make an entry its key's live value."},
    {"remove", (PyCFunction)index_remove, METH_O, "Take a key's live entry out."},
    {"drain_touches", (PyCFunction)index_drain_touches, METH_NOARGS, "The hits, in order."},
    {"values", (PyCFunction)index_values, METH_NOARGS, "The live entries (a copy)."},
    {"retire", (PyCFunction)index_retire, METH_NOARGS, "Close: no entry is live any more."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef index_members[] = {
    {"pinned", T_OBJECT_EX, offsetof(DramIndex, pinned), READONLY, "Keys readers pin."},
    {"tick", T_LONGLONG, offsetof(DramIndex, tick), 0, "The recency clock."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods index_as_sequence = {
    .sq_length = (lenfunc)index_len,
    .sq_contains = (objobjproc)index_contains,
};

PyTypeObject DramIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.core._core.DramIndex",
    .tp_basicsize = sizeof(DramIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Key -> live DRAM entry, pins and the touch ring (kvstore.dram.DramIndex in C).",
    .tp_new = index_new,
    .tp_dealloc = (destructor)index_dealloc,
    .tp_traverse = (traverseproc)index_traverse,
    .tp_clear = (inquiry)index_clear,
    .tp_methods = index_methods,
    .tp_members = index_members,
    .tp_as_sequence = &index_as_sequence,
};
