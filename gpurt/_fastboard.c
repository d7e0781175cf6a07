/* gpurt._fastboard: the shm board's blocking small-message round, compiled.
 *
 * The same protocol as transports/shm_board.py (read that docstring first), for the inline
 * fast path of the blocking collectives on NumPy arrays: publish my contribution and header, wait
 * for every peer's flag, compare their headers, read (copy or reduce in rank order), store
 * `done`.  Python keeps everything that is not the common case: when a slot is not free
 * yet, a peer is slow (longer than a short spin-then-yield budget), a header differs
 * (Python raises the CollectiveMismatchError with the details) or the dtype/op has no
 * kernel here, `run` returns where it stopped and BoardRun.advance finishes the call under
 * the executor's deadlines and liveness checks.  Nothing here blocks for long, raises a
 * collective error or decides anything the Python protocol would decide differently.
 *
 * Results are bitwise those of the NumPy path: out = slot0, then out = out op slot_k for
 * k = 1..p-1, one rounding per element and step; integer sum/product wrap (computed in
 * unsigned arithmetic); min/max pick the same operand as np.minimum/np.maximum
 * (NaN first, then the second of two equal values: -0.0 vs 0.0).
 *
 * The staged allreduce (shm_direct's shm_staged; transports/shm_direct.py, "Staged
 * allreduce") is here too, as `staged`: publish the input with the agreement's header,
 * reduce this rank's block of every board buffer, publish the reduced block, copy the
 * others' out.  The same rule: anything but the common case (a header that differs, a
 * rank that did not stage, a peer slower than the wait budget) returns where it stopped,
 * and shm_direct.DirectRun finishes the call from that phase.
 *
 * Memory order: flags are loaded with acquire and stored with release (between two C ranks
 * that would hold on weakly ordered CPUs too; the Python path, and so the transport,
 * relies on x86 TSO and is off elsewhere).
 */
#ifdef __FAST_MATH__
#error "gpurt._fastboard must not be built with -ffast-math: the NaN tests in min/max would fold away"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

/* the order of shm_board.COLLS, checked by Python at import */
enum { C_ALLREDUCE, C_REDUCE, C_BROADCAST, C_ALLGATHER, C_REDUCE_SCATTER, C_ALLTOALL,
       C_GATHER, C_SCATTER, C_BARRIER };
/* reduction ops (AVG reduces with SUM; Python divides afterwards) */
enum { O_NONE, O_SUM, O_PROD, O_MIN, O_MAX, O_BAND, O_BOR, O_BXOR };
/* element types with kernels here; anything else reduces in Python */
enum { T_NONE = -1, T_I8, T_I16, T_I32, T_I64, T_U8, T_U16, T_U32, T_U64, T_F32, T_F64 };

/* what run(), staged() and direct() return (direct's D_STOPPED and D_CMAFAIL carry the
 * peer's local rank in bits 8..19, D_CMAFAIL also the direction in bit 20 (1: a write
 * into the peer) and errno in bits 21..30; D_CLOSED: stop() came before READY was stored,
 * so no peer is let into this rank's buffers) */
enum { DONE = 0, PUBLISHED = 1, NOTHING = 2, HANDBACK = 3, REDUCED = 4,
       D_READY = 5, D_FINISHED = 6, D_STOPPED = 7, D_CMAFAIL = 8, D_CLOSED = 9 };

#define HDR_SITE 8
#define HDR_EXTRA 9             /* header words 9..15: shm_direct's (call word, locations) */
#define N_EXTRA 7
#define W_READY 2               /* control-line words of shm_direct: 2 seq (+1: failed) */
#define W_FINISHED 3            /*   this rank's share is done */
#define W_REDUCED 4             /* control-line word: a staged call's block is reduced */
#define D_PIECE (256 << 10)     /* direct(): bytes reduced at a time (scratch: two of them) */
#define D_COPY (2 << 20)        /* direct(): bytes copied between checks of the peers */
#define STAGE_PIECE (64 << 10)  /* bytes reduced at a time (they stay in the core's L2) */
#define ALIGN_BYTES 4096        /* shm_direct.blocks: blocks split on 4 KiB boundaries */
#define ABI 11                  /* bumped whenever Python's use of this module changes */

static PyTypeObject *ndarray_type;  /* numpy.ndarray, given by set_ndarray (run checks it) */

typedef struct {
    PyObject_HEAD
    uint64_t *q;            /* the segment, as 64-bit words (NULL once closed) */
    char *u8;               /* the segment, as bytes */
    int p, me;
    Py_ssize_t *ctrl;       /* word index of rank k's flag; done is the next word */
    Py_ssize_t *hdr;        /* word index of rank k's header b: [2k + b] */
    Py_ssize_t *data;       /* byte offset of rank k's buffer b: [2k + b] */
    Py_ssize_t slot;
    int64_t spin_ns;        /* spin this long before yielding (0: yield at once) */
    int64_t budget_ns;      /* then yield until this much has passed; then Python waits */
    /* direct(): the local ranks' pids and the word index of each one's error record
     * (set_direct), two pieces of scratch, and each rank's input and output address */
    Py_ssize_t *pid, *err;
    char *scratch;
    uint64_t *xa, *oa;
    /* rounds running without the GIL (changed with the GIL held), and stop() or close()
     * under way (read by direct() without the GIL: atomics): close waits for the rounds
     * before it frees the tables (the segment is unmapped next) — in the process that
     * made the board only (a child forked during a round inherits busy, never the round) */
    int busy, closing;
    pid_t owner;
} FastBoard;

typedef struct {
    PyObject_HEAD
    int coll, op, type, itemsize;
    uint64_t sig;
    uint64_t meta[5];
    Py_ssize_t n;           /* elements of the call (per rank) */
    Py_ssize_t wbytes;      /* bytes this rank publishes */
    int root;
} Plan;

/* NumPy's array object starts with its data pointer (part of its stable C ABI:
 * PyArrayObject_fields); Python checks this against ndarray.ctypes.data at import.
 * plain() reads the fields that follow (the same struct, NumPy 1 and 2), which Python
 * also checks at import on arrays whose answers it knows. */
typedef struct { PyObject_HEAD char *data; } np_head;
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions, *strides;
    PyObject *base, *descr;
    int flags;
} np_fields;
#define NP_C_CONTIGUOUS 0x0001
#define NP_WRITEABLE 0x0400

static inline uint64_t load_acq(const uint64_t *a) { return __atomic_load_n(a, __ATOMIC_ACQUIRE); }
static inline void store_rel(uint64_t *a, uint64_t v) { __atomic_store_n(a, v, __ATOMIC_RELEASE); }

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ---- reduction kernels: out = out op src, n elements ----------------------------------
 * The arrays may be unaligned (a NumPy view at an odd offset is still C-contiguous):
 * elements are read and written through types of alignment 1, so the compiler assumes
 * nothing (a loop peeled "up to alignment" from a T* would fault with aligned vector
 * loads on an odd address) — unaligned vector loads cost the same on x86-64 */
#define UNALIGNED(T) typedef T __attribute__((aligned(1), may_alias)) T##_u;
UNALIGNED(int8_t) UNALIGNED(int16_t) UNALIGNED(int32_t) UNALIGNED(int64_t)
UNALIGNED(uint8_t) UNALIGNED(uint16_t) UNALIGNED(uint32_t) UNALIGNED(uint64_t)
UNALIGNED(float) UNALIGNED(double)

#define INT_KERNEL(T, U)                                                                   \
    static void red_##T(int op, char *o_, const char *s_, Py_ssize_t n) {                \
        T##_u *o = (T##_u *)o_; const T##_u *s = (const T##_u *)s_; Py_ssize_t i;        \
        switch (op) {                                                                      \
        case O_SUM: for (i = 0; i < n; i++) o[i] = (T)(U)((uint64_t)(U)o[i] + (uint64_t)(U)s[i]); break; \
        case O_PROD: for (i = 0; i < n; i++) o[i] = (T)(U)((uint64_t)(U)o[i] * (uint64_t)(U)s[i]); break; \
        case O_MIN: for (i = 0; i < n; i++) o[i] = s[i] < o[i] ? s[i] : o[i]; break;    \
        case O_MAX: for (i = 0; i < n; i++) o[i] = s[i] > o[i] ? s[i] : o[i]; break;    \
        case O_BAND: for (i = 0; i < n; i++) o[i] = o[i] & s[i]; break;                  \
        case O_BOR: for (i = 0; i < n; i++) o[i] = o[i] | s[i]; break;                   \
        case O_BXOR: for (i = 0; i < n; i++) o[i] = o[i] ^ s[i]; break;                  \
        }                                                                                  \
    }

INT_KERNEL(int8_t, uint8_t)
INT_KERNEL(int16_t, uint16_t)
INT_KERNEL(int32_t, uint32_t)
INT_KERNEL(int64_t, uint64_t)
INT_KERNEL(uint8_t, uint8_t)
INT_KERNEL(uint16_t, uint16_t)
INT_KERNEL(uint32_t, uint32_t)
INT_KERNEL(uint64_t, uint64_t)

/* np.minimum / np.maximum, bit for bit: a NaN operand wins (the first one if both are
 * NaN), and between equal values (0.0 and -0.0) the second */
#define FLOAT_KERNEL(T)                                                                    \
    static void red_##T(int op, char *o_, const char *s_, Py_ssize_t n) {                \
        T##_u *o = (T##_u *)o_; const T##_u *s = (const T##_u *)s_; Py_ssize_t i;        \
        switch (op) {                                                                      \
        case O_SUM: for (i = 0; i < n; i++) o[i] = o[i] + s[i]; break;                   \
        case O_PROD: for (i = 0; i < n; i++) o[i] = o[i] * s[i]; break;                  \
        case O_MIN: for (i = 0; i < n; i++) { T a = o[i], b = s[i];                       \
                    o[i] = (a < b || a != a) ? a : b; } break;                            \
        case O_MAX: for (i = 0; i < n; i++) { T a = o[i], b = s[i];                       \
                    o[i] = (a > b || a != a) ? a : b; } break;                            \
        }                                                                                  \
    }

