/*
 * slipstream._fastpath: the per-message calls as plain CPython functions (METH_FASTCALL), in
 * the limited API of CPython 3.11 (setup.py defines Py_LIMITED_API): one build, the abi3 one,
 * loads in every CPython from 3.11 on.
 *
 * cffi is the binding for everything else, but on these machines each cffi argument
 * conversion costs ~40-50 ns, which is most of a 32-byte offer.  These functions take
 * their arguments as raw objects instead:
 *   Offerer(appender_address, owner, spins_before_yield=-1, on_refused=None, *, yield_ns=0,
 *   park_ns=0).offer(message, reserved_value=0) -> position or negative code (ss_offer; ss_offer_rv
 *   for a reserved value other than 0), with the client's idle strategy (on_offer_result), or
 *   what on_refused(message, code, reserved_value) returns for a refused offer (a
 *   publication's policy).  offer(message) alone parses nothing more.  The bound method
 *   `offer` is the publication's offer: CPython calls a METH_FASTCALL|METH_KEYWORDS builtin
 *   method straight from the interpreter, as fast as a vectorcall type's instance.
 *   dispatch(handler, header, term, starts_address, ends_address, count) -> count
 *   payload_buffer(starts_address, ends_address, count) -> a bytearray as long as the
 *   scanned messages' payloads, not zeroed: Image.poll_gathered's copy fills all of it.
 *   controlled_dispatch(handler, header, term, starts_address, ends_address, first, count,
 *   go_on, gone_address) -> (index, result): dispatch's loop for a controlled poll, from
 *   message `first`, while the handler returns `go_on` (ControlledPollAction.CONTINUE, by
 *   identity) and the image's gone flag (a uint8_t at gone_address, which closing its
 *   subscription sets) is 0; it stops at the first message whose handler returns anything
 *   else, returning its index and what the handler returned, or (index, go_on) before
 *   delivering message `index` once the flag is set, (count, go_on) when every one went on.
 * The appender and the scan arrays are the cffi-owned structures of native.h, passed by
 * address; Python keeps them alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stddef.h>

#include "native.h"

static PyObject *payload_name; /* interned "_payload": the Header flyweight's slot */
static PyObject *reserved_value_name; /* interned "reserved_value": offer()'s keyword */
static PyObject *failed_index; /* set by dispatch when the handler raised */

/* Py_XSETREF, which the limited API does not have. */
#define SET_REFERENCE(target, value)                                                       \
    do {                                                                                   \
        PyObject *previous_ = (PyObject *)(target);                                        \
        (target) = (value);                                                                \
        Py_XDECREF(previous_);                                                             \
    } while (0)

static PyObject *message_too_long; /* slipstream.client.errors.MessageTooLongError */
static PyObject *invalid_argument; /* slipstream.client.errors.InvalidArgumentError */

/* An offer() bound to one publication's appender: calling it is the whole per-message cost. */
typedef struct {
    PyObject_HEAD
    ss_appender_t *appender;
    PyObject *owner; /* keeps the appender's memory (a cffi object) alive */
    PyObject *on_refused; /* NULL, or the policy's hook for a refused offer (then no idling) */
    int32_t spins_before_yield; /* < 0: never idle */
    int64_t yield_ns;           /* the first wait of an idle spell yields this long, then parks */
    int64_t park_ns;            /* the longest park of one offer; 0: sched_yield instead */
    long long yields;           /* how many offers gave the CPU up (read-only: .yields) */
} Offerer;

/* The client's idle strategy counts per thread (client/idle.py): the calls in a row of this
 * thread that did nothing, offers without credit and polls that moved nothing alike, so that
 * a loop serving several streams waits only when none of them had work (as an agent's duty
 * cycle idles).  Capped at the spins + 1. */
static _Thread_local int32_t thread_misses;

/* One more call of this thread that did nothing: 0 spin on, 1 the spell's first wait (yield,
 * then park), 2 park at once. */
