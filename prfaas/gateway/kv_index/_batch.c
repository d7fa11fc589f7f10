/* A flush's per-key loops over a batch, in C: `batch.py`'s `group_numpy`,
 * `salted_keys_numpy` and `chain_stores_python`.
 *
 * Why in C: a flush groups its batch's keys three times (translations, blocks, holder-set
 * changes) and salts its engine hashes twice (parents, then every block); in numpy that is
 * a sort-based `np.unique` (18 us for 256 keys, whatever their order) and a conversion of
 * Python ints to uint64 (15 us for 256 hashes past 2**63), several per flush. Here each is
 * one pass over the batch: a small open-addressing table for the grouping, the int's low
 * 64 bits read in place for the salting. `chain_stores` re-hashes a flush's stored events
 * (each chained to its parent, one indexed before or stored earlier in the flush), the
 * per-event loop that in Python took about 8 us an event of 18 blocks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/chain_hash.h"

PyDoc_STRVAR(group_doc,
"group(keys, first, inverse, last, /) -> int\n\n"
"Group equal `keys` (uint64): returns the number of groups, numbered in the order of\n"
"their first occurrence, and writes for each group its first and last position into\n"
"`first` and `last`, and for each key its group into `inverse` (int64, each as long as\n"
"`keys`; `first` and `last` are written up to the number of groups).");

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* An engine hash (any int, modulo 2**64) salted by its instance's salt, as a table key. */
static inline uint64_t salted_key(uint64_t hash, uint64_t salt, uint64_t stand_in) {
    uint64_t key = hash ^ salt;
    return key ? key : stand_in;
}

/* An int's low 64 bits (an int or any __index__ type); -1 with an exception set otherwise. */
static int low_bits(PyObject *item, uint64_t *out) {
    if (PyLong_Check(item)) {
        *out = PyLong_AsUnsignedLongLongMask(item);
        return 0;
    }
    Py_INCREF(item); /* numpy integers and other __index__ types: Python code may run */
    PyObject *number = PyNumber_Index(item);
    Py_DECREF(item);
    if (number == NULL) {
        return -1;
    }
    *out = PyLong_AsUnsignedLongLongMask(number);
    Py_DECREF(number);
    return 0;
}

static int open_buffers(PyObject *const *args, Py_ssize_t nargs, Py_buffer *views,
                        const int *writable, const Py_ssize_t *item) {
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (PyObject_GetBuffer(args[i], &views[i], writable[i] ? PyBUF_WRITABLE
                                                                 : PyBUF_SIMPLE) < 0) {
            return -1;
        }
        if (views[i].len % item[i] != 0) {
            PyErr_SetString(PyExc_ValueError, "a buffer's size is not a whole number of items");
            return -1;
        }
    }
    return 0;
}

static void release(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&views[i]);
    }
}

static PyObject *group(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "group(keys, first, inverse, last)");
        return NULL;
    }
    Py_buffer views[4] = {{0}};
    static const int writable[4] = {0, 1, 1, 1};
    static const Py_ssize_t item[4] = {8, 8, 8, 8};
    PyObject *result = NULL;
    uint64_t *table_keys = NULL;
    int64_t *table_groups = NULL;
    if (open_buffers(args, 4, views, writable, item) < 0) {
        goto done;
    }
    Py_ssize_t n = views[0].len / 8;
    if (views[1].len / 8 < n || views[2].len / 8 < n || views[3].len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "first, inverse and last must be as long as keys");
        goto done;
    }
    const uint64_t *keys = views[0].buf;
    int64_t *first = views[1].buf, *inverse = views[2].buf, *last = views[3].buf;
    size_t capacity = 16;
    while (capacity < 2 * (size_t)n) {
        capacity *= 2;
    }
    table_keys = malloc(capacity * sizeof *table_keys);
    table_groups = malloc(capacity * sizeof *table_groups);
    if (table_keys == NULL || table_groups == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t s = 0; s < capacity; s++) {
        table_groups[s] = -1;
    }
    int64_t groups = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t s = mix(keys[i]) & (capacity - 1);
        while (table_groups[s] >= 0 && table_keys[s] != keys[i]) {
            s = (s + 1) & (capacity - 1);
        }
        if (table_groups[s] < 0) {
            table_keys[s] = keys[i];
            table_groups[s] = groups;
            first[groups++] = i;
        }
        inverse[i] = table_groups[s];
        last[table_groups[s]] = i;
    }
    result = PyLong_FromLongLong(groups);
done:
    free(table_keys);
    free(table_groups);
    release(views, 4);
    return result;
}