FLOAT_KERNEL(float)
FLOAT_KERNEL(double)

typedef void (*kernel_t)(int, char *, const char *, Py_ssize_t);
static const kernel_t KERNELS[] = {red_int8_t, red_int16_t, red_int32_t, red_int64_t,
                                   red_uint8_t, red_uint16_t, red_uint32_t, red_uint64_t,
                                   red_float, red_double};

static int has_kernel(int type, int op) {
    if (type < 0 || op == O_NONE) return 0;
    if (type >= T_F32 && op >= O_BAND) return 0;   /* bitwise ops: integers only */
    return 1;
}

/* ---- Plan -------------------------------------------------------------------------------- */

static PyTypeObject PlanType;

/* ---- FastBoard --------------------------------------------------------------------------- */

static void fb_free_tables(FastBoard *fb) {
    PyMem_Free(fb->ctrl); PyMem_Free(fb->hdr); PyMem_Free(fb->data);
    fb->ctrl = fb->hdr = fb->data = NULL;
    PyMem_Free(fb->pid); PyMem_Free(fb->err); PyMem_Free(fb->xa); PyMem_Free(fb->oa);
    fb->pid = fb->err = NULL; fb->xa = fb->oa = NULL;
    free(fb->scratch);
    fb->scratch = NULL;
    fb->q = NULL; fb->u8 = NULL;
}

static void fb_dealloc(FastBoard *fb) {
    fb_free_tables(fb);
    Py_TYPE(fb)->tp_free((PyObject *)fb);
}

static int read_table(PyObject *seq, Py_ssize_t want, Py_ssize_t **out) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != want) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "expected %zd entries", want);
        return -1;
    }
    *out = PyMem_Malloc(sizeof(Py_ssize_t) * (want ? want : 1));
    if (!*out) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < want; i++) {
        (*out)[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if ((*out)[i] == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
    }
    Py_DECREF(fast);
    return 0;
}

/* FastBoard(address, nlocal, me, slot, ctrl, hdr, data): word/byte offsets as in Board */
static int fb_init(FastBoard *fb, PyObject *args, PyObject *kw) {
    unsigned long long addr;
    int p, me;
    Py_ssize_t slot;
    PyObject *ctrl, *hdr, *data;
    if (!PyArg_ParseTuple(args, "KiinOOO", &addr, &p, &me, &slot, &ctrl, &hdr, &data))
        return -1;
    if (p < 1 || me < 0 || me >= p || (addr & 7)) {
        PyErr_SetString(PyExc_ValueError, "bad board geometry");
        return -1;
    }
    fb_free_tables(fb);
    if (read_table(ctrl, p, &fb->ctrl) || read_table(hdr, 2 * p, &fb->hdr) ||
        read_table(data, 2 * p, &fb->data)) {
        fb_free_tables(fb);
        return -1;
    }
    fb->q = (uint64_t *)(uintptr_t)addr;
    fb->u8 = (char *)(uintptr_t)addr;
    fb->p = p; fb->me = me; fb->slot = slot;
    fb->spin_ns = 0; fb->budget_ns = 1000000;
    fb->busy = fb->closing = 0;
    fb->owner = getpid();
    return 0;
}

static PyObject *fb_set_wait(FastBoard *fb, PyObject *args) {
    long long spin, budget;
    if (!PyArg_ParseTuple(args, "LL", &spin, &budget)) return NULL;
    fb->spin_ns = spin < 0 ? 0 : spin;
    fb->budget_ns = budget < fb->spin_ns ? fb->spin_ns : budget;
    Py_RETURN_NONE;
}

/* close(): no new round starts; the ones running without the GIL (another thread's call,
 * bounded by its wait budget and its share) end first */
static PyObject *fb_close(FastBoard *fb, PyObject *unused) {
    __atomic_store_n(&fb->closing, 1, __ATOMIC_SEQ_CST);
    while (fb->busy && fb->owner == getpid()) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
        Py_END_ALLOW_THREADS
    }
    fb_free_tables(fb);
    Py_RETURN_NONE;
}

/* stop(): no new round starts, and a direct() round that has not stored READY yet stops
 * there (D_CLOSED): Communicator.close() from another thread, before it waits for the
 * call to end (the tables and the segment stay until close()) */
static PyObject *fb_stop(FastBoard *fb, PyObject *unused) {
    __atomic_store_n(&fb->closing, 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* the checks before a round: the board is open (NULL and an exception set otherwise) */
static int fb_open(const FastBoard *fb) {
    if (fb->q == NULL || __atomic_load_n(&fb->closing, __ATOMIC_SEQ_CST)) {
        PyErr_SetString(PyExc_RuntimeError, "the board is closed");
        return 0;
    }
    return 1;
}

/* plan(coll, sig, meta(5 ints), n, itemsize, type, op, root, wbytes) */
static PyObject *fb_plan(FastBoard *fb, PyObject *args) {
    int coll, itemsize, type, op, root;
    unsigned long long sig;
    unsigned long long m[5];
    Py_ssize_t n, wbytes;
    if (!PyArg_ParseTuple(args, "iK(KKKKK)niiiin", &coll, &sig, &m[0], &m[1], &m[2], &m[3],
                          &m[4], &n, &itemsize, &type, &op, &root, &wbytes))
        return NULL;
    if (coll < C_ALLREDUCE || coll > C_BARRIER || op < O_NONE || op > O_BXOR ||
        type < T_NONE || type > T_F64 || itemsize < 1 || itemsize > 64 ||
        root < 0 || root >= fb->p) {
        PyErr_SetString(PyExc_ValueError, "plan: bad collective, op, type, itemsize or root");
        return NULL;
    }
    /* every byte read at an offset of a buffer must lie inside it */
    Py_ssize_t blocks = (coll == C_REDUCE_SCATTER || coll == C_ALLTOALL || coll == C_SCATTER)
        ? fb->p : 1;
    if (wbytes < 0 || wbytes > fb->slot || n < 0 ||
        (n && (coll == C_BARRIER ? 0 : n > fb->slot / itemsize / blocks))) {
        PyErr_SetString(PyExc_ValueError, "call does not fit the board");
        return NULL;
    }
    Plan *pl = PyObject_New(Plan, &PlanType);
    if (!pl) return NULL;
    pl->coll = coll; pl->sig = sig; pl->n = n; pl->itemsize = itemsize; pl->type = type;
    pl->op = op; pl->root = root; pl->wbytes = wbytes;
    for (int i = 0; i < 5; i++) pl->meta[i] = m[i];
    return (PyObject *)pl;
}

/* every peer's control-line word `w` (0: flag, 1: done, W_REDUCED) has reached `seq` */
static inline int peers_at(const FastBoard *fb, int w, uint64_t seq) {
    for (int k = 0; k < fb->p; k++)
        if (k != fb->me && load_acq(&fb->q[fb->ctrl[k] + w]) < seq) return 0;
    return 1;
}

static inline int peers_ready(const FastBoard *fb, uint64_t seq) { return peers_at(fb, 0, seq); }

/* Spin, then yield, until every peer's word `w` has reached `seq` or `budget` ns are
 * gone, or stop() or close() was called (Python then goes on, or stops).  Called without
 * the GIL. */
static int wait_word(const FastBoard *fb, int w, uint64_t seq, int64_t budget) {
    int64_t start = now_ns(), t;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (peers_at(fb, w, seq)) return 1;
            cpu_relax();
        }
        t = now_ns() - start;
        if (t >= budget || __atomic_load_n(&fb->closing, __ATOMIC_RELAXED))
            return peers_at(fb, w, seq);
        if (t >= fb->spin_ns) sched_yield();
    }
}

static int wait_peers(const FastBoard *fb, uint64_t seq) {
    return wait_word(fb, 0, seq, fb->budget_ns);
}

static int finish(const FastBoard *fb, const Plan *pl, uint64_t seq, char *out);

/* run(plan, seq, last, x, out) -> DONE / PUBLISHED / NOTHING (see the top of the file) */
static PyObject *fb_run(FastBoard *fb, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || Py_TYPE(args[0]) != &PlanType) {
        PyErr_SetString(PyExc_TypeError, "run(plan, seq, last, x, out)");
        return NULL;
    }
    if (!fb_open(fb)) return NULL;
    const Plan *pl = (const Plan *)args[0];
    if (!ndarray_type || Py_TYPE(args[3]) != ndarray_type || Py_TYPE(args[4]) != ndarray_type) {
        PyErr_SetString(PyExc_TypeError, "run: x and out must be numpy.ndarray");
        return NULL;
    }
    uint64_t seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    uint64_t last = PyLong_AsUnsignedLongLong(args[2]);
    if (last == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    const char *x = ((np_head *)args[3])->data;
    char *out = ((np_head *)args[4])->data;
    uint64_t *q = fb->q;
    const int p = fb->p, me = fb->me, b = (int)(seq & 1);

    /* 1. my buffer b is free once every peer has finished the call that last used it */
    if (last)
        for (int k = 0; k < p; k++)
            if (k != me && load_acq(&q[fb->ctrl[k] + 1]) < last) return PyLong_FromLong(NOTHING);

    /* 2. publish: data, header, then the flag */
    Py_ssize_t h = fb->hdr[2 * me + b];
    if (pl->wbytes) memcpy(fb->u8 + fb->data[2 * me + b], x, (size_t)pl->wbytes);
    q[h] = seq;
    q[h + 1] = pl->sig;
    q[h + 2] = (uint64_t)pl->wbytes;
    for (int i = 0; i < 5; i++) q[h + 3 + i] = pl->meta[i];
    q[h + HDR_SITE] = 0;            /* the inline path publishes no call site */
    store_rel(&q[fb->ctrl[me]], seq);

    /* 3. wait for every peer's flag (briefly; then Python waits, with deadlines) */
    if (!peers_ready(fb, seq)) {
        int ok;
        fb->busy++;
        Py_BEGIN_ALLOW_THREADS
        ok = wait_peers(fb, seq);
        Py_END_ALLOW_THREADS
        fb->busy--;
        if (!ok) return PyLong_FromLong(PUBLISHED);
    }
    return PyLong_FromLong(finish(fb, pl, seq, out) == DONE ? DONE : PUBLISHED);
}

