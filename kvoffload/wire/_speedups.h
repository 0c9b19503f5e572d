/* What _speedups.c needs from _speedups_frames.c (the native protocol's frame fast path). */
#ifndef KVOFFLOAD_SPEEDUPS_H
#define KVOFFLOAD_SPEEDUPS_H
#include <Python.h>

PyObject *speedups_parse_frame(PyObject *self, PyObject *args);
PyObject *speedups_register(PyObject *self, PyObject *args);
PyObject *speedups_frame_head(PyObject *self, PyObject *args);
extern const char speedups_parse_frame_doc[];
extern const char speedups_register_doc[];
extern const char speedups_frame_head_doc[];
#endif
