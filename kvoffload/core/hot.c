/* HotGets: the daemon's DRAM hit path for Get, GetMany, Exists and Lookup requests, in C
 * (issue 29).
 *
 * One per authenticated plain-TCP connection of a DRAM-only engine (the native session makes
 * it after Hello; NativeSession.start_hot). `serve(reader, inflight, max_inflight, most)` is
 * called once per wake-up while the connection has no request outstanding. It takes the whole
 * Get, GetMany, Exists and Lookup frames at the front of the buffer (`FrameReader`'s bytes, in the
 * canonical encoding the Python client sends), at most `most` of them (what is left of the
 * connection's turn of the loop: a pipelining peer still yields to the others), derives the
 * tenant's engine keys, and answers each under the engine's lock exactly as `Reads.acquire`,
 * `Engine.contains` and `Engine.lookup` do (the same counters, the same touches and pins; a
 * GetMany as `requests.on_get_many` does: chunks of `step` keys, the answer cut short where the
 * frame's payload limit or the daemon's answer pin budget says so),
 * building each answer's header with `fast.frame_head`. It stops at the
 * first frame it does not take whole (any other request, a non-canonical or bad frame, an
 * engine closing), which the Python session then reads and answers as always: the answers
 * leave in request order. `release(views, entries, taken)` unpins once the kernel took the
 * bytes and gives `taken` back to the pin budget. `arm` and calling the object make it the
 * connection's reader callback on the event loop (receive, `serve`, hand back; see below).
 */
#include "core.h" /* Python.h first: it sets the POSIX feature macros (clock_gettime) */
#include "../wire/_speedups.h" /* crc_update: the CRC32C of a key's shard */

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define HEAD 24
#define GET_MAP 23 /* {"key": bin8 of 16 bytes}: fixmap 1, fixstr 3, "key", bin8, 16, key */
#define OP_GET 3
#define OP_EXISTS 4 /* the same request map as a Get's; the answer carries no payload */
#define OP_GET_MANY 7 /* {"keys": [...]} as a Lookup's; the answer {"lengths": [...]} */
#define OP_LOOKUP 8
#define NOPS CORE_HOT_OPS /* in take_metrics' order: get, exists, lookup, get_many, put */
#define PUT_OP 4          /* put_done's row of the counts */
#define MAX_BOUNDS 32 /* latency buckets counted in C (metrics._BUCKETS has 15) */
#define IOV_BATCH 512 /* buffers per sendmsg: Linux refuses more than IOV_MAX (1024) */
#define OP_PUT 2
#define LARGE_PAYLOAD (32 << 10) /* frames.LARGE_PAYLOAD */
#define SMALL_READ 512         /* frames.HEAD_READ */

typedef struct {
    PyObject_HEAD
    PyObject *lock;          /* the engine's threading.Lock */
    DramIndex *index;        /* the engine's C DramIndex */
    PyObject *counters;      /* the manager's counters (dict) */
    PyObject *manager;       /* for its `closing` / `closed` flags */
    PyObject *apply_touches; /* DramTier.apply_touches */
    PyObject *free;          /* DramTier.free */
    PyObject *arena;         /* memoryview of the whole arena */
    PyObject *prefix;        /* the tenant's keyed BLAKE3 hasher, or None */
    PyObject *frame_head;    /* kvoffload.wire.fast.frame_head */
    PyObject *head_state;    /* frames._State.HEAD */
    Py_ssize_t touch_ring;   /* hits queued before the policy is told (dram.TOUCH_RING) */
    /* GetMany, served only with `pins` given: the daemon's PinBudget (answers' pinned bytes
     * across connections), the frame's payload limit, and the engine's chunk (read_depth). */
    PyObject *pins;
    long long max_payload;
    Py_ssize_t step;
    /* A worker of a multi-worker daemon (`set_shard`): only frames whose client keys are all
     * of shard `shard_index` of `shard_count` are served; any other is left to Python, which
     * answers it WRONG_SHARD. shard_count 0 or 1: no check (one worker). */
    uint32_t shard_index, shard_count;
    /* With `buckets` given, serve(..., fd) sends and counts in C: requests, bytes out and
     * latencies by op (get, exists, lookup, get_many; put from put_done) and the put
     * payload bytes in, taken by `take_metrics` before every scrape. */
    Py_ssize_t nbounds;                       /* 0: no metrics in C (serve needs fd -1) */
    double bounds[MAX_BOUNDS];                /* the histogram's upper bounds, ascending */
    long long m_counts[NOPS], m_bytes_out, m_bytes_in;
    long long m_buckets[NOPS][MAX_BOUNDS + 1]; /* not cumulative; the last is +Inf */
    double m_sums[NOPS];
    /* The reader callback (`arm`, then the loop calls the object on readable): what it
     * reads into and hands back to, while armed. */
    int armed, r_fd;
    long long r_most, r_max_inflight;
    PyObject *r_reader, *r_handback, *r_services;
    double last_rx; /* when the callback last received (CLOCK_MONOTONIC, as time.monotonic) */
    /* Puts taken by the reader callback (`take_puts`; see "puts in the reader callback"):
     * the session's reserve and commit, and the put whose payload is arriving into its slot. */
    PyObject *p_begin, *p_commit, *p_slot, *p_token;
    int p_active, small_read;
    uint32_t p_rid;
    long long p_len, p_got;
    double p_t0;
} HotGets;

static PyObject *s_acquire, *s_release, *s_closing, *s_closed, *s_buf, *s_start, *s_end,
    *s_state, *s_head, *s_gets, *s_hits, *s_misses, *s_bytes_out, *s_copy, *s_update, *s_digest,
    *s_length_name, *s_found_name, *s_count_name, *s_limits, *s_max_header, *s_take,
    *s_give_back, *s_hot_names[5];
/* The handback's codes, made at import: handing back allocates no code object and so cannot
 * fail to call the handback (the session would wait for it until the idle timeout). */
static PyObject *s_back_codes[4];

static int intern_all(void) {
    struct { PyObject **at; const char *name; } names[] = {
        {&s_acquire, "acquire"}, {&s_release, "release"}, {&s_closing, "closing"},
        {&s_closed, "closed"}, {&s_buf, "_buf"}, {&s_start, "_start"}, {&s_end, "_end"},
        {&s_state, "_state"}, {&s_head, "_head"}, {&s_gets, "gets"}, {&s_hits, "hits"},
        {&s_misses, "misses"}, {&s_bytes_out, "bytes_out"}, {&s_copy, "copy"},
        {&s_update, "update"}, {&s_digest, "digest"}, {&s_length_name, "length"},
        {&s_found_name, "found"}, {&s_count_name, "count"}, {&s_limits, "limits"},
        {&s_max_header, "max_header_bytes"}, {&s_take, "take"}, {&s_give_back, "give_back"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].at = PyUnicode_InternFromString(names[i].name)) == NULL) return -1;
    /* Services' counters of what C answered, in serve's order (gets, exists, lookups, many),
     * then of what the reader callback answered */
    static const char *hot[5] = {"hot_gets", "hot_exists", "hot_lookups", "hot_get_manys",
                                 "hot_reader_requests"};
    for (int i = 0; i < 5; i++)
        if ((s_hot_names[i] = PyUnicode_InternFromString(hot[i])) == NULL) return -1;
    for (int i = 0; i < 4; i++)
        if ((s_back_codes[i] = PyLong_FromLong(i)) == NULL) return -1;
    return 0;
}

static int bump(PyObject *counters, PyObject *name, long long delta) {
    PyObject *old = PyDict_GetItemWithError(counters, name);
    if (old == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name);
        return -1;
    }
    long long value = PyLong_AsLongLong(old);
    if (value == -1 && PyErr_Occurred()) return -1;
    PyObject *updated = PyLong_FromLongLong(value + delta);
    if (updated == NULL) return -1;
    int rc = PyDict_SetItem(counters, name, updated);
    Py_DECREF(updated);
    return rc;
}

static int flag(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int truth = PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth;
}

static long long long_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    long long out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return out;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Whether p (n bytes buffered) starts with a whole canonical Get or Exists frame; *rid gets
 * its request id, *op its type. */
static int canonical_get(const unsigned char *p, Py_ssize_t n, uint32_t *rid, int *op) {
    static const unsigned char map[] = {0x81, 0xa3, 'k', 'e', 'y', 0xc4, 16};
    if (n < HEAD + GET_MAP || memcmp(p, "KVNP", 4) != 0 || p[4] != 1) return 0;
    if (p[5] != OP_GET && p[5] != OP_EXISTS) return 0;
    *op = p[5];
    if (p[6] != 0 || p[7] != 0) return 0; /* flags: a request carries none */
    *rid = le32(p + 8);
    if (*rid == 0 || le32(p + 12) != GET_MAP) return 0;
    for (int i = 16; i < 24; i++)
        if (p[i] != 0) return 0; /* no payload */
    return memcmp(p + HEAD, map, sizeof map) == 0;
}

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* Whether p (n bytes buffered) starts with a whole Lookup or GetMany frame whose map is
 * {"keys": [...]} of bin8 16-byte keys and nothing else, or a Lookup's {"keys": [...],
 * "tiers": true} (*tiers set), within `max_header`: *op is its type, *keys points at the first
 * key (the others 18 bytes apart), *count says how many. GetMany only when `many`. */