/* complete(plan, seq, out): the rest of a published call (the Python BoardRun's phase 1):
 * 0 done, 1 a peer has not published yet, 3 Python's to finish (a header differs, or no
 * kernel for this dtype/op).  Lets every read of the board go through the same kernels,
 * so that ranks on different paths get the same bits (NaN payloads included). */
static PyObject *fb_complete(FastBoard *fb, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || Py_TYPE(args[0]) != &PlanType) {
        PyErr_SetString(PyExc_TypeError, "complete(plan, seq, out)");
        return NULL;
    }
    if (!fb_open(fb)) return NULL;
    if (!ndarray_type || Py_TYPE(args[2]) != ndarray_type) {
        PyErr_SetString(PyExc_TypeError, "complete: out must be a numpy.ndarray");
        return NULL;
    }
    uint64_t seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    if (!peers_ready(fb, seq)) return PyLong_FromLong(1);
    return PyLong_FromLong(finish(fb, (const Plan *)args[0], seq, ((np_head *)args[2])->data)
                           == DONE ? 0 : 3);
}

/* Steps 4-6 once every peer's flag has passed `seq`: compare headers, read, store done.
 * DONE, or HANDBACK when a header differs or there is no kernel (Python's to do). */
static int finish(const FastBoard *fb, const Plan *pl, uint64_t seq, char *out) {
    uint64_t *q = fb->q;
    const int p = fb->p, me = fb->me, b = (int)(seq & 1);
    /* 4. their headers: any difference is Python's to report */
    for (int k = 0; k < p; k++) {
        if (k == me) continue;
        Py_ssize_t hk = fb->hdr[2 * k + b];
        if (q[hk] != seq || q[hk + 1] != pl->sig) return HANDBACK;
        /* the call's arguments too: two calls whose 32-bit signatures collide differ here */
        for (int i = 0; i < 5; i++)
            if (q[hk + 3 + i] != pl->meta[i]) return HANDBACK;
    }
    /* 5. read, in rank order */
    Py_ssize_t nb = pl->n * pl->itemsize;
    switch (pl->coll) {
    case C_ALLREDUCE:
        if (!has_kernel(pl->type, pl->op)) return HANDBACK;
        memcpy(out, fb->u8 + fb->data[b], (size_t)nb);
        for (int k = 1; k < p; k++)
            KERNELS[pl->type](pl->op, out, fb->u8 + fb->data[2 * k + b], pl->n);
        break;
    case C_REDUCE:
        if (me != pl->root) break;
        if (!has_kernel(pl->type, pl->op)) return HANDBACK;
        memcpy(out, fb->u8 + fb->data[b], (size_t)nb);
        for (int k = 1; k < p; k++)
            KERNELS[pl->type](pl->op, out, fb->u8 + fb->data[2 * k + b], pl->n);
        break;
    case C_REDUCE_SCATTER:      /* my block of every rank's p blocks */
        if (!has_kernel(pl->type, pl->op)) return HANDBACK;
        memcpy(out, fb->u8 + fb->data[b] + me * nb, (size_t)nb);
        for (int k = 1; k < p; k++)
            KERNELS[pl->type](pl->op, out, fb->u8 + fb->data[2 * k + b] + me * nb, pl->n);
        break;
    case C_GATHER:
        if (me != pl->root) break;
        /* fall through */
    case C_ALLGATHER:
        for (int k = 0; k < p; k++)
            memcpy(out + k * nb, fb->u8 + fb->data[2 * k + b], (size_t)nb);
        break;
    case C_ALLTOALL:            /* block k of out: my block of rank k's */
        for (int k = 0; k < p; k++)
            memcpy(out + k * nb, fb->u8 + fb->data[2 * k + b] + me * nb, (size_t)nb);
        break;
    case C_BROADCAST:
        if (me != pl->root) memcpy(out, fb->u8 + fb->data[2 * pl->root + b], (size_t)nb);
        break;
    case C_SCATTER:
        memcpy(out, fb->u8 + fb->data[2 * pl->root + b] + me * nb, (size_t)nb);
        break;
    case C_BARRIER:
        break;
    default:
        return HANDBACK;
    }
    /* 6. done with the peers' buffers */
    store_rel(&q[fb->ctrl[me] + 1], seq);
    return DONE;
}

