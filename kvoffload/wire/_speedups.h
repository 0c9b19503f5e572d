/* What the parts of kvoffload.wire._speedups share: the frame fast path (_speedups_frames.c),
 * CRC32C (_speedups_crc.c) and the client's one-call exchanges (_speedups_net.c). */
#ifndef KVOFFLOAD_SPEEDUPS_H
#define KVOFFLOAD_SPEEDUPS_H
#include <Python.h>

PyObject *speedups_parse_frame(PyObject *self, PyObject *args);
PyObject *speedups_register(PyObject *self, PyObject *args);
PyObject *speedups_frame_head(PyObject *self, PyObject *args);
extern const char speedups_parse_frame_doc[];
extern const char speedups_register_doc[];
extern const char speedups_frame_head_doc[];
PyObject *speedups_net_get_into(PyObject *self, PyObject *args);
PyObject *speedups_net_put(PyObject *self, PyObject *args);
PyObject *speedups_net_lookup(PyObject *self, PyObject *args);
PyObject *speedups_net_get_many_into(PyObject *self, PyObject *args);
extern const char speedups_net_get_many_into_doc[];
extern const char speedups_net_get_into_doc[];
extern const char speedups_net_put_doc[];
extern const char speedups_net_lookup_doc[];

#include <stddef.h>
#include <stdint.h>

/* The register (the complement of a CRC) after `src`; `dst`, unless NULL, gets a copy. */
typedef uint32_t (*crc_fn)(uint32_t reg, uint8_t *dst, const uint8_t *src, size_t n);
extern crc_fn crc_update;
extern crc_fn crc_portable;
extern const char *crc_kind;
/* 0: the table; 1: SSE4.2 if present; 2: VPCLMULQDQ (AVX2 width) if present; 3: at AVX-512 width */
void crc_init(int level);
#endif