static int canonical_keys(const unsigned char *p, Py_ssize_t n, long long max_header, int many,
                          int *op, uint32_t *rid, uint32_t *hlen, const unsigned char **keys,
                          uint32_t *count, int *tiers) {
    static const unsigned char map[] = {0x81, 0xa4, 'k', 'e', 'y', 's'};
    static const unsigned char tail[] = {0xa5, 't', 'i', 'e', 'r', 's', 0xc3};
    if (n < HEAD || memcmp(p, "KVNP", 4) != 0 || p[4] != 1) return 0;
    if (p[5] != OP_LOOKUP && !(many && p[5] == OP_GET_MANY)) return 0;
    *op = p[5];
    if (p[6] != 0 || p[7] != 0) return 0;
    for (int i = 16; i < 24; i++)
        if (p[i] != 0) return 0; /* no payload */
    *rid = le32(p + 8);
    *hlen = le32(p + 12);
    /* every length checked against what was received before anything is read */
    if (*rid == 0 || *hlen < sizeof map + 1 || *hlen > max_header || n - HEAD < *hlen) return 0;
    const unsigned char *m = p + HEAD, *a = m + sizeof map;
    /* {"keys": ...} or, a Lookup only, {"keys": ..., "tiers": true} (the client's order) */
    *tiers = *op == OP_LOOKUP && m[0] == 0x82;
    if ((m[0] != 0x81 && !*tiers) || memcmp(m + 1, map + 1, sizeof map - 1) != 0) return 0;
    size_t extra = *tiers ? sizeof tail : 0;
    uint64_t c, head;
    if ((a[0] & 0xf0) == 0x90) c = a[0] & 0x0f, head = 1;
    else if (a[0] == 0xdc && *hlen >= sizeof map + 3) c = (uint64_t)a[1] << 8 | a[2], head = 3;
    else if (a[0] == 0xdd && *hlen >= sizeof map + 5) c = be32(a + 1), head = 5;
    else return 0;
    if (sizeof map + head + 18 * c + extra != *hlen) return 0;
    const unsigned char *k = a + head;
    if (extra && memcmp(k + 18 * c, tail, sizeof tail) != 0) return 0;
    for (uint64_t i = 0; i < c; i++)
        if (k[18 * i] != 0xc4 || k[18 * i + 1] != 16) return 0;
    *keys = k + 2;
    *count = (uint32_t)c;
    return 1;
}

/* Whether every one of `n` 16-byte client keys, `stride` bytes apart at `keys`, is this
 * worker's: CRC32C of the key modulo the shard count, as kvoffload.wire.shards.shard_of. */
static int own_keys(const HotGets *self, const unsigned char *keys, uint32_t n, size_t stride) {
    if (self->shard_count <= 1) return 1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t crc = ~crc_update(0xFFFFFFFFu, NULL, keys + stride * i, 16);
        if (crc % self->shard_count != self->shard_index) return 0;
    }
    return 1;
}

/* The engine key of a client key: as Tenant.key does it. */
static PyObject *engine_key(HotGets *self, PyObject *key) {
    if (self->prefix == Py_None) {
        Py_INCREF(key);
        return key;
    }
    PyObject *hasher = PyObject_CallMethodNoArgs(self->prefix, s_copy);
    if (hasher == NULL) return NULL;
    PyObject *done = PyObject_CallMethodOneArg(hasher, s_update, key);
    PyObject *digest = NULL;
    if (done != NULL) {
        Py_DECREF(done);
        PyObject *kw = Py_BuildValue("{s:i}", "length", 16);
        PyObject *method = kw ? PyObject_GetAttr(hasher, s_digest) : NULL;
        PyObject *noargs = method ? PyTuple_New(0) : NULL;
        digest = noargs ? PyObject_Call(method, noargs, kw) : NULL;
        Py_XDECREF(noargs);
        Py_XDECREF(method);
        Py_XDECREF(kw);
    }
    Py_DECREF(hasher);
    return digest;
}

static int lock_engine(HotGets *self) {
    PyObject *r = PyObject_CallMethodNoArgs(self->lock, s_acquire);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static int unlock_engine(HotGets *self) {
    PyObject *r = PyObject_CallMethodNoArgs(self->lock, s_release);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* 1 open, 0 closing or closed (the request is left to Python), -1 error; the lock is held. */
static int engine_open(HotGets *self) {
    int closing = flag(self->manager, s_closing);
    int closed = closing == 0 ? flag(self->manager, s_closed) : closing;
    return closing < 0 || closed < 0 ? -1 : (closing || closed) ? 0 : 1;
}

/* The engine key of the one client key of a canonical Get or Exists frame at p. */
static PyObject *frame_key(HotGets *self, const unsigned char *p) {
    PyObject *client = PyBytes_FromStringAndSize((const char *)p + HEAD + 7, 16);
    PyObject *key = client ? engine_key(self, client) : NULL;
    Py_XDECREF(client);
    return key;
}

/* Look `key` up and pin its entry, as Reads.acquire does for a DRAM-only engine; the lock is
 * held by the caller. 1: served (*entry the pinned entry or NULL for a miss), 0: leave the
 * request to Python (the engine is closing), -1: error. */
static int acquire(HotGets *self, PyObject *key, PyObject **entry) {
    int open = engine_open(self);
    if (open <= 0) return open;
    if (bump(self->counters, s_gets, 1) < 0) return -1;
    PyObject *found = index_lookup(self->index, key);
    if (found == NULL) return -1;
    if (found == Py_None) {
        Py_DECREF(found);
        *entry = NULL;
        return bump(self->counters, s_misses, 1) < 0 ? -1 : 1;
    }
    long long length = long_attr(found, core_str_length);
    if ((length < 0 && PyErr_Occurred()) || bump(self->counters, s_hits, 1) < 0 ||
        bump(self->counters, s_bytes_out, length) < 0) {
        Py_DECREF(found);
        return -1;
    }
    PyObject *queued = index_pin(self->index, found);
    if (queued == NULL) {
        Py_DECREF(found);
        return -1;
    }
    Py_ssize_t n = PyLong_AsSsize_t(queued);
    Py_DECREF(queued);
    if (n >= self->touch_ring) {
        PyObject *r = PyObject_CallNoArgs(self->apply_touches);
        if (r == NULL) {
            /* the pin stays: the caller gives it back with the entry */
            *entry = found;
            return -1;
        }
        Py_DECREF(r);
    }
    *entry = found;
    return 1;
}

/* The value of a pinned entry: a slice of the arena. */
static PyObject *value_of(HotGets *self, PyObject *entry, long long *length) {
    long long offset = long_attr(entry, core_str_offset);
    if (offset < 0 && PyErr_Occurred()) return NULL;
    *length = long_attr(entry, core_str_length);
    if (*length < 0 && PyErr_Occurred()) return NULL;
    PyObject *lo = PyLong_FromLongLong(offset), *hi = PyLong_FromLongLong(offset + *length);
    PyObject *slice = (lo && hi) ? PySlice_New(lo, hi, NULL) : NULL;
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    if (slice == NULL) return NULL;
    PyObject *view = PyObject_GetItem(self->arena, slice);
    Py_DECREF(slice);
    return view;
}

static int unpin_locked(HotGets *self, PyObject *entry) {
    PyObject *last = index_unpin(self->index, entry);
    if (last == NULL) return -1;
    int rc = 0;
    if (last == Py_True) {
        int closed = flag(self->manager, s_closed);
        if (closed < 0) rc = -1;
        else if (!closed) {
            PyObject *r = PyObject_CallOneArg(self->free, entry);
            if (r == NULL) rc = -1;
            Py_XDECREF(r);
        }
    }
    Py_DECREF(last);
    return rc;
}

/* Serve one Lookup already checked canonical (its `count` keys at `keys`), as Engine.lookup
 * does for a DRAM-only engine: every key derived first, then the leading run counted under the
 * lock. 1 served, 0 left to Python, -1 error. */
/* x as msgpack's smallest unsigned form, as msgpack.packb writes it; the byte after it. */
static unsigned char *put_uint(unsigned char *p, unsigned long long x) {
    int b = x < 0x80 ? 0 : x <= 0xff ? 1 : x <= 0xffff ? 2 : x <= 0xffffffffull ? 4 : 8;
    if (b == 0) {
        *p++ = (unsigned char)x;
        return p;
    }
    *p++ = b == 1 ? 0xcc : b == 2 ? 0xcd : b == 4 ? 0xce : 0xcf;
    for (int i = b - 1; i >= 0; i--) *p++ = (unsigned char)(x >> (8 * i));
    return p;
}

/* An answer's 24-byte frame header before its map at o + HEAD, which ends at `end`. */
static void answer_head(unsigned char *o, int op, uint32_t rid, const unsigned char *end,
                        long long payload) {
    uint64_t hlen = (uint64_t)(end - o - HEAD), plen = (uint64_t)payload;
    memcpy(o, "KVNP", 4);
    o[4] = 1;
    o[5] = (unsigned char)op;
    o[6] = 1; /* FLAG_RESPONSE */
    o[7] = 0;
    for (int i = 0; i < 4; i++) o[8 + i] = (unsigned char)(rid >> (8 * i));
    for (int i = 0; i < 4; i++) o[12 + i] = (unsigned char)(hlen >> (8 * i));
    for (int i = 0; i < 8; i++) o[16 + i] = (unsigned char)(plen >> (8 * i));
}

/* A LookupResult with tiers, as `wire_pairs` gives them for a DRAM-only engine: {"count": n,
 * "tiers": [1 (Tier.DRAM), n]}, or [] for none. */
static PyObject *tiers_header(uint32_t rid, long long found) {
    unsigned char o[HEAD + 40], *p = o + HEAD;
    static const unsigned char count[] = {0x82, 0xa5, 'c', 'o', 'u', 'n', 't'};
    static const unsigned char tiers[] = {0xa5, 't', 'i', 'e', 'r', 's'};
    memcpy(p, count, sizeof count);
    p = put_uint(p + sizeof count, (unsigned long long)found);
    memcpy(p, tiers, sizeof tiers);
    p += sizeof tiers;
    if (found) {
        *p++ = 0x92;
        *p++ = 1;
        p = put_uint(p, (unsigned long long)found);
    } else {
        *p++ = 0x90;
    }
    answer_head(o, OP_LOOKUP, rid, p, 0);
    return PyBytes_FromStringAndSize((const char *)o, p - o);
}

/* The engine keys of `count` client keys 18 bytes apart at `keys` (in the reader's buffer):
 * all copied out before any Python code runs. */
static PyObject *derive_keys(HotGets *self, const unsigned char *keys, uint32_t count) {
    PyObject *engine_keys = PyList_New(count);
    if (engine_keys == NULL) return NULL;
    for (uint32_t i = 0; i < count; i++) {
        PyObject *client = PyBytes_FromStringAndSize((const char *)keys + 18 * (size_t)i, 16);
        if (client == NULL) {
            Py_DECREF(engine_keys);
            return NULL;
        }
        PyList_SET_ITEM(engine_keys, i, client);
    }
    for (uint32_t i = 0; i < count; i++) {
        PyObject *key = engine_key(self, PyList_GET_ITEM(engine_keys, i));
        if (key == NULL) {
            Py_DECREF(engine_keys);
            return NULL;
        }
        PyList_SetItem(engine_keys, i, key); /* drops the client key */
    }
    return engine_keys;
}

static int serve_lookup(HotGets *self, const unsigned char *keys, uint32_t count, uint32_t rid,
                        int tiers, PyObject *parts, long long *answer) {
    PyObject *engine_keys = derive_keys(self, keys, count);
    if (engine_keys == NULL) return -1;
    if (lock_engine(self) < 0) {
        Py_DECREF(engine_keys);
        return -1;
    }
    int got = engine_open(self);
    long long found = 0;
    for (uint32_t i = 0; got == 1 && i < count; i++) {
        int in = PyDict_Contains(self->index->entries, PyList_GET_ITEM(engine_keys, i));
        if (in < 0) got = -1;
        if (in <= 0) break;
        found++;
    }
    Py_DECREF(engine_keys);
    if (unlock_engine(self) < 0) return -1;
    if (got <= 0) return got;
    PyObject *header = tiers ? tiers_header(rid, found)
                             : PyObject_CallFunction(self->frame_head, "iIOLi", OP_LOOKUP, rid,
                                                     s_count_name, found, 0);
    if (header == NULL) return -1;
    int rc = PyList_Append(parts, header);
    *answer += PyBytes_GET_SIZE(header);
    Py_DECREF(header);
    return rc < 0 ? -1 : 1;
}

/* Serve one Exists already checked canonical at p, as Engine.contains does for a DRAM-only
 * engine (no counters); 1 served, 0 left to Python, -1 error. */
static int serve_exists(HotGets *self, const unsigned char *p, uint32_t rid, PyObject *parts,
                        long long *answer) {
    PyObject *key = frame_key(self, p);
    if (key == NULL) return -1;
    if (lock_engine(self) < 0) {
        Py_DECREF(key);
        return -1;
    }
    int got = engine_open(self);
    int found = got == 1 ? PyDict_Contains(self->index->entries, key) : 0;
    if (found < 0) got = -1;
    Py_DECREF(key);
    if (unlock_engine(self) < 0) return -1;
    if (got <= 0) return got;
    PyObject *header = PyObject_CallFunction(self->frame_head, "iIOOi", OP_EXISTS, rid,
                                             s_found_name, found ? Py_True : Py_False, 0);
    if (header == NULL) return -1;
    int rc = PyList_Append(parts, header);
    *answer += PyBytes_GET_SIZE(header);
    Py_DECREF(header);
    return rc < 0 ? -1 : 1;
}

/* Serve one Get already checked canonical at p; appends to parts/views/entries. 1 served,
 * 0 left to Python, -1 error. */
static int serve_one(HotGets *self, const unsigned char *p, uint32_t rid, PyObject *parts,
                     PyObject *views, PyObject *entries, long long *out_bytes,
                     long long *answer) {
    PyObject *key = frame_key(self, p);
    if (key == NULL) return -1;
    if (lock_engine(self) < 0) {
        Py_DECREF(key);
        return -1;
    }
    PyObject *entry = NULL, *view = NULL;
    long long length = 0;
    int got = acquire(self, key, &entry);
    Py_DECREF(key);
    if (got == 1 && entry != NULL) {
        view = value_of(self, entry, &length);
        if (view == NULL) got = -1;
    }
    if (got < 0 && entry != NULL) { /* give back what this request took */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        if (unpin_locked(self, entry) < 0) PyErr_Clear();
        PyErr_Restore(et, ev, etb);
    }
    if (unlock_engine(self) < 0) got = -1;
    if (got <= 0) {
        Py_XDECREF(entry);
        Py_XDECREF(view);
        return got;
    }
    PyObject *length_obj = entry ? PyLong_FromLongLong(length) : Py_NewRef(Py_None);
    PyObject *header = length_obj ? PyObject_CallFunction(self->frame_head, "iIOOL", OP_GET,
                                                          rid, s_length_name, length_obj,
                                                          length)
                                  : NULL;
    Py_XDECREF(length_obj);
    int rc = header ? PyList_Append(parts, header) : -1;
    if (rc == 0) *answer += PyBytes_GET_SIZE(header);
    Py_XDECREF(header);
    if (rc == 0 && entry != NULL) {
        rc = PyList_Append(parts, view) | PyList_Append(views, view) |
             PyList_Append(entries, entry);
        *out_bytes += length;
        *answer += length;
    }
    Py_XDECREF(entry);
    Py_XDECREF(view);
    return rc < 0 ? -1 : 1;
}

/* A GetManyResult's frame header: {"lengths": [...]}, each length an unsigned int in its
 * smallest form or nil (-1), as msgpack.packb writes it; `payload` bytes follow. */
static PyObject *many_header(uint32_t rid, const long long *lengths, uint32_t n,
                             long long payload) {
    size_t most = HEAD + 1 + 8 + 5 + 9 * (size_t)n;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)most);
    if (out == NULL) return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out), *p = o + HEAD;
    *p++ = 0x81;
    *p++ = 0xa7;
    memcpy(p, "lengths", 7);
    p += 7;
    if (n < 16) *p++ = (unsigned char)(0x90 | n);
    else if (n <= 0xffff) *p++ = 0xdc, *p++ = (unsigned char)(n >> 8), *p++ = (unsigned char)n;
    else {
        *p++ = 0xdd;
        for (int i = 3; i >= 0; i--) *p++ = (unsigned char)(n >> (8 * i));
    }
    for (uint32_t k = 0; k < n; k++)
        p = lengths[k] < 0 ? (*p = 0xc0, p + 1) : put_uint(p, (unsigned long long)lengths[k]);
    answer_head(o, OP_GET_MANY, rid, p, payload);
    if (_PyBytes_Resize(&out, p - o) < 0) return NULL;
    return out;
}

