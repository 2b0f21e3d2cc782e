/*
 * shmprod._speedups: the per-record send() path, and writing rows as records, in C.
 *
 * Three types, each with a pure-Python twin in shmprod/speedups.py that behaves the
 * same (the tests run both):
 *
 *   StageCore   the fields of a Stage that send() touches: the three row lists (values,
 *               keys, timestamps), the row count n, the staged bytes nbytes, the flush
 *               limit, and each row's headers section and explicit partition once a
 *               row has them. shmprod.worker.staging.Stage subclasses it.
 *   FutureCore  a RecordFuture's stage and row. shmprod.futures.RecordFuture
 *               subclasses it.
 *   Stager      the common case of Worker.send(): bytes, bytearray, str or None key and
 *               value, headers
 *               none or a dict / list of (str, bytes | str | None) pairs (encoded
 *               here into the row's section), no partition or one the stage knows,
 *               the topic's one stage has room. It appends the row under the Worker's
 *               state lock and returns the record's future, or returns None (nothing
 *               staged) so that the Python path handles the record.
 *
 * Why (measured, ARCHITECTURE.md "The per-record path"): the same steps in Python cost
 * about 1.1 us of the caller's CPU per record; here they cost about a quarter of that,
 * most of it the lock's two method calls and the Python frame of send() around it.
 *
 * And three functions without a twin (shmprod.worker.direct; without the extension the
 * vectorised encoder does their work): plan_batches and encode_records cut rows sorted
 * by partition into batches and write each record straight into a pool buffer, from a
 * stage's lists or from Arrow buffers; staged_lengths sizes a stage's rows.
 *
 * One function for the sender, with a twin in shmprod/protocol/crc.py: crc32c_patch
 * gives a batch's CRC after its producer state is rewritten, without reading the batch
 * again.
 *
 * And three for spare pool buffers, worker and sender, without a twin (Python has no
 * compare-and-swap on shared memory; without them there are no spares): claim_words,
 * swap_word and store_word change a DESCRIPTOR's state and owner as one atomic word.
 *
 * Runs in: worker (the thread that calls send(), or the one flushing). Holds the GIL
 * throughout; the lock is the Worker's state lock, taken and released through its own
 * methods.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------------------ */
/* StageCore                                                                            */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *values;     /* list of bytes | None */
    PyObject *keys;       /* list of bytes | None */
    PyObject *timestamps; /* list of int (ms) */
    Py_ssize_t n;         /* rows staged */
    Py_ssize_t nbytes;    /* key + value + header bytes staged (with overhead) */
    long long limit;      /* nbytes at which the stage is flushed */
    PyObject *headers;    /* NULL (None) or a list: each row's encoded headers section */
    Py_ssize_t header_max; /* the largest of those sections (1: none) */
    PyObject *partitions; /* NULL (None) or a list: each row's explicit partition, -1 none */
    PyObject *part_bytes; /* NULL (None) or a bytearray: bytes staged per explicit
                             partition, one native int64 each, for every partition the
                             topic had (a partition past its end: the Python path) */
    Py_ssize_t batch_size; /* what one explicit partition's rows may stage */
} StageCore;

static int
stage_traverse(StageCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->values);
    Py_VISIT(self->keys);
    Py_VISIT(self->timestamps);
    Py_VISIT(self->headers);
    Py_VISIT(self->partitions);
    Py_VISIT(self->part_bytes);
    return 0;
}

static int
stage_clear(StageCore *self)
{
    Py_CLEAR(self->values);
    Py_CLEAR(self->keys);
    Py_CLEAR(self->timestamps);
    Py_CLEAR(self->headers);
    Py_CLEAR(self->partitions);
    Py_CLEAR(self->part_bytes);
    return 0;
}

static void
stage_dealloc(StageCore *self)
{
    PyObject_GC_UnTrack(self);
    stage_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
stage_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    StageCore *self = (StageCore *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->limit = (long long)1 << 62;
        self->header_max = 1;
    }
    return (PyObject *)self;
}

static PyMemberDef stage_members[] = {
    {"values", T_OBJECT_EX, offsetof(StageCore, values), 0, "staged values (bytes | None)"},
    {"keys", T_OBJECT_EX, offsetof(StageCore, keys), 0, "staged keys (bytes | None)"},
    {"timestamps", T_OBJECT_EX, offsetof(StageCore, timestamps), 0, "staged timestamps (ms)"},
    {"n", T_PYSSIZET, offsetof(StageCore, n), 0, "rows staged"},
    {"nbytes", T_PYSSIZET, offsetof(StageCore, nbytes), 0, "bytes staged"},
    {"limit", T_LONGLONG, offsetof(StageCore, limit), 0, "bytes at which it is flushed"},
    {"headers", T_OBJECT, offsetof(StageCore, headers), 0,
     "None, or each row's encoded headers section (a list of bytes)"},
    {"header_max", T_PYSSIZET, offsetof(StageCore, header_max), 0,
     "the largest encoded headers section of a row (1: none)"},
    {"partitions", T_OBJECT, offsetof(StageCore, partitions), 0,
     "None, or each row's explicit partition (-1: none)"},
    {"part_bytes", T_OBJECT, offsetof(StageCore, part_bytes), 0,
     "None, or a bytearray of the bytes staged per explicit partition (native int64)"},
    {"batch_size", T_PYSSIZET, offsetof(StageCore, batch_size), 0,
     "what one explicit partition's rows may stage"},
    {NULL},
};

static PyTypeObject StageCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmprod._speedups.StageCore",
    .tp_doc = "The fields of a stage that send() touches (see shmprod.worker.staging).",
    .tp_basicsize = sizeof(StageCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = stage_new,
    .tp_dealloc = (destructor)stage_dealloc,
    .tp_traverse = (traverseproc)stage_traverse,
    .tp_clear = (inquiry)stage_clear,
    .tp_members = stage_members,
};

/* ------------------------------------------------------------------------------------ */
/* FutureCore                                                                           */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *stage;
    Py_ssize_t row;
} FutureCore;

static int
future_traverse(FutureCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->stage);
    return 0;
}

static int
future_clear(FutureCore *self)
{
    Py_CLEAR(self->stage);
    return 0;
}

static void
future_dealloc(FutureCore *self)
{
    PyObject_GC_UnTrack(self);
    future_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
future_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stage", "row", NULL};
    PyObject *stage;
    Py_ssize_t row;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On:FutureCore", kwlist, &stage, &row)) {
        return NULL;
    }
    FutureCore *self = (FutureCore *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    Py_INCREF(stage);
    self->stage = stage;
    self->row = row;
    return (PyObject *)self;
}

static PyMemberDef future_members[] = {
    {"_stage", T_OBJECT_EX, offsetof(FutureCore, stage), READONLY, "the record's stage"},
    {"_row", T_PYSSIZET, offsetof(FutureCore, row), READONLY, "the record's row in it"},
    {NULL},
};

static PyTypeObject FutureCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmprod._speedups.FutureCore",
    .tp_doc = "A record future's stage and row (see shmprod.futures.RecordFuture).",
    .tp_basicsize = sizeof(FutureCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = future_new,
    .tp_dealloc = (destructor)future_dealloc,
    .tp_traverse = (traverseproc)future_traverse,
    .tp_clear = (inquiry)future_clear,
    .tp_members = future_members,
};

/* ------------------------------------------------------------------------------------ */
/* Stager                                                                               */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *stages;   /* the Worker's dict: topic -> list of stages */
    PyObject *acquire;  /* the Worker's state lock: bound acquire, release, locked */
    PyObject *release;
    PyObject *locked;
    PyTypeObject *future_type; /* RecordFuture (a FutureCore subclass) */
    Py_ssize_t records_room;   /* batch_size - batch header */
    Py_ssize_t max_request_size;
    Py_ssize_t header_size;    /* a batch's header */
    Py_ssize_t overhead_max;   /* a record's largest varint overhead */
    Py_ssize_t staged_overhead;
    /* the timestamp of the last record stamped here, and its int: records of the same
       millisecond share it (no allocation per record; the encoder compares pointers) */
    long long last_ms;
    PyObject *last_ts;
    PyObject *int_type; /* NULL, or another integer type send() takes (numpy.integer) */
} Stager;

static int
stager_traverse(Stager *self, visitproc visit, void *arg)
{
    Py_VISIT(self->stages);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->locked);
    Py_VISIT(self->future_type);
    Py_VISIT(self->int_type);
    return 0;
}

static int
stager_clear(Stager *self)
{
    Py_CLEAR(self->stages);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->locked);
    Py_CLEAR(self->future_type);
    Py_CLEAR(self->last_ts);
    Py_CLEAR(self->int_type);
    return 0;
}

static void
stager_dealloc(Stager *self)
{
    PyObject_GC_UnTrack(self);
    stager_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Removes the last item of a list (undoing an append). */
static void
drop_last(PyObject *list)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n > 0) {
        PyList_SetSlice(list, n - 1, n, NULL);
    }
}

/* Releases the lock, keeping any exception already set. */
static int
unlock(Stager *self)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallNoArgs(self->release);
    if (r == NULL) {
        if (et != NULL) {
            PyErr_Clear();
            PyErr_Restore(et, ev, tb);
        }
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
    return 0;
}

/*
 * stager(topic, value, key, headers, partition, timestamp_ms) -> future | None
 *
 * None means nothing was staged: the record is not the common case (or its stage has
 * no room), and the caller handles it in Python, where every check raises its typed
 * error. Runs in: worker, takes the state lock.
 */
static PyObject *stage_row(Stager *self, PyObject *const *args);
static PyObject *stage_text(Stager *self, PyObject *const *args);
static PyObject *header_section(PyObject *headers);
static PyObject *no_headers; /* b"\x00": a record without headers */
static PyObject *no_partition; /* -1: a row without an explicit partition */

static PyObject *
stager_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 6 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "Stager takes (topic, value, key, headers, partition, timestamp_ms)");
        return NULL;
    }
    return stage_text((Stager *)self_, args);
}

/* An explicit partition or timestamp that is an integer but not an exact int (an int
 * subclass, or a numpy integer: the Python path takes both, bools excepted). */
static inline int
other_int(Stager *self, PyObject *o)
{
    if (o == Py_None || PyLong_CheckExact(o) || PyBool_Check(o)) {
        return 0;
    }
    return PyLong_Check(o) ||
           (self->int_type != NULL && PyObject_TypeCheck(o, (PyTypeObject *)self->int_type));
}

/* A key or value the stager converts to bytes: a str (its UTF-8) or a bytearray (a copy:
 * the caller may reuse it once send() returns). */
