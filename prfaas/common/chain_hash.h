/* The chained block hash, in C: shared by the hash's own loops (`_chain_hash.c`) and the KV
 * index's loop over a flush's stored chains (`prfaas/gateway/kv_index/_batch.c`), so that
 * the definition is written once.
 *
 * The definition is hashing.py's: a block's hash is xxh3-64 over its parent's hash (8 bytes,
 * little-endian; absent for the first block) followed by the block's token ids (uint32,
 * little-endian). xxHash is the vendored header (vendor/xxhash.h, BSD-2-Clause), the same
 * library the `xxhash` package wraps, inlined. */
#ifndef PRFAAS_CHAIN_HASH_H
#define PRFAAS_CHAIN_HASH_H

#include <Python.h>
#include <stdint.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

#define CHAIN_PARENT_BYTES 8

static inline void put_u64_le(uint8_t *out, uint64_t value) {
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(value >> (8 * i));
    }
}

static inline void put_u32_le(uint8_t *out, uint32_t value) {
    for (int i = 0; i < 4; i++) {
        out[i] = (uint8_t)(value >> (8 * i));
    }
}

/* The hash of the block whose ids (uint32 little-endian) lie at `data + CHAIN_PARENT_BYTES`,
 * chained to `parent` where `has_parent` (its bytes are written before the ids). */
static inline uint64_t chain_block(uint8_t *data, size_t block_bytes, uint64_t parent,
                                   int has_parent) {
    if (!has_parent) {
        return XXH3_64bits(data + CHAIN_PARENT_BYTES, block_bytes);
    }
    put_u64_le(data, parent);
    return XXH3_64bits(data, CHAIN_PARENT_BYTES + block_bytes);
}

/* Token `i` of a list or tuple as a uint32; -1 with an exception set when it is not an
 * integer (TypeError) or does not fit (OverflowError), as `array.array("I", ...)` says. */
static inline int token_at(PyObject *seq, Py_ssize_t i, uint32_t *out) {
    /* a list may change size while an item's __index__ runs: read it by checked access */
    PyObject *item = PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
    if (item == NULL) {
        return -1;
    }
    unsigned long value; /* where it is 32 bits, a larger id overflows in the conversion */
    if (PyLong_CheckExact(item)) {
        value = PyLong_AsUnsignedLong(item);
    } else {  /* numpy integers and other __index__ types; the call may run Python code */
        Py_INCREF(item);
        PyObject *number = PyNumber_Index(item);
        Py_DECREF(item);
        if (number == NULL) {
            return -1;
        }
        value = PyLong_AsUnsignedLong(number);
        Py_DECREF(number);
    }
    if (value == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (value > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "token id %lu does not fit uint32", value);
        return -1;
    }
    *out = (uint32_t)value;
    return 0;
}

#endif