static inline int idle_miss(int32_t spins) {
    int32_t misses = thread_misses;
    if (misses < spins) {
        thread_misses = misses + 1;
        return 0;
    }
    if (misses == spins) {
        thread_misses = misses + 1;
        return 1;
    }
    return 2;
}

/* The idle strategy for an offer that retries at once: past spins_before_yield calls of this
 * thread in a row that did nothing, an offer without credit waits for it with the GIL
 * released, yielding between looks for yield_ns at the spell's start and then parking on the
 * log's publisher eventcount (which the driver bumps as it moves the limit or connects the
 * stream) for at most park_ns.  A parked publisher takes no CPU: on a machine with fewer cores
 * than busy threads the driver that raises the limit gets to run.  park_ns 0 (an embedded
 * driver's client, whose own thread moves the limit) yields instead.  A success resets the
 * thread's count. */
static inline __attribute__((always_inline)) void on_offer_result(Offerer *offerer,
                                                                   int64_t result) {
    if (result > 0) {
        thread_misses = 0;
    } else if ((result == SS_BACK_PRESSURED || result == SS_NOT_CONNECTED) &&
               offerer->spins_before_yield >= 0) {
        int phase = idle_miss(offerer->spins_before_yield);
        if (phase != 0) {
            const ss_appender_t *appender = offerer->appender;
            int64_t yield_ns = phase == 1 ? offerer->yield_ns : 0, park_ns = offerer->park_ns;
            offerer->yields++;
            Py_BEGIN_ALLOW_THREADS
            if (park_ns > 0) (void)ss_await_credit(appender, 0, yield_ns, park_ns);
            else sched_yield();
            Py_END_ALLOW_THREADS
        }
    }
}

/* InvalidArgumentError(field, problem), raised. */
static void invalid_argument_error(const char *field, PyObject *problem) {
    if (problem == NULL) return;
    PyObject *error = PyObject_CallFunction(invalid_argument, "sO", field, problem);
    Py_DECREF(problem);
    if (error != NULL) {
        PyErr_SetObject(invalid_argument, error);
        Py_DECREF(error);
    }
}

/* The cold path of offer(): anything but offer(message).  The reserved value, positional or
 * by keyword, into *reserved_value; -1 with an exception set when the call is not
 * offer(message, reserved_value=0). */
static int offer_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                           int64_t *reserved_value) {
    Py_ssize_t keywords = kwnames == NULL ? 0 : PyTuple_Size(kwnames);
    PyObject *value = nargs == 2 ? args[1] : NULL;
    if (nargs < 1 || nargs > 2) goto usage;
    for (Py_ssize_t i = 0; i < keywords; i++) {
        PyObject *name = PyTuple_GetItem(kwnames, i);
        if (name == NULL) return -1;
        /* A keyword in the caller's code is interned: the same object, mostly. */
        if (name != reserved_value_name &&
            PyUnicode_Compare(name, reserved_value_name) != 0) {
            if (PyErr_Occurred()) return -1;
            PyErr_Format(PyExc_TypeError, "offer() got an unexpected keyword argument %R: it "
                         "takes offer(message, reserved_value=0)", name);
            return -1;
        }
        if (value != NULL) {
            PyErr_SetString(PyExc_TypeError, "offer() got reserved_value twice");
            return -1;
        }
        value = args[nargs + i];
    }
    if (value == NULL) return 0;
    int overflow = 0;
    long long converted;
    if (PyLong_CheckExact(value)) {
        converted = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow == 0) {
            *reserved_value = converted; /* -1 too: an exact int cannot fail otherwise */
            return 0;
        }
        goto out_of_range;
    }
    if (!PyIndex_Check(value) || PyBool_Check(value)) {
        invalid_argument_error("reserved_value", PyUnicode_FromFormat(
            "%R is not an int64 (a signed 64-bit integer)", value));
        return -1;
    }
    PyObject *number = PyNumber_Index(value);
    if (number == NULL) return -1;
    converted = PyLong_AsLongLongAndOverflow(number, &overflow);
    Py_DECREF(number);
    if (overflow != 0) goto out_of_range;
    if (converted == -1 && PyErr_Occurred()) return -1;
    *reserved_value = converted;
    return 0;
