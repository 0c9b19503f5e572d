/* The blocking `kv://` client's commonest exchanges as one C call each (issue 29): send a
 * request's frame, read its answer, and for a get land the block's payload straight in the
 * caller's buffer, summing CRC32C as each cache-sized chunk lands.
 *
 * Only the answer everyone expects is taken here: a canonical GetResult / PutDone for the
 * request id sent. Anything else (an ErrorReply, a goodbye, another encoding, a value too short
 * to hold a block header or too long for the buffer, a bad frame) comes back as FALLBACK with
 * the bytes read so far, none of them past the frame head, and the Python codec, the reference,
 * takes over from exactly there: the same errors, retries and connection handling as without
 * this file. Every wire length is bounded before it sizes anything; nothing is allocated from one.
 *
 * Socket errors raise OSError, the deadline TimeoutError, as Python's socket module does; a
 * signal runs its handler and the call goes on unless the handler raised.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "_speedups.h"

#define HEAD 24
#define HEAD_READ 512           /* frames.HEAD_READ: the first read of an answer */
#define BLOCK_HEADER 96         /* wire.block.HEADER_BYTES */
#define CHUNK (256 << 10)       /* summed while it is still in L2 */
#define MAX_PLEN (4ull << 30)   /* the client's Limits.max_payload_bytes */
#define MAX_IOV 512

enum { DONE = 0, FALLBACK = 1, CUT = 2 };
enum { IO_OK = 0, IO_EOF = -1, IO_TIMEOUT = -2, IO_ERRNO = -3, IO_SIGNAL = -4 };

typedef struct {
    int fd;
    double deadline; /* CLOCK_MONOTONIC seconds */
    int err;         /* errno for IO_ERRNO */
} Io;

/* A signal interrupted a system call: run its Python handler (as the socket module does); true
 * when the handler raised, whose exception then stays set for the caller. Called without the
 * GIL; takes it for the check. */
