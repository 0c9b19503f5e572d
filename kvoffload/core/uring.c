/* SlotRing: a minimal io_uring for the SSD tier's slot I/O (issue 30), with raw system calls
 * (io_uring_setup / io_uring_enter and mmap of the rings: no liburing, no new dependency).
 *
 * `submit(entries)` takes a batch of (fd, offset, buffer, write) entries, submits them with at
 * most `depth` in flight, waits for every completion with the GIL released and returns each
 * entry's result: bytes moved, or -errno. The Python reference is the thread path
 * (kvstore.ssd.slotio.ThreadPages): tests compare the two.
 *
 * Buffers in flight: every entry's Py_buffer is taken before anything is submitted and given
 * back only once its completion is reaped. A call returns only when all its entries are reaped,
 * so normally nothing outlives it. If io_uring_enter fails with any other error than
 * EINTR/EAGAIN/EBUSY (retried), the ring is marked broken: every later submit fails (EIO) and
 * its owner makes a fresh ring. The entries queued in the SQ ring that the kernel has not taken
 * are withdrawn first (the tail set back to the head), so none is ever sent. If entries the
 * kernel took are still unreaped, the ring is also stranded: their buffers are never released
 * (leaked, not reused under the kernel's writes) and the ring is never unmapped. A second
 * caller waits on the ring's lock; `close()` never unmaps a ring with a batch in flight: it
 * marks it, and that batch's caller unmaps it once all is reaped.
 *
 * Fault seam (kvstore/faults.py, tests only): `delay_s` sleeps after the first submission,
 * before any completion is reaped (a slow device, with the buffers still in flight),
 * `fail` gives chosen entries a -errno result in place of what the kernel answered, and
 * `enter_fail` makes the batch's first io_uring_enter fail with that errno before the call,
 * its entries queued and none taken (an enter that failed, `ring.enter`).
 */
#include "core.h"

#include <errno.h>
#include <limits.h>
#include <linux/io_uring.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define RING_MAX_DEPTH 4096
#define RING_MAX_ENTRIES 65536     /* entries of one submit call */
#define RING_MAX_LEN (1u << 30)    /* bytes of one entry (the kernel's cap is ~2 GiB) */
#define RING_MAX_DELAY_S 60.0

typedef struct {
    PyObject_HEAD
    int fd;
    unsigned depth;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len;
    struct io_uring_sqe *sqes;
    size_t sqes_len;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    PyThread_type_lock lock; /* held by the batch in flight and by close */
    int broken;              /* io_uring_enter failed: never submit again */
    int stranded;            /* ... with completions left unreaped: never unmap either */
    int closing;             /* close() came during a batch: its last caller unmaps after it */
    int users;               /* calls past their checks, buffers held (changed under the GIL) */
    unsigned long long batches, entries;
} SlotRing;

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static void ring_unmap(SlotRing *r) {
    if (r->sqes != NULL) munmap(r->sqes, r->sqes_len);
    if (r->cq_map != NULL && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map != NULL) munmap(r->sq_map, r->sq_map_len);
    if (r->fd >= 0) close(r->fd);
    r->sqes = NULL;
    r->cq_map = r->sq_map = NULL;
    r->fd = -1;
}

static int ring_init(SlotRing *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"depth", NULL};
    int depth = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i:SlotRing", names, &depth)) return -1;
    if (self->lock != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SlotRing is initialised already");
        return -1;
    }
    if (depth < 1 || depth > RING_MAX_DEPTH) {
        PyErr_Format(PyExc_ValueError, "depth must be in [1, %d], got %d", RING_MAX_DEPTH, depth);
        return -1;
    }
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = sys_setup((unsigned)depth, &p);
    if (fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError); /* ENOSYS, EPERM: the caller falls back */
        return -1;
    }
    self->fd = fd;
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && cq_len > sq_len) sq_len = cq_len;
    void *sq = mmap(NULL, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) goto fail;
    self->sq_map = sq;
    self->sq_map_len = sq_len;
    void *cq = sq;
    if (!single) {
        cq = mmap(NULL, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                  IORING_OFF_CQ_RING);
        if (cq == MAP_FAILED) goto fail;
    }
    self->cq_map = cq;
    self->cq_map_len = single ? sq_len : cq_len;
    size_t sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    void *sqes = mmap(NULL, sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                      IORING_OFF_SQES);
    if (sqes == MAP_FAILED) goto fail;
    self->sqes = sqes;
    self->sqes_len = sqes_len;
    char *s = sq, *c = cq;
    self->sq_head = (unsigned *)(s + p.sq_off.head);
    self->sq_tail = (unsigned *)(s + p.sq_off.tail);
    self->sq_mask = (unsigned *)(s + p.sq_off.ring_mask);
    self->sq_array = (unsigned *)(s + p.sq_off.array);
    self->cq_head = (unsigned *)(c + p.cq_off.head);
    self->cq_tail = (unsigned *)(c + p.cq_off.tail);
    self->cq_mask = (unsigned *)(c + p.cq_off.ring_mask);
    self->cqes = (struct io_uring_cqe *)(c + p.cq_off.cqes);
    /* In flight at once: no more than either ring holds (the CQ ring is at least as large). */
    self->depth = (unsigned)depth < p.sq_entries ? (unsigned)depth : p.sq_entries;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        ring_unmap(self);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    ring_unmap(self);
    return -1;
}