/* Unpin `n` entries (NULL: a miss) under the lock, keeping an error already set. */
static void unpin_all(HotGets *self, PyObject **held, Py_ssize_t n) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    if (lock_engine(self) == 0) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (held[i] != NULL && unpin_locked(self, held[i]) < 0) PyErr_Clear();
        if (unlock_engine(self) < 0) PyErr_Clear();
    } else {
        PyErr_Clear();
    }
    PyErr_Restore(et, ev, etb);
}

/* Give `n` bytes back to the pin budget. */
static int give_back(HotGets *self, long long n) {
    if (n == 0 || self->pins == Py_None) return 0;
    PyObject *amount = PyLong_FromLongLong(n);
    PyObject *r = amount ? PyObject_CallMethodOneArg(self->pins, s_give_back, amount) : NULL;
    Py_XDECREF(amount);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* Whether the pin budget lets this answer hold `n` more bytes (the first value always fits). */
static int take_pins(HotGets *self, long long n, int first) {
    PyObject *r = PyObject_CallMethod(self->pins, "take", "LO", n, first ? Py_True : Py_False);
    if (r == NULL) return -1;
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    return truth;
}

/* Serve one GetMany already checked canonical (its `count` keys at `keys`) as on_get_many
 * does on a DRAM-only engine: chunks of `step` keys acquired under the lock (every key of a
 * chunk counted), then the answer cut short before the first hit that would pass the frame's
 * payload limit or the pin budget (the rest of that chunk unpinned). Appends the header and
 * the hits' views to parts (views, entries: what `release` gives back; *taken: the budget's
 * bytes). 1 served, 0 left to Python, -1 error. */
static int serve_many(HotGets *self, const unsigned char *keys, uint32_t count, uint32_t rid,
                      PyObject *parts, PyObject *views, PyObject *entries, long long *out_bytes,
                      long long *answer, long long *taken_out) {
    PyObject *engine_keys = derive_keys(self, keys, count);
    if (engine_keys == NULL) return -1;
    Py_ssize_t step = self->step;
    long long *lengths = PyMem_Malloc(sizeof(long long) * (count ? count : 1));
    PyObject **chunk = PyMem_Malloc(sizeof(PyObject *) * (size_t)step);
    PyObject *held = PyList_New(0), *hviews = PyList_New(0);
    int rc = lengths && chunk && held && hviews ? 1 : -1;
    if (rc < 0 && !PyErr_Occurred()) PyErr_NoMemory();
    uint32_t answered = 0;
    long long taken = 0;
    int stop = 0;
    for (uint32_t at = 0; rc == 1 && !stop && at < count; at += (uint32_t)step) {
        Py_ssize_t m = (Py_ssize_t)(count - at) < step ? (Py_ssize_t)(count - at) : step, got = 0;
        if (lock_engine(self) < 0) {
            rc = -1;
            break;
        }
        rc = engine_open(self);
        while (rc == 1 && got < m) {
            PyObject *entry = NULL;
            int a = acquire(self, PyList_GET_ITEM(engine_keys, at + got), &entry);
            if (a <= 0) { /* 0 cannot happen: the lock is held since engine_open */
                if (entry != NULL) chunk[got++] = entry; /* pinned: given back below */
                rc = -1;
                break;
            }
            chunk[got++] = entry;
        }
        if (unlock_engine(self) < 0) rc = -1;
        Py_ssize_t i = 0;
        for (; rc == 1 && i < m; i++) {
            PyObject *entry = chunk[i];
            if (entry == NULL) {
                lengths[answered++] = -1;
                continue;
            }
            long long length = long_attr(entry, core_str_length);
            if (length < 0) {
                rc = -1;
                break;
            }
            int fits = !(answered > 0 && taken + length > self->max_payload);
            if (fits) fits = take_pins(self, length, taken == 0);
            if (fits < 0) rc = -1;
            if (fits <= 0) {
                stop = 1;
                break;
            }
            taken += length; /* held by the budget from here: given back with the answer */
            long long ignored;
            PyObject *view = value_of(self, entry, &ignored);
            if (view == NULL || PyList_Append(hviews, view) < 0 || PyList_Append(held, entry) < 0) {
                Py_XDECREF(view);
                rc = -1;
                break;
            }
            Py_DECREF(view);
            Py_DECREF(entry); /* `held` has it now */
            chunk[i] = NULL;
            lengths[answered++] = length;
        }
        unpin_all(self, chunk + i, got - i); /* the rest of the chunk, when cut short */
        for (Py_ssize_t j = 0; j < got; j++) Py_XDECREF(chunk[j]);
    }
    Py_DECREF(engine_keys);
    if (rc == 1) { /* views and entries take the whole answer's, or none of it */
        Py_ssize_t nv = PyList_GET_SIZE(views), ne = PyList_GET_SIZE(entries);
        if (PyList_SetSlice(views, nv, nv, hviews) < 0) {
            rc = -1;
        } else if (PyList_SetSlice(entries, ne, ne, held) < 0) {
            if (PyList_SetSlice(views, nv, PyList_GET_SIZE(views), NULL) < 0) PyErr_Clear();
            rc = -1;
        }
    }
    if (rc == 1) {
        /* from here hot_serve releases the views, the entries and `taken`, even on error */
        *taken_out += taken;
        PyObject *header = many_header(rid, lengths, answered, taken);
        if (header == NULL || PyList_Append(parts, header) < 0) rc = -1;
        else *answer += PyBytes_GET_SIZE(header);
        Py_XDECREF(header);
        for (Py_ssize_t j = 0; rc == 1 && j < PyList_GET_SIZE(hviews); j++)
            if (PyList_Append(parts, PyList_GET_ITEM(hviews, j)) < 0) rc = -1;
        if (rc == 1) {
            *out_bytes += taken;
            *answer += taken;
        }
    } else if (held != NULL && hviews != NULL) {
        /* nothing of this request went out: its pins and budget bytes go back (a request left
         * to Python at a later chunk was counted once here already: a closing engine only) */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(hviews); j++) {
            PyObject *r = PyObject_CallMethodNoArgs(PyList_GET_ITEM(hviews, j), s_release);
            if (r == NULL) PyErr_Clear();
            Py_XDECREF(r);
        }
        if (PyList_GET_SIZE(held)) unpin_all(self, &PyList_GET_ITEM(held, 0), PyList_GET_SIZE(held));
        if (give_back(self, taken) < 0) PyErr_Clear();
        PyErr_Restore(et, ev, etb);
    }
    Py_XDECREF(held);
    Py_XDECREF(hviews);
    PyMem_Free(lengths);
    PyMem_Free(chunk);
    return rc;
}