static int signal_raised(void) {
    PyGILState_STATE g = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    PyGILState_Release(g);
    return raised;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Wait for `events` on the socket until the deadline. Called without the GIL. */
static int wait_for(Io *io, short events) {
    for (;;) {
        double left = io->deadline - now();
        if (left <= 0) return IO_TIMEOUT;
        struct pollfd p = {io->fd, events, 0};
        int ms = left > 3600.0 ? 3600000 : (int)(left * 1000.0) + 1;
        int r = poll(&p, 1, ms);
        if (r > 0) return IO_OK;
        if (r == 0) continue; /* the loop re-checks the deadline */
        if (errno == EINTR) {
            if (signal_raised()) return IO_SIGNAL;
            continue;
        }
        io->err = errno;
        return IO_ERRNO;
    }
}

/* Some bytes into buf (n > 0): how many, or an IO_ code. */
static Py_ssize_t recv_some(Io *io, uint8_t *buf, size_t n) {
    for (;;) {
        ssize_t got = recv(io->fd, buf, n, 0);
        if (got > 0) return got;
        if (got == 0) return IO_EOF;
        if (errno == EINTR) {
            if (signal_raised()) return IO_SIGNAL;
            continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) { io->err = errno; return IO_ERRNO; }
        int w = wait_for(io, POLLIN);
        if (w != IO_OK) return w;
    }
}

/* Every byte of iov[0..count) (modified). */
static int send_all(Io *io, struct iovec *iov, int count) {
    while (count) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)(count < MAX_IOV ? count : MAX_IOV);
        ssize_t sent = sendmsg(io->fd, &m, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) {
                if (signal_raised()) return IO_SIGNAL;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) { io->err = errno; return IO_ERRNO; }
            int w = wait_for(io, POLLOUT);
            if (w != IO_OK) return w;
            continue;
        }
        while (count && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count) {
            iov->iov_base = (uint8_t *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return IO_OK;
}

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Read until buf holds a frame head and its map (or HEAD_READ bytes); *have counts what is
 * there. IO_OK when a whole head is in, FALLBACK when the map does not fit (or EOF: *eof). */
static int read_head(Io *io, uint8_t *buf, size_t *have, int *eof) {
    for (;;) {
        if (*have >= HEAD) {
            uint64_t hlen = le(buf + 12, 4);
            if (hlen > HEAD_READ - HEAD) return FALLBACK;
            if (*have >= HEAD + hlen) return IO_OK;
        }
        Py_ssize_t got = recv_some(io, buf + *have, HEAD_READ - *have);
        if (got == IO_EOF) { *eof = 1; return FALLBACK; }
        if (got < 0) return (int)got;
        *have += (size_t)got;
    }
}

/* A response frame head for `rid` of type `op` with flags exactly FLAG_RESPONSE. */
static int head_is(const uint8_t *h, int op, uint64_t rid) {
    return !memcmp(h, "KVNP", 4) && h[4] == 1 && h[5] == op && le(h + 6, 2) == 1 &&
           le(h + 8, 4) == rid;
}

/* The canonical GetResult map: {"length": nil or uint}; -1 for nil, -2 for anything else. */
static long long get_length(const uint8_t *p, size_t n) {
    static const uint8_t name[] = {0x81, 0xa6, 'l', 'e', 'n', 'g', 't', 'h'};
    if (n < sizeof name + 1 || memcmp(p, name, sizeof name)) return -2;
    p += sizeof name;
    n -= sizeof name;
    uint64_t v;
    if (n == 1 && *p == 0xc0) return -1;
    if (n == 1 && *p < 0x80) v = *p;
    else if (*p >= 0xcc && *p <= 0xcf && n == 1 + (1u << (*p - 0xcc))) {
        v = 0;
        for (size_t i = 1; i < n; i++) v = (v << 8) | p[i];
    } else return -2;
    return v > MAX_PLEN ? -2 : (long long)v;
}

/* Raise the Python exception for an IO_ code (the GIL held). */
static PyObject *io_error(Io *io, int code) {
    if (code == IO_TIMEOUT) PyErr_SetString(PyExc_TimeoutError, "timed out");
    else if (code == IO_SIGNAL) {
        /* the handler's exception is set already */
    } else {
        errno = io->err;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return NULL;
}

/* The frame parts as an iovec: views[] and iov[] hold `most` entries; more parts than that
 * are refused (the caller sends those through Python). */
static int gather(PyObject *parts, Py_buffer *views, struct iovec *iov, int most) {
    PyObject *seq = PySequence_Fast(parts, "parts must be a sequence of buffers");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > most) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many parts for one call");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], PyBUF_C_CONTIGUOUS) <
            0) {
            while (i--) PyBuffer_Release(&views[i]);
            Py_DECREF(seq);
            return -1;
        }
        iov[i].iov_base = views[i].buf;
        iov[i].iov_len = (size_t)views[i].len;
    }
    Py_DECREF(seq);
    return (int)n;
}

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

#define PARTS_MAX 1024 /* a put_many of up to 511 blocks */

/* The arguments every exchange checks before it sends: a request id the codec could have
 * numbered (0 is the connection's own, whose ErrorReply is a goodbye: an answer "for" it must
 * not be taken) and a deadline poll() can honour (NaN would wait forever). */
/* An "O&" converter: a request id as an int in [0, 2**64), where "K" would take any int modulo
 * 2**64 (2**64 + 5 as request 5). */
static int rid_arg(PyObject *o, void *out) {
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "a request id is an int");
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o); /* OverflowError outside the range */
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(unsigned long long *)out = v;
    return 1;
}

static int bad_call(const char *name, unsigned long long rid, double timeout) {
    if (rid == 0 || rid > 0xffffffffull || timeout != timeout) {
        PyErr_Format(PyExc_ValueError, "%s: a 32-bit request id (not 0) and a timeout", name);
        return 1;
    }
    return 0;
}

const char speedups_net_put_doc[] =
    "net_put(fd, parts, request_id, op, timeout) -> (status, 0, 0, eof, bytes): send a Put or "
    "PutMany frame's parts (at most 1024), read its answer of type `op` with an empty map "
    "(status 0), or hand back what was read (1).";