/* an array's nbytes, or -1 with an exception set */
static Py_ssize_t nbytes_of(PyObject *arr) {
    PyObject *nbo = PyObject_GetAttrString(arr, "nbytes");
    if (!nbo) return -1;
    Py_ssize_t nbv = PyLong_AsSsize_t(nbo);
    Py_DECREF(nbo);
    if (nbv < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative nbytes");
    return nbv < 0 ? -1 : nbv;
}

/* staged()'s and direct()'s x and out (args 3, 4): numpy.ndarray holding `want` bytes
 * (exactly, or at least), so that every byte the round reads from x and writes into out
 * lies inside them (the caller passes C-contiguous arrays: Communicator._inline_res);
 * 1, or 0 with an exception set */
static int round_arrays(PyObject *const *args, const Py_ssize_t *want, int exact,
                        const char *who) {
    if (!ndarray_type || Py_TYPE(args[3]) != ndarray_type || Py_TYPE(args[4]) != ndarray_type) {
        PyErr_Format(PyExc_TypeError, "%s: x and out must be numpy.ndarray", who);
        return 0;
    }
    for (int i = 0; i < 2; i++) {
        Py_ssize_t nbv = nbytes_of(args[3 + i]);
        if (nbv == -1) return 0;
        if (exact ? nbv != want[i] : nbv < want[i]) {
            PyErr_Format(PyExc_ValueError, exact ? "%s: x and out must hold the plan's bytes"
                                                 : "%s: x or out is smaller than the plan", who);
            return 0;
        }
    }
    return 1;
}

/* staged()'s and direct()'s words: seq, last (args 1, 2), site and the extra words (args
 * 5 ..): 0, or -1 with an exception set */
static int round_words(PyObject *const *args, uint64_t *v) {
    for (int i = 0; i < 3 + N_EXTRA; i++) {
        v[i] = PyLong_AsUnsignedLongLong(args[i < 2 ? 1 + i : 3 + i]);
        if (v[i] == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* ---- the staged allreduce -----------------------------------------------------------
 * staged(plan, seq, last, x, out, site, w0, x_loc, x_off, x_addr, o_loc, o_off, o_addr)
 *   -> DONE, NOTHING (buffer `seq % 2` not free yet: nothing done), PUBLISHED (input and
 *      header published; Python's BoardRun phase 1 goes on: a peer is late, a header
 *      differs, or a rank did not stage) or REDUCED (this rank's block is reduced and
 *      published: DirectRun's phase 7 waits for the others' and copies them out).
 * The header is the one shm_direct.DirectRun publishes through BoardRun(check=True,
 * stage=x, extra=(w0,) + where(x) + where(out)): seq, sig, bytes, meta, the call site's id
 * (its text published by Python), then w0 = 4 seq + 2 (staged) + forced and the locations, which
 * a peer that did not stage needs for the shm_direct shares.  Blocks are
 * shm_direct.blocks(n, p, itemsize); reductions go in rank order into `out`. */

static void stage_block(Py_ssize_t n, int p, int k, int isz, Py_ssize_t *lo, Py_ssize_t *hi) {
    Py_ssize_t unit = ALIGN_BYTES / isz > 0 ? ALIGN_BYTES / isz : 1;
    Py_ssize_t units = (n + unit - 1) / unit;
    Py_ssize_t a = units * k / p * unit, b = units * (k + 1) / p * unit;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

/* everything after the argument checks; no Python object is touched (GIL released) */
static int staged_round(const FastBoard *fb, const Plan *pl, uint64_t seq, uint64_t last,
                        const char *x, char *out, uint64_t site, const uint64_t *extra) {
    uint64_t *q = fb->q;
    const int p = fb->p, me = fb->me, b = (int)(seq & 1), isz = pl->itemsize;
    const Py_ssize_t nb = pl->wbytes;
    char *mine = fb->u8 + fb->data[2 * me + b];
    /* the waits scale with the bytes each rank moves first (1 ns a byte, at most 4 ms
     * more): past them the executor waits, with its deadlines and liveness checks */
    const int64_t budget = fb->budget_ns + (nb < (4 << 20) ? nb : (4 << 20));

    /* 1. my buffer b is free once every peer has finished the call that last used it */
    if (last && !peers_at(fb, 1, last)) return NOTHING;

    /* 2. publish: input, header, then the flag */
    Py_ssize_t h = fb->hdr[2 * me + b];
    memcpy(mine, x, (size_t)nb);
    q[h] = seq;
    q[h + 1] = pl->sig;
    q[h + 2] = (uint64_t)nb;
    for (int i = 0; i < 5; i++) q[h + 3 + i] = pl->meta[i];
    q[h + HDR_SITE] = site;
    for (int i = 0; i < N_EXTRA; i++) q[h + HDR_EXTRA + i] = extra[i];
    store_rel(&q[fb->ctrl[me]], seq);

    /* 3. every rank's header: the same call, staged as well (else Python decides) */
    if (!peers_ready(fb, seq) && !wait_word(fb, 0, seq, budget)) return PUBLISHED;
    for (int k = 0; k < p; k++) {
        if (k == me) continue;
        Py_ssize_t hk = fb->hdr[2 * k + b];
        if (q[hk] != seq || q[hk + 1] != pl->sig || q[hk + HDR_EXTRA] != extra[0])
            return PUBLISHED;
        for (int i = 0; i < 5; i++)
            if (q[hk + 3 + i] != pl->meta[i]) return PUBLISHED;
    }

    /* 4. my block of every rank's input, in rank order, into out; then over my input's
     * block on the board (only I read it there until every rank is done) */
    Py_ssize_t lo, hi;
    stage_block(pl->n, p, me, isz, &lo, &hi);
    const Py_ssize_t step = STAGE_PIECE / isz > 0 ? STAGE_PIECE / isz : 1;
    for (Py_ssize_t a = lo; a < hi; a += step) {
        Py_ssize_t z = hi - a < step ? hi : a + step;
        size_t off = (size_t)a * isz, len = (size_t)(z - a) * isz;
        memcpy(out + off, fb->u8 + fb->data[b] + off, len);
        for (int k = 1; k < p; k++)
            KERNELS[pl->type](pl->op, out + off, fb->u8 + fb->data[2 * k + b] + off, z - a);
        memcpy(mine + off, out + off, len);
    }
    store_rel(&q[fb->ctrl[me] + W_REDUCED], seq);

    /* 5. the others' reduced blocks */
    if (!peers_at(fb, W_REDUCED, seq) && !wait_word(fb, W_REDUCED, seq, budget))
        return REDUCED;
    for (int k = 0; k < p; k++) {
        if (k == me) continue;
        stage_block(pl->n, p, k, isz, &lo, &hi);
        if (hi > lo)
            memcpy(out + (size_t)lo * isz, fb->u8 + fb->data[2 * k + b] + (size_t)lo * isz,
                   (size_t)(hi - lo) * isz);
    }
    /* 6. done with the peers' buffers */
    store_rel(&q[fb->ctrl[me] + 1], seq);
    return DONE;
}

static PyObject *fb_staged(FastBoard *fb, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 + N_EXTRA || Py_TYPE(args[0]) != &PlanType) {
        PyErr_SetString(PyExc_TypeError, "staged(plan, seq, last, x, out, site, w0, x_loc, "
                                         "x_off, x_addr, o_loc, o_off, o_addr)");
        return NULL;
    }
    if (!fb_open(fb)) return NULL;
    const Plan *pl = (const Plan *)args[0];
    if (pl->coll != C_ALLREDUCE || !has_kernel(pl->type, pl->op) || pl->n < 1 ||
        pl->wbytes != pl->n * pl->itemsize) {
        PyErr_SetString(PyExc_ValueError, "staged: an allreduce plan with a kernel");
        return NULL;
    }
    const Py_ssize_t want[2] = {pl->wbytes, pl->wbytes};
    if (!round_arrays(args, want, 1, "staged")) return NULL;
    uint64_t v[3 + N_EXTRA];      /* seq, last, site, the extra words */
    if (round_words(args, v)) return NULL;
    const char *x = ((np_head *)args[3])->data;
    char *out = ((np_head *)args[4])->data;
    int got;
    fb->busy++;
    Py_BEGIN_ALLOW_THREADS
    got = staged_round(fb, pl, v[0], v[1], x, out, v[2], v + 3);
    Py_END_ALLOW_THREADS
    fb->busy--;
    return PyLong_FromLong(got);
}

/* ---- shm_direct by process_vm_readv/writev, compiled -----------------------------------
 * direct(plan, seq, last, x, out, site, w0, x_loc, x_off, x_addr, o_loc, o_off, o_addr, nt)
 * runs one shm_direct call (transports/shm_direct.py: read its docstring first) on
 * ordinary arrays whose every peer buffer is reached by CMA, the way DirectRun would,
 * without the GIL: the header round (the agreement: the same header words, the buffer
 * locations in words 9..15), done, READY = 2 seq, wait for every READY, this rank's share
 * (below), FINISHED = seq, wait for every FINISHED.  Anything but the common case goes to
 * DirectRun at the phase reached:
 *   NOTHING     buffer seq % 2 not free yet: nothing done;
 *   PUBLISHED   header published; BoardRun's phase 1 goes on (a peer is late, a header
 *               differs — Python raises the mismatch —, a peer staged, or one of the
 *               buffers a peer touches is a shared array or missing: Python decides);
 *   D_READY     headers agreed, READY stored, a peer not READY within the wait (or it
 *               failed to open: DirectRun then takes the schedule);
 *   D_FINISHED  the share is done and FINISHED stored, a peer still in its share;
 *   D_STOPPED   a peer published its error record during the share (Python raises
 *               PeerFailure; the share stopped between pieces);
 *   D_CMAFAIL   a process_vm_readv/writev failed (ESRCH: the peer is gone).
 * Shares, as shm_direct's _SHARES (p ranks, blocks as shm_direct.blocks): allreduce —
 * reduce block r of every input in rank order, write it into every output; reduce — into
 * the root's output; reduce_scatter — this rank's block of every input into its output;
 * allgather — the input into block r of every output; alltoall — block r of every input
 * into block k of the output; broadcast — block r of the root's buffer into every other
 * output.  Reductions go through two pieces of scratch (D_PIECE bytes, in the core's
 * cache) with the board's kernels: acc = in0, acc = acc op in_k, bitwise what the Python
 * shares compute.  `nt`: copies here of at least this many bytes (or pieces of a
 * transfer that large) use streaming stores, as gpurt.memcopy (0: never). */

/* which ranks' input / output a collective touches from other ranks: 0 none or only its
 * owner, 1 every rank's, 2 the root's */
static void direct_roles(int coll, int *tin, int *tout) {
    switch (coll) {
    case C_ALLREDUCE: *tin = 1; *tout = 1; break;
    case C_REDUCE: *tin = 1; *tout = 2; break;
    case C_REDUCE_SCATTER: *tin = 1; *tout = 0; break;
    case C_ALLGATHER: *tin = 0; *tout = 1; break;
    case C_ALLTOALL: *tin = 1; *tout = 0; break;
    default: *tin = 0; *tout = 1; break;      /* broadcast: in place in the outputs */
    }
}

/* the bytes of x and out a rank's call holds, by the shares' arithmetic */
static void direct_sizes(const Plan *pl, int p, int me, Py_ssize_t *xb, Py_ssize_t *ob) {
    Py_ssize_t nb = pl->n * pl->itemsize;
    switch (pl->coll) {
    case C_REDUCE_SCATTER: *xb = p * nb; *ob = nb; break;
    case C_ALLGATHER: *xb = nb; *ob = p * nb; break;
    case C_ALLTOALL: *xb = p * nb; *ob = p * nb; break;
    case C_BROADCAST: *xb = 0; *ob = nb; break;
    case C_REDUCE: *xb = nb; *ob = nb; break;      /* (a non-root's out is its x) */
    default: *xb = nb; *ob = nb; break;
    }
    (void)me;
}

/* n bytes between `loc` here and `rem` in local rank k's process; 0, or errno */
static int cma_copy(const FastBoard *fb, int k, char *loc, uint64_t rem, size_t n, int to_peer) {
    while (n) {
        struct iovec l = {loc, n}, r = {(void *)(uintptr_t)rem, n};
        ssize_t got = to_peer ? process_vm_writev((pid_t)fb->pid[k], &l, 1, &r, 1, 0)
                              : process_vm_readv((pid_t)fb->pid[k], &l, 1, &r, 1, 0);
        if (got <= 0) return got < 0 && errno ? errno : EFAULT;
        loc += got; rem += (uint64_t)got; n -= (size_t)got;
    }
    return 0;
}

static inline int cma_fail(int k, int to_peer, int e) {
    return D_CMAFAIL | (k << 8) | (to_peer << 20) | ((e & 1023) << 21);
}

/* the first peer that has published its error record (it is going down), or -1; a
 * close notice (bit 62 of the word: transports/shm.py CLOSED) is no failure here — a peer
 * that closed after its share of this call no longer reads or writes anything, and one
 * that never came is found by the Python wait's liveness check */
static int peer_failed(const FastBoard *fb) {
    for (int k = 0; k < fb->p; k++) {
        uint64_t w = k != fb->me ? load_acq(&fb->q[fb->err[k]]) : 0;
        if (w && !(w & (UINT64_C(1) << 62))) return k;
    }
    return -1;
}

static void copy_stream(char *dst, const char *src, size_t n);

/* a local copy, streamed as gpurt.memcopy.copyto would (hint: the whole transfer) */
static void local_copy(char *dst, const char *src, size_t n, size_t hint, Py_ssize_t nt) {
    if (dst == src || !n) return;
    if (nt > 0 && (n >= (size_t)nt || hint >= (size_t)nt) &&
        (dst + n <= src || src + n <= dst))
        copy_stream(dst, src, n);
    else
        memmove(dst, src, n);
}

/* n bytes from (rank k, address a) into dst here, in pieces, checking the peers between
 * them; 0 or a D_ code */
static int fetch(const FastBoard *fb, int k, char *dst, uint64_t a, size_t n, size_t hint,
                 Py_ssize_t nt, const char *own) {
    for (size_t o = 0; o < n; o += D_COPY) {
        size_t len = n - o < D_COPY ? n - o : D_COPY;
        int f = peer_failed(fb);
        if (f >= 0) return D_STOPPED | (f << 8);
        if (k == fb->me) {
            local_copy(dst + o, own + o, len, hint, nt);
        } else {
            int e = cma_copy(fb, k, dst + o, a + o, len, 0);
            if (e) return cma_fail(k, 0, e);
        }
    }
    return 0;
}

/* n bytes from src here to (rank k, address a), likewise */
static int put(const FastBoard *fb, int k, uint64_t a, char *own, const char *src, size_t n,
               size_t hint, Py_ssize_t nt) {
    for (size_t o = 0; o < n; o += D_COPY) {
        size_t len = n - o < D_COPY ? n - o : D_COPY;
        int f = peer_failed(fb);
        if (f >= 0) return D_STOPPED | (f << 8);
        if (k == fb->me) {
            local_copy(own + o, src + o, len, hint, nt);
        } else {
            int e = cma_copy(fb, k, (char *)src + o, a + o, len, 1);
            if (e) return cma_fail(k, 1, e);
        }
    }
    return 0;
}

/* elements [lo, hi) at element offset `src_off` of every rank's input, reduced in rank
 * order, written at [lo, hi) of the targets: every rank's output (who 1), the root's (2)
 * or this rank's own (0; then out is this rank's output at lo) */
static int direct_reduce(const FastBoard *fb, const Plan *pl, const char *x, char *out,
                         Py_ssize_t src_off, Py_ssize_t lo, Py_ssize_t hi, int who,
                         size_t hint, Py_ssize_t nt) {
    const int p = fb->p, me = fb->me, isz = pl->itemsize;
    const Py_ssize_t step = D_PIECE / isz > 0 ? D_PIECE / isz : 1;
    char *acc0 = fb->scratch, *tmp = fb->scratch + D_PIECE;
    Py_ssize_t xbytes, obytes;
    direct_sizes(pl, p, me, &xbytes, &obytes);
    /* reduce straight into my own output where it is a target and no input to be read */
    char *home = NULL;
    if (who == 0 || who == 1 || (who == 2 && me == pl->root))
        home = (x + xbytes <= out || out + obytes <= x) ? out : NULL;
    for (Py_ssize_t a = lo; a < hi; a += step) {
        Py_ssize_t z = hi - a < step ? hi : a + step, cnt = z - a;
        size_t len = (size_t)cnt * isz, so = (size_t)(src_off + a) * isz;
        char *acc = home ? (who == 0 ? out + (size_t)(a - lo) * isz : out + (size_t)a * isz)
                         : acc0;
        int f = peer_failed(fb);
        if (f >= 0) return D_STOPPED | (f << 8);
        for (int k = 0; k < p; k++) {
            const char *src;
            if (k == me) {
                src = x + so;
            } else {
                int e = cma_copy(fb, k, k == 0 ? acc : tmp, fb->xa[k] + so, len, 0);
                if (e) return cma_fail(k, 0, e);
                src = k == 0 ? acc : tmp;
            }
            if (k == 0) {
                if (src != acc) memcpy(acc, src, len);
            } else {
                KERNELS[pl->type](pl->op, acc, src, cnt);
            }
        }
        size_t at = (size_t)a * isz;
        if (who == 0) {
            if (!home) local_copy(out + (size_t)(a - lo) * isz, acc, len, hint, nt);
            continue;
        }
        for (int i = 0; i < p; i++) {
            int k = (me + i) % p;
            if (who == 2 && k != pl->root) continue;
            if (k == me) {
                if (acc != out + at) local_copy(out + at, acc, len, hint, nt);
            } else {
                int e = cma_copy(fb, k, acc, fb->oa[k] + at, len, 1);
                if (e) return cma_fail(k, 1, e);
            }
        }
    }
    return 0;
}

/* this rank's share; 0 or a D_ code */
static int direct_share(const FastBoard *fb, const Plan *pl, const char *x, char *out,
                        Py_ssize_t nt) {
    const int p = fb->p, me = fb->me, isz = pl->itemsize;
    const Py_ssize_t n = pl->n;
    const size_t nb = (size_t)n * isz;
    Py_ssize_t lo, hi;
    int rc = 0;
    switch (pl->coll) {
    case C_ALLREDUCE:
        stage_block(n, p, me, isz, &lo, &hi);
        return direct_reduce(fb, pl, x, out, 0, lo, hi, 1, nb, nt);
    case C_REDUCE:
        stage_block(n, p, me, isz, &lo, &hi);
        return direct_reduce(fb, pl, x, out, 0, lo, hi, 2, nb, nt);
    case C_REDUCE_SCATTER:
        return direct_reduce(fb, pl, x, out, (Py_ssize_t)me * n, 0, n, 0, p * nb, nt);
    case C_ALLGATHER:
        for (int i = 0; i < p && !rc; i++) {
            int k = (me + i) % p;
            rc = put(fb, k, fb->oa[k] + me * nb, out + me * nb, x, nb, p * nb, nt);
        }
        return rc;
    case C_ALLTOALL:
        for (int i = 0; i < p && !rc; i++) {
            int k = (me + i) % p;
            rc = fetch(fb, k, out + k * nb, fb->xa[k] + me * nb, nb, p * nb, nt, x + me * nb);
        }
        return rc;
    case C_BROADCAST: {
        stage_block(n, p, me, isz, &lo, &hi);
        size_t a = (size_t)lo * isz, len = (size_t)(hi - lo) * isz;
        if (!len) return 0;
        int root = pl->root;
        if (me != root) {       /* my block of the root's buffer: into my output first */
            rc = fetch(fb, root, out + a, fb->oa[root] + a, len, nb, nt, NULL);
            if (rc) return rc;
        }
        for (int i = 1; i < p && !rc; i++) {   /* then from there into the others' */
            int k = (me + i) % p;
            if (k != root) rc = put(fb, k, fb->oa[k] + a, NULL, out + a, len, nb, nt);
        }
        return rc;
    }
    }
    return 0;
}

/* the whole round; no Python object is touched (GIL released) */
static int direct_round(const FastBoard *fb, const Plan *pl, uint64_t seq, uint64_t last,
                        const char *x, char *out, uint64_t site, const uint64_t *extra,
                        Py_ssize_t nt) {
    uint64_t *q = fb->q;
    const int p = fb->p, me = fb->me, b = (int)(seq & 1);
    Py_ssize_t xbytes, obytes;
    direct_sizes(pl, p, me, &xbytes, &obytes);
    Py_ssize_t moved = xbytes > obytes ? xbytes : obytes;
    const int64_t budget = fb->budget_ns + (moved < (4 << 20) ? moved : (4 << 20));

    /* 1. my buffer b (its header) is free once every peer has finished with it */
    if (last && !peers_at(fb, 1, last)) return NOTHING;

    /* 2. publish the header (no data), as BoardRun(check=True, extra=...) */
    Py_ssize_t h = fb->hdr[2 * me + b];
    q[h] = seq;
    q[h + 1] = pl->sig;
    q[h + 2] = 0;
    for (int i = 0; i < 5; i++) q[h + 3 + i] = pl->meta[i];
    q[h + HDR_SITE] = site;
    for (int i = 0; i < N_EXTRA; i++) q[h + HDR_EXTRA + i] = extra[i];
    store_rel(&q[fb->ctrl[me]], seq);

    /* 3. every rank's header: the same call, not staged, every buffer that another rank
     * touches an ordinary array (else Python decides: a shared one is mapped) */
    if (!peers_ready(fb, seq) && !wait_word(fb, 0, seq, budget)) return PUBLISHED;
    int tin, tout;
    direct_roles(pl->coll, &tin, &tout);
    for (int k = 0; k < p; k++) {
        const uint64_t *w = k == me ? extra : &q[fb->hdr[2 * k + b] + HDR_EXTRA];
        if (k != me) {
            Py_ssize_t hk = fb->hdr[2 * k + b];
            if (q[hk] != seq || q[hk + 1] != pl->sig) return PUBLISHED;
            for (int i = 0; i < 5; i++)
                if (q[hk + 3 + i] != pl->meta[i]) return PUBLISHED;
            if ((w[0] >> 2) != seq || (w[0] & 2)) return PUBLISHED;
            if (tin == 1 && (w[1] || !w[3])) return PUBLISHED;
            if ((tout == 1 || (tout == 2 && k == pl->root)) && (w[4] || !w[6]))
                return PUBLISHED;
        }
        fb->xa[k] = w[3];
        fb->oa[k] = w[6];
    }
    /* 4. done with the headers (BoardRun's round ends here); READY — unless the
     * communicator is being closed: then no peer may come in (they find this rank's error,
     * published by the caller, or its READY missing) */
    if (__atomic_load_n(&fb->closing, __ATOMIC_SEQ_CST)) return D_CLOSED;
    store_rel(&q[fb->ctrl[me] + 1], seq);
    store_rel(&q[fb->ctrl[me] + W_READY], 2 * seq);
    if (!peers_at(fb, W_READY, 2 * seq) && !wait_word(fb, W_READY, 2 * seq, budget))
        return D_READY;
    for (int k = 0; k < p; k++)      /* a peer could not open its buffers: the schedule */
        if (k != me && load_acq(&q[fb->ctrl[k] + W_READY]) != 2 * seq) return D_READY;

    /* 5. the share, then: no peer went down meanwhile; FINISHED; wait for every one */
    int rc = direct_share(fb, pl, x, out, nt);
    if (rc) return rc;
    int f = peer_failed(fb);
    if (f >= 0) return D_STOPPED | (f << 8);
    store_rel(&q[fb->ctrl[me] + W_FINISHED], seq);
    if (!peers_at(fb, W_FINISHED, seq) && !wait_word(fb, W_FINISHED, seq, budget))
        return D_FINISHED;
    return DONE;
}

static PyObject *fb_direct(FastBoard *fb, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 + N_EXTRA || Py_TYPE(args[0]) != &PlanType) {
        PyErr_SetString(PyExc_TypeError, "direct(plan, seq, last, x, out, site, w0, x_loc, "
                                         "x_off, x_addr, o_loc, o_off, o_addr, nt)");
        return NULL;
    }
    if (!fb_open(fb)) return NULL;
    if (fb->pid == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "direct: set_direct was not called");
        return NULL;
    }
    const Plan *pl = (const Plan *)args[0];
    int red = pl->coll == C_ALLREDUCE || pl->coll == C_REDUCE || pl->coll == C_REDUCE_SCATTER;
    if (pl->coll > C_ALLTOALL || pl->n < 1 || (red && !has_kernel(pl->type, pl->op))) {
        PyErr_SetString(PyExc_ValueError, "direct: a plan of shm_direct's collectives "
                                          "(a reduction with a kernel)");
        return NULL;
    }
    Py_ssize_t want[2];
    direct_sizes(pl, fb->p, fb->me, &want[0], &want[1]);
    if (!round_arrays(args, want, 0, "direct")) return NULL;
    uint64_t v[3 + N_EXTRA];      /* seq, last, site, the extra words */
    if (round_words(args, v)) return NULL;
    Py_ssize_t nt = PyLong_AsSsize_t(args[6 + N_EXTRA]);
    if (nt == -1 && PyErr_Occurred()) return NULL;
    if (red && !fb->scratch) {
        fb->scratch = malloc(2 * D_PIECE);
        if (!fb->scratch) return PyErr_NoMemory();
    }
    const char *x = ((np_head *)args[3])->data;
    char *out = ((np_head *)args[4])->data;
    int got;
    fb->busy++;
    Py_BEGIN_ALLOW_THREADS
    got = direct_round(fb, pl, v[0], v[1], x, out, v[2], v + 3, nt);
    Py_END_ALLOW_THREADS
    fb->busy--;
    return PyLong_FromLong(got);
}

/* set_direct(pids, err_words): for direct(), by local rank */
static PyObject *fb_set_direct(FastBoard *fb, PyObject *args) {
    PyObject *pids, *errs;
    if (!PyArg_ParseTuple(args, "OO", &pids, &errs)) return NULL;
    Py_ssize_t *pid = NULL, *err = NULL;
    if (read_table(pids, fb->p, &pid) || read_table(errs, fb->p, &err)) {
        PyMem_Free(pid); PyMem_Free(err);
        return NULL;
    }
    uint64_t *xa = PyMem_Calloc(fb->p, sizeof(uint64_t)), *oa = PyMem_Calloc(fb->p, sizeof(uint64_t));
    if (!xa || !oa) {
        PyMem_Free(pid); PyMem_Free(err); PyMem_Free(xa); PyMem_Free(oa);
        return PyErr_NoMemory();
    }
    PyMem_Free(fb->pid); PyMem_Free(fb->err); PyMem_Free(fb->xa); PyMem_Free(fb->oa);
    fb->pid = pid; fb->err = err; fb->xa = xa; fb->oa = oa;
    Py_RETURN_NONE;
}

/* dplan(coll, sig, meta(5 ints), n, itemsize, type, op, root): a plan for direct() (no
 * size limit: nothing goes through the board's buffers) */
static PyObject *fb_dplan(FastBoard *fb, PyObject *args) {
    int coll, itemsize, type, op, root;
    unsigned long long sig;
    unsigned long long m[5];
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iK(KKKKK)niiii", &coll, &sig, &m[0], &m[1], &m[2], &m[3],
                          &m[4], &n, &itemsize, &type, &op, &root))
        return NULL;
    if (coll < C_ALLREDUCE || coll > C_ALLTOALL || op < O_NONE || op > O_BXOR ||
        type < T_NONE || type > T_F64 || itemsize < 1 || itemsize > 64 ||
        root < 0 || root >= fb->p || n < 1 || n > PY_SSIZE_T_MAX / itemsize / fb->p) {
        PyErr_SetString(PyExc_ValueError, "dplan: bad collective, op, type, itemsize, root "
                                          "or count");
        return NULL;
    }
    Plan *pl = PyObject_New(Plan, &PlanType);
    if (!pl) return NULL;
    pl->coll = coll; pl->sig = sig; pl->n = n; pl->itemsize = itemsize; pl->type = type;
    pl->op = op; pl->root = root; pl->wbytes = 0;
    for (int i = 0; i < 5; i++) pl->meta[i] = m[i];
    return (PyObject *)pl;
}

