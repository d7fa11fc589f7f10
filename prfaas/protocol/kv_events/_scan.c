/* A KV event batch's fields read in one pass, for `events.decode_batch` with packed token
 * ids (see events.py).
 *
 * Why: msgspec reads a `BlockStored`'s token ids as `msgspec.Raw` by skipping the array
 * item by item, about 7 ns an id: 8 us of the 9 us a typical event (18 blocks of 64 ids)
 * took to decode, more than the index then spends hashing those ids. Here skipping an id is
 * one table lookup.
 *
 * `scan_batch` reads only the batches it is sure of, in the shortest forms msgspec writes,
 * and answers None for anything else (another field form, an unknown event, a value out of
 * range, trailing fields or bytes, a batch cut short): events.py then decodes that payload
 * with msgspec, which decodes it or names what is wrong. So the fields it returns are those
 * msgspec would have decoded, and it never raises for a payload's content.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../../common/msgpack_read.h"

/* The events' kinds, their index in the tuple events.py builds them from. */
enum kind { BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED, STATES_STORED, STATES_REMOVED };

static const char *const KIND_NAMES[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared",
                                         "StatesStored", "StatesRemoved"};
#define KINDS 5

/* Bytes an integer takes by its type byte; 0: not an integer. */
static uint8_t INT_BYTES[256];

typedef struct {
    const uint8_t *data;
    Py_ssize_t len;
    Py_ssize_t pos;
} Reader;

/* An array header with at most the bytes left as items (each takes one at least); -1 if
 * none is there. */
static Py_ssize_t read_array(Reader *r) {
    uint64_t count;
    if (mp_array(r->data, r->len, &r->pos, &count) != MP_UNSIGNED ||
        count > (uint64_t)(r->len - r->pos)) {
        return -1;
    }
    return (Py_ssize_t)count;
}

/* A new int of any integer form (msgspec's range: int64 and uint64), or NULL with no
 * exception set if none is there. */
static PyObject *read_int(Reader *r) {
    uint64_t u;
    int64_t s;
    switch (mp_int(r->data, r->len, &r->pos, &u, &s)) {
    case MP_UNSIGNED:
        return PyLong_FromUnsignedLongLong(u);
    case MP_SIGNED:
        return PyLong_FromLongLong(s);
    default:
        return NULL;
    }
}

/* A new int, or None for nil; NULL as `read_int`. */
static PyObject *read_optional_int(Reader *r) {
    if (r->pos < r->len && r->data[r->pos] == 0xc0) {
        r->pos++;
        Py_RETURN_NONE;
    }
    return read_int(r);
}

/* A tuple of the integers in an array; NULL as `read_int`. */
static PyObject *read_int_tuple(Reader *r) {
    Py_ssize_t n = read_array(r);
    if (n < 0) {
        return NULL;
    }
    PyObject *items = PyTuple_New(n);
    if (items == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = read_int(r);
        if (item == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        PyTuple_SET_ITEM(items, i, item);
    }
    return items;
}

/* Past an array of integers: 0, or -1 if that is not what is there. */
static int skip_int_array(Reader *r) {
    Py_ssize_t n = read_array(r);
    if (n < 0) {
        return -1;
    }
    const uint8_t *data = r->data;
    Py_ssize_t pos = r->pos, len = r->len;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pos >= len) {
            return -1;
        }
        uint8_t width = INT_BYTES[data[pos]];
        if (width == 0) {
            return -1;
        }
        pos += width;
    }
    if (pos > len) {
        return -1;
    }
    r->pos = pos;
    return 0;
}

/* The event kind whose name (a fixstr or str 8) is there; -1 if none is. */
static int read_kind(Reader *r) {
    if (r->pos >= r->len) {
        return -1;
    }
    uint8_t type = r->data[r->pos];
    Py_ssize_t n, at;
    if ((type & 0xe0) == 0xa0) { /* fixstr */
        n = type & 0x1f;
        at = r->pos + 1;
    } else if (type == 0xd9 && r->len - r->pos >= 2) { /* str 8 */
        n = r->data[r->pos + 1];
        at = r->pos + 2;
    } else {
        return -1;
    }
    if (r->len - at < n) {
        return -1;
    }
    for (int kind = 0; kind < KINDS; kind++) {
        if ((size_t)n == strlen(KIND_NAMES[kind]) && memcmp(r->data + at, KIND_NAMES[kind], n) == 0) {
            r->pos = at + n;
            return kind;
        }
    }
    return -1;
}

/* A float 64 or float 32 as a new float; NULL (no exception) if neither is there. */
static PyObject *read_float(Reader *r) {
    if (r->pos >= r->len) {
        return NULL;
    }
    uint8_t type = r->data[r->pos];
    if (type == 0xcb && r->len - r->pos >= 9) {
        uint64_t bits = mp_get_be(r->data + r->pos + 1, 8);
        double value;
        memcpy(&value, &bits, sizeof value);
        r->pos += 9;
        return PyFloat_FromDouble(value);
    }
    if (type == 0xca && r->len - r->pos >= 5) {
        uint32_t bits = (uint32_t)mp_get_be(r->data + r->pos + 1, 4);
        float value;
        memcpy(&value, &bits, sizeof value);
        r->pos += 5;
        return PyFloat_FromDouble(value);
    }
    return NULL;
}