out_of_range:
    invalid_argument_error("reserved_value", PyUnicode_FromFormat(
        "%R is outside the int64 range [-2**63, 2**63 - 1]", value));
    return -1;
usage:
    PyErr_SetString(PyExc_TypeError, "offer(message, reserved_value=0) takes one or two "
                                     "positional arguments");
    return -1;
}

/* One offer of `message` with `reserved_value`: offer()'s body, inlined in offerer_offer with
 * reserved_value 0, so that the common call, offer(message), is ss_offer as it always was, and
 * in offer_with_value. */
static inline __attribute__((always_inline)) PyObject *
offer_one(Offerer *offerer, PyObject *message, int64_t reserved_value) {
    int64_t result;
    Py_ssize_t length;
    if (PyBytes_CheckExact(message)) {
        char *data;
        if (PyBytes_AsStringAndSize(message, &data, &length) < 0) return NULL;
        result = length > INT32_MAX ? SS_INVALID_LENGTH
               : reserved_value == 0 ? ss_offer(offerer->appender, data, (int32_t)length)
               : ss_offer_rv(offerer->appender, data, (int32_t)length, reserved_value);
    } else {
        Py_buffer view;
        if (PyObject_GetBuffer(message, &view, PyBUF_SIMPLE) < 0) return NULL;
        length = view.len;
        result = length > INT32_MAX ? SS_INVALID_LENGTH
               : reserved_value == 0 ? ss_offer(offerer->appender, (const char *)view.buf,
                                                (int32_t)length)
               : ss_offer_rv(offerer->appender, (const char *)view.buf, (int32_t)length,
                             reserved_value);
        PyBuffer_Release(&view);
    }
    if (result == SS_INVALID_LENGTH) {
        PyObject *error = PyObject_CallFunction(message_too_long, "ni", length,
                                                offerer->appender->max_message_length);
        if (error != NULL) {
            PyErr_SetObject(message_too_long, error);
            Py_DECREF(error);
        }
        return NULL;
    }
    if (result < 0 && offerer->on_refused != NULL) {
        PyObject *code = PyLong_FromLongLong(result);
        if (code == NULL) return NULL;
        PyObject *value = PyLong_FromLongLong(reserved_value);
        if (value == NULL) {
            Py_DECREF(code);
            return NULL;
        }
        PyObject *settled = PyObject_CallFunctionObjArgs(offerer->on_refused, message, code,
                                                         value, NULL);
        Py_DECREF(code);
        Py_DECREF(value);
        return settled;
    }
    on_offer_result(offerer, result);
    return PyLong_FromLongLong(result);
}

/* offer(message, reserved_value) and the other calls but offer(message): out of line, so that
 * the common call's code stays as small as it was. */
static __attribute__((noinline, cold)) PyObject *
offer_with_value(Offerer *offerer, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int64_t reserved_value = 0;
    if (offer_arguments(args, nargs, kwnames, &reserved_value) < 0) return NULL;
    return offer_one(offerer, args[0], reserved_value);
}

static PyObject *offerer_offer(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    Offerer *offerer = (Offerer *)self;
    if (__builtin_expect(nargs != 1 || kwnames != NULL, 0))
        return offer_with_value(offerer, args, nargs, kwnames);
    return offer_one(offerer, args[0], 0);
}