PyDoc_STRVAR(salted_keys_doc,
"salted_keys(hashes, bits, salts, out, stand_in, /) -> None\n\n"
"Write into `out` (uint64, as long as `hashes`) each hash of `hashes` (a list or tuple of\n"
"ints, taken modulo 2**64) xor the salt (uint64 `salts`) of the member number at the same\n"
"place in `bits` (int64), as a table key: 0 becomes `stand_in`.");

static PyObject *salted_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "salted_keys(hashes, bits, salts, out, stand_in)");
        return NULL;
    }
    PyObject *hashes = args[0];
    if (!PyList_Check(hashes) && !PyTuple_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "hashes must be a list or tuple of ints");
        return NULL;
    }
    uint64_t stand_in = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer views[3] = {{0}};
    static const int writable[3] = {0, 0, 1};
    static const Py_ssize_t item[3] = {8, 8, 8};
    PyObject *result = NULL;
    if (open_buffers(args + 1, 3, views, writable, item) < 0) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    Py_ssize_t members = views[1].len / 8;
    if (views[0].len / 8 != n || views[2].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "bits and out must be as long as hashes");
        goto done;
    }
    const int64_t *bits = views[0].buf;
    const uint64_t *salts = views[1].buf;
    uint64_t *out = views[2].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bits[i] < 0 || bits[i] >= members) {
            PyErr_Format(PyExc_IndexError, "bits[%zd] = %lld has no salt", i,
                         (long long)bits[i]);
            goto done;
        }
        if (i >= PySequence_Fast_GET_SIZE(hashes)) { /* an __index__ below shrank it */
            PyErr_SetString(PyExc_RuntimeError, "hashes changed size");
            goto done;
        }
        uint64_t hash;
        if (low_bits(PySequence_Fast_GET_ITEM(hashes, i), &hash) < 0) {
            PyErr_Format(PyExc_TypeError, "hashes[%zd] is not an int", i);
            goto done;
        }
        out[i] = salted_key(hash, salts[bits[i]], stand_in);
    }
    result = Py_NewRef(Py_None);
done:
    release(views, 3);
    return result;
}

PyDoc_STRVAR(chain_stores_doc,
"chain_stores(events, bits, starts, block_size, salts, block_bits, keys, ours, stand_in, /)\n"
"-> tuple[int, int]\n\n"
"Re-hash a flush's `BlockStored` events (a list, in order; their `block_hashes` a list or\n"
"tuple of ints, their ids a list or tuple of ints or a uint32 buffer, filling their\n"
"blocks), event k of the instance whose member number is `bits[k]` (int64), chained to\n"
"`starts[k]` where that is an int, else to the block an earlier event of the same instance\n"
"stored under its `parent_block_hash` (the first such), else (a parent named and not found:\n"
"the event is rejected) to nothing. Writes each block's member number, translation key (its\n"
"engine hash salted by `salts`, 0 as `stand_in`) and our hash into `block_bits` (int64),\n"
"`keys` and `ours` (uint64). Returns the number of blocks written and of events rejected\n"
"(engine hashes are read modulo 2**64).");

#define MAX_BLOCK_SIZE (1 << 20) /* tokens: far above any engine's page, and no overflow */

/* (instance, engine hash) -> our hash: the blocks stored so far in the flush, first wins. */
typedef struct {
    uint64_t *engine;
    uint64_t *ours;
    int64_t *bit; /* -1: empty */
    size_t mask;
} chained_map;

static size_t chained_slot(const chained_map *map, int64_t bit, uint64_t engine) {
    size_t s = mix(engine ^ (uint64_t)bit) & map->mask;
    while (map->bit[s] >= 0 && (map->bit[s] != bit || map->engine[s] != engine)) {
        s = (s + 1) & map->mask;
    }
    return s;
}

/* What `chain_stores` writes: per block, its member number, translation key and our hash. */
typedef struct {
    int64_t *bits;
    uint64_t *keys;
    uint64_t *ours;
    Py_ssize_t room, written;
    const uint64_t *salts;
    uint64_t stand_in;
    Py_ssize_t block_size;
    uint8_t *data; /* CHAIN_PARENT_BYTES and one block's ids */
} chain_out;

/* Whether a buffer's items are uint32 ids as the hash reads them: little-endian. */
static int little_u32(const char *format, Py_ssize_t itemsize) {
    if (itemsize != 4) {
        return 0;
    }
    if (format[0] == '<') {
        return strcmp(format + 1, "I") == 0;
    }
    if (format[0] == '=' || format[0] == '@') {
        format++;
    }
    return PY_LITTLE_ENDIAN && strcmp(format, "I") == 0;
}