PyObject *speedups_net_put(PyObject *self, PyObject *args) {
    int fd, op;
    PyObject *parts;
    unsigned long long rid;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOO&id:net_put", &fd, &parts, rid_arg, &rid, &op, &timeout))
        return NULL;
    if (bad_call("net_put", rid, timeout)) return NULL;
    Py_buffer *views = PyMem_Malloc(PARTS_MAX * sizeof *views);
    struct iovec *iov = PyMem_Malloc(PARTS_MAX * sizeof *iov);
    int n = views && iov ? gather(parts, views, iov, PARTS_MAX) : -1;
    if (n < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        PyMem_Free(views);
        PyMem_Free(iov);
        return NULL;
    }
    Io io = {fd, now() + timeout, 0};
    uint8_t head[HEAD_READ];
    size_t have = 0;
    int eof = 0, code;
    Py_BEGIN_ALLOW_THREADS
    code = send_all(&io, iov, n);
    if (code == IO_OK) code = read_head(&io, head, &have, &eof);
    Py_END_ALLOW_THREADS
    release(views, n);
    PyMem_Free(views);
    PyMem_Free(iov);
    if (code < 0) return io_error(&io, code);
    int status = FALLBACK;
    if (code == IO_OK && have == HEAD + 1 && head_is(head, op, rid) && le(head + 12, 4) == 1 &&
        le(head + 16, 8) == 0 && head[HEAD] == 0x80)
        status = DONE;
    return Py_BuildValue("(iiIiy#)", status, 0, 0u, eof, (const char *)head,
                         status == DONE ? (Py_ssize_t)0 : (Py_ssize_t)have);
}

const char speedups_net_get_into_doc[] =
    "net_get_into(fd, frame, request_id, header, buffer, timeout) -> (status, length, crc, "
    "eof, bytes): send a Get frame (or build it: `frame` 16 bytes is the key); a hit lands its block header in `header` (96 bytes) and "
    "its payload at the start of `buffer`: (0, payload length, its CRC32C, 0, bytes read past "
    "the frame); a miss (0, -1, 0, 0, bytes past the frame); (1, 0, 0, eof, bytes read) for the "
    "Python codec; (2, 0, 0, 1, b'') when the daemon closed the connection mid-payload. A get "
    "that fails part-way zeroes the bytes it landed.";