/* ---- shared claim counters (the shm transport's cooperative single copy) --------------
 * A 64-bit word holds (generation << 32) | next chunk.  claim(addr, gen, n) takes the next
 * chunk of generation `gen` if there is one (compare-and-swap, so a word already reset
 * for a later generation is never taken from): the chunk's index, or -1. */
static PyObject *claim(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "claim(address, gen, nchunks)");
        return NULL;
    }
    uint64_t *a = (uint64_t *)PyLong_AsVoidPtr(args[0]);
    if (!a && PyErr_Occurred()) return NULL;
    uint64_t gen = PyLong_AsUnsignedLongLong(args[1]);
    if (gen == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    long long n = PyLong_AsLongLong(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (!a || ((uintptr_t)a & 7)) {
        PyErr_SetString(PyExc_ValueError, "claim: not an aligned address");
        return NULL;
    }
    gen &= 0xFFFFFFFFu;
    uint64_t w = __atomic_load_n(a, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((w >> 32) != gen || (long long)(w & 0xFFFFFFFFu) >= n) return PyLong_FromLong(-1);
        if (__atomic_compare_exchange_n(a, &w, w + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return PyLong_FromLongLong((long long)(w & 0xFFFFFFFFu));
    }
}

/* seal(addr, gen): no chunk of generation `gen` can be taken any more; returns how many
 * had been taken (-1 if the word is not at `gen`).  The receiver seals before it gives up
 * on a message, so a late sender never writes into a buffer that was handed back. */
static PyObject *seal(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "seal(address, gen)");
        return NULL;
    }
    uint64_t *a = (uint64_t *)PyLong_AsVoidPtr(args[0]);
    if (!a && PyErr_Occurred()) return NULL;
    uint64_t gen = PyLong_AsUnsignedLongLong(args[1]);
    if (gen == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    if (!a || ((uintptr_t)a & 7)) {
        PyErr_SetString(PyExc_ValueError, "seal: not an aligned address");
        return NULL;
    }
    gen &= 0xFFFFFFFFu;
    uint64_t w = __atomic_load_n(a, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((w >> 32) != gen) return PyLong_FromLong(-1);
        uint64_t taken = w & 0xFFFFFFFFu;
        if (__atomic_compare_exchange_n(a, &w, (gen << 32) | 0xFFFFFFFFu, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return PyLong_FromUnsignedLongLong(taken == 0xFFFFFFFFu ? 0 : taken);
    }
}

static PyObject *set_ndarray(PyObject *mod, PyObject *t) {
    if (!PyType_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "set_ndarray(numpy.ndarray)");
        return NULL;
    }
    Py_INCREF(t);
    Py_XDECREF((PyObject *)ndarray_type);
    ndarray_type = (PyTypeObject *)t;
    Py_RETURN_NONE;
}

/* fetch_add(addr, v) -> the previous value (sequentially consistent) */
static PyObject *fetch_add(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "fetch_add(address, value)");
        return NULL;
    }
    uint64_t *a = (uint64_t *)PyLong_AsVoidPtr(args[0]);
    if (!a && PyErr_Occurred()) return NULL;
    uint64_t v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    if (!a || ((uintptr_t)a & 7)) {
        PyErr_SetString(PyExc_ValueError, "fetch_add: not an aligned address");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(__atomic_fetch_add(a, v, __ATOMIC_SEQ_CST));
}

/* ---- streaming copy --------------------------------------------------------------------
 * stream_copy(dst, src, n): memcpy with non-temporal stores (x86-64 SSE2: MOVNTDQ), GIL
 * released.  A large copy whose destination is not read again soon writes around the
 * caches: no read-for-ownership of the destination lines and no eviction of the source,
 * about 1.5x the speed of memcpy's cached stores here once source and destination
 * outgrow the last-level cache (glibc switches to such stores only far above that).
 * Elsewhere it is memcpy.  Overlapping ranges are the caller's error (Python checks). */
static void copy_stream(char *dst, const char *src, size_t n) {
#if HAVE_STREAM
    size_t head = (size_t)(-(uintptr_t)dst) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence();       /* the streamed lines are visible before anything stored after */
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *stream_copy(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "stream_copy(dst_address, src_address, nbytes)");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(args[0]);
    if (!dst && PyErr_Occurred()) return NULL;
    const char *src = (const char *)PyLong_AsVoidPtr(args[1]);
    if (!src && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || (n && (!dst || !src))) {
        PyErr_SetString(PyExc_ValueError, "stream_copy: bad address or size");
        return NULL;
    }
    if (n) {
        Py_BEGIN_ALLOW_THREADS
        copy_stream(dst, src, (size_t)n);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* plain(x, out, nbytes) -> whether an inline call may read x (nbytes of it) and write
 * its result of x's shape into out as they are: both numpy.ndarray, x C-contiguous, out
 * C-contiguous and writeable and, unless it is x, of x's very dtype object and element
 * count and not overlapping x's bytes.  False sends the caller to the general checks
 * (Python's ``_inline_res``; they also raise the errors): this is that check's
 * common case, without its ~0.5 us of attribute lookups. */
static PyObject *plain(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "plain(x, out, nbytes)");
        return NULL;
    }
    if (!ndarray_type || Py_TYPE(args[0]) != ndarray_type || Py_TYPE(args[1]) != ndarray_type)
        Py_RETURN_FALSE;
    Py_ssize_t nb = PyLong_AsSsize_t(args[2]);
    if (nb == -1 && PyErr_Occurred()) return NULL;
    const np_fields *x = (const np_fields *)args[0], *o = (const np_fields *)args[1];
    if (!(x->flags & NP_C_CONTIGUOUS) || (o->flags & (NP_C_CONTIGUOUS | NP_WRITEABLE)) !=
            (NP_C_CONTIGUOUS | NP_WRITEABLE))
        Py_RETURN_FALSE;
    if (o == x) Py_RETURN_TRUE;
    if (o->descr != x->descr) Py_RETURN_FALSE;
    Py_ssize_t cx = 1, co = 1;
    for (int i = 0; i < x->nd; i++) cx *= x->dimensions[i];
    for (int i = 0; i < o->nd; i++) co *= o->dimensions[i];
    if (cx != co) Py_RETURN_FALSE;
    if (nb > 0 && o->data < x->data + nb && x->data < o->data + nb) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyObject *data_address(PyObject *mod, PyObject *arr) {
    if (!ndarray_type || Py_TYPE(arr) != ndarray_type) {
        PyErr_SetString(PyExc_TypeError, "data_address: a numpy.ndarray (after set_ndarray)");
        return NULL;
    }
    return PyLong_FromVoidPtr(((np_head *)arr)->data);
}

/* ---- point to point: one shm ring's common case (transports/shm.py, _Ring) --------------
 * A P2PRing is one direction of one lane between two local ranks, seen from one end, over
 * the segment's bytes (it holds a buffer of the segment's array, so its mapping stays while this
 * object does).  put() is _Ring._push for one message from a chunk offset on: as many of its
 * slot-sized chunks as there are free slots (the same header words, then the bytes, then the
 * head with release, chunk by chunk); get() is _Ring._pull for the posted receive from a
 * chunk offset on: the ring's next chunks while each is exactly the next chunk of that
 * message (tag, signature, size, offset, length; no single-copy address), waiting up to a
 * spin budget for each.  Anything else returns to Python, which takes the general path (and
 * raises there): no error of the protocol is decided here.  Both return the end's new
 * counter (the ring's head or tail; the chunks moved are its difference from the old one),
 * 0 for "nothing moved now", and get -1 for "here, but not the common case".  put_addr()
 * posts a single-copy message (its address), and get() reads one that is exactly the
 * receive's whole message with process_vm_readv, then releases its slot and acknowledges
 * it (an end given the sender's pid).  The GIL is held throughout (the spin is bounded and
 * short) except around that read; no other thread of this process moves the ring meanwhile
 * even then, since the caller holds the communicator's engine (Engine.busy: a second
 * thread's call is the two-threads error). */
typedef struct {
    PyObject_HEAD
    Py_buffer seg;          /* the segment (held: its mapping stays while this object does) */
    int held;
    uint64_t *q;
    char *u8;
    Py_ssize_t head_i, tail_i, err_i, slot0, stride, nslots, slot;
    int pid;                /* the peer's process, for single-copy reads (0: none here) */
    Py_ssize_t ack_i;       /* this end's single-copy acknowledgement word (receiver) */
    unsigned long long reads;   /* single-copy messages get() read (how Python tells them) */
} P2PRing;

/* P2PRing(segment, head_i, tail_i, err_i, slot0, stride, nslots, slot[, pid, ack_i]):
 * word indices of the ring's head and tail and of the peer's error record, the byte offset
 * of slot 0's header, the distance between slots, their count and their data bytes — all
 * checked to lie inside the segment (a writable buffer, 8-byte aligned); for a receiving
 * end that may read single-copy messages, the sender's pid (process_vm_readv) and the word
 * index of this end's acknowledgement counter (pid 0: such messages go back to Python) */
static int pr_init(P2PRing *r, PyObject *args, PyObject *kw) {
    PyObject *seg;
    Py_buffer v;
    Py_ssize_t h, t, e, s0, st, ns, sl, ack = -1;
    int pid = 0;
    if (!PyArg_ParseTuple(args, "Onnnnnnn|in", &seg, &h, &t, &e, &s0, &st, &ns, &sl,
                          &pid, &ack))
        return -1;
    if (PyObject_GetBuffer(seg, &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    Py_ssize_t words = v.len / 8;
    if (((uintptr_t)v.buf & 7) || ns < 1 || sl < 0 || s0 < 0 || (s0 & 7) || (st & 7) ||
            st < sl + 64 || h < 0 || h >= words || t < 0 || t >= words || e < 0 ||
            e >= words || s0 > v.len || (v.len - s0) / st < ns - 1 || pid < 0 ||
            (pid && (ack < 0 || ack >= words)) ||
            v.len - s0 - (ns - 1) * st < sl + 64) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "P2PRing: a ring layout that does not fit the segment");
        return -1;
    }
    if (r->held) PyBuffer_Release(&r->seg);
    r->seg = v;
    r->held = 1;
    r->head_i = h; r->tail_i = t; r->err_i = e; r->slot0 = s0; r->stride = st;
    r->nslots = ns; r->slot = sl;
    r->pid = pid; r->ack_i = pid ? ack : -1;
    r->u8 = (char *)v.buf;
    r->q = (uint64_t *)v.buf;
    return 0;
}

static void pr_dealloc(P2PRing *r) {
    if (r->held) PyBuffer_Release(&r->seg);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int u64_arg(PyObject *o, uint64_t *v) {
    *v = PyLong_AsUnsignedLongLong(o);
    return !(*v == (uint64_t)-1 && PyErr_Occurred());
}

/* put(x, nbytes, tag, sig, off): x a C-contiguous numpy.ndarray of nbytes bytes (its
 * nbytes: the caller's to give right); off the byte offset of the first chunk to write (0,
 * or where an earlier put stopped) */
static PyObject *pr_put(P2PRing *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "put(x, nbytes, tag, sig, off)");
        return NULL;
    }
    uint64_t tag, sig;
    Py_ssize_t nb = PyLong_AsSsize_t(args[1]), off = PyLong_AsSsize_t(args[4]);
    if ((nb == -1 && PyErr_Occurred()) || (off == -1 && PyErr_Occurred()) ||
            !u64_arg(args[2], &tag) || !u64_arg(args[3], &sig))
        return NULL;
    if (!r->held || Py_TYPE(args[0]) != ndarray_type || r->slot < 1 ||
            !(((const np_fields *)args[0])->flags & NP_C_CONTIGUOUS) || nb < 0 || off < 0 ||
            off % r->slot || (off && off >= nb))
        return PyLong_FromLong(0);
    uint64_t *q = r->q;
    if (load_acq(&q[r->err_i]))
        return PyLong_FromLong(0);      /* the peer failed or closed: Python says what */
    uint64_t count = q[r->head_i];      /* (this end's own word) */
    uint64_t tail = load_acq(&q[r->tail_i]);
    const char *src = ((const np_head *)args[0])->data;
    uint64_t moved = 0;
    do {
        if (count - tail >= (uint64_t)r->nslots)
            break;
        Py_ssize_t n = nb - off < r->slot ? nb - off : r->slot;
        char *s = r->u8 + r->slot0 + (Py_ssize_t)(count % (uint64_t)r->nslots) * r->stride;
        uint64_t *h = (uint64_t *)s;
        h[0] = tag; h[1] = sig; h[2] = (uint64_t)nb; h[3] = (uint64_t)off; h[4] = (uint64_t)n;
        h[5] = 0;
        if (n) memcpy(s + 64, src + off, (size_t)n);
        count++;
        moved++;
        store_rel(&q[r->head_i], count);
        off += n;
    } while (off < nb);
    if (!moved) return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(count);
}

/* put_addr(x, nbytes, tag, sig): a single-copy message — one slot whose header carries
 * the address of x's bytes instead of them (_Ring._push's single-copy case: the receiver
 * reads them with process_vm_readv, then acknowledges; the caller waits for that before x
 * is its program's again).  The new head, or 0 (no free slot, the peer failed or closed). */
static PyObject *pr_put_addr(P2PRing *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put_addr(x, nbytes, tag, sig)");
        return NULL;
    }
    uint64_t tag, sig;
    Py_ssize_t nb = PyLong_AsSsize_t(args[1]);
    if ((nb == -1 && PyErr_Occurred()) || !u64_arg(args[2], &tag) || !u64_arg(args[3], &sig))
        return NULL;
    if (!r->held || Py_TYPE(args[0]) != ndarray_type || nb < 1 ||
            !(((const np_fields *)args[0])->flags & NP_C_CONTIGUOUS))
        return PyLong_FromLong(0);
    uint64_t *q = r->q;
    if (load_acq(&q[r->err_i]))
        return PyLong_FromLong(0);
    uint64_t count = q[r->head_i];
    if (count - load_acq(&q[r->tail_i]) >= (uint64_t)r->nslots)
        return PyLong_FromLong(0);
    char *s = r->u8 + r->slot0 + (Py_ssize_t)(count % (uint64_t)r->nslots) * r->stride;
    uint64_t *h = (uint64_t *)s;
    h[0] = tag; h[1] = sig; h[2] = (uint64_t)nb; h[3] = 0; h[4] = 0;
    h[5] = (uint64_t)(uintptr_t)((const np_head *)args[0])->data;
    h[6] = 0; h[7] = 0;
    count++;
    store_rel(&q[r->head_i], count);
    return PyLong_FromUnsignedLongLong(count);
}

/* The single-copy message whose header h the receive (out, nb) finds at its start: read
 * from the sender's memory, the slot released, acknowledged.  0 done; -1 for Python (the
 * sender failed or closed, before or during the read — whose bytes then cannot be
 * trusted —, or the read failed: Python's path reads it again and raises what it is). */
static int pr_read_remote(P2PRing *r, const uint64_t *h, char *dst, Py_ssize_t nb,
                          uint64_t count) {
    uint64_t *q = r->q;
    if (load_acq(&q[r->err_i]))
        return -1;
    uint64_t rem = h[5];
    size_t n = (size_t)nb;
    char *loc = dst;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS      /* (the engine is this thread's: see the note above) */
    while (n) {
        struct iovec l = {loc, n}, rv = {(void *)(uintptr_t)rem, n};
        ssize_t got = process_vm_readv((pid_t)r->pid, &l, 1, &rv, 1, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) { bad = 1; break; }
        loc += got; rem += (uint64_t)got; n -= (size_t)got;
    }
    Py_END_ALLOW_THREADS
    if (bad || load_acq(&q[r->err_i]))
        return -1;
    store_rel(&q[r->tail_i], count + 1);
    store_rel(&q[r->ack_i], q[r->ack_i] + 1);
    r->reads++;
    return 0;
}

/* get(out, nbytes, tag, sig, spin_ns, off[, remote]): out a C-contiguous, writeable
 * numpy.ndarray of nbytes bytes (as put's x); off the offset of the next chunk the receive
 * expects; remote 0: a single-copy message is not read now (0 returned: an irecv posting,
 * whose caller's next call may be the send the peer waits for — its read is the wait's) */
static PyObject *pr_get(P2PRing *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "get(out, nbytes, tag, sig, spin_ns, off[, remote])");
        return NULL;
    }
    int remote = 1;
    if (nargs == 7 && (remote = PyObject_IsTrue(args[6])) < 0)
        return NULL;
    uint64_t tag, sig;
    Py_ssize_t nb = PyLong_AsSsize_t(args[1]), off = PyLong_AsSsize_t(args[5]);
    long long spin = PyLong_AsLongLong(args[4]);
    if ((nb == -1 && PyErr_Occurred()) || (spin == -1 && PyErr_Occurred()) ||
            (off == -1 && PyErr_Occurred()) || !u64_arg(args[2], &tag) || !u64_arg(args[3], &sig))
        return NULL;
    if (!r->held || Py_TYPE(args[0]) != ndarray_type || nb < 0 || off < 0 || r->slot < 1 ||
            off % r->slot || (off && off >= nb) ||
            (((const np_fields *)args[0])->flags & (NP_C_CONTIGUOUS | NP_WRITEABLE)) !=
            (NP_C_CONTIGUOUS | NP_WRITEABLE))
        return PyLong_FromLong(-1);
    uint64_t *q = r->q;
    uint64_t count = q[r->tail_i];      /* (this end's own word) */
    uint64_t head = load_acq(&q[r->head_i]);
    char *dst = ((np_head *)args[0])->data;
    uint64_t moved = 0;
    int64_t start = 0;
    do {
        if (head == count) {
            if (spin <= 0) break;
            if (!start) start = now_ns();
            for (;;) {
                for (int i = 0; i < 64; i++) cpu_relax();
                head = load_acq(&q[r->head_i]);
                if (head != count || now_ns() - start >= spin) break;
            }
            if (head == count) break;
        }
        Py_ssize_t n = nb - off < r->slot ? nb - off : r->slot;
        const char *s = r->u8 + r->slot0 + (Py_ssize_t)(count % (uint64_t)r->nslots) * r->stride;
        const uint64_t *h = (const uint64_t *)s;
        if (h[5] && !moved && !off && r->pid && h[0] == tag && h[1] == sig &&
                h[2] == (uint64_t)nb && !h[3] && !h[4] && !h[6] && !h[7]) {
            /* the whole message, single copy (not from a shared array: h[6]) */
            if (!remote)
                return PyLong_FromLong(0);
            if (pr_read_remote(r, h, dst, nb, count) < 0)
                return PyLong_FromLong(-1);
            return PyLong_FromUnsignedLongLong(count + 1);
        }
        if (h[0] != tag || h[1] != sig || h[2] != (uint64_t)nb || h[3] != (uint64_t)off ||
                h[4] != (uint64_t)n || h[5]) {
            if (!moved) return PyLong_FromLong(-1);
            break;                      /* Python reads it next, and says what it is */
        }
        if (n) memcpy(dst + off, s + 64, (size_t)n);
        count++;
        moved++;
        store_rel(&q[r->tail_i], count);   /* the slot is free again at once */
        off += n;
    } while (off < nb);
    if (!moved) return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(count);
}