static inline int
convertible(PyObject *o)
{
    return PyUnicode_CheckExact(o) || PyByteArray_CheckExact(o);
}

/*
 * stage_row for what the Python path converts, converted the same way first: a str key
 * or value staged as its UTF-8 bytes, a bytearray as a copy (a new bytes object each,
 * as the Python path copies them); a partition or timestamp that is an int subclass or
 * a numpy integer as an exact int. A str that is not valid UTF-8 (a lone surrogate) is
 * left to the Python path, which raises its typed error. The conversions run before
 * the stage is touched.
 */
static PyObject *
stage_text(Stager *self, PyObject *const *args)
{
    PyObject *value = args[1], *key = args[2], *partition = args[4], *ts = args[5];
    int text = convertible(value) || convertible(key);
    int ints = other_int(self, partition) || other_int(self, ts);
    if (!text && !ints) {
        return stage_row(self, args);
    }
    PyObject *row[6] = {args[0], args[1], args[2], args[3], args[4], args[5]};
    PyObject *made[4] = {NULL, NULL, NULL, NULL};
    PyObject *result = NULL;
    const int at[4] = {1, 2, 4, 5};
    for (int i = 0; i < 4; i++) {
        PyObject *o = args[at[i]];
        if (i < 2 && PyUnicode_CheckExact(o)) {
            made[i] = PyUnicode_AsUTF8String(o);
        }
        else if (i < 2 && PyByteArray_CheckExact(o)) {
            made[i] =
                PyBytes_FromStringAndSize(PyByteArray_AS_STRING(o), PyByteArray_GET_SIZE(o));
        }
        else if (i >= 2 && other_int(self, o)) {
            made[i] = PyNumber_Index(o);
        }
        else {
            continue;
        }
        if (made[i] == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeError) &&
                !PyErr_ExceptionMatches(PyExc_TypeError)) {
                goto out; /* a memory error: raised */
            }
            PyErr_Clear(); /* the Python path raises its typed error */
            result = Py_NewRef(Py_None);
            goto out;
        }
        row[at[i]] = made[i];
    }
    result = stage_row(self, row);
out:
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(made[i]);
    }
    return result;
}

/* args: topic, value, key, headers, partition, timestamp_ms. */
static PyObject *
stage_row(Stager *self, PyObject *const *args)
{
    PyObject *topic = args[0], *value = args[1], *key = args[2];
    PyObject *headers = args[3], *partition = args[4], *ts_arg = args[5];
    if (!PyUnicode_CheckExact(topic)) {
        Py_RETURN_NONE;
    }
    long long part = -1; /* the explicit partition, -1: none */
    if (partition != Py_None) {
        int overflow = 0;
        if (!PyLong_CheckExact(partition)) {
            Py_RETURN_NONE;
        }
        part = PyLong_AsLongLongAndOverflow(partition, &overflow);
        if (overflow != 0 || part < 0) {
            Py_RETURN_NONE; /* out of range: the Python path raises */
        }
    }
    Py_ssize_t klen = 0, vlen = 0;
    if (key != Py_None) {
        if (!PyBytes_CheckExact(key)) {
            Py_RETURN_NONE;
        }
        klen = PyBytes_GET_SIZE(key);
    }
    if (value != Py_None) {
        if (!PyBytes_CheckExact(value)) {
            Py_RETURN_NONE;
        }
        vlen = PyBytes_GET_SIZE(value);
    }
    /* the row's headers section (NULL: none), encoded before the stage is touched */
    PyObject *section = NULL;
    Py_ssize_t hlen = 1;
    if (headers != Py_None) {
        section = header_section(headers);
        if (section == NULL) {
            return NULL;
        }
        if (section == Py_None) {
            return section; /* not the common form: the Python path checks or converts */
        }
        hlen = PyBytes_GET_SIZE(section);
        if (hlen <= 1) {
            Py_CLEAR(section); /* no headers */
            hlen = 1;
        }
    }
    Py_ssize_t bound = klen + vlen + hlen + self->overhead_max;
    if (bound > self->records_room || bound + self->header_size > self->max_request_size) {
        Py_XDECREF(section);
        Py_RETURN_NONE; /* too large: the Python path raises its error */
    }
    Py_ssize_t size = klen + vlen + hlen + self->staged_overhead;

    PyObject *ts;
    if (ts_arg == Py_None) {
        struct timespec now;
        if (clock_gettime(CLOCK_REALTIME, &now) != 0) {
            Py_XDECREF(section);
            Py_RETURN_NONE;
        }
        long long ms = (long long)now.tv_sec * 1000LL + now.tv_nsec / 1000000;
        if (self->last_ts != NULL && ms == self->last_ms) {
            ts = Py_NewRef(self->last_ts);
        }
        else {
            ts = PyLong_FromLongLong(ms);
            if (ts == NULL) {
                Py_XDECREF(section);
                return NULL;
            }
            Py_XSETREF(self->last_ts, Py_NewRef(ts));
            self->last_ms = ms;
        }
    }
    else if (PyLong_CheckExact(ts_arg)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(ts_arg, &overflow);
        if (overflow != 0 || v < 0) {
            Py_XDECREF(section);
            Py_RETURN_NONE; /* out of range: the Python path raises */
        }
        Py_INCREF(ts_arg);
        ts = ts_arg;
    }
    else {
        Py_XDECREF(section);
        Py_RETURN_NONE;
    }

    /* Allocated before the stage is touched: an allocation may start a garbage
       collection, which may run Python code (finalizers) and switch threads. */
    FutureCore *fut = (FutureCore *)self->future_type->tp_alloc(self->future_type, 0);
    if (fut == NULL) {
        Py_XDECREF(section);
        Py_DECREF(ts);
        return NULL;
    }
    /* The state lock guards the stages against the flushing thread. When nobody holds
       it, this thread holds the GIL and runs no Python code until the row is staged
       (no allocation that can collect, no decref that can free what has a finalizer),
       so no other thread can take the lock or touch the stages meanwhile: the row is
       staged without acquiring it (two Python calls per record saved). When it is
       held (a flush, the Python path, a socket write under the lock), this waits for
       it. A build without the GIL always takes it. */
    int held = 1;
#ifndef Py_GIL_DISABLED
    PyObject *busy = PyObject_CallNoArgs(self->locked);
    if (busy == NULL) {
        Py_XDECREF(section);
        Py_DECREF(fut);
        Py_DECREF(ts);
        return NULL;
    }
    held = (busy != Py_False);
    Py_DECREF(busy);
#endif
    if (held) {
        PyObject *r = PyObject_CallNoArgs(self->acquire);
        if (r == NULL) {
            Py_XDECREF(section);
            Py_DECREF(fut);
            Py_DECREF(ts);
            return NULL;
        }
        Py_DECREF(r);
    }

    PyObject *result = NULL;
    PyObject *stages = PyDict_GetItemWithError(self->stages, topic); /* borrowed */
    if (stages == NULL) {
        if (!PyErr_Occurred()) {
            result = Py_NewRef(Py_None); /* no stage yet: the Python path makes one */
        }
        goto done;
    }
    if (!PyList_CheckExact(stages) || PyList_GET_SIZE(stages) != 1) {
        result = Py_NewRef(Py_None); /* older stages still wait to be flushed */
        goto done;
    }
    PyObject *item = PyList_GET_ITEM(stages, 0);
    if (!PyObject_TypeCheck(item, &StageCoreType)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    StageCore *st = (StageCore *)item;
    if ((long long)(st->nbytes + size) > st->limit || st->values == NULL ||
        st->keys == NULL || st->timestamps == NULL || !PyList_CheckExact(st->values) ||
        !PyList_CheckExact(st->keys) || !PyList_CheckExact(st->timestamps)) {
        result = Py_NewRef(Py_None); /* full: the Python path flushes it */
        goto done;
    }
    /* an explicit partition: the stage's first one (the Python path makes the list), a
       partition past what the stage knows (the Python path checks it against the
       topic), or a partition whose batch has no room (the Python path flushes) */
    PyObject *plist =
        (st->partitions != NULL && st->partitions != Py_None) ? st->partitions : NULL;
    char *used_at = NULL;
    long long used = 0;
    if (plist != NULL && !PyList_CheckExact(plist)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (part >= 0) {
        PyObject *pb = st->part_bytes;
        if (plist == NULL || pb == NULL || !PyByteArray_CheckExact(pb) ||
            part >= PyByteArray_GET_SIZE(pb) / 8) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        used_at = PyByteArray_AS_STRING(pb) + 8 * part;
        memcpy(&used, used_at, 8);
        if (used != 0 && (long long)st->batch_size - used < size) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    /* the stage's first row with headers: the Python path makes its list of sections
       (an allocation here could collect garbage and run Python code) */
    PyObject *hlist = (st->headers != NULL && st->headers != Py_None) ? st->headers : NULL;
    if ((section != NULL && hlist == NULL) || (hlist != NULL && !PyList_CheckExact(hlist))) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (hlist != NULL && PyList_Append(hlist, section != NULL ? section : no_headers) < 0) {
        goto done;
    }
    if (plist != NULL && PyList_Append(plist, part >= 0 ? partition : no_partition) < 0) {
        goto undo_headers;
    }
    if (PyList_Append(st->values, value) < 0) {
        goto undo_partitions;
    }
    if (PyList_Append(st->keys, key) < 0) {
        drop_last(st->values);
        goto undo_partitions;
    }
    if (PyList_Append(st->timestamps, ts) < 0) {
        drop_last(st->values);
        drop_last(st->keys);
        goto undo_partitions;
    }
    fut->stage = Py_NewRef(item);
    fut->row = st->n;
    st->n += 1;
    st->nbytes += size;
    if (hlen > st->header_max) {
        st->header_max = hlen;
    }
    if (used_at != NULL) {
        used += size;
        memcpy(used_at, &used, 8);
    }
    result = (PyObject *)Py_NewRef(fut);
    goto done;
undo_partitions:
    if (plist != NULL) {
        drop_last(plist);
    }
undo_headers:
    if (hlist != NULL) {
        drop_last(hlist);
    }
done:
    if (held && unlock(self) < 0) {
        Py_XDECREF(result);
        result = NULL;
    }
    /* after the stage is consistent: these may free objects */
    Py_XDECREF(section);
    Py_DECREF(fut);
    Py_DECREF(ts);
    return result;
}

static PyObject *
stager_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stages", "lock", "future_type", "records_room",
                             "max_request_size", "header_size", "overhead_max",
                             "staged_overhead", "int_type", NULL};
    PyObject *stages, *lock, *future_type, *int_type = NULL;
    Py_ssize_t records_room, max_request_size, header_size, overhead_max, staged_overhead;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!nnnnn|O!:Stager", kwlist, &PyDict_Type,
                                     &stages, &lock, &PyType_Type, &future_type,
                                     &records_room, &max_request_size, &header_size,
                                     &overhead_max, &staged_overhead, &PyType_Type,
                                     &int_type)) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)future_type, &FutureCoreType)) {
        PyErr_SetString(PyExc_TypeError, "future_type must be a FutureCore subclass");
        return NULL;
    }
    PyObject *acquire = PyObject_GetAttrString(lock, "acquire");
    if (acquire == NULL) {
        return NULL;
    }
    PyObject *release = PyObject_GetAttrString(lock, "release");
    if (release == NULL) {
        Py_DECREF(acquire);
        return NULL;
    }
    PyObject *locked = PyObject_GetAttrString(lock, "locked");
    if (locked == NULL) {
        Py_DECREF(acquire);
        Py_DECREF(release);
        return NULL;
    }
    Stager *self = (Stager *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(acquire);
        Py_DECREF(release);
        Py_DECREF(locked);
        return NULL;
    }
    self->vectorcall = stager_call;
    self->stages = Py_NewRef(stages);
    self->acquire = acquire;
    self->release = release;
    self->locked = locked;
    self->future_type = (PyTypeObject *)Py_NewRef(future_type);
    self->records_room = records_room;
    self->max_request_size = max_request_size;
    self->header_size = header_size;
    self->overhead_max = overhead_max;
    self->staged_overhead = staged_overhead;
    self->int_type = int_type == NULL ? NULL : Py_NewRef(int_type);
    return (PyObject *)self;
}