PyObject *speedups_net_get_into(PyObject *self, PyObject *args) {
    int fd;
    PyObject *frame;
    unsigned long long rid;
    Py_buffer header, buffer;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOO&w*w*d:net_get_into", &fd, &frame, rid_arg, &rid, &header,
                          &buffer, &timeout))
        return NULL;
    PyObject *result = NULL;
    Py_buffer view;
    struct iovec iov[1];
    if (bad_call("net_get_into", rid, timeout)) goto out;
    if (header.len < BLOCK_HEADER || !PyBuffer_IsContiguous(&buffer, 'C')) {
        PyErr_SetString(PyExc_ValueError, "net_get_into: a 96-byte header, a flat buffer");
        goto out;
    }
    /* A 16-byte `frame` is the key: the Get frame is built here, as msgpack.packb would. */
    uint8_t get[HEAD + 23];
    int n = 0;
    if (PyBytes_Check(frame) && PyBytes_GET_SIZE(frame) == 16) {
        static const uint8_t map[] = {0x81, 0xa3, 'k', 'e', 'y', 0xc4, 0x10};
        memset(get, 0, HEAD);
        memcpy(get, "KVNP", 4);
        get[4] = 1;
        get[5] = 3;
        for (int i = 0; i < 4; i++) get[8 + i] = (uint8_t)(rid >> (8 * i));
        get[12] = 23;
        memcpy(get + HEAD, map, sizeof map);
        memcpy(get + HEAD + sizeof map, PyBytes_AS_STRING(frame), 16);
        iov[0].iov_base = get;
        iov[0].iov_len = sizeof get;
        n = 1;
    } else {
        PyObject *one = PyTuple_Pack(1, frame);
        if (!one) goto out;
        n = gather(one, &view, iov, 1);
        Py_DECREF(one);
        if (n < 0) goto out;
    }
    int views_held = PyBytes_Check(frame) && PyBytes_GET_SIZE(frame) == 16 ? 0 : n;
    Io io = {fd, now() + timeout, 0};
    uint8_t head[HEAD_READ];
    size_t have = 0, past = 0;
    int eof = 0, code, status = FALLBACK;
    long long length = 0;
    uint32_t reg = 0xffffffffu;
    size_t landed = 0;
    uint8_t *out = buffer.buf, *hdr = header.buf;
    Py_BEGIN_ALLOW_THREADS
    code = send_all(&io, iov, n);
    if (code == IO_OK) code = read_head(&io, head, &have, &eof);
    if (code == IO_OK && head_is(head, 3, rid)) {
        size_t end = HEAD + (size_t)le(head + 12, 4);
        uint64_t plen = le(head + 16, 8);
        length = get_length(head + HEAD, end - HEAD);
        if (length == -1 && plen == 0) {
            status = DONE;
            past = end;
        } else if (length >= BLOCK_HEADER && (uint64_t)length == plen &&
                   (uint64_t)length - BLOCK_HEADER <= (uint64_t)buffer.len) {
            /* Committed: from here on, bytes go to the caller's buffers. */
            size_t want = (size_t)length - BLOCK_HEADER, in_head = have - end;
            size_t take = in_head < BLOCK_HEADER ? in_head : BLOCK_HEADER;
            memcpy(hdr, head + end, take);
            size_t hgot = take;
            size_t more = in_head - take < want ? in_head - take : want;
            reg = crc_update(reg, out, head + end + take, more);
            landed = more;
            past = end + take + more;
            status = DONE;
            while (hgot < BLOCK_HEADER) {
                Py_ssize_t got = recv_some(&io, hdr + hgot, BLOCK_HEADER - hgot);
                if (got < 0) { code = (int)got; break; }
                hgot += (size_t)got;
            }
            while (code == IO_OK && landed < want) {
                size_t ask = want - landed < CHUNK ? want - landed : CHUNK;
                Py_ssize_t got = recv_some(&io, out + landed, ask);
                if (got < 0) { code = (int)got; break; }
                reg = crc_update(reg, NULL, out + landed, (size_t)got);
                landed += (size_t)got;
            }
            if (code == IO_EOF) { status = CUT; code = IO_OK; }
            /* A get that fails part-way leaves no byte of the block in the caller's buffer
             * (and touches none past what landed). */
            if (code != IO_OK || status == CUT) memset(out, 0, landed);
        } else {
            length = 0;
        }
    }
    Py_END_ALLOW_THREADS
    release(&view, views_held);
    if (code < 0) { io_error(&io, code); goto out; }
    if (status == CUT)
        result = Py_BuildValue("(iiIiy#)", CUT, 0, 0u, 1, "", (Py_ssize_t)0);
    else if (status == DONE)
        result = Py_BuildValue("(iLIiy#)", DONE, length < 0 ? -1LL : length - BLOCK_HEADER,
                               (unsigned)~reg, 0, (const char *)head + past,
                               (Py_ssize_t)(have - past));
    else
        result = Py_BuildValue("(iiIiy#)", FALLBACK, 0, 0u, eof, (const char *)head,
                               (Py_ssize_t)have);
out:
    PyBuffer_Release(&header);
    PyBuffer_Release(&buffer);
    return result;
}

/* ------------------------------------------------------------------ get_many_into */

/* Where an answer's bytes come from: first what the head read took past the map, then the
 * socket. */
typedef struct {
    const uint8_t *buf;
    size_t pos, have;
} Src;

/* n bytes into dst (summed into *reg unless reg is NULL), in CHUNK-sized reads; *landed
 * counts what arrived. IO_OK, IO_EOF or an error code. */
