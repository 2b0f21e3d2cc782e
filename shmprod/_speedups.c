/*
 * shmprod._speedups: the per-record send() path in C.
 *
 * Three types, each with a pure-Python twin in shmprod/speedups.py that behaves the
 * same (the tests run both):
 *
 *   StageCore   the fields of a Stage that send() touches: the three row lists (values,
 *               keys, timestamps), the row count n, the staged bytes nbytes, the flush
 *               limit and the plain flag. shmprod.worker.staging.Stage subclasses it.
 *   FutureCore  a RecordFuture's stage and row. shmprod.futures.RecordFuture
 *               subclasses it.
 *   Stager      the common case of Worker.send(): bytes or None key and value, no
 *               headers, no explicit partition, the topic's one stage has room. It
 *               appends the row under the Worker's state lock and returns the record's
 *               future, or returns None (nothing staged) so that the Python path
 *               handles the record.
 *
 * Why (measured, ARCHITECTURE.md "The per-record path"): the same steps in Python cost
 * about 1.1 us of the caller's CPU per record; here they cost about a quarter of that,
 * most of it the lock's two method calls and the Python frame of send() around it.
 *
 * Runs in: worker (the thread that calls send()). Holds the GIL throughout; the lock is
 * the Worker's state lock, taken and released through its own methods.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
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
    char plain;           /* no row has headers or an explicit partition */
} StageCore;

static int
stage_traverse(StageCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->values);
    Py_VISIT(self->keys);
    Py_VISIT(self->timestamps);
    return 0;
}

static int
stage_clear(StageCore *self)
{
    Py_CLEAR(self->values);
    Py_CLEAR(self->keys);
    Py_CLEAR(self->timestamps);
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
        self->plain = 1;
        self->limit = (long long)1 << 62;
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
    {"plain", T_BOOL, offsetof(StageCore, plain), 0, "no headers, no explicit partition"},
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
    PyObject *acquire;  /* the Worker's state lock: bound acquire and release */
    PyObject *release;
    PyTypeObject *future_type; /* RecordFuture (a FutureCore subclass) */
    Py_ssize_t records_room;   /* batch_size - batch header */
    Py_ssize_t max_request_size;
    Py_ssize_t header_size;    /* a batch's header */
    Py_ssize_t overhead_max;   /* a record's largest varint overhead */
    Py_ssize_t staged_overhead;
} Stager;

static int
stager_traverse(Stager *self, visitproc visit, void *arg)
{
    Py_VISIT(self->stages);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->future_type);
    return 0;
}

static int
stager_clear(Stager *self)
{
    Py_CLEAR(self->stages);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->future_type);
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
static PyObject *
stager_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Stager *self = (Stager *)self_;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 6 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "Stager takes (topic, value, key, headers, partition, timestamp_ms)");
        return NULL;
    }
    PyObject *topic = args[0], *value = args[1], *key = args[2];
    PyObject *headers = args[3], *partition = args[4], *ts_arg = args[5];
    if (headers != Py_None || partition != Py_None || !PyUnicode_CheckExact(topic)) {
        Py_RETURN_NONE;
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
    Py_ssize_t bound = klen + vlen + 1 + self->overhead_max;
    if (bound > self->records_room || bound + self->header_size > self->max_request_size) {
        Py_RETURN_NONE; /* too large: the Python path raises its error */
    }
    Py_ssize_t size = klen + vlen + 1 + self->staged_overhead;

    PyObject *ts;
    if (ts_arg == Py_None) {
        struct timespec now;
        if (clock_gettime(CLOCK_REALTIME, &now) != 0) {
            Py_RETURN_NONE;
        }
        ts = PyLong_FromLongLong((long long)now.tv_sec * 1000LL + now.tv_nsec / 1000000);
        if (ts == NULL) {
            return NULL;
        }
    }
    else if (PyLong_CheckExact(ts_arg)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(ts_arg, &overflow);
        if (overflow != 0 || v < 0) {
            Py_RETURN_NONE; /* out of range: the Python path raises */
        }
        Py_INCREF(ts_arg);
        ts = ts_arg;
    }
    else {
        Py_RETURN_NONE;
    }

    PyObject *r = PyObject_CallNoArgs(self->acquire);
    if (r == NULL) {
        Py_DECREF(ts);
        return NULL;
    }
    Py_DECREF(r);

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
    if (!st->plain || (long long)(st->nbytes + size) > st->limit || st->values == NULL ||
        st->keys == NULL || st->timestamps == NULL || !PyList_CheckExact(st->values) ||
        !PyList_CheckExact(st->keys) || !PyList_CheckExact(st->timestamps)) {
        result = Py_NewRef(Py_None); /* full, or not plain: the Python path */
        goto done;
    }
    FutureCore *fut = (FutureCore *)self->future_type->tp_alloc(self->future_type, 0);
    if (fut == NULL) {
        goto done;
    }
    fut->stage = Py_NewRef(item);
    fut->row = st->n;
    if (PyList_Append(st->values, value) < 0) {
        Py_DECREF(fut);
        goto done;
    }
    if (PyList_Append(st->keys, key) < 0) {
        drop_last(st->values);
        Py_DECREF(fut);
        goto done;
    }
    if (PyList_Append(st->timestamps, ts) < 0) {
        drop_last(st->values);
        drop_last(st->keys);
        Py_DECREF(fut);
        goto done;
    }
    st->n += 1;
    st->nbytes += size;
    result = (PyObject *)fut;
done:
    Py_DECREF(ts);
    if (unlock(self) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *
stager_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stages", "lock", "future_type", "records_room",
                             "max_request_size", "header_size", "overhead_max",
                             "staged_overhead", NULL};
    PyObject *stages, *lock, *future_type;
    Py_ssize_t records_room, max_request_size, header_size, overhead_max, staged_overhead;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!nnnnn:Stager", kwlist, &PyDict_Type,
                                     &stages, &lock, &PyType_Type, &future_type,
                                     &records_room, &max_request_size, &header_size,
                                     &overhead_max, &staged_overhead)) {
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
    Stager *self = (Stager *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(acquire);
        Py_DECREF(release);
        return NULL;
    }
    self->vectorcall = stager_call;
    self->stages = Py_NewRef(stages);
    self->acquire = acquire;
    self->release = release;
    self->future_type = (PyTypeObject *)Py_NewRef(future_type);
    self->records_room = records_room;
    self->max_request_size = max_request_size;
    self->header_size = header_size;
    self->overhead_max = overhead_max;
    self->staged_overhead = staged_overhead;
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
              "header_size, overhead_max, staged_overhead): send()'s common case.",
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

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmprod._speedups",
    .m_doc = "The per-record send() path in C (see shmprod.speedups).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&StageCoreType) < 0 || PyType_Ready(&FutureCoreType) < 0 ||
        PyType_Ready(&StagerType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "StageCore", (PyObject *)&StageCoreType) < 0 ||
        PyModule_AddObjectRef(m, "FutureCore", (PyObject *)&FutureCoreType) < 0 ||
        PyModule_AddObjectRef(m, "Stager", (PyObject *)&StagerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