static PyObject *
stager_tp_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static PyTypeObject StagerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmprod._speedups.Stager",
    .tp_doc = "Stager(stages, lock, future_type, records_room, max_request_size, "
              "header_size, overhead_max, staged_overhead, int_type=None): send()'s "
              "common case.",
    .tp_basicsize = sizeof(Stager),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = stager_new,
    .tp_dealloc = (destructor)stager_dealloc,
    .tp_traverse = (traverseproc)stager_traverse,
    .tp_clear = (inquiry)stager_clear,
    .tp_vectorcall_offset = offsetof(Stager, vectorcall),
    .tp_call = stager_tp_call,
};

/* ------------------------------------------------------------------------------------ */
/* SendMethod: Worker.send without a Python frame in the common case                     */
/* ------------------------------------------------------------------------------------ */

/*
 * A method descriptor standing for Worker.send. Called as worker.send(topic, value=None,
 * key=None, headers=None, partition=None, timestamp_ms=None): when the worker's
 * ``_fast`` attribute is its Stager (the worker is open and has no serializers) and the
 * stager stages the row, that future is the answer; otherwise the Python method it
 * wraps (``slow``) is called with the same arguments, and every check raises there.
 * Py_TPFLAGS_METHOD_DESCRIPTOR: worker.send(...) calls it with the worker first, with
 * no bound method made; worker.send as a value is a bound method.
 */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *slow;
} SendMethod;

static PyObject *str_fast;       /* "_fast" */
static PyObject *send_names[6];  /* the parameters after self */

static int
send_traverse(SendMethod *self, visitproc visit, void *arg)
{
    Py_VISIT(self->slow);
    return 0;
}

static int
send_clear(SendMethod *self)
{
    Py_CLEAR(self->slow);
    return 0;
}

static void
send_dealloc(SendMethod *self)
{
    PyObject_GC_UnTrack(self);
    send_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
send_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    SendMethod *self = (SendMethod *)self_;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs < 2 || nargs > 7) {
        goto slow;
    }
    PyObject *params[6] = {NULL, Py_None, Py_None, Py_None, Py_None, Py_None};
    for (Py_ssize_t i = 1; i < nargs; i++) {
        params[i - 1] = args[i];
    }
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        int slot = -1;
        for (int i = 1; i < 6; i++) {
            if (name == send_names[i]) {
                slot = i;
                break;
            }
        }
        if (slot < 0 || slot < nargs - 1) {
            goto slow; /* spelled another way, repeated or unknown: Python says which */
        }
        params[slot] = args[nargs + j];
    }
    PyObject *fast = PyObject_GetAttr(args[0], str_fast);
    if (fast == NULL) {
        PyErr_Clear();
        goto slow;
    }
    if (Py_TYPE(fast) != &StagerType) {
        Py_DECREF(fast);
        goto slow; /* None: closed, failed, forked, or serializers configured */
    }
    PyObject *fut = stage_text((Stager *)fast, params);
    Py_DECREF(fast);
    if (fut != Py_None) {
        return fut; /* the future, or NULL with the error set */
    }
    Py_DECREF(fut);
slow:
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *
send_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slow", NULL};
    PyObject *slow;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:SendMethod", kwlist, &slow)) {
        return NULL;
    }
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "slow must be callable");
        return NULL;
    }
    SendMethod *self = (SendMethod *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = send_call;
    self->slow = Py_NewRef(slow);
    return (PyObject *)self;
}

static PyObject *
send_tp_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static PyObject *
send_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

/* __doc__, __name__, __qualname__, __module__, __wrapped__: the wrapped method's */
static PyObject *
send_getattro(PyObject *self, PyObject *name)
{
    PyObject *r = PyObject_GenericGetAttr(self, name);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) {
        return r;
    }
    PyErr_Clear();
    return PyObject_GetAttr(((SendMethod *)self)->slow, name);
}

static PyObject *
send_get_doc(SendMethod *self, void *closure)
{
    return PyObject_GetAttrString(self->slow, "__doc__");
}

static PyObject *
send_get_wrapped(SendMethod *self, void *closure)
{
    return Py_NewRef(self->slow);
}

static PyGetSetDef send_getset[] = {
    {"__doc__", (getter)send_get_doc, NULL, NULL, NULL},
    {"__wrapped__", (getter)send_get_wrapped, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject SendMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmprod._speedups.SendMethod",
    .tp_basicsize = sizeof(SendMethod),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = send_new,
    .tp_dealloc = (destructor)send_dealloc,
    .tp_traverse = (traverseproc)send_traverse,
    .tp_clear = (inquiry)send_clear,
    .tp_vectorcall_offset = offsetof(SendMethod, vectorcall),
    .tp_call = send_tp_call,
    .tp_descr_get = send_descr_get,
    .tp_getattro = send_getattro,
    .tp_getset = send_getset,
};

/* ------------------------------------------------------------------------------------ */
/* Rows encoded as records, straight into a buffer                                      */
/* ------------------------------------------------------------------------------------ */
/*
 * A flush of a stage, or a send_batch, without per-row headers writes each record
 * straight from its source into the granted pool buffer: one copy of every key and
 * value, no take into partition order, no intermediate records section. The rows of a
 * batch are order[lo:hi] (order: the rows sorted by partition, int64; None is the
 * identity).
 *
 * A column (values, keys) is either a list of bytes | None (a stage's rows) or a tuple
 * (length, offset, width, validity, offsets, data) describing an Arrow binary (width 4)
 * or large_binary (width 8) array by its buffers; keys may be None (every key null).
 * Timestamps are a list of int, an int64 buffer, or one int for every row. Every offset
 * read from a buffer is checked against the buffer's length.
 *
 * A record (Kafka RecordBatch v2): length attributes timestampDelta offsetDelta
 * keyLength key valueLength value headers, every integer a zig-zag varint, a null key
 * or value a length of -1; headers is either one encoded section shared by every row
 * (b"\x00": none) or a list of one section per row (a stage whose rows were sent with
 * headers), indexed like the columns.
 */

static inline int
zz_size(unsigned long long u)
{
    int n = 1;
    while (u >= 0x80) {
        u >>= 7;
        n++;
    }
    return n;
}

static inline unsigned long long
zigzag(long long v)
{
    return ((unsigned long long)v << 1) ^ (unsigned long long)(v >> 63);
}

static inline char *
put_varint(char *p, unsigned long long u)
{
    while (u >= 0x80) {
        *p++ = (char)((u & 0x7F) | 0x80);
        u >>= 7;
    }
    *p++ = (char)u;
    return p;
}

/* A length (zig-zag varint; -1: null) and, when it is positive, that many bytes. */
static inline char *
put_blob(char *p, const char *src, Py_ssize_t len)
{
    p = put_varint(p, zigzag(len));
    if (len > 0) {
        memcpy(p, src, (size_t)len);
        p += len;
    }
    return p;
}

/* One header of the stager's headers (item i of a list or tuple, or the next pair of a
 * dict at *pos) as UTF-8 key bytes and value bytes (*vlen -1: null). 0: done; 1: not
 * the common form (no exception set). Runs no Python code. */
static int
header_pair(PyObject *headers, Py_ssize_t i, Py_ssize_t *pos, const char **k,
            Py_ssize_t *klen, const char **v, Py_ssize_t *vlen)
{
    PyObject *key, *value;
    if (PyDict_CheckExact(headers)) {
        if (!PyDict_Next(headers, pos, &key, &value)) {
            return 1; /* fewer pairs than its size said: never without Python code */
        }
    }
    else {
        PyObject *item = PySequence_Fast_GET_ITEM(headers, i);
        if ((!PyTuple_Check(item) && !PyList_Check(item)) ||
            PySequence_Fast_GET_SIZE(item) != 2) {
            return 1;
        }
        key = PySequence_Fast_GET_ITEM(item, 0);
        value = PySequence_Fast_GET_ITEM(item, 1);
    }
    if (!PyUnicode_Check(key)) {
        return 1;
    }
    *k = PyUnicode_AsUTF8AndSize(key, klen);
    if (*k == NULL) {
        PyErr_Clear(); /* not encodable (a lone surrogate): the Python path says so */
        return 1;
    }
    if (value == Py_None) {
        *v = NULL;
        *vlen = -1;
    }
    else if (PyBytes_Check(value)) {
        *v = PyBytes_AS_STRING(value);
        *vlen = PyBytes_GET_SIZE(value);
    }
    else if (PyUnicode_Check(value)) {
        *v = PyUnicode_AsUTF8AndSize(value, vlen);
        if (*v == NULL) {
            PyErr_Clear();
            return 1;
        }
    }
    else {
        return 1; /* another bytes-like: the Python path converts it */
    }
    return (*klen > 0x7FFFFFFF || *vlen > 0x7FFFFFFF) ? 1 : 0;
}

/*
 * The encoded headers section of one record sent with headers: a dict, or a list or
 * tuple of (key, value) pairs (each a 2-tuple or 2-list); key str, value bytes, str or
 * None (shmprod.protocol.records.encode_headers writes the same bytes). Returns a new
 * bytes object; None for any other form or what cannot be encoded (the Python path
 * then converts it or raises its typed error); NULL on a memory error. Runs in: worker,
 * the thread that calls send(); no lock, no Python code.
 */
static PyObject *
header_section(PyObject *headers)
{
    Py_ssize_t count;
    if (PyDict_CheckExact(headers)) {
        count = PyDict_GET_SIZE(headers);
    }
    else if (PyList_CheckExact(headers) || PyTuple_CheckExact(headers)) {
        count = PySequence_Fast_GET_SIZE(headers);
    }
    else {
        Py_RETURN_NONE;
    }
    if (count == 0) {
        return Py_NewRef(no_headers);
    }
    if (count > 0x7FFFFFFF) {
        Py_RETURN_NONE;
    }
    long long size = zz_size(zigzag(count));
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *k, *v;
        Py_ssize_t klen, vlen;
        if (header_pair(headers, i, &pos, &k, &klen, &v, &vlen)) {
            Py_RETURN_NONE;
        }
        size += zz_size(zigzag(klen)) + klen + zz_size(zigzag(vlen)) + (vlen > 0 ? vlen : 0);
    }
    if (size > 0x7FFFFFFFLL) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out == NULL) {
        return NULL;
    }
    char *p = PyBytes_AS_STRING(out);
    p = put_varint(p, zigzag(count));
    pos = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *k, *v;
        Py_ssize_t klen, vlen;
        if (header_pair(headers, i, &pos, &k, &klen, &v, &vlen)) {
            Py_DECREF(out); /* the same pairs as above: never */
            Py_RETURN_NONE;
        }
        p = put_blob(p, k, klen);
        p = put_blob(p, v, vlen);
    }
    return out;
}

