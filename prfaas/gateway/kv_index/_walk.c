/* A lookup's walk along a request's chain of blocks, in C: `manager._walk_numpy`'s loop.
 *
 * Each block of the chain names the set of instances holding it (a holder-set id, a row of
 * `bits`: instance i is bit i). An instance's match ends at the first block it does not
 * hold. The walk ANDs the rows into `alive` (the instances still matching), records in
 * `ends` the block where each instance dropped out, and stops at the first block no
 * instance holds. Why in C: in numpy it is a dozen array calls and a Python loop over the
 * instances that drop out (about 50 us of a 128K-token lookup); here a chain's blocks come
 * in runs held by one set, so it reads each run's row once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

PyDoc_STRVAR(walk_doc,
"walk(bits, holders, alive, ends, offset, /) -> int\n\n"
"Walk `holders` (uint32 holder-set ids, one per block, in chain order) against `bits`\n"
"(uint64 rows of len(alive) words, one per id), removing from `alive` (uint64 words,\n"
"updated in place) the instances a block does not hold, and writing `offset` plus that\n"
"block's position into `ends` (int64, one per instance bit) for each. Returns how many\n"
"blocks some instance holds (the position of the first block none holds, or all).");

static PyObject *walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "walk(bits, holders, alive, ends, offset)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[4]);
    if (offset == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer bits = {0}, holders = {0}, alive = {0}, ends = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &bits, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(args[1], &holders, PyBUF_SIMPLE) < 0 ||
        PyObject_GetBuffer(args[2], &alive, PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(args[3], &ends, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    Py_ssize_t words = alive.len / 8;
    if (words < 1 || alive.len % 8 || bits.len % (8 * words) || holders.len % 4 ||
        ends.len != words * 64 * 8) {
        PyErr_SetString(PyExc_ValueError,
                        "walk: alive must be uint64 words, bits rows of as many, holders "
                        "uint32, ends one int64 per bit");
        goto done;
    }
    Py_ssize_t sets = bits.len / (8 * words);
    Py_ssize_t n = holders.len / 4;
    const uint32_t *ids = holders.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] >= (uint64_t)sets) {
            PyErr_Format(PyExc_IndexError, "holder set %u is not in bits", ids[i]);
            goto done;
        }
    }
    uint64_t *live = alive.buf;
    int64_t *end = ends.buf;
    const uint64_t *rows = bits.buf;
    Py_ssize_t held = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i > 0 && ids[i] == ids[i - 1]) {
            continue; /* the same set as the block before: nobody drops out */
        }
        const uint64_t *row = rows + (Py_ssize_t)ids[i] * words;
        uint64_t any = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            uint64_t gone = live[w] & ~row[w];
            while (gone) {
                end[w * 64 + __builtin_ctzll(gone)] = offset + i;
                gone &= gone - 1;
            }
            live[w] &= row[w];
            any |= live[w];
        }
        if (!any) {
            held = i;
            break;
        }
    }
    result = PyLong_FromSsize_t(held);
done:
    PyBuffer_Release(&ends);
    PyBuffer_Release(&alive);
    PyBuffer_Release(&holders);
    PyBuffer_Release(&bits);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prfaas.gateway.kv_index._walk",
    .m_doc = "A lookup's walk along a chain of blocks' holder sets (see manager.py).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__walk(void) { return PyModule_Create(&module); }