/* Event `event`'s ids (a list or tuple of ints, or a uint32 buffer) into `data` block by
 * block, each hashed chained to the one before (the first to `parent` where `has_parent`)
 * and written to `out` with its engine hash from `hashes` (a list or tuple) salted for
 * `bit`, and recorded in `map`. -1 with an exception set where the ids are not that or do not fill
 * the blocks. */
static int hash_event(PyObject *hashes, PyObject *ids, int64_t bit, uint64_t parent,
                      int has_parent, chain_out *out, chained_map *map) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes), count;
    Py_buffer view = {0};
    int sequence = PyList_Check(ids) || PyTuple_Check(ids);
    if (sequence) {
        count = PySequence_Fast_GET_SIZE(ids);
    } else {
        if (PyObject_GetBuffer(ids, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            return -1;
        }
        if (!little_u32(view.format == NULL ? "B" : view.format, view.itemsize)) {
            PyErr_Format(PyExc_TypeError, "token ids must be a list, a tuple or uint32 ids, "
                         "not a buffer of format %s", view.format == NULL ? "B" : view.format);
            PyBuffer_Release(&view);
            return -1;
        }
        count = view.len / 4;
    }
    int status = 0;
    if (count != n * out->block_size || n > out->room - out->written) {
        PyErr_Format(PyExc_ValueError, "%zd token ids for %zd blocks of %zd (or more blocks "
                     "than room)", count, n, out->block_size);
        status = -1;
    }
    size_t block_bytes = 4 * (size_t)out->block_size;
    uint8_t *block = out->data + CHAIN_PARENT_BYTES;
    for (Py_ssize_t j = 0; status == 0 && j < n; j++) {
        if (sequence) {
            for (Py_ssize_t t = 0; t < out->block_size && status == 0; t++) {
                uint32_t id = 0;
                status = token_at(ids, j * out->block_size + t, &id);
                put_u32_le(block + 4 * t, id);
            }
        } else {
            memcpy(block, (const uint8_t *)view.buf + j * block_bytes, block_bytes);
        }
        if (status == 0 && j >= PySequence_Fast_GET_SIZE(hashes)) { /* shrunk by Python */
            PyErr_SetString(PyExc_RuntimeError, "block_hashes changed size");
            status = -1;
        }
        uint64_t engine;
        if (status < 0 || (status = low_bits(PySequence_Fast_GET_ITEM(hashes, j), &engine)) < 0) {
            break;
        }
        parent = chain_block(out->data, block_bytes, parent, has_parent);
        has_parent = 1;
        Py_ssize_t w = out->written++;
        out->bits[w] = bit;
        out->keys[w] = salted_key(engine, out->salts[bit], out->stand_in);
        out->ours[w] = parent;
        size_t s = chained_slot(map, bit, engine);
        if (map->bit[s] < 0) {
            map->bit[s] = bit;
            map->engine[s] = engine;
            map->ours[s] = parent;
        }
    }
    if (!sequence) {
        PyBuffer_Release(&view);
    }
    return status;
}

/* Where event `event` of member `bit` chains from: `start` where that is an int, else the
 * block stored earlier under its `parent_block_hash`, else nothing where it names none.
 * Returns 1 (chained to `*parent`), 0 (no parent), 2 (its parent unknown: rejected), -1 with
 * an exception set. */
static int chain_start(PyObject *event, PyObject *start, int64_t bit, const chained_map *map,
                       uint64_t *parent) {
    if (start != Py_None) {
        return low_bits(start, parent) < 0 ? -1 : 1;
    }
    PyObject *named = PyObject_GetAttrString(event, "parent_block_hash");
    if (named == NULL) {
        return -1;
    }
    int status = 0;
    if (named != Py_None) {
        uint64_t engine;
        if (low_bits(named, &engine) < 0) {
            status = -1;
        } else {
            size_t s = chained_slot(map, bit, engine);
            status = map->bit[s] < 0 ? 2 : 1;
            if (status == 1) {
                *parent = map->ours[s];
            }
        }
    }
    Py_DECREF(named);
    return status;
}