/* header_sections(rows) -> list: each row's encoded headers section, for send_batch's
 * per-row headers (rows: a list, one headers dict or list of pairs per row, None for
 * none). An item is None where the row is not in a common form (header_section): the
 * Python path encodes that row, or raises its typed error. Runs in: worker, no lock. */
static PyObject *
header_sections(PyObject *mod, PyObject *rows)
{
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "header_sections takes a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        PyObject *section = row == Py_None ? Py_NewRef(no_headers) : header_section(row);
        if (section == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, section);
    }
    return out;
}

enum { COL_NULL, COL_LIST, COL_ARROW, COL_CHUNKS };

typedef struct Col Col;
struct Col {
    int kind;
    PyObject **items; /* COL_LIST: the list's items (borrowed; the list outlives the call) */
    Py_ssize_t n;
    Py_ssize_t base; /* COL_ARROW: the array's offset */
    int wide;        /* COL_ARROW: 8-byte offsets */
    const unsigned char *valid;
    Py_ssize_t valid_len;
    const char *offsets;
    Py_ssize_t offsets_len;
    const char *data;
    Py_ssize_t data_len;
    Py_buffer views[3];
    int held[3];
    Col *chunks;        /* COL_CHUNKS: one COL_ARROW column per chunk (owned) */
    Py_ssize_t nchunks; /* COL_CHUNKS */
    Py_ssize_t *starts; /* COL_CHUNKS: chunk j's first row; starts[nchunks] == n (owned) */
};

static void
col_release(Col *c)
{
    if (c->chunks != NULL) {
        for (Py_ssize_t j = 0; j < c->nchunks; j++) {
            col_release(&c->chunks[j]);
        }
        PyMem_Free(c->chunks);
        c->chunks = NULL;
    }
    PyMem_Free(c->starts);
    c->starts = NULL;
    for (int i = 0; i < 3; i++) {
        if (c->held[i]) {
            PyBuffer_Release(&c->views[i]);
            c->held[i] = 0;
        }
    }
}

static int
col_view(Col *c, int i, PyObject *obj, const char *what)
{
    if (PyObject_GetBuffer(obj, &c->views[i], PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: the Arrow %s buffer is not a buffer", what,
                     i == 0 ? "validity" : (i == 1 ? "offsets" : "data"));
        return -1;
    }
    c->held[i] = 1;
    return 0;
}

static int col_get(Col *c, PyObject *obj, int allow_none, const char *what);

/* A column of Arrow chunks: a list of Arrow buffers tuples, read as one column (the
 * ``send_batch`` calls held together, without joining their bytes). */
static int
col_chunks(Col *c, PyObject *list, const char *what)
{
    c->kind = COL_CHUNKS;
    if (!PyList_Check(list) || PyList_GET_SIZE(list) == 0) {
        PyErr_Format(PyExc_TypeError, "%s: chunks must be a non-empty list", what);
        return -1;
    }
    Py_ssize_t m = PyList_GET_SIZE(list);
    c->chunks = PyMem_Calloc((size_t)m, sizeof(Col));
    c->starts = PyMem_Calloc((size_t)m + 1, sizeof(Py_ssize_t));
    if (c->chunks == NULL || c->starts == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        PyObject *item = PyList_GET_ITEM(list, j);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
            PyErr_Format(PyExc_TypeError, "%s: each chunk must be an Arrow buffers tuple", what);
            goto fail;
        }
        if (col_get(&c->chunks[j], item, 0, what) < 0) {
            goto fail;
        }
        c->nchunks = j + 1;
        c->starts[j + 1] = c->starts[j] + c->chunks[j].n;
    }
    c->n = c->starts[m];
    return 0;
fail:
    col_release(c);
    return -1;
}

/* A column from a list, an Arrow buffers tuple, a 1-tuple holding a list of Arrow
 * buffers tuples (chunks), or None (when allowed). */
static int
col_get(Col *c, PyObject *obj, int allow_none, const char *what)
{
    memset(c, 0, sizeof(*c));
    if (obj == Py_None && allow_none) {
        c->kind = COL_NULL;
        c->n = -1; /* any */
        return 0;
    }
    if (PyList_Check(obj)) {
        c->kind = COL_LIST;
        c->items = ((PyListObject *)obj)->ob_item;
        c->n = PyList_GET_SIZE(obj);
        return 0;
    }
    if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == 1) {
        return col_chunks(c, PyTuple_GET_ITEM(obj, 0), what);
    }
    PyObject *validity, *offsets, *data;
    Py_ssize_t width;
    if (!PyTuple_Check(obj) ||
        !PyArg_ParseTuple(obj, "nnnOOO", &c->n, &c->base, &width, &validity, &offsets, &data)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s must be a list or a (length, offset, width, validity, offsets, data) "
                     "tuple",
                     what);
        return -1;
    }
    c->kind = COL_ARROW;
    if (c->n < 0 || c->base < 0 || (width != 4 && width != 8)) {
        PyErr_Format(PyExc_ValueError, "%s: bad Arrow length, offset or width", what);
        return -1;
    }
    c->wide = width == 8;
    if (validity != Py_None) {
        if (col_view(c, 0, validity, what) < 0) {
            goto fail;
        }
        c->valid = (const unsigned char *)c->views[0].buf;
        c->valid_len = c->views[0].len;
        if (c->valid_len * 8 < c->base + c->n) {
            PyErr_Format(PyExc_ValueError, "%s: the validity buffer is too short", what);
            goto fail;
        }
    }
    if (col_view(c, 1, offsets, what) < 0) {
        goto fail;
    }
    c->offsets = (const char *)c->views[1].buf;
    c->offsets_len = c->views[1].len;
    if (c->offsets_len / (c->wide ? 8 : 4) < c->base + c->n + 1) {
        PyErr_Format(PyExc_ValueError, "%s: the offsets buffer is too short", what);
        goto fail;
    }
    if (data != Py_None) {
        if (col_view(c, 2, data, what) < 0) {
            goto fail;
        }
        c->data = (const char *)c->views[2].buf;
        c->data_len = c->views[2].len;
    }
    return 0;
fail:
    col_release(c);
    return -1;
}

/* Item i's offsets in an Arrow column's offsets buffer (the array's offset included;
 * col_get checked that the buffer holds them), unchecked against the data. */
static inline void
arrow_offsets(const Col *c, Py_ssize_t i, long long *a, long long *b)
{
    if (c->wide) {
        int64_t x, y;
        memcpy(&x, c->offsets + 8 * i, 8);
        memcpy(&y, c->offsets + 8 * (i + 1), 8);
        *a = x;
        *b = y;
    }
    else {
        int32_t x, y;
        memcpy(&x, c->offsets + 4 * i, 4);
        memcpy(&y, c->offsets + 4 * (i + 1), 4);
        *a = x;
        *b = y;
    }
}

/* Row ``row``'s bytes of an Arrow column: *len -1 for null. */
static inline int
arrow_item(const Col *c, Py_ssize_t row, const char **ptr, Py_ssize_t *len)
{
    Py_ssize_t i = c->base + row;
    if (c->valid && !(c->valid[i >> 3] & (1 << (i & 7)))) {
        *ptr = NULL;
        *len = -1;
        return 0;
    }
    long long a, b;
    arrow_offsets(c, i, &a, &b);
    if (a < 0 || b < a || b > c->data_len) {
        PyErr_SetString(PyExc_ValueError, "an Arrow offset is outside its data buffer");
        return -1;
    }
    *ptr = c->data + a;
    *len = (Py_ssize_t)(b - a);
    return 0;
}

/* The chunk of a chunked column holding row: the last j with starts[j] <= row (0 <= row
 * < n, checked by the caller). */
static inline Py_ssize_t
chunk_of(const Col *c, Py_ssize_t row)
{
    Py_ssize_t lo = 0, hi = c->nchunks - 1;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (c->starts[mid] <= row) {
            lo = mid;
        }
        else {
            hi = mid - 1;
        }
    }
    return lo;
}