static PyObject *offerer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *address, *owner, *on_refused = Py_None;
    int spins_before_yield = -1;
    long long yield_ns = 0, park_ns = 0;
    static char *keywords[] = {"appender_address", "owner", "spins_before_yield", "on_refused",
                               "yield_ns", "park_ns", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|iO$LL", keywords, &address, &owner,
                                     &spins_before_yield, &on_refused, &yield_ns, &park_ns))
        return NULL;
    if (yield_ns < 0 || park_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "yield_ns and park_ns must be >= 0");
        return NULL;
    }
    if (on_refused != Py_None && !PyCallable_Check(on_refused)) {
        PyErr_SetString(PyExc_TypeError, "on_refused must be callable or None");
        return NULL;
    }
    if (message_too_long == NULL || invalid_argument == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "call set_errors() first");
        return NULL;
    }
    void *appender = PyLong_AsVoidPtr(address);
    if (appender == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null appender");
        return NULL;
    }
    Offerer *self = (Offerer *)PyType_GenericAlloc(type, 0);
    if (self == NULL) return NULL;
    self->appender = appender;
    self->owner = Py_NewRef(owner);
    self->on_refused = on_refused == Py_None ? NULL : Py_NewRef(on_refused);
    self->spins_before_yield = spins_before_yield;
    self->yield_ns = yield_ns;
    self->park_ns = park_ns;
    self->yields = 0;
    return (PyObject *)self;
}

static int offerer_traverse(Offerer *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE((PyObject *)self)); /* a heap type: its instances hold a reference to it */
    Py_VISIT(self->owner);
    Py_VISIT(self->on_refused);
    return 0;
}

static int offerer_clear(Offerer *self) {
    Py_CLEAR(self->owner);
    Py_CLEAR(self->on_refused);
    return 0;
}

static void offerer_dealloc(Offerer *self) {
    PyTypeObject *type = Py_TYPE((PyObject *)self);
    PyObject_GC_UnTrack(self);
    offerer_clear(self);
    ((freefunc)PyType_GetSlot(type, Py_tp_free))(self);
    Py_DECREF(type);
}

static PyObject *offerer_yields(Offerer *self, void *unused) {
    (void)unused;
    return PyLong_FromLongLong(self->yields);
}

