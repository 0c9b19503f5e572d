/* What the parts of kvoffload.core._core share (the module, the index, the hot path). */
#ifndef KVOFFLOAD_CORE_H
#define KVOFFLOAD_CORE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyTypeObject DramIndexType;
/* Interned attribute names of kvstore.dram.DramEntry (set at import). */
extern PyObject *core_str_pins, *core_str_live, *core_str_tick, *core_str_key,
    *core_str_staging;
int core_index_init_strings(void);
#endif