/* Row ``row``'s bytes: *len -1 for null. */
static inline int
col_item(const Col *c, Py_ssize_t row, const char **ptr, Py_ssize_t *len)
{
    if (c->kind == COL_NULL) {
        *ptr = NULL;
        *len = -1;
        return 0;
    }
    if (c->kind == COL_LIST) {
        PyObject *o = c->items[row];
        if (o == Py_None) {
            *ptr = NULL;
            *len = -1;
            return 0;
        }
        if (!PyBytes_Check(o)) {
            PyErr_Format(PyExc_TypeError,
                         "staged keys and values must be bytes or None, got %.100s",
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        *ptr = PyBytes_AS_STRING(o);
        *len = PyBytes_GET_SIZE(o);
        return 0;
    }
    if (c->kind == COL_CHUNKS) {
        Py_ssize_t j = chunk_of(c, row);
        return arrow_item(&c->chunks[j], row - c->starts[j], ptr, len);
    }
    return arrow_item(c, row, ptr, len);
}

/* A buffer of native int64 items (numpy int64 exports "l" or "q"). */
static int
is_int64(const Py_buffer *v)
{
    const char *f = v->format;
    return v->itemsize == 8 && f != NULL &&
           (!strcmp(f, "q") || !strcmp(f, "l") || !strcmp(f, "<q") || !strcmp(f, "<l") ||
            !strcmp(f, "=q") || !strcmp(f, "=l"));
}

enum { TS_ONE, TS_LIST, TS_ARRAY };

typedef struct {
    int kind;
    long long one;
    PyObject **items;
    const long long *arr;
    Py_ssize_t n;
    Py_buffer view;
    int held;
    /* TS_LIST: the last int read and its value. The stager gives every record of one
       millisecond the same int object, and a millisecond timestamp is a two-digit int,
       which PyLong_AsLongLong converts on its slow path: a pointer compare skips it. */
    PyObject *last;
    long long last_v;
} Stamps;

static int
ts_get(Stamps *t, PyObject *obj)
{
    memset(t, 0, sizeof(*t));
    if (PyLong_Check(obj)) {
        t->kind = TS_ONE;
        t->n = -1;
        t->one = PyLong_AsLongLong(obj);
        if (t->one == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (t->one < 0) {
            PyErr_SetString(PyExc_ValueError, "timestamps must be >= 0");
            return -1;
        }
        return 0;
    }
    if (PyList_Check(obj)) {
        t->kind = TS_LIST;
        t->items = ((PyListObject *)obj)->ob_item;
        t->n = PyList_GET_SIZE(obj);
        return 0;
    }
    if (PyObject_GetBuffer(obj, &t->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "timestamps must be an int, a list or an int64 array");
        return -1;
    }
    t->held = 1;
    if (!is_int64(&t->view)) {
        PyErr_SetString(PyExc_TypeError, "timestamps must be an int, a list or an int64 array");
        PyBuffer_Release(&t->view);
        t->held = 0;
        return -1;
    }
    t->kind = TS_ARRAY;
    t->arr = (const long long *)t->view.buf;
    t->n = t->view.len / 8;
    return 0;
}

static inline int
ts_item(Stamps *t, Py_ssize_t row, long long *ts)
{
    if (t->kind == TS_ONE) {
        *ts = t->one;
        return 0;
    }
    if (t->kind == TS_ARRAY) {
        *ts = t->arr[row];
    }
    else {
        PyObject *o = t->items[row];
        if (o == t->last) {
            *ts = t->last_v; /* checked when first read */
            return 0;
        }
        if (!PyLong_Check(o)) {
            PyErr_SetString(PyExc_TypeError, "staged timestamps must be ints");
            return -1;
        }
        *ts = PyLong_AsLongLong(o);
        if (*ts == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (*ts >= 0) {
            t->last = o; /* borrowed: the list holds it for the whole call */
            t->last_v = *ts;
        }
    }
    if (*ts < 0) {
        PyErr_SetString(PyExc_ValueError, "timestamps must be >= 0");
        return -1;
    }
    return 0;
}

typedef struct {
    Col values, keys;
    Stamps ts;
    Py_ssize_t n;
    const long long *order; /* NULL: the identity */
    Py_buffer order_view;
    int has_order;
    const char *headers;
    Py_ssize_t headers_len;
    PyObject **row_headers; /* NULL: every record carries headers; else one per row */
} Rows;

static void
rows_release(Rows *r)
{
    col_release(&r->values);
    col_release(&r->keys);
    if (r->ts.held) {
        PyBuffer_Release(&r->ts.view);
        r->ts.held = 0;
    }
    if (r->has_order) {
        PyBuffer_Release(&r->order_view);
        r->has_order = 0;
    }
}

/* The columns (one length), the order (int64, that length) and the headers section. */
static int
rows_get(Rows *r, PyObject *values, PyObject *keys, PyObject *stamps, PyObject *order,
         PyObject *headers)
{
    memset(r, 0, sizeof(*r));
    if (col_get(&r->values, values, 0, "values") < 0) {
        return -1;
    }
    if (col_get(&r->keys, keys, 1, "keys") < 0 || ts_get(&r->ts, stamps) < 0) {
        goto fail;
    }
    r->n = r->values.n;
    if ((r->keys.n != -1 && r->keys.n != r->n) || (r->ts.n != -1 && r->ts.n != r->n)) {
        PyErr_SetString(PyExc_ValueError, "values, keys and timestamps differ in length");
        goto fail;
    }
    if (headers == NULL) {
        r->headers = "";
        r->headers_len = 1; /* the NUL byte: a count of 0 */
    }
    else if (PyBytes_Check(headers) && PyBytes_GET_SIZE(headers) > 0) {
        r->headers = PyBytes_AS_STRING(headers);
        r->headers_len = PyBytes_GET_SIZE(headers);
    }
    else if (PyList_Check(headers)) {
        if (PyList_GET_SIZE(headers) != r->n) {
            PyErr_SetString(PyExc_ValueError, "per-row headers must have one section per row");
            goto fail;
        }
        r->row_headers = ((PyListObject *)headers)->ob_item;
    }
    else {
        PyErr_SetString(PyExc_TypeError,
                        "headers must be a non-empty encoded headers section, or a list of "
                        "one per row");
        goto fail;
    }
    if (order != Py_None) {
        if (PyObject_GetBuffer(order, &r->order_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            goto fail;
        }
        r->has_order = 1;
        if (!is_int64(&r->order_view)) {
            PyErr_SetString(PyExc_TypeError, "order must be an int64 array");
            goto fail;
        }
        if (r->order_view.len / 8 != r->n) {
            PyErr_SetString(PyExc_ValueError, "order must have one entry per row");
            goto fail;
        }
        r->order = (const long long *)r->order_view.buf;
    }
    return 0;
fail:
    rows_release(r);
    return -1;
}

/* Row ``row``'s timestamp and headers section, checked. */
static inline int
row_stamp(Rows *r, Py_ssize_t row, long long *ts, const char **h, Py_ssize_t *hlen)
{
    if (ts_item(&r->ts, row, ts) < 0) {
        return -1;
    }
    if (r->row_headers == NULL) {
        *h = r->headers;
        *hlen = r->headers_len;
        return 0;
    }
    PyObject *o = r->row_headers[row];
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) < 1 || PyBytes_GET_SIZE(o) > 0x7FFFFFFF) {
        PyErr_SetString(PyExc_TypeError, "a row's headers must be a non-empty encoded section");
        return -1;
    }
    *h = PyBytes_AS_STRING(o);
    *hlen = PyBytes_GET_SIZE(o);
    return 0;
}

/* Sorted position i's row, checked: -1 and IndexError outside the rows. */
static inline Py_ssize_t
row_at(const Rows *r, Py_ssize_t i)
{
    long long x = r->order ? r->order[i] : (long long)i;
    if (x < 0 || x >= r->n) {
        PyErr_SetString(PyExc_IndexError, "order holds a row out of range");
        return -1;
    }
    return (Py_ssize_t)x;
}

/* Sorted position i's row, key, value, timestamp and headers section, checked. */
static inline int
row_get(Rows *r, Py_ssize_t i, const char **k, Py_ssize_t *klen, const char **v,
        Py_ssize_t *vlen, long long *ts, const char **h, Py_ssize_t *hlen)
{
    Py_ssize_t row = row_at(r, i);
    if (row < 0 || col_item(&r->keys, row, k, klen) < 0 ||
        col_item(&r->values, row, v, vlen) < 0) {
        return -1;
    }
    return row_stamp(r, row, ts, h, hlen);
}

/* How far ahead encode_records asks for a row's bytes: PREFETCH_ROWS rows, the first
 * PREFETCH_BYTES of each value and key. Measured (10,000-row calls sorted by partition,
 * the rows not in cache): the copy of 100 B values takes half the time, 8 or 32 rows
 * ahead alike; of 1 KB values 12% less, the first 512 B to 2 KiB alike. */
#define PREFETCH_ROWS 8
#define PREFETCH_BYTES 1024
/* Of a list column's bytes objects (send()'s staged rows), the first 3 lines: a 32-byte
 * object header and 160 bytes. Measured on 100 B values: 1 line 8%, 3 lines 40% less
 * time; 2-stage (the first line, then the size's worth) no better. */
#define LIST_PREFETCH_LINES 3

/* Asks the CPU to start loading the cache line at p. It never faults, whatever p is.
 * On x86 it is the instruction itself: GCC 12 compiled the __builtin_prefetch calls of
 * encode_records to nothing at -O1 and above (read in its assembly). */
static inline void
prefetch_line(const char *p)
{
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#else
    __builtin_prefetch(p);
#endif
}

/* Asks for the first PREFETCH_BYTES of row ``row``'s bytes in an Arrow column. Reads
 * what arrow_item reads and checks nothing else: a bad offset only loads a useless line,
 * and arrow_item reports it when the row is reached. */
static inline void
arrow_prefetch(const Col *c, Py_ssize_t row)
{
    Py_ssize_t i = c->base + row;
    long long a, b;
    arrow_offsets(c, i, &a, &b);
    if (a >= 0 && a < b && b <= c->data_len) {
        if (b - a > PREFETCH_BYTES) {
            b = a + PREFETCH_BYTES;
        }
        for (long long at = a; at < b; at += 64) {
            prefetch_line(c->data + at);
        }
        prefetch_line(c->data + b - 1);
    }
}

/* Row ``row``'s bytes asked for (see arrow_prefetch); of a list column, the first
 * LIST_PREFETCH_LINES lines of the bytes object, without reading its size. */
static inline void
col_prefetch(const Col *c, Py_ssize_t row)
{
    if (c->kind == COL_LIST) {
        const char *o = (const char *)c->items[row];
        for (int k = 0; k < LIST_PREFETCH_LINES; k++) {
            prefetch_line(o + 64 * k);
        }
    }
    else if (c->kind == COL_ARROW) {
        arrow_prefetch(c, row);
    }
    else if (c->kind == COL_CHUNKS) {
        Py_ssize_t j = chunk_of(c, row);
        arrow_prefetch(&c->chunks[j], row - c->starts[j]);
    }
}

/* Asks for sorted row i's key and value bytes ahead of their copy (see col_prefetch). */
static inline void
row_prefetch(const Rows *r, Py_ssize_t i)
{
    long long x = r->order ? r->order[i] : (long long)i;
    if (x >= 0 && x < r->n) {
        col_prefetch(&r->values, (Py_ssize_t)x);
        col_prefetch(&r->keys, (Py_ssize_t)x);
    }
}

/* A record's body size (all but its length varint); -1 and OverflowError if too big. */
static inline long long
body_size(Py_ssize_t klen, Py_ssize_t vlen, long long ts_delta, long long offset_delta,
          Py_ssize_t headers_len)
{
    long long body = 1 + zz_size(zigzag(ts_delta)) + zz_size(zigzag(offset_delta)) +
                     zz_size(zigzag(klen)) + (klen > 0 ? klen : 0) + zz_size(zigzag(vlen)) +
                     (vlen > 0 ? vlen : 0) + headers_len;
    if (body > 0x7FFFFFFFLL) {
        PyErr_SetString(PyExc_OverflowError, "a record is larger than 2**31 - 1 bytes");
        return -1;
    }
    return body;
}

/* staged_lengths(values, keys, out[, sizes]): out[i] = key + value bytes of staged row i
 * (None counts 0); sizes (optional): a writable buffer of two native int32 per row, the
 * key's and the value's length (-1: None), what plan_batches reads instead of the
 * objects. values, keys: lists; out: a writable int64 buffer of one entry per row.
 * Reads each row's two objects once, in staging order, asking for them PREFETCH_ROWS
 * rows ahead. Runs in: worker. */
static PyObject *
staged_lengths(PyObject *mod, PyObject *args)
{
    PyObject *values, *keys, *sizes_arg = Py_None;
    Py_buffer out, sizes = {0};
    if (!PyArg_ParseTuple(args, "O!O!w*|O:staged_lengths", &PyList_Type, &values, &PyList_Type,
                          &keys, &out, &sizes_arg)) {
        return NULL;
    }
    PyObject *result = NULL;
    char *sz = NULL; /* two int32 a row, at any alignment */
    int sized = 0;   /* the sizes buffer is held (its buf may be NULL when empty) */
    Py_ssize_t n = PyList_GET_SIZE(values);
    if (PyList_GET_SIZE(keys) != n || out.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "values, keys and out differ in length");
        goto done;
    }
    if (sizes_arg != Py_None) {
        if (PyObject_GetBuffer(sizes_arg, &sizes, PyBUF_WRITABLE) < 0) {
            goto done;
        }
        sized = 1;
        sz = (char *)sizes.buf;
        if (sizes.len != n * 8) {
            PyErr_SetString(PyExc_ValueError, "sizes must hold two int32 per row");
            goto done;
        }
    }
    PyObject **vi = ((PyListObject *)values)->ob_item;
    PyObject **ki = ((PyListObject *)keys)->ob_item;
    Col vc = {.kind = COL_LIST, .items = vi, .n = n};
    Col kc = {.kind = COL_LIST, .items = ki, .n = n};
    long long *dst = (long long *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_ROWS < n) {
            prefetch_line((const char *)vi[i + PREFETCH_ROWS]);
            prefetch_line((const char *)ki[i + PREFETCH_ROWS]);
        }
        const char *p;
        Py_ssize_t k, v;
        if (col_item(&kc, i, &p, &k) < 0 || col_item(&vc, i, &p, &v) < 0) {
            goto done;
        }
        dst[i] = (k > 0 ? k : 0) + (v > 0 ? v : 0);
        if (sized) {
            if (k > INT32_MAX || v > INT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "a staged key or value of 2**31 bytes");
                goto done;
            }
            int32_t kv[2] = {(int32_t)k, (int32_t)v};
            memcpy(sz + 8 * i, kv, sizeof(kv));
        }
    }
    result = Py_NewRef(Py_None);
done:
    if (sized) {
        PyBuffer_Release(&sizes);
    }
    PyBuffer_Release(&out);
    return result;
}

