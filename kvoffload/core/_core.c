/* kvoffload.core._core: the daemon's C core (issue 29). kvoffload/core/__init__.py loads it,
 * or leaves it out (KVOFFLOAD_PURE_PYTHON=1) so that the Python reference runs instead.
 *
 * - DramIndex (index.c): the C twin of kvstore.dram.DramIndex.
 * - HotGets (hot.c): a connection's DRAM Get hits served without the Python session.
 * - SlotRing (uring.c): a minimal io_uring for the SSD tier's slot I/O (issue 30).
 */
#include "core.h"

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_core", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
    if (core_index_init_strings() < 0 || core_hot_init() < 0 ||
        PyType_Ready(&DramIndexType) < 0 || PyType_Ready(&HotGetsType) < 0 ||
        PyType_Ready(&SlotRingType) < 0)
        return NULL;
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
