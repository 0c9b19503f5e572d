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
 * Registered files and memory (`register_files`, `register_memory`, `clone_memory`): the slot
 * file's descriptor goes in the ring's file table (IORING_REGISTER_FILES) and an entry on it is
 * sent with IOSQE_FIXED_FILE (no file lookup and reference per request); the DRAM arena goes in
 * its buffer table (IORING_REGISTER_BUFFERS, in 1 GiB pieces, the kernel's cap per buffer) and
 * an entry whose buffer lies inside one piece is READ_FIXED / WRITE_FIXED (its pages pinned
 * once, not per request). Other rings of the same owner clone that table
 * (IORING_REGISTER_CLONE_BUFFERS, Linux 6.12+), so the arena is pinned once, not per ring. The
 * ring holds an export of the registered memory until it is unmapped, so the memory cannot be
 * unmapped (and its addresses reused) while the ring's table points at it. A registered
 * descriptor must not be closed while the ring may still submit on it: the table holds the
 * file the number named then. Every registration that fails raises OSError: the owner goes on
 * with plain descriptors and addresses (and counts it).
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
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define RING_MAX_DEPTH 4096
#define RING_MAX_ENTRIES 65536     /* entries of one submit call */
#define RING_MAX_LEN (1u << 30)    /* bytes of one entry (the kernel's cap is ~2 GiB) */
#define RING_MAX_DELAY_S 60.0
#define RING_MAX_FILES 8
#define RING_MAX_BUFS 1024         /* 1 TiB of registered memory */
#define RING_BUF_SHIFT 30          /* registered memory in 1 GiB pieces (the kernel's cap) */

/* IORING_REGISTER_CLONE_BUFFERS (Linux 6.12) under names of our own: older headers lack it,
 * and newer ones declare the struct while the opcode is an enum member #ifndef cannot see. */
#define KVO_REGISTER_CLONE_BUFFERS 30
struct kvo_clone_buffers {
    __u32 src_fd;
    __u32 flags;
    __u32 src_off;
    __u32 dst_off;
    __u32 nr;
    __u32 pad[3];
};

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
    int files[RING_MAX_FILES]; /* registered descriptors, by table index */
    unsigned nfiles;
    Py_buffer memory;          /* registered memory, exported until unmapped; .obj NULL: none */
    unsigned nbufs;            /* its 1 GiB pieces in the buffer table */
    unsigned long long fixed_files, fixed_bufs; /* entries sent with each */
} SlotRing;

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static int sys_register(int fd, unsigned op, void *arg, unsigned nr) {
    return (int)syscall(__NR_io_uring_register, fd, op, arg, nr);
}

/* With the GIL held (the memory's export is given back here). */
static void ring_unmap(SlotRing *r) {
    if (r->memory.obj != NULL) PyBuffer_Release(&r->memory); /* the table goes with the fd */
    r->nbufs = r->nfiles = 0;
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
            for (unsigned k = 0; k < r->nfiles; k++) {
                if (r->files[k] == e[next].fd) {
                    sqe->fd = (int)k; /* its index in the file table */
                    sqe->flags |= IOSQE_FIXED_FILE;
                    r->fixed_files++;
                    break;
                }
            }
            if (r->nbufs) {
                uintptr_t base = (uintptr_t)r->memory.buf, at = (uintptr_t)e[next].view.buf;
                size_t len = (size_t)e[next].view.len;
                /* len first: memory.len - len must not wrap for an entry larger than it */
                if (len && len <= (size_t)r->memory.len && at >= base &&
                    at - base <= (size_t)r->memory.len - len &&
                    (at - base) >> RING_BUF_SHIFT == (at - base + len - 1) >> RING_BUF_SHIFT) {
                    sqe->opcode = e[next].write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
                    sqe->buf_index = (__u16)((at - base) >> RING_BUF_SHIFT);
                    r->fixed_bufs++;
                }
            }
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

/* Registration runs with the ring's lock held (no batch in flight) and the GIL released. */
static int ring_usable(SlotRing *self) {
    if (self->lock == NULL || self->fd < 0 || self->closing || self->broken) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed or broken");
        return 0;
    }
    return 1;
}