/* plan_batches(values, keys, timestamps, order, ends, budget[, headers[, sizes]]): cuts
 * the sorted rows into batches. ends: the sorted positions where a partition's rows end
 * (rising, the last one the row count); no batch crosses one. A batch's records take at
 * most budget bytes; a record too big for an empty batch goes alone. sizes: None, or
 * each row's key and value length (two native int32, -1: None) as staged_lengths wrote
 * them: read instead of the key and value objects, which the rows sorted by partition
 * reach in no order (measured: the first read of every staged object was a cache miss,
 * 12% of the worker's CPU with eight processes sending 100 B records). Lengths that are
 * not the rows' make batches encode_records refuses, never a wrong one. Returns a list
 * of (lo, hi, records bytes, base timestamp, max timestamp). Runs in: worker. */
static PyObject *
plan_batches(PyObject *mod, PyObject *args)
{
    PyObject *values, *keys, *stamps, *order, *ends, *headers = NULL, *sizes_arg = Py_None;
    long long budget;
    if (!PyArg_ParseTuple(args, "OOOOO!L|OO:plan_batches", &values, &keys, &stamps, &order,
                          &PyList_Type, &ends, &budget, &headers, &sizes_arg)) {
        return NULL;
    }
    Rows r;
    if (rows_get(&r, values, keys, stamps, order, headers) < 0) {
        return NULL;
    }
    Py_buffer sizes = {0};
    const char *sz = NULL; /* two int32 a row, at any alignment */
    int sized = 0;         /* the sizes buffer is held (its buf may be NULL when empty) */
    PyObject *out = NULL;
    if (sizes_arg != Py_None) {
        if (PyObject_GetBuffer(sizes_arg, &sizes, PyBUF_SIMPLE) < 0) {
            goto fail;
        }
        sized = 1;
        if (sizes.len != r.n * 8) {
            PyErr_SetString(PyExc_ValueError, "sizes must hold two int32 per row");
            goto fail;
        }
        sz = (const char *)sizes.buf;
    }
    out = PyList_New(0);
    if (out == NULL) {
        goto fail;
    }
    Py_ssize_t nends = PyList_GET_SIZE(ends);
    Py_ssize_t lo = 0, prev_end = 0;
    for (Py_ssize_t g = 0; g < nends; g++) {
        Py_ssize_t end = PyLong_AsSsize_t(PyList_GET_ITEM(ends, g));
        if (end == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (end <= prev_end || end > r.n) {
            PyErr_SetString(PyExc_ValueError, "ends must rise strictly to the row count");
            goto fail;
        }
        prev_end = end;
        while (lo < end) {
            Py_ssize_t i = lo;
            long long size = 0, base = 0, top = 0;
            for (; i < end; i++) {
                const char *kp, *vp, *hp;
                Py_ssize_t k, v, h;
                long long ts;
                if (sized) {
                    Py_ssize_t row = row_at(&r, i);
                    if (row < 0 || row_stamp(&r, row, &ts, &hp, &h) < 0) {
                        goto fail;
                    }
                    int32_t kv[2];
                    memcpy(kv, sz + 8 * row, sizeof(kv));
                    k = kv[0];
                    v = kv[1];
                    if (k < -1 || v < -1) {
                        PyErr_SetString(PyExc_ValueError, "a size below -1");
                        goto fail;
                    }
                }
                else if (row_get(&r, i, &kp, &k, &vp, &v, &ts, &hp, &h) < 0) {
                    goto fail;
                }
                if (i == lo) {
                    base = top = ts;
                }
                long long body = body_size(k, v, ts - base, (long long)(i - lo), h);
                if (body < 0) {
                    goto fail;
                }
                long long one = zz_size(zigzag(body)) + body;
                if (i > lo && size + one > budget) {
                    break;
                }
                size += one;
                if (ts > top) {
                    top = ts;
                }
            }
            PyObject *item = Py_BuildValue("(nnLLL)", lo, i, size, base, top);
            if (item == NULL || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                goto fail;
            }
            Py_DECREF(item);
            lo = i;
        }
    }
    if (prev_end != r.n) {
        PyErr_SetString(PyExc_ValueError, "ends must rise strictly to the row count");
        goto fail;
    }
    if (sized) {
        PyBuffer_Release(&sizes);
    }
    rows_release(&r);
    return out;
fail:
    if (sized) {
        PyBuffer_Release(&sizes);
    }
    rows_release(&r);
    Py_XDECREF(out);
    return NULL;
}

/* encode_records(values, keys, timestamps, order, lo, hi, base_ts, out, offset[,
 * headers]): writes the records of sorted rows [lo, hi) at out[offset:], offsetDelta
 * from 0 and timestampDelta from base_ts; returns the end offset. ValueError when they
 * do not fit (nothing is promised of out then). Runs in: worker; out is a buffer this
 * worker owns. */
static PyObject *
encode_records(PyObject *mod, PyObject *args)
{
    PyObject *values, *keys, *stamps, *order, *headers = NULL;
    Py_ssize_t lo, hi, offset;
    long long base;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OOOOnnLw*n|O:encode_records", &values, &keys, &stamps, &order,
                          &lo, &hi, &base, &out, &offset, &headers)) {
        return NULL;
    }
    Rows r;
    if (rows_get(&r, values, keys, stamps, order, headers) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (lo < 0 || hi < lo || hi > r.n || offset < 0 || offset > out.len) {
        PyErr_SetString(PyExc_ValueError, "rows or offset out of range");
        goto fail;
    }
    char *p = (char *)out.buf + offset;
    const char *stop = (const char *)out.buf + out.len;
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i + PREFETCH_ROWS < hi) {
            row_prefetch(&r, i + PREFETCH_ROWS);
        }
        const char *kp, *vp, *hp;
        Py_ssize_t k, v, h;
        long long ts;
        if (row_get(&r, i, &kp, &k, &vp, &v, &ts, &hp, &h) < 0) {
            goto fail;
        }
        long long od = (long long)(i - lo);
        long long body = body_size(k, v, ts - base, od, h);
        if (body < 0) {
            goto fail;
        }
        if (zz_size(zigzag(body)) + body > stop - p) {
            PyErr_SetString(PyExc_ValueError, "the records do not fit in the buffer");
            goto fail;
        }
        p = put_varint(p, zigzag(body));
        *p++ = 0; /* attributes */
        p = put_varint(p, zigzag(ts - base));
        p = put_varint(p, zigzag(od));
        p = put_blob(p, kp, k);
        p = put_blob(p, vp, v);
        memcpy(p, hp, (size_t)h);
        p += h;
    }
    Py_ssize_t end = p - (char *)out.buf;
    rows_release(&r);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(end);
fail:
    rows_release(&r);
    PyBuffer_Release(&out);
    return NULL;
}