static PyMethodDef offerer_methods[] = {
    {"offer", (PyCFunction)(void (*)(void))offerer_offer, METH_FASTCALL | METH_KEYWORDS,
     "offer(message, reserved_value=0) -> position or negative code"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef offerer_getset[] = {
    {"yields", (getter)offerer_yields, NULL,
     "how many offers gave the CPU up, waiting or yielding (the idle strategy)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot offerer_slots[] = {
    {Py_tp_doc, "Offerer(appender_address, owner, spins_before_yield=-1, on_refused=None, *, "
                "yield_ns=0, park_ns=0).offer(message, reserved_value=0) -> position or "
                "negative code"},
    {Py_tp_traverse, offerer_traverse},
    {Py_tp_clear, offerer_clear},
    {Py_tp_new, offerer_new},
    {Py_tp_dealloc, offerer_dealloc},
    {Py_tp_methods, offerer_methods},
    {Py_tp_getset, offerer_getset},
    {0, NULL},
};

static PyType_Spec offerer_spec = {
    .name = "slipstream.client._fastpath.Offerer",
    .basicsize = sizeof(Offerer),
    /* Immutable, as a static type is: setting Offerer.offer cannot change every publication's. */
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = offerer_slots,
};

static PyObject *fast_set_errors(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "set_errors(MessageTooLongError, InvalidArgumentError)");
        return NULL;
    }
    SET_REFERENCE(message_too_long, Py_NewRef(args[0]));
    SET_REFERENCE(invalid_argument, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* The handler's arguments, (data, header): one tuple serves a dispatch's messages, so that a
 * call allocates none (the limited API of 3.11 has no vectorcall; PyObject_Call passes a
 * tuple's items to the handler's vectorcall as they are).  A new one, with `header` in place;
 * NULL with the exception set. */
static PyObject *handler_arguments(PyObject *header) {
    PyObject *arguments = PyTuple_New(2);
    if (arguments != NULL && PyTuple_SetItem(arguments, 1, Py_NewRef(header)) < 0) {
        Py_DECREF(arguments);
        return NULL;
    }
    return arguments;
}

/* One message to the handler: the slice of the term and the header pointed at it, through
 * `*arguments` (handler_arguments; replaced by a new one when the handler kept a reference to
 * it, since a tuple others hold cannot change).  What the handler returned (a new reference),
 * or NULL with the exception set. */
static inline __attribute__((always_inline)) PyObject *deliver(PyObject *handler,
                                                              PyObject *header, PyObject *term,
                                                              int32_t start, int32_t end,
                                                              PyObject **arguments) {
    /* A slice of the term's memoryview: it pins the mapping for as long as anyone holds it,
     * so a handler that keeps a view by mistake reads stale data, never freed memory. */
    PyObject *data = PySequence_GetSlice(term, start, end);
    if (data == NULL) return NULL;
    PyObject *payload = PyLong_FromLong(start);
    if (payload == NULL || PyObject_SetAttr(header, payload_name, payload) < 0) {
        Py_XDECREF(payload);
        Py_DECREF(data);
        return NULL;
    }
    Py_DECREF(payload);
    if (Py_REFCNT(*arguments) != 1) {
        Py_DECREF(*arguments);
        *arguments = handler_arguments(header);
        if (*arguments == NULL) {
            Py_DECREF(data);
            return NULL;
        }
    }
    /* The tuple takes data, and lets the previous message's go. */
    if (PyTuple_SetItem(*arguments, 0, data) < 0) return NULL;
    return PyObject_Call(handler, *arguments, NULL);
}

static PyObject *fast_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "dispatch(handler, header, term, starts_address, ends_address, count)");
        return NULL;
    }
    PyObject *handler = args[0], *header = args[1], *term = args[2];
    const int32_t *starts = (const int32_t *)PyLong_AsVoidPtr(args[3]);
    const int32_t *ends = (const int32_t *)PyLong_AsVoidPtr(args[4]);
    Py_ssize_t count = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    PyObject *arguments = handler_arguments(header);
    if (arguments == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *result = deliver(handler, header, term, starts[i], ends[i], &arguments);
        if (result == NULL) {
            /* The caller reads the index of the message that failed (it counts as consumed). */
            SET_REFERENCE(failed_index, PyLong_FromSsize_t(i));
            Py_XDECREF(arguments);
            return NULL;
        }
        Py_DECREF(result);
    }
    Py_DECREF(arguments);
    return PyLong_FromSsize_t(count);
}

static PyObject *fast_controlled_dispatch(PyObject *module, PyObject *const *args,
                                          Py_ssize_t nargs) {
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "controlled_dispatch(handler, header, term, starts_address, "
                        "ends_address, first, count, go_on, gone_address)");
        return NULL;
    }
    PyObject *handler = args[0], *header = args[1], *term = args[2], *go_on = args[7];
    const int32_t *starts = (const int32_t *)PyLong_AsVoidPtr(args[3]);
    const int32_t *ends = (const int32_t *)PyLong_AsVoidPtr(args[4]);
    Py_ssize_t first = PyLong_AsSsize_t(args[5]);
    Py_ssize_t count = PyLong_AsSsize_t(args[6]);
    /* Set (under the GIL) by whoever closes the subscription or removes the image, a handler
     * included: re-read before each message, since each handler call may have set it. */
    const volatile uint8_t *gone = (const volatile uint8_t *)PyLong_AsVoidPtr(args[8]);
    if (PyErr_Occurred()) return NULL;
    PyObject *arguments = handler_arguments(header);
    if (arguments == NULL) return NULL;
    Py_ssize_t i = first;
    PyObject *result = go_on, *outcome;
    for (; i < count && !*gone; i++) { /* read no further once gone */
        result = deliver(handler, header, term, starts[i], ends[i], &arguments);
        if (result == NULL) {
            SET_REFERENCE(failed_index, PyLong_FromSsize_t(i)); /* as dispatch */
            Py_XDECREF(arguments);
            return NULL;
        }
        if (result != go_on) break;
        Py_DECREF(result);
    }
    Py_DECREF(arguments);
    if (i < count && result != go_on) /* N: the tuple takes the reference */
        outcome = Py_BuildValue("(nN)", i, result);
    else
        outcome = Py_BuildValue("(nO)", i, go_on);
    return outcome;
}

