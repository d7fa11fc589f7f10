/* A flush's per-key loops over a batch, in C: `batch.py`'s `group_numpy` and
 * `salted_keys_numpy`.
 *
 * Why in C: a flush groups its batch's keys three times (translations, blocks, holder-set
 * changes) and salts its engine hashes twice (parents, then every block); in numpy that is
 * a sort-based `np.unique` (18 us for 256 keys, whatever their order) and a conversion of
 * Python ints to uint64 (15 us for 256 hashes past 2**63), several per flush. Here each is
 * one pass over the batch: a small open-addressing table for the grouping, the int's low
 * 64 bits read in place for the salting.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

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
        PyObject *item = PySequence_Fast_GET_ITEM(hashes, i);
        uint64_t hash;
        if (PyLong_Check(item)) {
            hash = PyLong_AsUnsignedLongLongMask(item);
        } else { /* numpy integers and other __index__ types: Python code may run */
            Py_INCREF(item);
            PyObject *number = PyNumber_Index(item);
            Py_DECREF(item);
            if (number == NULL) {
                PyErr_Format(PyExc_TypeError, "hashes[%zd] is not an int", i);
                goto done;
            }
            hash = PyLong_AsUnsignedLongLongMask(number);
            Py_DECREF(number);
        }
        uint64_t key = hash ^ salts[bits[i]];
        out[i] = key ? key : stand_in;
    }
    result = Py_NewRef(Py_None);
done:
    release(views, 3);
    return result;
}

static PyMethodDef methods[] = {
    {"group", (PyCFunction)(void (*)(void))group, METH_FASTCALL, group_doc},
    {"salted_keys", (PyCFunction)(void (*)(void))salted_keys, METH_FASTCALL, salted_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "prfaas.gateway.kv_index._batch",
    "A flush's per-key loops in C (see batch.py).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__batch(void) { return PyModule_Create(&module); }