/* Kafka's murmur2 (the Java client's Utils.murmur2) of len bytes at p. */
static uint32_t
murmur2(const unsigned char *p, Py_ssize_t len)
{
    const uint32_t m = 0x5bd1e995u;
    uint32_t h = 0x9747b28cu ^ (uint32_t)len;
    Py_ssize_t whole = len & ~(Py_ssize_t)3;
    for (Py_ssize_t i = 0; i < whole; i += 4) {
        uint32_t k = (uint32_t)p[i] | ((uint32_t)p[i + 1] << 8) | ((uint32_t)p[i + 2] << 16) |
                     ((uint32_t)p[i + 3] << 24);
        k *= m;
        k ^= k >> 24;
        k *= m;
        h *= m;
        h ^= k;
    }
    switch (len & 3) {
    case 3:
        h ^= (uint32_t)p[whole + 2] << 16;
        /* fall through */
    case 2:
        h ^= (uint32_t)p[whole + 1] << 8;
        /* fall through */
    case 1:
        h ^= (uint32_t)p[whole];
        h *= m;
    }
    h ^= h >> 13;
    h *= m;
    h ^= h >> 15;
    return h;
}

/* murmur2_partitions(keys, num_partitions, out): out[i] = (murmur2(key) & 0x7fffffff) %
 * num_partitions, the Java client's choice, or -1 for a null key (chosen later by the
 * sticky rule). keys: a list of bytes | None, or an Arrow binary column (see col_get);
 * out: a writable int32 buffer of one entry per key. Runs in: worker. */
