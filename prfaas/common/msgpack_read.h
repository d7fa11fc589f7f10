/* Reading msgpack in place: the few forms the project's C loops read (array headers,
 * integers), shared by the block hash's reader of packed token ids (`_chain_hash.c`) and the
 * KV event batches' scanner (`prfaas/protocol/kv_events/_scan.c`). Every reader takes the
 * buffer, its length and a position, moves the position past what it read, and reads
 * nothing past the length. */
#ifndef PRFAAS_MSGPACK_READ_H
#define PRFAAS_MSGPACK_READ_H

#include <Python.h>
#include <stdint.h>

/* What a reader found. */
enum mp_status {
    MP_SHORT = -2,   /* the buffer ends within the value */
    MP_OTHER = -1,   /* another type is there (the position is left on its type byte) */
    MP_UNSIGNED = 0, /* an integer, its value in the uint64 */
    MP_SIGNED = 1,   /* an integer of a signed form, its value in the int64 */
};

/* Big-endian unsigned integer of `n` bytes at `p`. */
static inline uint64_t mp_get_be(const uint8_t *p, int n) {
    uint64_t value = 0;
    for (int i = 0; i < n; i++) {
        value = (value << 8) | p[i];
    }
    return value;
}

/* The count of the array whose header is at `data[*pos]`. Encoders write the shortest
 * form, but any form is read. */
static inline int mp_array(const uint8_t *data, Py_ssize_t len, Py_ssize_t *pos,
                           uint64_t *count) {
    if (*pos >= len) {
        return MP_SHORT;
    }
    uint8_t type = data[*pos];
    int width;
    if ((type & 0xf0) == 0x90) { /* fixarray */
        *count = type & 0x0f;
        *pos += 1;
        return MP_UNSIGNED;
    }
    if (type == 0xdc || type == 0xdd) { /* array 16, array 32 */
        width = type == 0xdc ? 2 : 4;
        if (len - *pos < 1 + width) {
            return MP_SHORT;
        }
        *count = mp_get_be(data + *pos + 1, width);
        *pos += 1 + width;
        return MP_UNSIGNED;
    }
    return MP_OTHER;
}

/* The integer at `data[*pos]`: MP_UNSIGNED with `*u` set (fixint and uint 8-64), or
 * MP_SIGNED with `*s` set (negative fixint and int 8-64, whatever the value's sign). */
static inline int mp_int(const uint8_t *data, Py_ssize_t len, Py_ssize_t *pos, uint64_t *u,
                         int64_t *s) {
    if (*pos >= len) {
        return MP_SHORT;
    }
    uint8_t type = data[*pos];
    if (type <= 0x7f) { /* positive fixint */
        *u = type;
        *pos += 1;
        return MP_UNSIGNED;
    }
    if (type >= 0xe0) { /* negative fixint */
        *s = (int8_t)type;
        *pos += 1;
        return MP_SIGNED;
    }
    int width;
    if (type >= 0xcc && type <= 0xcf) { /* uint 8, 16, 32, 64 */
        width = 1 << (type - 0xcc);
        if (len - *pos < 1 + width) {
            return MP_SHORT;
        }
        *u = mp_get_be(data + *pos + 1, width);
        *pos += 1 + width;
        return MP_UNSIGNED;
    }
    if (type >= 0xd0 && type <= 0xd3) { /* int 8, 16, 32, 64 */
        width = 1 << (type - 0xd0);
        if (len - *pos < 1 + width) {
            return MP_SHORT;
        }
        uint64_t bits = mp_get_be(data + *pos + 1, width);
        int shift = 64 - 8 * width; /* sign-extend */
        *s = (int64_t)(bits << shift) >> shift;
        *pos += 1 + width;
        return MP_SIGNED;
    }
    return MP_OTHER;
}

#endif