static int take(Io *io, Src *src, uint8_t *dst, size_t n, uint32_t *reg, size_t *landed) {
    size_t from_head = src->have - src->pos < n ? src->have - src->pos : n;
    if (reg) *reg = crc_update(*reg, dst, src->buf + src->pos, from_head);
    else memcpy(dst, src->buf + src->pos, from_head);
    src->pos += from_head;
    *landed = from_head;
    while (*landed < n) {
        size_t ask = n - *landed < CHUNK ? n - *landed : CHUNK;
        Py_ssize_t got = recv_some(io, dst + *landed, ask);
        if (got < 0) return (int)got;
        if (reg) *reg = crc_update(*reg, NULL, dst + *landed, (size_t)got);
        *landed += (size_t)got;
    }
    return IO_OK;
}

/* The canonical GetManyResult map {"lengths": [nil or uint, ...]} of exactly `count` entries
 * into lengths[] (-1 for nil); its sum in *total. 0, or -1 for anything else. */
static int many_lengths(const uint8_t *p, size_t n, long long *lengths, size_t count,
                        uint64_t *total) {
    static const uint8_t name[] = {0x81, 0xa7, 'l', 'e', 'n', 'g', 't', 'h', 's'};
    const uint8_t *e = p + n;
    if (n < sizeof name + 1 || memcmp(p, name, sizeof name)) return -1;
    p += sizeof name;
    size_t items;
    if ((*p & 0xf0) == 0x90) items = *p++ & 0x0f;
    else if (*p == 0xdc && e - p >= 3) { items = (size_t)((p[1] << 8) | p[2]); p += 3; }
    else return -1; /* array 32 cannot fit a head read */
    if (items != count) return -1;
    *total = 0;
    for (size_t i = 0; i < count; i++) {
        if (p >= e) return -1;
        uint64_t v;
        if (*p == 0xc0) { lengths[i] = -1; p++; continue; }
        if (*p < 0x80) { v = *p++; }
        else if (*p >= 0xcc && *p <= 0xcf) {
            size_t w = 1u << (*p - 0xcc);
            if ((size_t)(e - p) < 1 + w) return -1;
            v = 0;
            for (size_t k = 1; k <= w; k++) v = (v << 8) | p[k];
            p += 1 + w;
        } else return -1;
        if (v > MAX_PLEN) return -1;
        lengths[i] = (long long)v;
        *total += v;
    }
    return p == e ? 0 : -1;
}

#define MANY_MAX 256 /* keys per call: a lengths map of more could not fit a head read */

const char speedups_net_get_many_into_doc[] =
    "net_get_many_into(fd, frame, request_id, headers, buffers, timeout) -> (status, lengths, "
    "crcs, eof, bytes): send a GetMany frame; when every key is answered, each hit's block "
    "header lands in headers[i] (96 bytes) and its payload at the start of buffers[i]: (0, "
    "payload lengths (-1: a miss), their CRC32Cs, 0, bytes read past the frame); else as "
    "net_get_into. A failure part-way zeroes what landed.";