static PyObject *
murmur2_partitions(PyObject *mod, PyObject *args)
{
    PyObject *keys;
    long long nparts;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OLw*:murmur2_partitions", &keys, &nparts, &out)) {
        return NULL;
    }
    Col kc;
    if (col_get(&kc, keys, 0, "keys") < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    if (nparts < 1 || nparts > 0x7FFFFFFFLL) {
        PyErr_SetString(PyExc_ValueError, "num_partitions must be in [1, 2**31 - 1]");
        goto done;
    }
    if (out.len != kc.n * 4) {
        PyErr_SetString(PyExc_ValueError, "out must hold one int32 per key");
        goto done;
    }
    int32_t *dst = (int32_t *)out.buf;
    for (Py_ssize_t i = 0; i < kc.n; i++) {
        const char *p;
        Py_ssize_t len;
        if (col_item(&kc, i, &p, &len) < 0) {
            goto done;
        }
        dst[i] = len < 0 ? -1
                         : (int32_t)((murmur2((const unsigned char *)p, len) & 0x7FFFFFFFu) %
                                     (uint32_t)nparts);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    col_release(&kc);
    PyBuffer_Release(&out);
    return result;
}

/* A native int32 buffer (numpy int32 exports "i", or "l" where long is 4 bytes). */
static int
is_int32(const Py_buffer *v)
{
    const char *f = v->format;
    return v->itemsize == 4 && f != NULL &&
           (!strcmp(f, "i") || !strcmp(f, "<i") || !strcmp(f, "=i") ||
            (sizeof(long) == 4 && (!strcmp(f, "l") || !strcmp(f, "<l") || !strcmp(f, "=l"))));
}

/* Runs of one partition at most this many (as shmprod.worker.bulk._order): below it, a
 * flush whose partitions are each one run already (null keys, sticky) is not sorted. */
#define GROUPED_RUNS_MAX 4096

/* partition_order(parts, order) -> (sorted, [(partition, lo, hi), ...]): a flush's rows
 * grouped by partition, input order kept inside each. parts: a C-contiguous int32 buffer,
 * every entry >= 0; order: a writable int64 buffer of as many entries. When each
 * partition's rows are one run already (at most GROUPED_RUNS_MAX runs), sorted is False,
 * order is not written and the ranges are the runs in input order; else order holds the
 * rows sorted by partition (a counting sort: two passes, one array of counts) and the
 * ranges ascend by partition. What numpy's stable argsort, a take and two diffs did, with
 * their five temporaries of one entry per row. Runs in: worker. */
static PyObject *
partition_order(PyObject *mod, PyObject *args)
{
    PyObject *parts_arg, *order_arg;
    if (!PyArg_ParseTuple(args, "OO:partition_order", &parts_arg, &order_arg)) {
        return NULL;
    }
    Py_buffer pv, ov;
    if (PyObject_GetBuffer(parts_arg, &pv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(order_arg, &ov, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) <
        0) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    PyObject *result = NULL, *ranges = NULL;
    Py_ssize_t *counts = NULL;
    if (!is_int32(&pv)) {
        PyErr_SetString(PyExc_TypeError, "parts must be an int32 buffer");
        goto done;
    }
    if (!is_int64(&ov)) {
        PyErr_SetString(PyExc_TypeError, "order must be an int64 buffer");
        goto done;
    }
    Py_ssize_t n = pv.len / 4;
    if (ov.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "order must hold one entry per row");
        goto done;
    }
    const int32_t *parts = (const int32_t *)pv.buf;
    long long *order = (long long *)ov.buf;
    int32_t top = 0;
    Py_ssize_t runs = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t v = parts[i];
        if (v < 0) {
            PyErr_SetString(PyExc_ValueError, "a partition below 0");
            goto done;
        }
        if (v > top) {
            top = v;
        }
        if (i == 0 || v != parts[i - 1]) {
            runs++;
        }
    }
    ranges = PyList_New(0);
    if (ranges == NULL) {
        goto done;
    }
    if (n == 0) {
        result = Py_BuildValue("(OO)", Py_False, ranges);
        goto done;
    }
    counts = PyMem_Calloc((size_t)top + 1, sizeof(Py_ssize_t));
    if (counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int grouped = runs <= GROUPED_RUNS_MAX;
    if (grouped) { /* is any partition in two runs? counts marks those seen */
        for (Py_ssize_t i = 0; i < n && grouped; i++) {
            if (i == 0 || parts[i] != parts[i - 1]) {
                grouped = counts[parts[i]]++ == 0;
            }
        }
    }
    if (grouped) {
        Py_ssize_t lo = 0;
        for (Py_ssize_t i = 1; i <= n; i++) {
            if (i == n || parts[i] != parts[i - 1]) {
                PyObject *item = Py_BuildValue("(inn)", (int)parts[lo], lo, i);
                if (item == NULL || PyList_Append(ranges, item) < 0) {
                    Py_XDECREF(item);
                    goto done;
                }
                Py_DECREF(item);
                lo = i;
            }
        }
        result = Py_BuildValue("(OO)", Py_False, ranges);
        goto done;
    }
    memset(counts, 0, ((size_t)top + 1) * sizeof(Py_ssize_t));
    for (Py_ssize_t i = 0; i < n; i++) {
        counts[parts[i]]++;
    }
    Py_ssize_t at = 0; /* counts[p] becomes where partition p's next row goes */
    for (int32_t p = 0; p <= top; p++) {
        Py_ssize_t c = counts[p];
        if (c == 0) {
            continue;
        }
        PyObject *item = Py_BuildValue("(inn)", (int)p, at, at + c);
        if (item == NULL || PyList_Append(ranges, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
        counts[p] = at;
        at += c;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        order[counts[parts[i]]++] = (long long)i;
    }
    result = Py_BuildValue("(OO)", Py_True, ranges);
done:
    PyMem_Free(counts);
    Py_XDECREF(ranges);
    PyBuffer_Release(&ov);
    PyBuffer_Release(&pv);
    return result;
}

/* row_places(order, counts, row_batch, row_index): where each row of a flush went. The
 * sorted rows are cut into batches of counts[b] rows each, in order; row order[k] (k
 * itself when order is None) of batch b at index j gets row_batch = b, row_index = j.
 * order: None or an int64 buffer of the rows (each once: every row is written);
 * row_batch, row_index: writable int32 buffers of one entry per row; the counts sum to
 * the rows. What two np.repeat, an arange and two scatters did. Runs in: worker. */
static PyObject *
row_places(PyObject *mod, PyObject *args)
{
    PyObject *order_arg, *counts, *batch_arg, *index_arg;
    Py_buffer bv, iv, ov = {0};
    if (!PyArg_ParseTuple(args, "OO!OO:row_places", &order_arg, &PyList_Type, &counts,
                          &batch_arg, &index_arg)) {
        return NULL;
    }
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE;
    if (PyObject_GetBuffer(batch_arg, &bv, flags) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(index_arg, &iv, flags) < 0) {
        PyBuffer_Release(&bv);
        return NULL;
    }
    PyObject *result = NULL;
    int has_order = 0;
    Py_ssize_t n = bv.len / 4;
    if (!is_int32(&bv) || !is_int32(&iv)) {
        PyErr_SetString(PyExc_TypeError, "row_batch and row_index must be int32 buffers");
        goto done;
    }
    if (iv.len != bv.len) {
        PyErr_SetString(PyExc_ValueError, "row_batch and row_index differ in length");
        goto done;
    }
    const long long *order = NULL;
    if (order_arg != Py_None) {
        if (PyObject_GetBuffer(order_arg, &ov, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            goto done;
        }
        has_order = 1;
        if (!is_int64(&ov) || ov.len != n * 8) {
            PyErr_SetString(PyExc_ValueError, "order must be int64, one entry per row");
            goto done;
        }
        order = (const long long *)ov.buf;
    }
    int32_t *rb = (int32_t *)bv.buf, *ri = (int32_t *)iv.buf;
    Py_ssize_t nb = PyList_GET_SIZE(counts), k = 0;
    if (nb > 0x7FFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "too many batches");
        goto done;
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        Py_ssize_t c = PyLong_AsSsize_t(PyList_GET_ITEM(counts, b));
        if (c == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (c < 0 || c > n - k || c > 0x7FFFFFFF) {
            PyErr_SetString(PyExc_ValueError, "the counts do not sum to the rows");
            goto done;
        }
        for (Py_ssize_t j = 0; j < c; j++, k++) {
            long long row = order != NULL ? order[k] : (long long)k;
            if (row < 0 || row >= n) {
                PyErr_SetString(PyExc_IndexError, "order holds a row out of range");
                goto done;
            }
            rb[row] = (int32_t)b;
            ri[row] = (int32_t)j;
        }
    }
    if (k != n) {
        PyErr_SetString(PyExc_ValueError, "the counts do not sum to the rows");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    if (has_order) {
        PyBuffer_Release(&ov);
    }
    PyBuffer_Release(&iv);
    PyBuffer_Release(&bv);
    return result;
}

/* stamp_runs(timestamps, starts, values) -> runs: a flushed stage's timestamps (a list
 * of int, ms) as runs of rows with one timestamp each: run r starts at row starts[r] and
 * holds values[r]. starts: a writable int32 buffer, values a writable int64 buffer, each
 * of at least one entry per row (runs <= rows). send() gives the rows of one millisecond
 * the same int object, so a row is usually one pointer compare. What np.array of the
 * list and a np.diff did, without the int64 copy of every row. Runs in: worker. */
static PyObject *
stamp_runs(PyObject *mod, PyObject *args)
{
    PyObject *ts, *starts_arg, *values_arg;
    Py_buffer sv, vv;
    if (!PyArg_ParseTuple(args, "O!OO:stamp_runs", &PyList_Type, &ts, &starts_arg,
                          &values_arg)) {
        return NULL;
    }
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE;
    if (PyObject_GetBuffer(starts_arg, &sv, flags) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(values_arg, &vv, flags) < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(ts);
    if (!is_int32(&sv) || !is_int64(&vv)) {
        PyErr_SetString(PyExc_TypeError, "starts must be int32 and values int64 buffers");
        goto done;
    }
    if (sv.len / 4 < n || vv.len / 8 < n || n > 0x7FFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "starts and values need one entry per row");
        goto done;
    }
    int32_t *starts = (int32_t *)sv.buf;
    long long *values = (long long *)vv.buf;
    Py_ssize_t runs = 0;
    PyObject *prev = NULL;
    long long last = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(ts, i);
        if (item == prev) {
            continue;
        }
        if (!PyLong_CheckExact(item)) {
            PyErr_SetString(PyExc_TypeError, "staged timestamps must be ints");
            goto done;
        }
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) {
            goto done;
        }
        prev = item;
        if (runs > 0 && v == last) {
            continue;
        }
        starts[runs] = (int32_t)i;
        values[runs] = v;
        last = v;
        runs++;
    }
    result = PyLong_FromSsize_t(runs);
done:
    PyBuffer_Release(&vv);
    PyBuffer_Release(&sv);
    return result;
}

/* ------------------------------------------------------------------------------------ */
/* CRC-32C of a batch whose producer state was rewritten (shmprod.protocol.crc)         */
/* ------------------------------------------------------------------------------------ */

/* The CRC is affine over GF(2): for two messages of one length, crc(A) ^ crc(B) is the
 * register (started at 0, no final xor) after the bytes A ^ B. When only a few bytes
 * change, that is the register after the changed bytes (zeros before them leave a zero
 * register as it is), carried through the `tail` unchanged bytes after them: a product
 * with x^(8*tail) modulo the polynomial, in O(log tail) without reading the tail. */

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t
gf2_mulmod(uint32_t a, uint32_t b)
{
    /* a * b modulo the polynomial, reflected: bit 31 is x^0 */
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
        if (a & m) {
            product ^= b;
        }
        b = (b & 1u) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return product;
}

static uint32_t
crc32c_zeros(uint32_t reg, unsigned long long nbytes)
{
    /* the register after nbytes zero bytes: reg * x^(8*nbytes) */
    uint32_t power = 1u << 23; /* x^8: one zero byte */
    uint32_t factor = 1u << 31; /* x^0 */
    while (nbytes) {
        if (nbytes & 1u) {
            factor = gf2_mulmod(factor, power);
        }
        nbytes >>= 1;
        power = gf2_mulmod(power, power);
    }
    return gf2_mulmod(factor, reg);
}

static PyObject *
crc32c_patch(PyObject *mod, PyObject *args)
{
    unsigned long crc;
    Py_buffer delta;
    unsigned long long tail;
    if (!PyArg_ParseTuple(args, "ky*K", &crc, &delta, &tail)) {
        return NULL;
    }
    if (crc > 0xFFFFFFFFul) {
        PyBuffer_Release(&delta);
        PyErr_SetString(PyExc_ValueError, "crc must fit in 32 bits");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)delta.buf;
    uint32_t reg = 0;
    for (Py_ssize_t i = 0; i < delta.len; i++) {
        reg ^= p[i];
        for (int k = 0; k < 8; k++) {
            reg = (reg & 1u) ? (reg >> 1) ^ CRC32C_POLY : reg >> 1;
        }
    }
    PyBuffer_Release(&delta);
    return PyLong_FromUnsignedLong((unsigned long)((uint32_t)crc ^ crc32c_zeros(reg, tail)));
}

/* ------------------------------------------------------------------------------------ */
/* Spare buffers: a DESCRIPTOR's state and owner as one atomic word                      */
/* ------------------------------------------------------------------------------------ */

/* The 8-byte word at ``off`` of ``v``, or NULL (ValueError) when it is outside the
 * buffer or not 8-byte aligned (an atomic operation needs both). */
static uint64_t *
word_at(Py_buffer *v, Py_ssize_t off)
{
    if (off < 0 || off > v->len - 8) {
        PyErr_Format(PyExc_ValueError, "word at %zd outside a %zd-byte buffer", off, v->len);
        return NULL;
    }
    char *p = (char *)v->buf + off;
    if (((uintptr_t)p & 7u) != 0) {
        PyErr_Format(PyExc_ValueError, "word at %zd is not 8-byte aligned", off);
        return NULL;
    }
    return (uint64_t *)p;
}

static PyObject *
claim_words(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    Py_ssize_t base, stride, n, count, start;
    unsigned long long expected, desired;
    if (!PyArg_ParseTuple(args, "w*nnnKKnn:claim_words", &v, &base, &stride, &n, &expected,
                          &desired, &count, &start)) {
        return NULL;
    }
    PyObject *out = NULL;
    if (n < 0 || stride < 8 || count < 0 || start < 0 || (n > 0 && start >= n) ||
        (n > 0 && (base < 0 || base > v.len || (v.len - base - 8) / stride < n - 1))) {
        PyErr_SetString(PyExc_ValueError, "claim_words: words outside the buffer");
        goto done;
    }
    out = PyList_New(0);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < n && PyList_GET_SIZE(out) < count; k++) {
        Py_ssize_t i = (start + k) % n;
        uint64_t *w = word_at(&v, base + i * stride);
        if (w == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        if (__atomic_load_n(w, __ATOMIC_RELAXED) != (uint64_t)expected) {
            continue;
        }
        uint64_t want = (uint64_t)expected;
        if (__atomic_compare_exchange_n(w, &want, (uint64_t)desired, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(out, index) < 0) {
                Py_XDECREF(index);
                Py_CLEAR(out);
                goto done;
            }
            Py_DECREF(index);
        }
    }
done:
    PyBuffer_Release(&v);
    return out;
}

static PyObject *
swap_word(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    Py_ssize_t off;
    unsigned long long expected, desired;
    if (!PyArg_ParseTuple(args, "w*nKK:swap_word", &v, &off, &expected, &desired)) {
        return NULL;
    }
    uint64_t *w = word_at(&v, off);
    if (w == NULL) {
        PyBuffer_Release(&v);
        return NULL;
    }
    uint64_t seen = (uint64_t)expected;
    __atomic_compare_exchange_n(w, &seen, (uint64_t)desired, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(seen);
}

static PyObject *
store_word(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    Py_ssize_t off;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "w*nK:store_word", &v, &off, &value)) {
        return NULL;
    }
    uint64_t *w = word_at(&v, off);
    if (w != NULL) {
        __atomic_store_n(w, (uint64_t)value, __ATOMIC_RELEASE);
    }
    PyBuffer_Release(&v);
    if (w == NULL) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef speedups_methods[] = {
    {"claim_words", claim_words, METH_VARARGS,
     "claim_words(buf, base, stride, n, expected, desired, count, start) -> [index]: "
     "swaps, one by one from index start (wrapping), up to count of the n 8-byte words at "
     "base + index * stride that hold expected to desired, atomically."},
    {"swap_word", swap_word, METH_VARARGS,
     "swap_word(buf, off, expected, desired) -> the word seen: desired was written (a "
     "compare-and-swap) if and only if it equals expected."},
    {"store_word", store_word, METH_VARARGS,
     "store_word(buf, off, value): an atomic 8-byte store (release ordering)."},
    {"staged_lengths", staged_lengths, METH_VARARGS,
     "staged_lengths(values, keys, out[, sizes]): key + value bytes per staged row into "
     "out; each key's and value's length (-1: None) into sizes, two int32 a row."},
    {"plan_batches", plan_batches, METH_VARARGS,
     "plan_batches(values, keys, timestamps, order, ends, budget[, headers[, sizes]]) -> "
     "[(lo, hi, bytes, base_ts, max_ts)]."},
    {"row_places", row_places, METH_VARARGS,
     "row_places(order, counts, row_batch, row_index): each row's batch and index in it."},
    {"stamp_runs", stamp_runs, METH_VARARGS,
     "stamp_runs(timestamps, starts, values) -> runs: a list of timestamps as runs of rows "
     "with one each (int32 starts, int64 values)."},
    {"partition_order", partition_order, METH_VARARGS,
     "partition_order(parts, order) -> (sorted, [(partition, lo, hi)]): rows grouped by "
     "partition, input order kept inside each (order written only when sorted)."},
    {"murmur2_partitions", murmur2_partitions, METH_VARARGS,
     "murmur2_partitions(keys, num_partitions, out): Java's partition of each key (-1: "
     "null) into an int32 buffer."},
    {"header_sections", header_sections, METH_O,
     "header_sections(rows) -> [bytes | None]: each row's encoded headers section (None: "
     "not a common form)."},
    {"crc32c_patch", crc32c_patch, METH_VARARGS,
     "crc32c_patch(crc, delta, tail) -> the CRC-32C after xoring delta into the covered "
     "bytes that are followed by tail unchanged bytes."},
    {"encode_records", encode_records, METH_VARARGS,
     "encode_records(values, keys, timestamps, order, lo, hi, base_ts, out, offset[, "
     "headers]) -> end."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------------ */

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmprod._speedups",
    .m_doc = "The per-record send() path in C (see shmprod.speedups).",
    .m_size = -1,
    .m_methods = speedups_methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&StageCoreType) < 0 || PyType_Ready(&FutureCoreType) < 0 ||
        PyType_Ready(&StagerType) < 0 || PyType_Ready(&SendMethodType) < 0) {
        return NULL;
    }
    static const char *names[6] = {"topic", "value", "key", "headers", "partition",
                                   "timestamp_ms"};
    for (int i = 0; i < 6; i++) {
        send_names[i] = PyUnicode_InternFromString(names[i]);
        if (send_names[i] == NULL) {
            return NULL;
        }
    }
    str_fast = PyUnicode_InternFromString("_fast");
    no_headers = PyBytes_FromStringAndSize("\0", 1);
    no_partition = PyLong_FromLong(-1);
    if (str_fast == NULL || no_headers == NULL || no_partition == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "StageCore", (PyObject *)&StageCoreType) < 0 ||
        PyModule_AddObjectRef(m, "FutureCore", (PyObject *)&FutureCoreType) < 0 ||
        PyModule_AddObjectRef(m, "Stager", (PyObject *)&StagerType) < 0 ||
        PyModule_AddObjectRef(m, "SendMethod", (PyObject *)&SendMethodType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