static PyObject *chain_stores(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "chain_stores(events, bits, starts, block_size, "
                        "salts, block_bits, keys, ours, stand_in)");
        return NULL;
    }
    PyObject *events = args[0], *starts = args[2];
    if (!PyList_Check(events) || !PyList_Check(starts)
        || PyList_GET_SIZE(starts) != PyList_GET_SIZE(events)) {
        PyErr_SetString(PyExc_TypeError, "events and starts must be lists of one length");
        return NULL;
    }
    chain_out out = {0};
    out.block_size = PyLong_AsSsize_t(args[3]);
    if (out.block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    out.stand_in = PyLong_AsUnsignedLongLong(args[8]);
    if (out.stand_in == (uint64_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (out.block_size <= 0 || out.block_size > MAX_BLOCK_SIZE) {
        PyErr_Format(PyExc_ValueError, "block_size must be in [1, %d], got %zd",
                     MAX_BLOCK_SIZE, out.block_size);
        return NULL;
    }
    PyObject *buffers[5] = {args[1], args[4], args[5], args[6], args[7]};
    Py_buffer views[5] = {{0}};
    static const int writable[5] = {0, 0, 1, 1, 1};
    static const Py_ssize_t item[5] = {8, 8, 8, 8, 8};
    PyObject *result = NULL;
    chained_map map = {NULL, NULL, NULL, 0};
    if (open_buffers(buffers, 5, views, writable, item) < 0) {
        goto done;
    }
    Py_ssize_t n_events = PyList_GET_SIZE(events), members = views[1].len / 8;
    out.room = views[2].len / 8;
    if (views[0].len / 8 != n_events || views[3].len / 8 != out.room
        || views[4].len / 8 != out.room) {
        PyErr_SetString(PyExc_ValueError, "bits must be as long as events, and block_bits, "
                        "keys and ours as long as each other");
        goto done;
    }
    const int64_t *bits = views[0].buf;
    out.salts = views[1].buf;
    out.bits = views[2].buf;
    out.keys = views[3].buf;
    out.ours = views[4].buf;
    size_t capacity = 16;
    while (capacity < 2 * (size_t)out.room) {
        capacity *= 2;
    }
    map.mask = capacity - 1;
    map.engine = malloc(capacity * sizeof *map.engine);
    map.ours = malloc(capacity * sizeof *map.ours);
    map.bit = malloc(capacity * sizeof *map.bit);
    out.data = malloc(CHAIN_PARENT_BYTES + 4 * (size_t)out.block_size);
    if (map.engine == NULL || map.ours == NULL || map.bit == NULL || out.data == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t s = 0; s < capacity; s++) {
        map.bit[s] = -1;
    }
    Py_ssize_t rejected = 0;
    for (Py_ssize_t k = 0; k < n_events; k++) {
        if (bits[k] < 0 || bits[k] >= members) {
            PyErr_Format(PyExc_IndexError, "bits[%zd] = %lld has no salt", k,
                         (long long)bits[k]);
            goto done;
        }
        if (k >= PyList_GET_SIZE(events) || k >= PyList_GET_SIZE(starts)) { /* (shrunk by
            Python code an int's __index__ ran) */
            PyErr_SetString(PyExc_RuntimeError, "events or starts changed size");
            goto done;
        }
        PyObject *event = Py_NewRef(PyList_GET_ITEM(events, k));
        PyObject *start = Py_NewRef(PyList_GET_ITEM(starts, k));
        uint64_t parent = 0;
        int chained = chain_start(event, start, bits[k], &map, &parent);
        Py_DECREF(start);
        if (chained < 0 || chained == 2) {
            Py_DECREF(event);
            if (chained < 0) {
                goto done;
            }
            rejected++;
            continue;
        }
        PyObject *hashes = PyObject_GetAttrString(event, "block_hashes");
        PyObject *ids = hashes == NULL ? NULL : PyObject_GetAttrString(event, "token_ids");
        int status = ids == NULL ? -1 : 0;
        if (status == 0 && !PyTuple_Check(hashes) && !PyList_Check(hashes)) {
            PyErr_Format(PyExc_TypeError, "event %zd: block_hashes is not a list or tuple", k);
            status = -1;
        }
        if (status == 0) {
            status = hash_event(hashes, ids, bits[k], parent, chained, &out, &map);
        }
        Py_XDECREF(ids);
        Py_XDECREF(hashes);
        Py_DECREF(event);
        if (status < 0) {
            goto done;
        }
    }
    result = Py_BuildValue("(nn)", out.written, rejected);
done:
    free(map.engine);
    free(map.ours);
    free(map.bit);
    free(out.data);
    release(views, 5);
    return result;
}

static PyMethodDef methods[] = {
    {"group", (PyCFunction)(void (*)(void))group, METH_FASTCALL, group_doc},
    {"salted_keys", (PyCFunction)(void (*)(void))salted_keys, METH_FASTCALL, salted_keys_doc},
    {"chain_stores", (PyCFunction)(void (*)(void))chain_stores, METH_FASTCALL,
     chain_stores_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "prfaas.gateway.kv_index._batch",
    "A flush's per-key loops in C (see batch.py).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__batch(void) { return PyModule_Create(&module); }