static PyObject *ring_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw;
    SlotRing *self = (SlotRing *)type->tp_alloc(type, 0);
    if (self != NULL) self->fd = -1; /* never close descriptor 0 on a failed init */
    return (PyObject *)self;
}

static void ring_dealloc(SlotRing *self) {
    /* No method runs (each holds a reference), so no batch is in flight. */
    ring_unmap(self);
    if (self->lock != NULL) PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

typedef struct {
    int fd;
    int write;
    unsigned long long offset;
    int fail; /* injected errno, 0: none */
    Py_buffer view;
} Entry;

/* Runs without the GIL, the ring's lock held. Returns 0, or an errno of io_uring_enter that
 * stopped the batch; `*left` is then how many entries are still in the kernel's hands. */
static int ring_run(SlotRing *r, Entry *e, long long *res, unsigned n, double delay_s,
                    int enter_fail, unsigned *left) {
    unsigned next = 0, inflight = 0, reaped = 0;
    unsigned mask = *r->sq_mask, cmask = *r->cq_mask;
    int delayed = delay_s <= 0;
    while (reaped < n) {
        unsigned tail = *r->sq_tail;
        while (next < n && inflight < r->depth) {
            unsigned idx = tail & mask;
            struct io_uring_sqe *sqe = &r->sqes[idx];
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = e[next].write ? IORING_OP_WRITE : IORING_OP_READ;
            sqe->fd = e[next].fd;
            sqe->off = e[next].offset;
            sqe->addr = (unsigned long long)(uintptr_t)e[next].view.buf;
            sqe->len = (unsigned)e[next].view.len;
            sqe->user_data = next;
            r->sq_array[idx] = idx;
            tail++;
            next++;
            inflight++;
        }
        __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        /* What the kernel has not taken yet (a retry after EINTR resubmits only those). */
        unsigned pending = tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        unsigned head = *r->cq_head;
        int ready = head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        if (pending || !ready) {
            int got;
            if (enter_fail) { /* the fault seam: this enter fails, nothing taken */
                errno = enter_fail;
                enter_fail = 0;
                got = -1;
            } else {
                got = sys_enter(r->fd, pending, ready ? 0 : 1, IORING_ENTER_GETEVENTS);
            }
            if (got < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
                int err = errno;
                unsigned sq_head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
                *left = inflight - (tail - sq_head);
                /* Withdraw what the kernel has not taken: those SQEs point at this batch's
                 * buffers, given back once we return, and the next enter would send them (with
                 * user_data that alias the next batch's entries). Without SQPOLL the kernel
                 * reads the SQ ring only inside io_uring_enter, which runs under our lock, so
                 * setting the tail back is safe. The caller marks the ring broken as well: an
                 * error that is not transient says the ring itself (its descriptor, its maps)
                 * cannot be trusted, and its owner makes a fresh one. */
                __atomic_store_n(r->sq_tail, sq_head, __ATOMIC_RELEASE);
                return err;
            }
        }
        if (!delayed) { /* the fault seam: completions reaped late, buffers in flight */
            delayed = 1;
            struct timespec ts = {(time_t)delay_s, (long)((delay_s - (time_t)delay_s) * 1e9)};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
            }
        }
        unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != ctail) {
            struct io_uring_cqe *cqe = &r->cqes[head & cmask];
            unsigned long long i = cqe->user_data;
            if (i < n) {
                res[i] = e[i].fail ? -(long long)e[i].fail : (long long)cqe->res;
                reaped++;
                inflight--;
            }
            head++;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return 0;
}

static void release_views(Entry *e, unsigned n) {
    for (unsigned i = 0; i < n; i++) PyBuffer_Release(&e[i].view);
}

static PyObject *ring_submit(SlotRing *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"entries", "delay_s", "fail", "enter_fail", NULL};
    PyObject *seq_obj, *fail_obj = NULL;
    double delay_s = 0.0;
    int enter_fail = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|dOi:submit", names, &seq_obj, &delay_s,
                                     &fail_obj, &enter_fail))
        return NULL;
    if (enter_fail < 0 || enter_fail > 4095) {
        PyErr_SetString(PyExc_ValueError, "enter_fail must be an errno in [1, 4095], or 0");
        return NULL;
    }
    if (self->lock == NULL || self->fd < 0 || self->closing) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        return NULL;
    }
    if (!(delay_s >= 0 && delay_s <= RING_MAX_DELAY_S)) { /* NaN fails too */
        PyErr_Format(PyExc_ValueError, "delay_s must be in [0, %g]", RING_MAX_DELAY_S);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(seq_obj, "entries must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > RING_MAX_ENTRIES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "at most %d entries a call, got %zd", RING_MAX_ENTRIES,
                     count);
        return NULL;
    }
    unsigned n = (unsigned)count, held = 0;
    Entry *e = PyMem_Calloc(n ? n : 1, sizeof *e);
    long long *res = PyMem_Calloc(n ? n : 1, sizeof *res);
    PyObject *out = NULL;
    if (e == NULL || res == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (unsigned i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *buf;
        long long fd, offset;
        int write;
        if (!PyTuple_Check(item) ||
            !PyArg_ParseTuple(item, "LLOp;an entry is (fd, offset, buffer, write)", &fd, &offset,
                              &buf, &write)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "an entry is (fd, offset, buffer, write)");
            goto done;
        }
        if (fd < 0 || fd > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "entry %u: bad file descriptor %lld", i, fd);
            goto done;
        }
        if (PyObject_GetBuffer(buf, &e[i].view, write ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0)
            goto done;
        held = i + 1;
        Py_ssize_t len = e[i].view.len;
        if (len < 0 || (unsigned long long)len > RING_MAX_LEN || offset < 0 ||
            offset > LLONG_MAX - len) {
            PyErr_Format(PyExc_ValueError,
                         "entry %u: offset %lld and length %zd out of range (length at most %u)",
                         i, offset, len, RING_MAX_LEN);
            goto done;
        }
        e[i].fd = (int)fd;
        e[i].offset = (unsigned long long)offset;
        e[i].write = write;
    }
    if (fail_obj != NULL && fail_obj != Py_None) {
        PyObject *fails = PySequence_Fast(fail_obj, "fail must be a sequence of (index, errno)");
        if (fails == NULL) goto done;
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(fails); j++) {
            Py_ssize_t idx;
            int code;
            PyObject *pair = PySequence_Fast_GET_ITEM(fails, j);
            if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "ni", &idx, &code) || idx < 0 ||
                idx >= (Py_ssize_t)n || code <= 0 || code > 4095) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError,
                                    "fail: (index, errno) with an index of an entry, errno > 0");
                Py_DECREF(fails);
                goto done;
            }
            e[idx].fail = code;
        }
        Py_DECREF(fails);
    }
    int err = 0;
    unsigned left = 0;
    self->users++; /* from here until its buffers are given back, close() leaves the ring be */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    if (self->fd < 0)
        err = -1;
    else if (self->broken)
        err = -2;
    else if (n)
        err = ring_run(self, e, res, n, delay_s, enter_fail, &left);
    if (err > 0) {
        self->broken = 1;
        self->stranded = left > 0;
    }
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    self->users--;
    if (err == -1) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        goto done;
    }
    if (err == -2) {
        PyObject *why = Py_BuildValue("(is)", EIO, "the ring broke: an io_uring_enter failed");
        if (why != NULL) {
            PyErr_SetObject(PyExc_OSError, why); /* OSError(EIO, ...): errno set */
            Py_DECREF(why);
        }
        goto done;
    }
    if (err > 0) {
        if (left) held = 0; /* the kernel may still write into them: never given back */
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    self->batches += n > 0;
    self->entries += n;
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (unsigned i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(res[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    if (e != NULL) release_views(e, held);
    PyMem_Free(e);
    PyMem_Free(res);
    Py_DECREF(seq);
    if (self->closing && self->users == 0 && !self->stranded) ring_unmap(self);
    return out;
}

/* Never blocks: with a batch in flight (a hung device), the ring is marked closing and the
 * last call using it unmaps it once its buffers are given back. True if closed now. */
static PyObject *ring_close(SlotRing *self, PyObject *unused) {
    (void)unused;
    self->closing = 1;
    if (self->users > 0) Py_RETURN_FALSE;
    if (!self->stranded) ring_unmap(self); /* a stranded ring's requests may still run */
    else self->fd = -1;
    Py_RETURN_TRUE;
}

static PyObject *ring_get_closed(SlotRing *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(self->fd < 0);
}

static PyObject *ring_get_broken(SlotRing *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(self->broken);
}

static PyObject *ring_get_counts(SlotRing *self, void *unused) {
    (void)unused;
    return Py_BuildValue("(KK)", self->batches, self->entries);
}

static PyObject *ring_get_depth(SlotRing *self, void *unused) {
    (void)unused;
    return PyLong_FromUnsignedLong(self->depth);
}

static PyMethodDef ring_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))ring_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(entries, delay_s=0.0, fail=(), enter_fail=0) -> list of bytes moved or -errno, "
     "per entry"},
    {"close", (PyCFunction)ring_close, METH_NOARGS,
     "Unmap the rings and close the descriptor, now (True) or, with a batch in flight, once "
     "its submitter has reaped it (False)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef ring_getset[] = {
    {"closed", (getter)ring_get_closed, NULL, NULL, NULL},
    {"broken", (getter)ring_get_broken, NULL, "an io_uring_enter failed: no submit runs again",
     NULL},
    {"counts", (getter)ring_get_counts, NULL, "(batches, entries) submitted", NULL},
    {"depth", (getter)ring_get_depth, NULL, "entries in flight at most", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject SlotRingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.core._core.SlotRing",
    .tp_basicsize = sizeof(SlotRing),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A minimal io_uring for slot reads and writes (kvoffload/core/uring.c).",
    .tp_new = ring_new,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_getset = ring_getset,
};
