/* Chained block hashes over token ids: the loop of `prfaas.common.hashing`, in C.
 *
 * The definition (chain_hash.h, shared with the KV index's C loops) is hashing.py's: a
 * block's hash is xxh3-64 over its parent's hash (8 bytes, little-endian; absent for the
 * first block) followed by the block's token ids (uint32, little-endian). Why in C: the
 * gateway hashes every prompt before it routes (2,000 blocks for a 128K-token prompt), the
 * KV index re-hashes every block the engines report, and the simulator hashes hundreds of
 * millions of tokens an hour; in Python each block costs a packing call, a bytes
 * concatenation and an xxhash call (about a microsecond), here tens of nanoseconds.
 * hashing.py keeps the same loop in Python for an interpreter this module was not built
 * for, and the tests compare the two.
 *
 * `unpack_ids` reads ids from their msgpack encoding (an array of integers, as engines' KV
 * events carry them where the event scan did not read them) into uint32 ids, so the
 * gateway's KV index never makes a Python int of each id.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "chain_hash.h"
#include "msgpack_read.h"

/* The hash (a new int) of the block whose ids lie at `data + CHAIN_PARENT_BYTES`, chained to
 * `*parent` where `*has_parent`; the block then becomes the parent. */
static PyObject *chain_next(uint8_t *data, size_t block_bytes, uint64_t *parent,
                            int *has_parent) {
    uint64_t hash = chain_block(data, block_bytes, *parent, *has_parent);
    *parent = hash;
    *has_parent = 1;
    return PyLong_FromUnsignedLongLong(hash);
}

/* An index-like argument (an int, a numpy integer) as a Py_ssize_t; -1 with an exception
 * set when it is not one or does not fit. */
static int get_size(PyObject *arg, Py_ssize_t *out) {
    PyObject *number = PyNumber_Index(arg);
    if (number == NULL) {
        return -1;
    }
    *out = PyLong_AsSsize_t(number);
    Py_DECREF(number);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The parent hash argument (None: 0, which the caller reads as no parent) as a uint64. */
static int get_parent(PyObject *arg, uint64_t *out) {
    *out = 0;
    if (arg == Py_None) {
        return 0;
    }
    PyObject *number = PyNumber_Index(arg);
    if (number == NULL) {
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(number);
    Py_DECREF(number);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(hash_range_doc,
"hash_range(token_ids, block_size, parent, start, stop, /) -> list[int]\n\n"
"Chained hashes of blocks `start` to `stop` (excluded) of `token_ids`, the first chained to\n"
"`parent` (None: no parent). `token_ids` is a list or tuple of ints, or a bytes-like object\n"
"of uint32 little-endian ids.");

static PyObject *hash_range(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "hash_range takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *tokens = args[0];
    Py_ssize_t block_size, start, stop;
    uint64_t parent;
    if (get_size(args[1], &block_size) < 0 || get_size(args[3], &start) < 0 ||
        get_size(args[4], &stop) < 0 || get_parent(args[2], &parent) < 0) {
        return NULL;
    }
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", block_size);
        return NULL;
    }
    int has_parent = args[2] != Py_None;

    int sequence = PyList_Check(tokens) || PyTuple_Check(tokens);
    Py_buffer view = {0};
    Py_ssize_t n_tokens;
    if (sequence) {
        n_tokens = PyList_Check(tokens) ? PyList_GET_SIZE(tokens) : PyTuple_GET_SIZE(tokens);
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0) {
            return NULL;
        }
        if (view.len % 4) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "token bytes must be uint32 ids (a multiple of 4)");
            return NULL;
        }
        n_tokens = view.len / 4;
    }
    if (start < 0 || stop < start || stop > n_tokens / block_size) {
        if (!sequence) {
            PyBuffer_Release(&view);
        }
        PyErr_Format(PyExc_ValueError, "blocks %zd to %zd are not within %zd tokens", start,
                     stop, n_tokens);
        return NULL;
    }

    if (stop == start) {
        if (!sequence) {
            PyBuffer_Release(&view);
        }
        return PyList_New(0);
    }
    /* a block of ids lies within them: no overflow below */
    size_t block_bytes = 4 * (size_t)block_size;
    PyObject *hashes = NULL;
    uint8_t *data = PyMem_Malloc(CHAIN_PARENT_BYTES + block_bytes);
    if (data == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    hashes = PyList_New(stop - start);
    if (hashes == NULL) {
        goto fail;
    }
    for (Py_ssize_t block = start; block < stop; block++) {
        uint8_t *ids = data + CHAIN_PARENT_BYTES;
        if (sequence) {
            for (Py_ssize_t j = 0; j < block_size; j++) {
                uint32_t id;
                if (token_at(tokens, block * block_size + j, &id) < 0) {
                    goto fail;
                }
                put_u32_le(ids + 4 * j, id);
            }
        } else {
            memcpy(ids, (const uint8_t *)view.buf + block * block_bytes, block_bytes);
        }
        PyObject *value = chain_next(data, block_bytes, &parent, &has_parent);
        if (value == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(hashes, block - start, value);
    }
    PyMem_Free(data);
    if (!sequence) {
        PyBuffer_Release(&view);
    }
    return hashes;

fail:
    PyMem_Free(data);
    Py_XDECREF(hashes);
    if (!sequence) {
        PyBuffer_Release(&view);
    }
    return NULL;
}

/* The count of the msgpack array whose header starts `data`, its items from `*pos`; -1 with
 * ValueError set when `data` does not start with an array header, or holds fewer bytes than
 * the count says there are ids (each takes one at least). */
static Py_ssize_t packed_count(const uint8_t *data, Py_ssize_t len, Py_ssize_t *pos) {
    uint64_t count;
    *pos = 0;
    if (mp_array(data, len, pos, &count) != MP_UNSIGNED) {
        PyErr_SetString(PyExc_ValueError, "packed token ids are not a msgpack array");
        return -1;
    }
    if (count > (uint64_t)(len - *pos)) {
        PyErr_SetString(PyExc_ValueError, "packed token ids end before their count");
        return -1;
    }
    return (Py_ssize_t)count;
}

/* The msgpack integer at `data[*pos]` as a uint32, `*pos` moved past it; -1 with an
 * exception set when it is not an integer (TypeError), does not fit (OverflowError) or is
 * cut short (ValueError). Encoders write the shortest form, but any integer form is read. */
static int packed_id(const uint8_t *data, Py_ssize_t len, Py_ssize_t *pos, uint32_t *out) {
    uint64_t u;
    int64_t s;
    switch (mp_int(data, len, pos, &u, &s)) {
    case MP_UNSIGNED:
        if (u > UINT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "token id %llu does not fit uint32",
                         (unsigned long long)u);
            return -1;
        }
        *out = (uint32_t)u;
        return 0;
    case MP_SIGNED:
        if (s < 0 || s > UINT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "token id %lld does not fit uint32", (long long)s);
            return -1;
        }
        *out = (uint32_t)s;
        return 0;
    case MP_SHORT:
        PyErr_SetString(PyExc_ValueError, "packed token ids end within an id");
        return -1;
    default:
        PyErr_Format(PyExc_TypeError,
                     "packed token id of msgpack type 0x%02x is not an integer", data[*pos]);
        return -1;
    }
}