static PyObject *hot_release(HotGets *self, PyObject *args);

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Send `parts` (bytes and arena views) on the non-blocking socket `fd` until the kernel takes
 * no more; how many bytes it took. An error or a full socket just stops: the session's Channel
 * sends the rest and meets the error itself. */
static long long send_parts(int fd, PyObject *parts) {
    Py_ssize_t n = PyList_GET_SIZE(parts), at = 0;
    long long sent = 0;
    size_t skip = 0; /* bytes of parts[at] already sent */
    while (at < n) {
        struct iovec iov[IOV_BATCH];
        Py_buffer bufs[IOV_BATCH];
        int count = 0;
        for (Py_ssize_t i = at; i < n && count < IOV_BATCH; i++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(parts, i), &bufs[count], PyBUF_SIMPLE) < 0) {
                PyErr_Clear(); /* cannot happen for bytes and arena views; Python sends it */
                break;
            }
            size_t off = i == at ? skip : 0;
            iov[count].iov_base = (char *)bufs[count].buf + off;
            iov[count].iov_len = (size_t)bufs[count].len - off;
            count++;
        }
        ssize_t got = -1;
        if (count) {
            struct msghdr msg;
            memset(&msg, 0, sizeof msg);
            msg.msg_iov = iov;
            msg.msg_iovlen = (size_t)count;
            got = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        }
        for (int i = 0; i < count; i++) PyBuffer_Release(&bufs[i]);
        if (got <= 0) break;
        sent += got;
        size_t left = (size_t)got;
        int i = 0;
        while (i < count && left >= iov[i].iov_len) left -= iov[i++].iov_len;
        skip = (i == 0 ? skip : 0) + left;
        at += i;
        if (i < count) break; /* the kernel took less than offered: the socket is full */
    }
    return sent;
}

/* What of `parts` the kernel did not take once `sent` bytes went: a new list (the part cut
 * in two continues as a memoryview slice). */
static PyObject *unsent(PyObject *parts, long long sent) {
    PyObject *rest = PyList_New(0);
    if (rest == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(parts); i++) {
        PyObject *part = PyList_GET_ITEM(parts, i);
        Py_ssize_t len = PyObject_Length(part);
        if (len < 0) goto fail;
        if (sent >= len) {
            sent -= len;
            continue;
        }
        PyObject *tail;
        if (sent > 0) {
            PyObject *view = PyMemoryView_FromObject(part);
            PyObject *lo = PyLong_FromLongLong(sent);
            PyObject *slice = lo ? PySlice_New(lo, NULL, NULL) : NULL;
            tail = view && slice ? PyObject_GetItem(view, slice) : NULL;
            Py_XDECREF(view);
            Py_XDECREF(lo);
            Py_XDECREF(slice);
            sent = 0;
        } else {
            tail = Py_NewRef(part);
        }
        if (tail == NULL || PyList_Append(rest, tail) < 0) {
            Py_XDECREF(tail);
            goto fail;
        }
        Py_DECREF(tail);
    }
    return rest;
fail:
    Py_DECREF(rest);
    return NULL;
}

/* Count one served batch: `counts` requests by op, each with the batch's time as latency. */
static void count_batch(HotGets *self, const long long counts[NOPS], long long out_bytes,
                        double elapsed) {
    Py_ssize_t b = 0;
    while (b < self->nbounds && elapsed > self->bounds[b]) b++; /* le: the first bound >= */
    for (int op = 0; op < NOPS; op++) {
        if (!counts[op]) continue;
        self->m_counts[op] += counts[op];
        self->m_buckets[op][b] += counts[op];
        for (long long i = 0; i < counts[op]; i++) self->m_sums[op] += elapsed; /* as observe */
    }
    self->m_bytes_out += out_bytes;
}