static PyMethodDef pr_methods[] = {
    {"put", (PyCFunction)(void (*)(void))pr_put, METH_FASTCALL,
     "put(x, nbytes, tag, sig, off)"},
    {"get", (PyCFunction)(void (*)(void))pr_get, METH_FASTCALL,
     "get(out, nbytes, tag, sig, spin_ns, off[, remote])"},
    {"put_addr", (PyCFunction)(void (*)(void))pr_put_addr, METH_FASTCALL,
     "put_addr(x, nbytes, tag, sig)"},
    {NULL}
};

static PyObject *pr_reads(P2PRing *r, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(r->reads);
}

static PyGetSetDef pr_getset[] = {
    {"reads", (getter)pr_reads, NULL, "single-copy messages get() has read", NULL},
    {NULL}
};

static PyTypeObject P2PRingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpurt._fastboard.P2PRing",
    .tp_basicsize = sizeof(P2PRing),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pr_init,
    .tp_dealloc = (destructor)pr_dealloc,
    .tp_methods = pr_methods,
    .tp_getset = pr_getset,
    .tp_doc = "One shm ring's common point-to-point case, compiled (see the module's source).",
};

static PyMethodDef fb_methods[] = {
    {"run", (PyCFunction)(void (*)(void))fb_run, METH_FASTCALL, "run(plan, seq, last, x, out)"},
    {"complete", (PyCFunction)(void (*)(void))fb_complete, METH_FASTCALL,
     "complete(plan, seq, out)"},
    {"staged", (PyCFunction)(void (*)(void))fb_staged, METH_FASTCALL,
     "staged(plan, seq, last, x, out, site, w0, x_loc, x_off, x_addr, o_loc, o_off, o_addr)"},
    {"direct", (PyCFunction)(void (*)(void))fb_direct, METH_FASTCALL,
     "direct(plan, seq, last, x, out, site, w0, x_loc, x_off, x_addr, o_loc, o_off, o_addr, nt)"},
    {"set_direct", (PyCFunction)fb_set_direct, METH_VARARGS, "set_direct(pids, err_words)"},
    {"dplan", (PyCFunction)fb_dplan, METH_VARARGS,
     "dplan(coll, sig, meta, n, itemsize, type, op, root)"},
    {"plan", (PyCFunction)fb_plan, METH_VARARGS,
     "plan(coll, sig, meta, n, itemsize, type, op, root, wbytes)"},
    {"set_wait", (PyCFunction)fb_set_wait, METH_VARARGS, "set_wait(spin_ns, budget_ns)"},
    {"close", (PyCFunction)fb_close, METH_NOARGS, "forget the segment (it is being unmapped)"},
    {"stop", (PyCFunction)fb_stop, METH_NOARGS, "no new round; direct() stops before READY"},
    {NULL}
};