PyDoc_STRVAR(unpack_ids_doc,
"unpack_ids(packed_ids, /) -> bytes\n\n"
"The ids of `packed_ids` (a bytes-like msgpack array of integers and nothing after it, as\n"
"engines' KV events carry them) as uint32 little-endian bytes, every id checked.");

static PyObject *unpack_ids(PyObject *module, PyObject *packed_ids) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(packed_ids, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const uint8_t *packed = view.buf;
    PyObject *result = NULL;
    Py_ssize_t pos = 0;
    Py_ssize_t count = packed_count(packed, view.len, &pos);
    if (count < 0) {
        goto done;
    }
    if (count > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "too many packed token ids");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, 4 * count);
    if (result == NULL) {
        goto done;
    }
    uint8_t *ids = (uint8_t *)PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t id;
        if (packed_id(packed, view.len, &pos, &id) < 0) {
            Py_CLEAR(result);
            goto done;
        }
        put_u32_le(ids + 4 * i, id);
    }
    if (pos != view.len) {
        PyErr_SetString(PyExc_ValueError, "bytes follow the packed token ids");
        Py_CLEAR(result);
    }
done:
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(packed_count_doc,
"packed_count(packed_ids, /) -> int\n\n"
"The number of ids in `packed_ids` (a bytes-like msgpack array), read from its header.");

static PyObject *packed_count_py(PyObject *module, PyObject *packed_ids) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(packed_ids, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t pos;
    Py_ssize_t count = packed_count(view.buf, view.len, &pos);
    PyBuffer_Release(&view);
    return count < 0 ? NULL : PyLong_FromSsize_t(count);
}

static PyMethodDef methods[] = {
    {"hash_range", (PyCFunction)(void (*)(void))hash_range, METH_FASTCALL, hash_range_doc},
    {"unpack_ids", unpack_ids, METH_O, unpack_ids_doc},
    {"packed_count", packed_count_py, METH_O, packed_count_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prfaas.common._chain_hash",
    .m_doc = "Chained xxh3-64 block hashes over token ids (see prfaas.common.hashing).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__chain_hash(void) { return PyModule_Create(&module); }