static PyObject *hot_serve(HotGets *self, PyObject *args) {
    PyObject *reader;
    long long inflight, max_inflight, most;
    int fd = -1;
    if (!PyArg_ParseTuple(args, "OLLL|i:serve", &reader, &inflight, &max_inflight, &most, &fd))
        return NULL;
    if (inflight < 0 || max_inflight < 0) { /* so max_inflight - inflight cannot overflow */
        PyErr_SetString(PyExc_ValueError, "serve: negative bytes in flight or limit");
        return NULL;
    }
    if (fd >= 0 && self->nbounds == 0) {
        PyErr_SetString(PyExc_ValueError, "serve(..., fd) needs HotGets(..., buckets=...)");
        return NULL;
    }
    double t0 = fd >= 0 ? now_s() : 0.0;
    PyObject *state = PyObject_GetAttr(reader, s_state);
    if (state == NULL) return NULL;
    Py_DECREF(state);
    if (state != self->head_state) Py_RETURN_NONE; /* inside a frame: Python's */
    PyObject *buf = PyObject_GetAttr(reader, s_buf);
    if (buf == NULL) return NULL;
    if (!PyByteArray_Check(buf)) {
        Py_DECREF(buf);
        PyErr_SetString(PyExc_TypeError, "the reader's buffer is not a bytearray");
        return NULL;
    }
    long long start = long_attr(reader, s_start), end = long_attr(reader, s_end);
    if (PyErr_Occurred()) {
        Py_DECREF(buf);
        return NULL;
    }
    PyObject *limits = PyObject_GetAttr(reader, s_limits);
    long long max_header = limits ? long_attr(limits, s_max_header) : -1;
    Py_XDECREF(limits);
    if (PyErr_Occurred()) {
        Py_DECREF(buf);
        return NULL;
    }
    PyObject *parts = PyList_New(0), *views = PyList_New(0), *entries = PyList_New(0);
    long long out_bytes = 0, answer = 0, served = 0, taken = 0, counts[NOPS] = {0};
    int many = self->pins != Py_None && self->step > 0;
    uint32_t rid = 0, last_rid = 0, hlen = 0, last_hlen = 0, nkeys = 0;
    int op = 0, last_op = 0, tiers = 0;
    const unsigned char *keys = NULL;
    int rc = parts && views && entries ? 1 : -1;
    while (rc == 1 && served < most && answer < max_inflight - inflight) {
        /* Nothing resizes the buffer while this runs (only this connection's reader does, on
         * this thread); the bounds are checked all the same. */
        if (start > end || end > PyByteArray_GET_SIZE(buf)) break;
        const unsigned char *p = (const unsigned char *)PyByteArray_AS_STRING(buf) + start;
        Py_ssize_t n = (Py_ssize_t)(end - start);
        /* a key of another shard stops here: Python answers it (WRONG_SHARD), as always */
        if (canonical_get(p, n, &rid, &op) && own_keys(self, p + HEAD + 7, 1, 16)) {
            unsigned char frame[HEAD + GET_MAP];
            memcpy(frame, p, sizeof frame); /* calls below run other code: work on a copy */
            hlen = GET_MAP;
            if (op == OP_EXISTS)
                rc = serve_exists(self, frame, rid, parts, &answer);
            else
                rc = serve_one(self, frame, rid, parts, views, entries, &out_bytes, &answer);
        } else if (canonical_keys(p, n, max_header, many, &op, &rid, &hlen, &keys, &nkeys,
                                  &tiers) &&
                   own_keys(self, keys, nkeys, 18)) {
            /* both copy the keys out before they call anything */
            if (op == OP_LOOKUP)
                rc = serve_lookup(self, keys, nkeys, rid, tiers, parts, &answer);
            else
                rc = serve_many(self, keys, nkeys, rid, parts, views, entries, &out_bytes,
                                &answer, &taken);
        } else {
            break;
        }
        if (rc == 1) {
            start += HEAD + hlen;
            served++;
            counts[op == OP_GET ? 0 : op == OP_EXISTS ? 1 : op == OP_LOOKUP ? 2 : 3]++;
            last_rid = rid;
            last_op = op;
            last_hlen = hlen;
        }
    }
    Py_DECREF(buf);
    PyObject *result = NULL;
    if (served) { /* move the reader past what was served, even if a later frame failed */
        PyObject *at = PyLong_FromLongLong(start);
        PyObject *head = Py_BuildValue("(iiIIi)", last_op, 0, last_rid, last_hlen, 0);
        if (at == NULL || head == NULL || PyObject_SetAttr(reader, s_start, at) < 0 ||
            PyObject_SetAttr(reader, s_head, head) < 0)
            rc = -1;
        Py_XDECREF(at);
        Py_XDECREF(head);
    }
    if (rc >= 0 && served && fd >= 0) {
        /* Sent here while the kernel takes it all: the pins go back at once, and only what a
         * full socket leaves goes through the session's Channel (`parts` becomes that rest). */
        long long sent = send_parts(fd, parts);
        PyObject *rest = unsent(parts, sent);
        if (rest == NULL) {
            rc = -1;
        } else {
            Py_SETREF(parts, rest);
            if (PyList_GET_SIZE(parts) == 0) {
                PyObject *amount = PyLong_FromLongLong(taken);
                PyObject *pair = amount ? PyTuple_Pack(3, views, entries, amount) : NULL;
                Py_XDECREF(amount);
                PyObject *r = pair ? hot_release(self, pair) : NULL;
                Py_XDECREF(pair);
                if (r == NULL) rc = -1; /* the pins are given back all the same */
                Py_XDECREF(r);
            }
            count_batch(self, counts, out_bytes, now_s() - t0);
        }
    }
    if (rc >= 0 && served)
        result = Py_BuildValue("(OOO(LLLL)LLL)", parts, views, entries, counts[0], counts[1],
                               counts[2], counts[3], out_bytes, answer, taken);
    else if (rc >= 0)
        result = Py_NewRef(Py_None);
    if (result == NULL && entries != NULL) {
        /* an error after some were served (or a GetMany part-way): they are answered by
         * nobody; give their pins and budget bytes back */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject *r = PyObject_CallMethod((PyObject *)self, "release", "OOL", views, entries,
                                          taken);
        if (r == NULL) PyErr_Clear();
        Py_XDECREF(r);
        PyErr_Restore(et, ev, etb);
    }
    Py_XDECREF(parts);
    Py_XDECREF(views);
    Py_XDECREF(entries);
    return result;
}

/* A put's answer, sent and counted here instead of through the session's Channel and
 * prometheus calls: `parts` are the codec's bytes (`send_put_done`), `fd` the socket with
 * nothing queued, `t0` the request's start (time.perf_counter: CLOCK_MONOTONIC, as now_s).
 * Counted as the Python path counts it (a put, ok, its latency including the send, `nbytes`
 * in) before this returns, so a client that scrapes once it has its answer finds it. */
static PyObject *hot_put_done(HotGets *self, PyObject *args) {
    PyObject *parts;
    int fd;
    double t0;
    long long nbytes;
    if (!PyArg_ParseTuple(args, "O!idL:put_done", &PyList_Type, &parts, &fd, &t0, &nbytes))
        return NULL;
    if (self->nbounds == 0 || fd < 0 || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "put_done needs HotGets(..., buckets=...), an fd and nbytes >= 0");
        return NULL;
    }
    if (nbytes > LLONG_MAX - self->m_bytes_in) { /* refused before anything is sent */
        PyErr_SetString(PyExc_OverflowError, "put_done: the bytes in would pass 2**63 - 1");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(parts); i++)
        if (!PyBytes_Check(PyList_GET_ITEM(parts, i))) { /* the codec's answer: bytes only */
            PyErr_SetString(PyExc_TypeError, "put_done: the parts must be bytes");
            return NULL;
        }
    PyObject *rest = unsent(parts, send_parts(fd, parts));
    if (rest == NULL) return NULL;
    long long counts[NOPS] = {0};
    counts[PUT_OP] = 1;
    count_batch(self, counts, 0, now_s() - t0);
    self->m_bytes_in += nbytes;
    return rest;
}

static PyObject *hot_release(HotGets *self, PyObject *args) {
    PyObject *views, *entries;
    long long taken = 0;
    if (!PyArg_ParseTuple(args, "O!O!|L:release", &PyList_Type, &views, &PyList_Type, &entries,
                          &taken))
        return NULL;
    if (taken < 0) {
        PyErr_SetString(PyExc_ValueError, "release: negative bytes taken");
        return NULL;
    }
    /* idempotent: the bytes go back with the entries, the first time only */
    if (PyList_GET_SIZE(entries) == 0) taken = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(views); i++) {
        PyObject *r = PyObject_CallMethodNoArgs(PyList_GET_ITEM(views, i), s_release);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    if (lock_engine(self) < 0) return NULL;
    int rc = 0;
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++)
        if (unpin_locked(self, PyList_GET_ITEM(entries, i)) < 0) {
            if (rc == 0) PyErr_Fetch(&et, &ev, &etb); /* unpin the rest all the same */
            else PyErr_Clear();
            rc = -1;
        }
    if (unlock_engine(self) < 0) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(etb);
        return NULL;
    }
    if (give_back(self, taken) < 0) {
        if (rc == 0) PyErr_Fetch(&et, &ev, &etb);
        else PyErr_Clear();
        rc = -1;
    }
    /* idempotent: a second call finds nothing left */
    if (PyList_SetSlice(views, 0, PyList_GET_SIZE(views), NULL) < 0 ||
        PyList_SetSlice(entries, 0, PyList_GET_SIZE(entries), NULL) < 0)
        return NULL;
    if (rc < 0) {
        PyErr_Restore(et, ev, etb);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *hot_take_metrics(HotGets *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *buckets = PyTuple_New(NOPS);
    if (buckets == NULL) return NULL;
    for (int op = 0; op < NOPS; op++) {
        PyObject *row = PyTuple_New(self->nbounds + 1);
        if (row == NULL) {
            Py_DECREF(buckets);
            return NULL;
        }
        PyTuple_SET_ITEM(buckets, op, row);
        for (Py_ssize_t b = 0; b <= self->nbounds; b++) {
            PyObject *v = PyLong_FromLongLong(self->m_buckets[op][b]);
            if (v == NULL) {
                Py_DECREF(buckets);
                return NULL;
            }
            PyTuple_SET_ITEM(row, b, v);
        }
    }
    PyObject *out = Py_BuildValue("((LLLLL)LN(ddddd)L)", self->m_counts[0], self->m_counts[1],
                                  self->m_counts[2], self->m_counts[3], self->m_counts[4],
                                  self->m_bytes_out, buckets, self->m_sums[0], self->m_sums[1],
                                  self->m_sums[2], self->m_sums[3], self->m_sums[4],
                                  self->m_bytes_in);
    if (out == NULL) return NULL;
    /* taken and zeroed in one call: nothing runs between (the GIL is held), so a scrape on
     * another thread never loses or doubles a count */
    memset(self->m_counts, 0, sizeof self->m_counts);
    memset(self->m_buckets, 0, sizeof self->m_buckets);
    memset(self->m_sums, 0, sizeof self->m_sums);
    self->m_bytes_out = self->m_bytes_in = 0;
    return out;
}

/* ------------------------------------------------------------------ the reader callback
 *
 * `arm(reader, fd, most, max_inflight, handback, services)` makes the object the event loop's
 * reader of `fd` (the session registers it with `loop.add_reader(fd, hot)`) while the
 * connection is idle at a frame boundary with nothing outstanding. Each time the socket is
 * readable it receives once, straight into the codec's buffer (`FrameReader._buf`, as
 * `get_buffer` offers it with everything parsed), and answers what `serve` would, at most
 * `most` frames (the connection's turn), counting in `services` what the session counts
 * after `serve`. It stays armed while that leaves nothing behind; otherwise it disarms and
 * calls `handback(code, extra, got)` once, with the buffer as the Python read loop would see
 * it after `recv_into`: code BACK_DATA (extra: frames served this turn; bytes may be left,
 * and `got` is serve's answer whose unsent rest the session must queue, or None), BACK_EOF,
 * BACK_OSERROR (extra: errno) or BACK_RAISED (extra: the exception). */
enum { BACK_DATA = 0, BACK_EOF = 1, BACK_OSERROR = 2, BACK_RAISED = 3 };

/* Disarm, then call the handback once; steals `extra` and `got` (NULL: none). */
static PyObject *hand_back(HotGets *self, int code, PyObject *extra, PyObject *got) {
    PyObject *handback = self->r_handback;
    self->r_handback = NULL;
    self->armed = 0;
    Py_CLEAR(self->r_reader);
    Py_CLEAR(self->r_services);
    PyObject *r = NULL;
    if (extra == NULL) { /* out of memory: the handback is called all the same, or the
                          * session would wait for it forever */
        PyErr_Clear();
        extra = Py_NewRef(Py_None);
    }
    if (handback != NULL)
        r = PyObject_CallFunctionObjArgs(handback, s_back_codes[code], extra,
                                         got ? got : Py_None, NULL);
    Py_XDECREF(extra);
    Py_XDECREF(got);
    Py_XDECREF(handback);
    return r; /* NULL: the loop's exception handler reports it, as any callback's error */
}

/* The exception set now as the handback's `extra` (a BACK_RAISED hand-back). */
static PyObject *back_raised(HotGets *self, PyObject *got) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (ev != NULL && etb != NULL) PyException_SetTraceback(ev, etb);
    Py_XDECREF(et);
    Py_XDECREF(etb);
    return hand_back(self, BACK_RAISED, ev, got);
}