/* A `BlockStored`'s fields after its name (`fields` of them in all, the name counted):
 * (kind, hashes, parent, ids start, ids end, block size, lora id); NULL as `read_int`. */
static PyObject *read_stored(Reader *r, Py_ssize_t fields) {
    if (fields != 5 && fields != 6) {
        return NULL;
    }
    PyObject *hashes = NULL, *parent = NULL, *size = NULL, *lora = NULL;
    hashes = read_int_tuple(r);
    if (hashes == NULL || (parent = read_optional_int(r)) == NULL) {
        goto fail;
    }
    Py_ssize_t start = r->pos;
    if (skip_int_array(r) < 0) {
        goto fail;
    }
    Py_ssize_t end = r->pos;
    uint64_t u;
    int64_t s;
    int form = mp_int(r->data, r->len, &r->pos, &u, &s);
    if (!((form == MP_UNSIGNED && u > 0 && u <= INT64_MAX) || (form == MP_SIGNED && s > 0))) {
        goto fail; /* msgspec's check: a positive block size */
    }
    size = PyLong_FromLongLong(form == MP_UNSIGNED ? (long long)u : (long long)s);
    if (size == NULL) {
        goto fail;
    }
    if (fields == 6) {
        lora = read_optional_int(r);
    } else {
        lora = Py_NewRef(Py_None);
    }
    if (lora == NULL) {
        goto fail;
    }
    return Py_BuildValue("(iNNnnNN)", BLOCK_STORED, hashes, parent, start, end, size, lora);

fail:
    Py_XDECREF(hashes);
    Py_XDECREF(parent);
    Py_XDECREF(size);
    Py_XDECREF(lora);
    return NULL;
}

/* One event as events.py builds it: (kind, *fields); NULL as `read_int`. */
static PyObject *read_event(Reader *r) {
    Py_ssize_t fields = read_array(r);
    int kind = fields >= 1 ? read_kind(r) : -1;
    switch (kind) {
    case BLOCK_STORED:
        return read_stored(r, fields);
    case ALL_BLOCKS_CLEARED:
        return fields == 1 ? Py_BuildValue("(i)", kind) : NULL;
    case BLOCK_REMOVED:
    case STATES_STORED:
    case STATES_REMOVED:
        if (fields == 2) {
            PyObject *hashes = read_int_tuple(r);
            return hashes == NULL ? NULL : Py_BuildValue("(iN)", kind, hashes);
        }
        return NULL;
    default:
        return NULL;
    }
}

PyDoc_STRVAR(scan_batch_doc,
"scan_batch(payload, /) -> tuple[float, list[tuple], int | None] | None\n\n"
"A KV event batch's fields: (ts, events, attn_dp_rank), each event (kind, *fields), a\n"
"`BlockStored`'s token ids as the (start, end) of their bytes in `payload`; None where the\n"
"payload is not a batch in the forms read here (decode it with msgspec then).");

static PyObject *scan_batch(PyObject *module, PyObject *payload) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Reader r = {view.buf, view.len, 0};
    PyObject *ts = NULL, *events = NULL, *rank = NULL, *result = NULL;
    Py_ssize_t fields = read_array(&r);
    if ((fields != 2 && fields != 3) || (ts = read_float(&r)) == NULL) {
        goto done;
    }
    Py_ssize_t n = read_array(&r);
    if (n < 0 || (events = PyList_New(n)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = read_event(&r);
        if (event == NULL) {
            goto done;
        }
        PyList_SET_ITEM(events, i, event);
    }
    rank = fields == 3 ? read_optional_int(&r) : Py_NewRef(Py_None);
    if (rank == NULL || r.pos != r.len) {
        goto done;
    }
    result = PyTuple_Pack(3, ts, events, rank);

done:
    Py_XDECREF(ts);
    Py_XDECREF(events);
    Py_XDECREF(rank);
    PyBuffer_Release(&view);
    if (result == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE; /* not a batch read here: msgspec decodes it */
    }
    return result;
}

static PyMethodDef methods[] = {
    {"scan_batch", scan_batch, METH_O, scan_batch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prfaas.protocol.kv_events._scan",
    .m_doc = "A KV event batch's fields read in one pass (see prfaas.protocol.kv_events.events).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__scan(void) {
    for (int type = 0; type < 256; type++) {
        INT_BYTES[type] = 0;
    }
    for (int type = 0x00; type <= 0x7f; type++) {
        INT_BYTES[type] = 1; /* positive fixint */
    }
    for (int type = 0xe0; type <= 0xff; type++) {
        INT_BYTES[type] = 1; /* negative fixint */
    }
    for (int w = 0; w < 4; w++) {
        INT_BYTES[0xcc + w] = (uint8_t)(1 + (1 << w)); /* uint 8-64 */
        INT_BYTES[0xd0 + w] = (uint8_t)(1 + (1 << w)); /* int 8-64 */
    }
    return PyModule_Create(&module);
}