static PyTypeObject FastBoardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpurt._fastboard.FastBoard",
    .tp_basicsize = sizeof(FastBoard),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fb_init,
    .tp_dealloc = (destructor)fb_dealloc,
    .tp_methods = fb_methods,
    .tp_doc = "The shm board's inline round, compiled (see the module's source).",
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpurt._fastboard.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One call's constant part (signature, header, kernel).",
};

static PyMethodDef mod_methods[] = {
    {"plain", (PyCFunction)(void (*)(void))plain, METH_FASTCALL,
     "plain(x, out, nbytes): x and out as an inline call takes them"},
    {"data_address", data_address, METH_O, "the data pointer of a NumPy array (self-check)"},
    {"claim", (PyCFunction)(void (*)(void))claim, METH_FASTCALL, "claim(address, gen, nchunks)"},
    {"fetch_add", (PyCFunction)(void (*)(void))fetch_add, METH_FASTCALL,
     "fetch_add(address, value)"},
    {"seal", (PyCFunction)(void (*)(void))seal, METH_FASTCALL, "seal(address, gen)"},
    {"stream_copy", (PyCFunction)(void (*)(void))stream_copy, METH_FASTCALL,
     "stream_copy(dst_address, src_address, nbytes): memcpy with non-temporal stores"},
    {"set_ndarray", set_ndarray, METH_O, "set_ndarray(numpy.ndarray): the only array type"},
    {NULL}
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "gpurt._fastboard", NULL, -1, mod_methods};