static int set_long(PyObject *obj, PyObject *name, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    int rc = v ? PyObject_SetAttr(obj, name, v) : -1;
    Py_XDECREF(v);
    return rc;
}

static PyObject *put_take(HotGets *self, PyObject *reader, PyObject *services, long long served,
                          long long start, long long end);
static PyObject *put_receive(HotGets *self, PyObject *services);

/* One readable event of an armed connection (see above); the reader and services are held by
 * the caller: serve runs Python code (the policy's touches), which may disarm and so drop the
 * object's own references. */
static PyObject *reader_turn(HotGets *self, PyObject *reader, PyObject *services) {
    PyObject *got = NULL;
    PyObject *state = PyObject_GetAttr(reader, s_state);
    if (state == NULL) return back_raised(self, NULL);
    Py_DECREF(state);
    long long start = long_attr(reader, s_start), end = long_attr(reader, s_end);
    if (PyErr_Occurred()) return back_raised(self, NULL);
    if (state != self->head_state || start != end) /* not as armed: the session reads it */
        return hand_back(self, BACK_DATA, PyLong_FromLong(0), NULL);
    if (start != 0 && (set_long(reader, s_start, 0) < 0 || set_long(reader, s_end, 0) < 0))
        return back_raised(self, NULL); /* all parsed: start over at the front, as get_buffer */
    PyObject *buf = PyObject_GetAttr(reader, s_buf);
    if (buf == NULL) return back_raised(self, NULL);
    if (!PyByteArray_Check(buf)) {
        Py_DECREF(buf);
        PyErr_SetString(PyExc_TypeError, "the reader's buffer is not a bytearray");
        return back_raised(self, NULL);
    }
    /* the buffer's own size bounds the read; nothing resizes it meanwhile (the GIL is held) */
    Py_ssize_t room = PyByteArray_GET_SIZE(buf);
    if (self->small_read && room > SMALL_READ) room = SMALL_READ; /* a put's payload: its slot */
    ssize_t n = -1;
    errno = EINVAL;
    if (room > 0) do
            n = recv(self->r_fd, PyByteArray_AS_STRING(buf), (size_t)room, MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
    int err = errno;
    Py_DECREF(buf);
    if (n < 0) {
        if (err == EAGAIN || err == EWOULDBLOCK) Py_RETURN_NONE; /* woken for nothing: armed */
        return hand_back(self, BACK_OSERROR, PyLong_FromLong(err), NULL);
    }
    self->last_rx = now_s();
    if (n == 0) return hand_back(self, BACK_EOF, PyLong_FromLong(0), NULL);
    if (set_long(reader, s_end, (long long)n) < 0) return back_raised(self, NULL);
    self->small_read = 0; /* read; a large put taken from these bytes sets it again */
    PyObject *args = Py_BuildValue("(OLLLi)", reader, 0LL, self->r_max_inflight, self->r_most,
                                   self->r_fd);
    got = args ? hot_serve(self, args) : NULL;
    Py_XDECREF(args);
    if (got == NULL) return back_raised(self, NULL);
    long long served = 0;
    if (got != Py_None) {
        PyObject *counts = PyTuple_GET_ITEM(got, 3);
        for (int i = 0; i < 5; i++) { /* the four ops, then all of them (reader_requests) */
            long long c = i < 4 ? PyLong_AsLongLong(PyTuple_GET_ITEM(counts, i)) : served;
            if (c == -1 && PyErr_Occurred()) return back_raised(self, got);
            if (i < 4) served += c;
            if (c && services != Py_None) {
                long long was = long_attr(services, s_hot_names[i]);
                if ((was == -1 && PyErr_Occurred()) ||
                    set_long(services, s_hot_names[i], was + c) < 0)
                    return back_raised(self, got);
            }
        }
        if (PyList_GET_SIZE(PyTuple_GET_ITEM(got, 0)) == 0) Py_CLEAR(got); /* all sent */
    } else {
        Py_CLEAR(got);
    }
    start = long_attr(reader, s_start);
    end = long_attr(reader, s_end);
    if (PyErr_Occurred()) return back_raised(self, got);
    if (start != end && got == NULL && self->p_begin != NULL)
        return put_take(self, reader, services, served, start, end);
    if (start != end || got != NULL)
        return hand_back(self, BACK_DATA, PyLong_FromLongLong(served), got);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ puts in the reader callback
 *
 * With `take_puts(begin, commit)` the armed callback also takes a whole canonical Put header at
 * the front of the buffer (the map the SDK sends: key, length of 1 byte up to the frame limit,
 * parent nil or a key, durable false; anything else is the Python codec's). It calls
 * `begin(request_id, key, length, parent)`, which reserves the value's slot exactly as the
 * Python path does and returns (slot, token), or None after it has handed the frame to the
 * Python codec itself (a refused reservation: the Python path answers it). C copies the payload
 * bytes already buffered into the slot and receives the rest straight into it, one `recv` per
 * readable event, never more than the slot's size. Once the value is whole, `commit(token)`
 * commits it as the Python path does and returns True (C answers as `put_done`) or False (it
 * answered in Python: hand back). A put whose payload is still arriving when C hands back (EOF,
 * a receive error) or is stopped stays held here until the session takes it (`take_put`) and
 * gives it to the Python codec, which then goes on (or abandons it) as for its own put. */

static uint64_t le64(const unsigned char *p) {
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

/* Whether p (n bytes) starts with a whole canonical Put header (frame head and map) whose
 * length is 1..max_payload; its fields out (key and parent point into p; parent NULL: nil). */
static int canonical_put(const unsigned char *p, Py_ssize_t n, long long max_header,
                         long long max_payload, uint32_t *rid, uint32_t *hlen, long long *length,
                         const unsigned char **key, const unsigned char **parent) {
    static const unsigned char k[] = {0x84, 0xa3, 'k', 'e', 'y', 0xc4, 16};
    static const unsigned char l[] = {0xa6, 'l', 'e', 'n', 'g', 't', 'h'};
    static const unsigned char pa[] = {0xa6, 'p', 'a', 'r', 'e', 'n', 't'};
    static const unsigned char d[] = {0xa7, 'd', 'u', 'r', 'a', 'b', 'l', 'e', 0xc2};
    if (n < HEAD || memcmp(p, "KVNP", 4) != 0 || p[4] != 1 || p[5] != OP_PUT) return 0;
    if (p[6] != 0 || p[7] != 0) return 0;
    *rid = le32(p + 8);
    *hlen = le32(p + 12);
    /* the longest canonical map is 73 bytes: anything longer is not one */
    if (*rid == 0 || *hlen > 80 || (long long)*hlen > max_header || n - HEAD < (Py_ssize_t)*hlen)
        return 0;
    const unsigned char *m = p + HEAD, *stop = m + *hlen;
    if (stop - m < (ptrdiff_t)sizeof k + 16 || memcmp(m, k, sizeof k) != 0) return 0;
    *key = m + sizeof k;
    m += sizeof k + 16;
    if (stop - m < (ptrdiff_t)sizeof l + 1 || memcmp(m, l, sizeof l) != 0) return 0;
    m += sizeof l;
    uint64_t v = 0;
    int width = *m == 0xcc ? 1 : *m == 0xcd ? 2 : *m == 0xce ? 4 : *m == 0xcf ? 8 : 0;
    if (width == 0 && *m >= 0x80) return 0;
    if (width == 0) v = *m++;
    else if (stop - ++m < width) return 0;
    for (int i = 0; i < width; i++) v = v << 8 | *m++;
    if (stop - m < (ptrdiff_t)sizeof pa + 1 || memcmp(m, pa, sizeof pa) != 0) return 0;
    m += sizeof pa;
    if (*m == 0xc0) {
        *parent = NULL;
        m++;
    } else if (stop - m >= 18 && m[0] == 0xc4 && m[1] == 16) {
        *parent = m + 2;
        m += 18;
    } else {
        return 0;
    }
    if (stop - m != (ptrdiff_t)sizeof d || memcmp(m, d, sizeof d) != 0) return 0;
    if (v != le64(p + 16) || v < 1 || max_payload < 1 || v > (uint64_t)max_payload) return 0;
    *length = (long long)v;
    return 1;
}

static PyObject *s_max_payload, *s_put_names[3];

/* The value is whole: commit it, answer it as put_done does, then stay armed (or hand back
 * `more` buffered bytes, or an answer a full socket did not take). */
static PyObject *put_finish(HotGets *self, PyObject *services, long long served, int more) {
    PyObject *token = self->p_token;
    self->p_token = NULL;
    Py_CLEAR(self->p_slot);
    self->p_active = 0;
    self->small_read = self->p_len >= LARGE_PAYLOAD; /* as FrameReader.after_large_payload */
    PyObject *ok = PyObject_CallOneArg(self->p_commit, token);
    Py_DECREF(token);
    if (ok == NULL) return back_raised(self, NULL);
    int committed = PyObject_IsTrue(ok);
    Py_DECREF(ok);
    if (committed < 0) return back_raised(self, NULL);
    if (!committed) { /* answered in Python (a failed commit): its Channel has the answer */
        self->small_read = 0;
        return hand_back(self, BACK_DATA, PyLong_FromLongLong(served), NULL);
    }
    PyObject *head = PyObject_CallFunction(self->frame_head, "(ikOOi)", OP_PUT,
                                           (unsigned long)self->p_rid, Py_None, Py_None, 0);
    PyObject *parts = head ? PyList_New(1) : NULL;
    if (parts == NULL) {
        Py_XDECREF(head);
        return back_raised(self, NULL);
    }
    PyList_SET_ITEM(parts, 0, head);
    PyObject *args = Py_BuildValue("(OidL)", parts, self->r_fd, self->p_t0, self->p_len);
    Py_DECREF(parts);
    PyObject *rest = args ? hot_put_done(self, args) : NULL;
    Py_XDECREF(args);
    if (rest == NULL) return back_raised(self, NULL);
    for (int i = 0; i < 3 && services != Py_None; i++) { /* what _serve_hot-like callers count */
        long long was = long_attr(services, s_put_names[i]);
        if ((was == -1 && PyErr_Occurred()) || set_long(services, s_put_names[i], was + 1) < 0) {
            Py_DECREF(rest);
            return back_raised(self, NULL);
        }
    }
    if (PyList_GET_SIZE(rest)) { /* a full socket: the session queues the rest, in flight */
        long long size = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rest); i++)
            size += PyObject_Length(PyList_GET_ITEM(rest, i));
        PyObject *got = Py_BuildValue("(N[][](iiii)iLi)", rest, 0, 0, 0, 0, 0, size, 0);
        return hand_back(self, BACK_DATA, PyLong_FromLongLong(served + 1), got);
    }
    Py_DECREF(rest);
    if (more) return hand_back(self, BACK_DATA, PyLong_FromLongLong(served + 1), NULL);
    Py_RETURN_NONE;
}

/* A failure after `begin` and before the header was consumed (the frame is still the
 * codec's): not a put arriving; `take_put` gives the token back with got -1 so that the
 * session aborts the reservation, and the error is raised through the hand-back. */
static PyObject *put_undo(HotGets *self) {
    self->p_active = 0;
    self->p_got = -1;
    Py_CLEAR(self->p_slot);
    return back_raised(self, NULL);
}

/* The front of the buffer holds what serve did not take: a canonical Put header starts a put
 * in C (see above); anything else goes back to the Python codec. */
static PyObject *put_take(HotGets *self, PyObject *reader, PyObject *services, long long served,
                          long long start, long long end) {
    PyObject *limits = PyObject_GetAttr(reader, s_limits);
    long long max_header = limits ? long_attr(limits, s_max_header) : -1;
    long long max_payload = limits && !PyErr_Occurred() ? long_attr(limits, s_max_payload) : -1;
    Py_XDECREF(limits);
    if (PyErr_Occurred()) return back_raised(self, NULL);
    PyObject *buf = PyObject_GetAttr(reader, s_buf);
    if (buf == NULL) return back_raised(self, NULL);
    uint32_t rid = 0, hlen = 0;
    long long length = 0;
    const unsigned char *keyp = NULL, *parentp = NULL;
    if (!PyByteArray_Check(buf) || start < 0 || start > end || end > PyByteArray_GET_SIZE(buf) ||
        !canonical_put((const unsigned char *)PyByteArray_AS_STRING(buf) + start, end - start,
                       max_header, max_payload, &rid, &hlen, &length, &keyp, &parentp) ||
        !own_keys(self, keyp, 1, 16)) { /* another shard's key: Python answers WRONG_SHARD */
        Py_DECREF(buf);
        return hand_back(self, BACK_DATA, PyLong_FromLongLong(served), NULL);
    }
    /* copied out before begin runs Python code */
    PyObject *key = PyBytes_FromStringAndSize((const char *)keyp, 16);
    PyObject *parent = parentp ? PyBytes_FromStringAndSize((const char *)parentp, 16)
                               : Py_NewRef(Py_None);
    double t0 = now_s();
    PyObject *r = key && parent ? PyObject_CallFunction(self->p_begin, "(kOLO)",
                                                        (unsigned long)rid, key, length, parent)
                                : NULL;
    Py_XDECREF(key);
    Py_XDECREF(parent);
    if (r == NULL) {
        Py_DECREF(buf);
        return back_raised(self, NULL);
    }
    if (r == Py_None) { /* refused: the Python codec has the frame now */
        Py_DECREF(r);
        Py_DECREF(buf);
        return hand_back(self, BACK_DATA, PyLong_FromLongLong(served), NULL);
    }
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        Py_DECREF(r);
        Py_DECREF(buf);
        PyErr_SetString(PyExc_TypeError, "take_puts: begin must return (slot, token) or None");
        return back_raised(self, NULL);
    }
    /* held from here: a hand-back or a stop gives it to the session (take_put) */
    self->p_slot = Py_NewRef(PyTuple_GET_ITEM(r, 0));
    self->p_token = Py_NewRef(PyTuple_GET_ITEM(r, 1));
    Py_DECREF(r);
    self->p_active = 1;
    self->p_rid = rid;
    self->p_len = length;
    self->p_got = 0;
    self->p_t0 = t0;
    Py_buffer slot;
    if (PyObject_GetBuffer(self->p_slot, &slot, PyBUF_WRITABLE) < 0) {
        Py_DECREF(buf);
        return put_undo(self);
    }
    int fits = slot.len == length && end <= PyByteArray_GET_SIZE(buf);
    long long at = start + HEAD + hlen, avail = end - at < length ? end - at : length;
    if (fits && avail > 0)
        memcpy(slot.buf, PyByteArray_AS_STRING(buf) + at, (size_t)avail);
    PyBuffer_Release(&slot);
    Py_DECREF(buf);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "take_puts: the slot is not the value's size");
        return put_undo(self);
    }
    long long header_at = start;
    self->p_got = avail;
    at += avail;
    if (at == end ? set_long(reader, s_start, 0) < 0 || set_long(reader, s_end, 0) < 0
                  : set_long(reader, s_start, at) < 0) {
        /* the header stays the codec's: the reader as it was, before anything was consumed */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (set_long(reader, s_start, header_at) < 0 || set_long(reader, s_end, end) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return put_undo(self);
    }
    if (self->p_got < length) Py_RETURN_NONE; /* the rest comes straight into the slot */
    return put_finish(self, services, served, at != end);
}