static PyObject *fast_payload_buffer(PyObject *module, PyObject *const *args,
                                     Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "payload_buffer(starts_address, ends_address, count)");
        return NULL;
    }
    const int32_t *starts = (const int32_t *)PyLong_AsVoidPtr(args[0]);
    const int32_t *ends = (const int32_t *)PyLong_AsVoidPtr(args[1]);
    Py_ssize_t count = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    /* The bounds come from a scan of another process's log: a negative length counts as
     * nothing here (ss_gather_messages refuses it), and the sum of lengths of frames that
     * do not overlap within one term stays below 2^31. */
    int64_t size = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t length = (int64_t)ends[i] - (int64_t)starts[i];
        if (length > 0) size += length;
    }
    if (size > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "payload_buffer: the messages exceed 2 GiB");
        return NULL;
    }
    /* Not zeroed (bytearray(n) is): the gather writes every byte of it. */
    return PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)size);
}

static PyObject *fast_idle_miss(PyObject *module, PyObject *spins) {
    (void)module;
    long value = PyLong_AsLong(spins);
    if (value == -1 && PyErr_Occurred()) return NULL;
    if (value < 0 || value > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "idle_miss(spins): spins in 0..2**31-1");
        return NULL;
    }
    return PyLong_FromLong(idle_miss((int32_t)value));
}

static PyObject *fast_idle_progress(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    thread_misses = 0;
    Py_RETURN_NONE;
}

static PyObject *fast_failed_index(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    /* NULL only when the index of a failed dispatch could not be made (no memory). */
    return failed_index != NULL ? Py_NewRef(failed_index) : PyLong_FromLong(-1);
}

static PyMethodDef methods[] = {
    {"set_errors", (PyCFunction)(void (*)(void))fast_set_errors, METH_FASTCALL,
     "set_errors(MessageTooLongError, InvalidArgumentError): the exceptions an oversized offer "
     "and a bad reserved_value raise"},
    {"dispatch", (PyCFunction)(void (*)(void))fast_dispatch, METH_FASTCALL,
     "dispatch(handler, header, term, starts_address, ends_address, count) -> count"},
    {"controlled_dispatch", (PyCFunction)(void (*)(void))fast_controlled_dispatch,
     METH_FASTCALL,
     "controlled_dispatch(handler, header, term, starts_address, ends_address, first, count, "
     "go_on, gone_address) -> (index, result)"},
    {"payload_buffer", (PyCFunction)(void (*)(void))fast_payload_buffer, METH_FASTCALL,
     "payload_buffer(starts_address, ends_address, count) -> bytearray: as long as the "
     "messages' payloads together (ends[i] - starts[i]), not zeroed: for a gather to fill"},
    {"idle_miss", fast_idle_miss, METH_O,
     "idle_miss(spins) -> 0, 1 or 2: one more call of this thread that did nothing: spin on, "
     "the idle spell's first wait (yield, then park), or park at once"},
    {"idle_progress", fast_idle_progress, METH_NOARGS,
     "a call of this thread did something: its idle count starts again"},
    {"failed_index", fast_failed_index, METH_NOARGS,
     "index of the message whose handler raised in the last failed (controlled) dispatch"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_fastpath",
                                        "Per-message hot calls of slipstream.client.", -1,
                                        methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fastpath(void) {
    payload_name = PyUnicode_InternFromString("_payload");
    reserved_value_name = PyUnicode_InternFromString("reserved_value");
    failed_index = PyLong_FromLong(-1);
    if (payload_name == NULL || reserved_value_name == NULL || failed_index == NULL) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    PyObject *offerer_type = PyType_FromSpec(&offerer_spec);
    if (offerer_type == NULL || PyModule_AddObjectRef(module, "Offerer", offerer_type) < 0) {
        Py_XDECREF(offerer_type);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(offerer_type);
    return module;
}