PyObject *speedups_net_get_many_into(PyObject *self, PyObject *args) {
    int fd;
    PyObject *frame, *hdrs, *bufs;
    unsigned long long rid;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOO&O!O!d:net_get_many_into", &fd, &frame, rid_arg, &rid,
                          &PyList_Type, &hdrs, &PyList_Type, &bufs, &timeout))
        return NULL;
    if (bad_call("net_get_many_into", rid, timeout)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(bufs);
    if (count < 1 || count > MANY_MAX || PyList_GET_SIZE(hdrs) != count) {
        PyErr_SetString(PyExc_ValueError, "net_get_many_into: 1 to 256 headers and buffers");
        return NULL;
    }
    Py_buffer views[2 * MANY_MAX + 1];
    int held = 0;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < 2 * count; i++, held++) {
        PyObject *o = i < count ? PyList_GET_ITEM(hdrs, i) : PyList_GET_ITEM(bufs, i - count);
        if (PyObject_GetBuffer(o, &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto out;
        if (i < count && views[i].len < BLOCK_HEADER) {
            held++;
            PyErr_SetString(PyExc_ValueError, "net_get_many_into: headers of 96 bytes");
            goto out;
        }
    }
    struct iovec iov[1];
    PyObject *one = PyTuple_Pack(1, frame);
    if (!one) goto out;
    int n = gather(one, &views[held], iov, 1);
    Py_DECREF(one);
    if (n < 0) goto out;
    held += n;
    Io io = {fd, now() + timeout, 0};
    uint8_t head[HEAD_READ];
    long long lengths[MANY_MAX];
    uint32_t crcs[MANY_MAX];
    size_t have = 0, at = 0, landed = 0;
    int eof = 0, code, status = FALLBACK;
    Src src = {head, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    code = send_all(&io, iov, n);
    if (code == IO_OK) code = read_head(&io, head, &have, &eof);
    uint64_t total = 0;
    if (code == IO_OK && head_is(head, 7, rid)) {
        size_t end = HEAD + (size_t)le(head + 12, 4);
        int fits = !many_lengths(head + HEAD, end - HEAD, lengths, (size_t)count, &total) &&
                   total == le(head + 16, 8);
        for (Py_ssize_t i = 0; fits && i < count; i++)
            fits = lengths[i] < 0 || (lengths[i] >= BLOCK_HEADER &&
                                      lengths[i] - BLOCK_HEADER <= views[count + i].len);
        if (fits) {
            /* Committed: from here on, bytes go to the caller's buffers. */
            status = DONE;
            src.pos = end;
            src.have = have;
            for (at = 0; code == IO_OK && at < (size_t)count; at++) {
                crcs[at] = 0;
                if (lengths[at] < 0) continue;
                code = take(&io, &src, views[at].buf, BLOCK_HEADER, NULL, &landed);
                uint32_t reg = 0xffffffffu;
                if (code == IO_OK)
                    code = take(&io, &src, views[count + at].buf,
                                (size_t)lengths[at] - BLOCK_HEADER, &reg, &landed);
                else landed = 0;
                crcs[at] = ~reg;
            }
            if (code == IO_EOF) { status = CUT; code = IO_OK; }
            if (code != IO_OK || status == CUT) {
                /* No byte of any block stays: the ones done, and the one cut off. */
                for (size_t i = 0; i + 1 < at; i++)
                    if (lengths[i] >= BLOCK_HEADER)
                        memset(views[count + i].buf, 0, (size_t)lengths[i] - BLOCK_HEADER);
                if (at) memset(views[count + at - 1].buf, 0, landed);
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (code < 0) { io_error(&io, code); goto out; }
    if (status == CUT) {
        result = Py_BuildValue("(iOOiy#)", CUT, Py_None, Py_None, 1, "", (Py_ssize_t)0);
    } else if (status == DONE) {
        PyObject *ls = PyList_New(count), *cs = PyList_New(count);
        for (Py_ssize_t i = 0; ls && cs && i < count; i++) {
            PyList_SET_ITEM(ls, i, PyLong_FromLongLong(lengths[i] < 0 ? -1 : lengths[i] - BLOCK_HEADER));
            PyList_SET_ITEM(cs, i, PyLong_FromUnsignedLong(crcs[i]));
        }
        if (ls && cs && !PyErr_Occurred())
            result = Py_BuildValue("(iOOiy#)", DONE, ls, cs, 0, (const char *)head + src.pos,
                                   (Py_ssize_t)(src.have - src.pos));
        Py_XDECREF(ls);
        Py_XDECREF(cs);
    } else {
        result = Py_BuildValue("(iOOiy#)", FALLBACK, Py_None, Py_None, eof, (const char *)head,
                               (Py_ssize_t)have);
    }
out:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    return result;
}

#define LOOKUP_OP 8
#define LOOKUP_MAX_KEYS 4096 /* plans._BATCH_KEYS: a Lookup frame of at most ~72 KiB */

/* The canonical LookupResult map: {"count": uint}; -1 for anything else (tiers, another
 * encoding), which the Python codec then reads. */
static long long lookup_count(const uint8_t *p, size_t n) {
    static const uint8_t name[] = {0x81, 0xa5, 'c', 'o', 'u', 'n', 't'};
    if (n < sizeof name + 1 || memcmp(p, name, sizeof name)) return -1;
    p += sizeof name;
    n -= sizeof name;
    if (n == 1 && *p < 0x80) return *p;
    if (*p >= 0xcc && *p <= 0xcf && n == 1 + (1u << (*p - 0xcc))) {
        uint64_t v = 0;
        for (size_t i = 1; i < n; i++) v = (v << 8) | p[i];
        return v > LOOKUP_MAX_KEYS ? -1 : (long long)v;
    }
    return -1;
}

const char speedups_net_lookup_doc[] =
    "net_lookup(fd, keys, request_id, timeout) -> (status, count, eof, bytes): build the "
    "Lookup frame of `keys` (a list or tuple of 1 to 4096 16-byte bytes; else TypeError or "
    "ValueError and nothing sent) as msgpack.packb would, send it in one sendmsg and read its "
    "answer: (0, count, 0, b'') for a canonical LookupResult, (1, 0, eof, bytes read) for the "
    "Python codec. `count` is as the daemon sent it (at most 4096): the caller checks it "
    "against len(keys).";

PyObject *speedups_net_lookup(PyObject *self, PyObject *args) {
    int fd;
    PyObject *keys;
    unsigned long long rid;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOO&d:net_lookup", &fd, &keys, rid_arg, &rid, &timeout))
        return NULL;
    if (bad_call("net_lookup", rid, timeout)) return NULL;
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) {
        PyErr_SetString(PyExc_TypeError, "net_lookup: keys must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (n < 1 || n > LOOKUP_MAX_KEYS) {
        PyErr_SetString(PyExc_ValueError, "net_lookup: 1 to 4096 keys");
        return NULL;
    }
    /* map of one entry, "keys", an array of n bin8 of 16 bytes (array16 past 15 items) */
    size_t arr = n < 16 ? 1 : 3;
    size_t hlen = 1 + 5 + arr + (size_t)n * 18;
    uint8_t *frame = PyMem_Malloc(HEAD + hlen);
    if (!frame) return PyErr_NoMemory();
    uint8_t *p = frame;
    memcpy(p, "KVNP\x01\x08\x00\x00", 8);
    for (int i = 0; i < 4; i++) p[8 + i] = (uint8_t)(rid >> (8 * i));
    for (int i = 0; i < 4; i++) p[12 + i] = (uint8_t)(hlen >> (8 * i));
    memset(p + 16, 0, 8);
    p += HEAD;
    memcpy(p, "\x81\xa4keys", 6);
    p += 6;
    if (n < 16) *p++ = (uint8_t)(0x90 | n);
    else {
        *p++ = 0xdc;
        *p++ = (uint8_t)(n >> 8);
        *p++ = (uint8_t)n;
    }
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) != 16) {
            PyMem_Free(frame);
            PyErr_SetString(PyExc_TypeError, "net_lookup: every key is 16 bytes");
            return NULL;
        }
        p[0] = 0xc4;
        p[1] = 16;
        memcpy(p + 2, PyBytes_AS_STRING(k), 16);
        p += 18;
    }
    Io io = {fd, now() + timeout, 0};
    struct iovec iov = {frame, HEAD + hlen};
    uint8_t head[HEAD_READ];
    size_t have = 0;
    int eof = 0, code;
    Py_BEGIN_ALLOW_THREADS
    code = send_all(&io, &iov, 1);
    /* The daemon has yet to read the keys: waiting first saves a recv that would find nothing
     * (strace: 998 of 1,000 did). */
    if (code == IO_OK) code = wait_for(&io, POLLIN);
    if (code == IO_OK) code = read_head(&io, head, &have, &eof);
    Py_END_ALLOW_THREADS
    PyMem_Free(frame);
    if (code < 0) return io_error(&io, code);
    long long count = -1;
    if (code == IO_OK && head_is(head, LOOKUP_OP, rid) && have == HEAD + le(head + 12, 4) &&
        le(head + 16, 8) == 0)
        count = lookup_count(head + HEAD, have - HEAD);
    if (count >= 0) return Py_BuildValue("(iLiy#)", DONE, count, 0, "", (Py_ssize_t)0);
    return Py_BuildValue("(iLiy#)", FALLBACK, 0LL, eof, (const char *)head, (Py_ssize_t)have);
}