/* A readable event while a put's payload is arriving: one recv into the rest of its slot. */
static PyObject *put_receive(HotGets *self, PyObject *services) {
    Py_buffer slot;
    if (PyObject_GetBuffer(self->p_slot, &slot, PyBUF_WRITABLE) < 0)
        return back_raised(self, NULL);
    ssize_t n = -1;
    errno = EINVAL;
    if (slot.len == self->p_len && self->p_got < self->p_len) do
            n = recv(self->r_fd, (char *)slot.buf + self->p_got,
                     (size_t)(self->p_len - self->p_got), MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
    int err = errno;
    PyBuffer_Release(&slot);
    if (n < 0) {
        if (err == EAGAIN || err == EWOULDBLOCK) Py_RETURN_NONE;
        return hand_back(self, BACK_OSERROR, PyLong_FromLong(err), NULL);
    }
    self->last_rx = now_s();
    if (n == 0) return hand_back(self, BACK_EOF, PyLong_FromLong(0), NULL);
    self->p_got += n;
    if (self->p_got < self->p_len) Py_RETURN_NONE;
    return put_finish(self, services, 0, 0);
}

static PyObject *hot_take_puts(HotGets *self, PyObject *args) {
    PyObject *begin, *commit;
    if (!PyArg_ParseTuple(args, "OO:take_puts", &begin, &commit)) return NULL;
    if (begin != Py_None && (!PyCallable_Check(begin) || !PyCallable_Check(commit))) {
        PyErr_SetString(PyExc_TypeError, "take_puts: begin and commit must be callable");
        return NULL;
    }
    if (self->p_token != NULL) {
        PyErr_SetString(PyExc_ValueError, "take_puts: a put is arriving");
        return NULL;
    }
    if (s_max_payload == NULL) {
        static const char *names[3] = {"hot_put_answers", "hot_reader_requests",
                                       "hot_reader_puts"};
        if ((s_max_payload = PyUnicode_InternFromString("max_payload_bytes")) == NULL)
            return NULL;
        for (int i = 0; i < 3; i++)
            if ((s_put_names[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    }
    Py_XSETREF(self->p_begin, begin == Py_None ? NULL : Py_NewRef(begin));
    Py_XSETREF(self->p_commit, begin == Py_None ? NULL : Py_NewRef(commit));
    Py_RETURN_NONE;
}

static PyObject *hot_take_put(HotGets *self, PyObject *Py_UNUSED(ignored)) {
    if (self->p_token == NULL) Py_RETURN_NONE; /* (got -1 after `put_undo`) */
    PyObject *out = Py_BuildValue("(OL)", self->p_token, self->p_got);
    if (out == NULL) return NULL;
    self->p_active = 0;
    Py_CLEAR(self->p_token);
    Py_CLEAR(self->p_slot);
    return out;
}

static PyObject *hot_call(HotGets *self, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "HotGets() takes no arguments");
        return NULL;
    }
    if (!self->armed) Py_RETURN_NONE; /* disarmed since the loop saw the fd readable */
    PyObject *reader = Py_NewRef(self->r_reader), *services = Py_NewRef(self->r_services);
    PyObject *out = self->p_active ? put_receive(self, services)
                                   : reader_turn(self, reader, services);
    Py_DECREF(services);
    Py_DECREF(reader);
    return out;
}

static PyObject *hot_arm(HotGets *self, PyObject *args) {
    PyObject *reader, *handback, *services;
    int fd;
    long long most, max_inflight;
    if (!PyArg_ParseTuple(args, "OiLLOO:arm", &reader, &fd, &most, &max_inflight, &handback,
                          &services))
        return NULL;
    if (self->nbounds == 0 || fd < 0 || most < 1 || max_inflight < 0) {
        PyErr_SetString(PyExc_ValueError, "arm needs HotGets(..., buckets=...), an fd, most >= 1 "
                                          "and max_inflight >= 0");
        return NULL;
    }
    if (!PyCallable_Check(handback)) {
        PyErr_SetString(PyExc_TypeError, "arm: handback must be callable");
        return NULL;
    }
    if (self->armed) {
        PyErr_SetString(PyExc_ValueError, "arm: already armed");
        return NULL;
    }
    self->r_reader = Py_NewRef(reader);
    self->r_handback = Py_NewRef(handback);
    self->r_services = Py_NewRef(services);
    self->r_fd = fd;
    self->r_most = most;
    self->r_max_inflight = max_inflight;
    self->armed = 1;
    Py_RETURN_NONE;
}

static PyObject *hot_disarm(HotGets *self, PyObject *Py_UNUSED(ignored)) {
    self->armed = 0;
    Py_CLEAR(self->r_reader);
    Py_CLEAR(self->r_handback);
    Py_CLEAR(self->r_services);
    Py_RETURN_NONE;
}

static PyObject *hot_set_shard(HotGets *self, PyObject *args) {
    long long index, count;
    if (!PyArg_ParseTuple(args, "LL:set_shard", &index, &count)) return NULL;
    if (count < 1 || count > 65536 || index < 0 || index >= count) {
        PyErr_SetString(PyExc_ValueError,
                        "set_shard needs 1 <= count <= 65536 and 0 <= index < count");
        return NULL;
    }
    self->shard_index = (uint32_t)index;
    self->shard_count = (uint32_t)count;
    Py_RETURN_NONE;
}

static PyMemberDef hot_members[] = {
    {"armed", T_INT, offsetof(HotGets, armed), READONLY,
     "whether the object is the connection's reader now (arm, until it hands back)"},
    {"last_rx", T_DOUBLE, offsetof(HotGets, last_rx), READONLY,
     "time.monotonic() of the reader callback's last receive (0.0: none yet)"},
    {"put_arriving", T_INT, offsetof(HotGets, p_active), READONLY,
     "whether a put's payload is arriving into its slot (take_puts)"},
    {"put_started", T_DOUBLE, offsetof(HotGets, p_t0), READONLY,
     "when C took that put's header (CLOCK_MONOTONIC, as time.monotonic)"},
    {"small_read", T_INT, offsetof(HotGets, small_read), 0,
     "whether the callback's next receive takes only a header's worth (after a large put)"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *hot_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"lock", "index", "counters", "manager", "apply_touches", "free",
                            "arena", "prefix", "frame_head", "head_state", "touch_ring",
                            "buckets", "pins", "max_payload", "step", NULL};
    PyObject *o[10], *buckets = Py_None, *pins = Py_None;
    Py_ssize_t touch_ring, step = 0;
    long long max_payload = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!OOOOOOOn|O$OLn:HotGets", names, &o[0],
                                     &DramIndexType, &o[1], &PyDict_Type, &o[2], &o[3], &o[4],
                                     &o[5], &o[6], &o[7], &o[8], &o[9], &touch_ring, &buckets,
                                     &pins, &max_payload, &step))
        return NULL;
    if (pins != Py_None && (step < 1 || step > 65536 || max_payload < 1)) {
        PyErr_SetString(PyExc_ValueError, "HotGets: pins needs 1 <= step <= 65536 and max_payload >= 1");
        return NULL;
    }
    double bounds[MAX_BOUNDS];
    Py_ssize_t nbounds = 0;
    if (buckets != Py_None) { /* the latency histogram's finite upper bounds, ascending */
        PyObject *seq = PySequence_Fast(buckets, "buckets must be a sequence of numbers");
        if (seq == NULL) return NULL;
        nbounds = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t i = 0; i < nbounds && i < MAX_BOUNDS; i++) {
            bounds[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
            if (bounds[i] == -1.0 && PyErr_Occurred()) break;
            if (i > 0 && !(bounds[i] > bounds[i - 1])) {
                PyErr_SetString(PyExc_ValueError, "buckets must be ascending");
                break;
            }
        }
        Py_DECREF(seq);
        if (PyErr_Occurred()) return NULL;
        if (nbounds < 1 || nbounds > MAX_BOUNDS) {
            PyErr_Format(PyExc_ValueError, "buckets: 1 to %d bounds", MAX_BOUNDS);
            return NULL;
        }
    }
    HotGets *self = (HotGets *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->nbounds = nbounds; /* tp_alloc zeroed the counts */
    memcpy(self->bounds, bounds, sizeof(double) * (size_t)nbounds);
    PyObject **fields[] = {&self->lock, (PyObject **)&self->index, &self->counters,
                           &self->manager, &self->apply_touches, &self->free, &self->arena,
                           &self->prefix, &self->frame_head, &self->head_state};
    for (int i = 0; i < 10; i++) *fields[i] = Py_NewRef(o[i]);
    self->touch_ring = touch_ring;
    self->pins = Py_NewRef(pins);
    self->max_payload = max_payload;
    self->step = pins != Py_None ? step : 0;
    return (PyObject *)self;
}

static int hot_traverse(HotGets *self, visitproc visit, void *arg) {
    Py_VISIT(self->lock);
    Py_VISIT(self->index);
    Py_VISIT(self->counters);
    Py_VISIT(self->manager);
    Py_VISIT(self->apply_touches);
    Py_VISIT(self->free);
    Py_VISIT(self->arena);
    Py_VISIT(self->prefix);
    Py_VISIT(self->frame_head);
    Py_VISIT(self->head_state);
    Py_VISIT(self->pins);
    Py_VISIT(self->r_reader);
    Py_VISIT(self->r_handback);
    Py_VISIT(self->r_services);
    Py_VISIT(self->p_begin);
    Py_VISIT(self->p_commit);
    Py_VISIT(self->p_slot);
    Py_VISIT(self->p_token);
    return 0;
}

static int hot_clear(HotGets *self) {
    Py_CLEAR(self->lock);
    Py_CLEAR(self->index);
    Py_CLEAR(self->counters);
    Py_CLEAR(self->manager);
    Py_CLEAR(self->apply_touches);
    Py_CLEAR(self->free);
    Py_CLEAR(self->arena);
    Py_CLEAR(self->prefix);
    Py_CLEAR(self->frame_head);
    Py_CLEAR(self->head_state);
    Py_CLEAR(self->pins);
    self->armed = 0;
    Py_CLEAR(self->r_reader);
    Py_CLEAR(self->r_handback);
    Py_CLEAR(self->r_services);
    self->p_active = 0;
    Py_CLEAR(self->p_begin);
    Py_CLEAR(self->p_commit);
    Py_CLEAR(self->p_slot);
    /* A token still held here is a session bug (`_forget` takes it and says so): its
     * reservation is not aborted from C, which cannot run the engine's Python here. */
    Py_CLEAR(self->p_token);
    return 0;
}

static void hot_dealloc(HotGets *self) {
    PyObject_GC_UnTrack(self);
    hot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef hot_methods[] = {
    {"serve", (PyCFunction)hot_serve, METH_VARARGS,
     "serve(reader, inflight, max_inflight, most, fd=-1) -> (parts, views, entries, (gets, "
     "exists, lookups, get_manys), bytes_out, answer_bytes, taken) or None: answer the whole "
     "canonical Gets, Exists, Lookups and (with pins) GetManys at the front of the buffer; "
     "taken: the pin budget's bytes the answers hold. With fd (a socket with nothing queued) "
     "the answers are sent and counted here; parts is then what the kernel did not take (its "
     "views and entries released once it is sent) or empty (already released)."},
    {"take_metrics", (PyCFunction)hot_take_metrics, METH_NOARGS,
     "take_metrics() -> ((gets, exists, lookups, get_manys, puts), bytes_out, (buckets per "
     "op), (latency sums per op), bytes_in): what serve(..., fd) and put_done counted since "
     "the last call (then zeroed); each op's buckets are not cumulative, the last is +Inf."},
    {"put_done", (PyCFunction)hot_put_done, METH_VARARGS,
     "put_done(parts, fd, t0, nbytes) -> rest: send a put's answer (the codec's bytes) on fd "
     "(nothing queued on it) and count it (a put, ok, latency from t0, nbytes in); rest is "
     "what the kernel did not take, for the session's Channel."},
    {"arm", (PyCFunction)hot_arm, METH_VARARGS,
     "arm(reader, fd, most, max_inflight, handback, services): be the connection's reader "
     "callback (the loop calls the object when fd is readable) until it calls "
     "handback(code, extra, got) once; see hot.c."},
    {"disarm", (PyCFunction)hot_disarm, METH_NOARGS,
     "disarm(): stop being the reader without a hand-back (the session was stopped)."},
    {"take_puts", (PyCFunction)hot_take_puts, METH_VARARGS,
     "take_puts(begin, commit): the reader callback also takes canonical Puts (None, None: "
     "no more); begin(request_id, key, length, parent) -> (slot, token) or None, "
     "commit(token) -> bool; see hot.c."},
    {"take_put", (PyCFunction)hot_take_put, METH_NOARGS,
     "take_put() -> (token, got) or None: the put whose payload C was receiving (got bytes "
     "in its slot), now the caller's."},
    {"set_shard", (PyCFunction)hot_set_shard, METH_VARARGS,
     "set_shard(index, count): serve only frames whose keys are all of shard `index` of "
     "`count` (shard_of: CRC32C mod count); any other frame is left to Python."},
    {"release", (PyCFunction)hot_release, METH_VARARGS,
     "release(views, entries, taken=0): unpin what served answers held and give `taken` back "
     "to the pin budget (idempotent)."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject HotGetsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.core._core.HotGets",
    .tp_basicsize = sizeof(HotGets),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A connection's DRAM Get hits served in C (see hot.c).",
    .tp_new = hot_new,
    .tp_dealloc = (destructor)hot_dealloc,
    .tp_traverse = (traverseproc)hot_traverse,
    .tp_clear = (inquiry)hot_clear,
    .tp_methods = hot_methods,
    .tp_members = hot_members,
    .tp_call = (ternaryfunc)hot_call,
};

int core_hot_init(void) { return intern_all(); }