static PyObject *ring_register_files(SlotRing *self, PyObject *arg) {
    if (!ring_usable(self)) return NULL;
    if (self->nfiles) {
        PyErr_SetString(PyExc_ValueError, "files are registered already");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "register_files takes a sequence of descriptors");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int fds[RING_MAX_FILES];
    if (n < 1 || n > RING_MAX_FILES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "register 1 to %d descriptors, got %zd", RING_MAX_FILES,
                     n);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        if (v < 0 || v > INT_MAX) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "bad file descriptor %ld", v);
            return NULL;
        }
        fds[i] = (int)v;
    }
    Py_DECREF(seq);
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = sys_register(self->fd, IORING_REGISTER_FILES, fds, (unsigned)n);
    if (rc < 0)
        err = errno;
    else {
        memcpy(self->files, fds, sizeof(int) * (size_t)n);
        self->nfiles = (unsigned)n;
    }
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *ring_register_memory(SlotRing *self, PyObject *arg) {
    if (!ring_usable(self)) return NULL;
    if (self->memory.obj != NULL) {
        PyErr_SetString(PyExc_ValueError, "memory is registered already");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0) return NULL;
    size_t len = (size_t)view.len;
    unsigned n = (unsigned)((len + (1ull << RING_BUF_SHIFT) - 1) >> RING_BUF_SHIFT);
    if (len == 0 || n > RING_MAX_BUFS) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "register 1 byte to %u GiB of memory, got %zu bytes",
                     RING_MAX_BUFS, len);
        return NULL;
    }
    struct iovec *iov = PyMem_Calloc(n, sizeof *iov);
    if (iov == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    for (unsigned i = 0; i < n; i++) {
        size_t off = (size_t)i << RING_BUF_SHIFT;
        iov[i].iov_base = (char *)view.buf + off;
        iov[i].iov_len = len - off < (1ull << RING_BUF_SHIFT) ? len - off : 1ull << RING_BUF_SHIFT;
    }
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = sys_register(self->fd, IORING_REGISTER_BUFFERS, iov, n); /* pins the pages */
    err = errno;
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    PyMem_Free(iov);
    if (rc < 0) {
        PyBuffer_Release(&view);
        errno = err; /* ENOMEM past RLIMIT_MEMLOCK without CAP_IPC_LOCK, EFAULT, ... */
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->memory = view;
    self->nbufs = n;
    Py_RETURN_NONE;
}

static PyObject *ring_clone_memory(SlotRing *self, PyObject *arg) {
    if (!ring_usable(self)) return NULL;
    if (!PyObject_TypeCheck(arg, Py_TYPE(self))) {
        PyErr_SetString(PyExc_TypeError, "clone_memory takes another SlotRing");
        return NULL;
    }
    SlotRing *src = (SlotRing *)arg;
    if (src == self || self->memory.obj != NULL || src->memory.obj == NULL || src->fd < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "clone_memory: the source needs registered memory, this ring none");
        return NULL;
    }
    Py_buffer view; /* an export of its own: the memory outlives this ring's table */
    if (PyObject_GetBuffer(src->memory.obj, &view, PyBUF_WRITABLE) < 0) return NULL;
    if (view.buf != src->memory.buf || view.len != src->memory.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "clone_memory: the source's memory moved");
        return NULL;
    }
    struct kvo_clone_buffers clone;
    memset(&clone, 0, sizeof clone);
    clone.src_fd = (__u32)src->fd;
    int rc, err = 0;
    /* Only this ring's lock: the source's table is not changed, and the kernel locks both. */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    rc = sys_register(self->fd, KVO_REGISTER_CLONE_BUFFERS, &clone, 1);
    err = errno;
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyBuffer_Release(&view);
        errno = err; /* EINVAL before Linux 6.12 */
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->memory = view;
    self->nbufs = src->nbufs;
    Py_RETURN_NONE;
}

static PyObject *ring_get_registered(SlotRing *self, void *unused) {
    (void)unused;
    return Py_BuildValue("(II)", self->nfiles, self->nbufs);
}

static PyObject *ring_get_fixed(SlotRing *self, void *unused) {
    (void)unused;
    return Py_BuildValue("(KK)", self->fixed_files, self->fixed_bufs);
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
    {"register_files", (PyCFunction)ring_register_files, METH_O,
     "register_files(fds): put the descriptors in the ring's file table; entries on them are "
     "sent as fixed files. Close the ring before closing them."},
    {"register_memory", (PyCFunction)ring_register_memory, METH_O,
     "register_memory(buffer): pin a writable buffer in the ring's buffer table (1 GiB "
     "pieces); entries inside one piece are READ_FIXED / WRITE_FIXED. Held until unmapped."},
    {"clone_memory", (PyCFunction)ring_clone_memory, METH_O,
     "clone_memory(ring): share another ring's registered memory (Linux 6.12+), no new pin."},
    {"close", (PyCFunction)ring_close, METH_NOARGS,
     "Unmap the rings and close the descriptor, now (True) or, with a batch in flight, once "
     "its submitter has reaped it (False)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef ring_getset[] = {
    {"closed", (getter)ring_get_closed, NULL, NULL, NULL},
    {"broken", (getter)ring_get_broken, NULL, "an io_uring_enter failed: no submit runs again",
     NULL},
    {"counts", (getter)ring_get_counts, NULL, "(batches, entries) submitted", NULL},
    {"registered", (getter)ring_get_registered, NULL,
     "(descriptors, 1 GiB pieces of memory) registered", NULL},
    {"fixed", (getter)ring_get_fixed, NULL,
     "(entries sent on a registered file, entries on registered memory)", NULL},
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
