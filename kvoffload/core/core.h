/* What the parts of kvoffload.core._core share (the module, the index, the hot path). */
#ifndef KVOFFLOAD_CORE_H
#define KVOFFLOAD_CORE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *entries; /* dict: key -> live entry */
    PyObject *pinned;  /* set: keys of live entries that readers pin */
    PyObject **ring;   /* hits since the last drain, oldest first (owned references) */
    Py_ssize_t ring_len, ring_cap;
    long long tick; /* the recency clock */
} DramIndex;

extern PyTypeObject DramIndexType, HotGetsType, SlotRingType;
/* DramIndex's methods, for the hot path (the same calls as from Python). */
PyObject *index_lookup(DramIndex *self, PyObject *key);
PyObject *index_pin(DramIndex *self, PyObject *entry);
PyObject *index_unpin(DramIndex *self, PyObject *entry);
/* Interned attribute names of kvstore.dram.DramEntry (set at import). */
extern PyObject *core_str_pins, *core_str_live, *core_str_tick, *core_str_key,
    *core_str_staging, *core_str_offset, *core_str_length;
int core_index_init_strings(void);
int core_hot_init(void);
/* Ops HotGets serves and counts (get, exists, lookup, get_many; put answered by put_done):
 * the module exports it as HOT_OPS, so that a build older than the Python code that reads
 * its answers is refused. */
#define CORE_HOT_OPS 5
#endif