PyMODINIT_FUNC PyInit__fastboard(void) {
    if (PyType_Ready(&FastBoardType) < 0 || PyType_Ready(&PlanType) < 0 ||
        PyType_Ready(&P2PRingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    PyObject *colls = Py_BuildValue("(sssssssss)", "allreduce", "reduce", "broadcast",
                                    "allgather", "reduce_scatter", "alltoall", "gather",
                                    "scatter", "barrier");
    PyObject *types = Py_BuildValue("(ssssssssss)", "int8", "int16", "int32", "int64", "uint8",
                                    "uint16", "uint32", "uint64", "float32", "float64");
    PyObject *ops = Py_BuildValue("(ssssssss)", "", "sum", "prod", "min", "max", "band", "bor",
                                  "bxor");
    if (!colls || !types || !ops ||
        PyModule_AddObjectRef(m, "FastBoard", (PyObject *)&FastBoardType) < 0 ||
        PyModule_AddObjectRef(m, "P2PRing", (PyObject *)&P2PRingType) < 0 ||
        PyModule_AddObjectRef(m, "COLLS", colls) < 0 ||
        PyModule_AddObjectRef(m, "TYPES", types) < 0 ||
        PyModule_AddObjectRef(m, "OPS", ops) < 0 ||
        PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAM) < 0 ||
        PyModule_AddIntConstant(m, "ABI", ABI) < 0) {
        Py_XDECREF(colls); Py_XDECREF(types); Py_XDECREF(ops); Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(colls); Py_DECREF(types); Py_DECREF(ops);
    return m;
}
