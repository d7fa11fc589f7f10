/* A KV event batch read in one pass, for `events.decode_batch` with packed token ids (see
 * events.py).
 *
 * Why: msgspec reads a `BlockStored`'s token ids as `msgspec.Raw` by skipping the array
 * item by item, about 7 ns an id: 8 us of the 9 us a typical event (18 blocks of 64 ids)
 * took to decode, and the index then read the ids again to hash them (about 2.6 ns an id).
 * Here the ids are read once, into uint32 little-endian bytes, what the block hash reads,
 * and the batch is built here too (built in Python, a one-block batch took twice
 * msgspec's time).
 *
 * `scan_batch` reads only the batches it is sure of, in some of the forms msgspec reads
 * (those it writes among them; fields after the known ones skipped, as msgspec skips
 * them), and answers None for anything else (another field form, an unknown event, a value
 * out of range, an id outside uint32, bytes after the batch, a batch cut short): events.py
 * then decodes that payload with msgspec, which decodes it or names what is wrong, and the
 * index rejects ids it cannot hash when it hashes them. So the batch it builds holds what
 * msgspec would have decoded, and it never raises for a payload's content (the classes it
 * is given do not validate when called, as msgspec's structs do not).
 *
 * The readers below return NULL with no exception set where the payload is not in a form
 * read here, and NULL with one set where an allocation or a class call failed.
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

typedef PyObject *(*ValueReader)(Reader *r);

/* None for nil, else what `read` reads; NULL as `read`. */
static PyObject *read_optional(Reader *r, ValueReader read) {
    if (r->pos < r->len && r->data[r->pos] == 0xc0) {
        r->pos++;
        Py_RETURN_NONE;
    }
    return read(r);
}

/* A tuple of what `read` reads from each item of an array; NULL as `read`. */
static PyObject *read_tuple(Reader *r, ValueReader read) {
    Py_ssize_t n = read_array(r);
    if (n < 0) {
        return NULL;
    }
    PyObject *items = PyTuple_New(n);
    if (items == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = read(r);
        if (item == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        PyTuple_SET_ITEM(items, i, item);
    }
    return items;
}

/* The id at `data[*pos]`, an integer in [0, 2**32), `*pos` moved past it; -1 if none is
 * there. The forms an id is written in shortest (fixint, uint 8, 16, 32) are read without
 * branching on which one it is: ids of 2 and of 4 bytes alternate at random in a prompt,
 * and a branch on the form, mispredicted half the time, doubled the time an id took. */
static inline int read_id(const uint8_t *data, Py_ssize_t len, Py_ssize_t *pos, uint32_t *id) {
    if (len - *pos >= 5) {
        uint8_t type = data[*pos];
        unsigned form = (unsigned)type - 0xcc; /* 0, 1, 2: uint 8, 16, 32 */
        int fixint = type < 0x80;
        if (fixint | (form < 3)) {
            unsigned width = form < 3 ? 1u << form : 0;
            const uint8_t *p = data + *pos + 1; /* the 4 bytes after the type byte */
            uint32_t next =
                (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
            *id = (uint32_t)((uint64_t)next >> (32 - 8 * width)) | (fixint ? type : 0);
            *pos += 1 + width;
            return 0;
        }
    }
    uint64_t u; /* any other form, or the last bytes of the data */
    int64_t s;
    switch (mp_int(data, len, pos, &u, &s)) {
    case MP_UNSIGNED:
        *id = (uint32_t)u;
        return u <= UINT32_MAX ? 0 : -1;
    case MP_SIGNED:
        *id = (uint32_t)s;
        return s >= 0 && s <= UINT32_MAX ? 0 : -1;
    default:
        return -1;
    }
}

/* The ids of an array of integers in [0, 2**32) as a new bytes object of uint32
 * little-endian ids (how the block hash reads them); NULL as `read_int` if that is not
 * what is there. */
static PyObject *read_ids(Reader *r) {
    Py_ssize_t n = read_array(r);
    if (n < 0 || n > PY_SSIZE_T_MAX / 4) {
        return NULL;
    }
    PyObject *ids = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (ids == NULL) {
        return NULL;
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(ids);
    Py_ssize_t pos = r->pos;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t id;
        if (read_id(r->data, r->len, &pos, &id) < 0) {
            Py_DECREF(ids);
            return NULL;
        }
        out[4 * i] = (uint8_t)id;
        out[4 * i + 1] = (uint8_t)(id >> 8);
        out[4 * i + 2] = (uint8_t)(id >> 16);
        out[4 * i + 3] = (uint8_t)(id >> 24);
    }
    r->pos = pos;
    return ids;
}

/* Past any one msgpack value: 0, or -1 if none is there whole (or it nests deeper than
 * `MAX_DEPTH`). For the fields a newer publisher adds after those known here, which msgspec
 * skips too (SGLang's `medium`, a `BlockStored`'s metadata). */
#define MAX_DEPTH 32

static int skip_value(Reader *r, int depth) {
    if (depth > MAX_DEPTH || r->pos >= r->len) {
        return -1;
    }
    const uint8_t *p = r->data + r->pos;
    uint8_t type = p[0];
    Py_ssize_t left = r->len - r->pos;
    Py_ssize_t head = 1; /* the type byte and any length after it */
    uint64_t size = 0;   /* bytes after the head, or items (a map's keys and values) */
    int items = 0;
    if (type <= 0x7f || type >= 0xe0 || type == 0xc0 || type == 0xc2 || type == 0xc3) {
        size = 0; /* fixints, nil, booleans */
    } else if ((type & 0xe0) == 0xa0) { /* fixstr */
        size = type & 0x1f;
    } else if ((type & 0xf0) == 0x90 || (type & 0xf0) == 0x80) { /* fixarray, fixmap */
        size = (uint64_t)(type & 0x0f) * ((type & 0xf0) == 0x80 ? 2 : 1);
        items = 1;
    } else {
        switch (type) {
        case 0xcc: case 0xd0: size = 1; break; /* uint 8, int 8 */
        case 0xcd: case 0xd1: size = 2; break;
        case 0xca: case 0xce: case 0xd2: size = 4; break;
        case 0xcb: case 0xcf: case 0xd3: size = 8; break;
        case 0xd4: size = 2; break; /* fixext 1-16: a type byte, then the data */
        case 0xd5: size = 3; break;
        case 0xd6: size = 5; break;
        case 0xd7: size = 9; break;
        case 0xd8: size = 17; break;
        case 0xc4: case 0xd9: case 0xc7: /* bin 8, str 8, ext 8 */
        case 0xc5: case 0xda: case 0xc8: /* bin 16, str 16, ext 16 */
        case 0xc6: case 0xdb: case 0xc9: { /* bin 32, str 32, ext 32 */
            int width = (type == 0xc4 || type == 0xd9 || type == 0xc7) ? 1
                        : (type == 0xc5 || type == 0xda || type == 0xc8) ? 2 : 4;
            int ext = type >= 0xc7 && type <= 0xc9; /* a type byte after the length */
            if (left < 1 + width + ext) {
                return -1;
            }
            size = mp_get_be(p + 1, width);
            head = 1 + width + ext;
            break;
        }
        case 0xdc: case 0xdd: case 0xde: case 0xdf: { /* array 16/32, map 16/32 */
            int width = (type == 0xdc || type == 0xde) ? 2 : 4;
            if (left < 1 + width) {
                return -1;
            }
            size = mp_get_be(p + 1, width) * (type >= 0xde ? 2 : 1);
            head = 1 + width;
            items = 1;
            break;
        }
        default: /* 0xc1, never used */
            return -1;
        }
    }
    if ((uint64_t)(left - head) < size) { /* (items take a byte at least) */
        return -1;
    }
    r->pos += head;
    if (!items) {
        r->pos += (Py_ssize_t)size;
        return 0;
    }
    for (uint64_t i = 0; i < size; i++) {
        if (skip_value(r, depth + 1) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Past `n` values: 0, or -1 as `skip_value`. */
static int skip_values(Reader *r, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (skip_value(r, 0) < 0) {
            return -1;
        }
    }
    return 0;
}

/* The bytes of the string there (fixstr, str 8, 16 or 32), `*pos` moved past it: 0, or -1
 * if no string is there whole. */
static int read_str(Reader *r, const uint8_t **at, Py_ssize_t *n) {
    if (r->pos >= r->len) {
        return -1;
    }
    uint8_t type = r->data[r->pos];
    Py_ssize_t left = r->len - r->pos, head;
    uint64_t size;
    if ((type & 0xe0) == 0xa0) { /* fixstr */
        head = 1;
        size = type & 0x1f;
    } else if (type >= 0xd9 && type <= 0xdb) { /* str 8, 16, 32 */
        int width = 1 << (type - 0xd9);
        if (left < 1 + width) {
            return -1;
        }
        head = 1 + width;
        size = mp_get_be(r->data + r->pos + 1, width);
    } else {
        return -1;
    }
    if ((uint64_t)(left - head) < size) {
        return -1;
    }
    *at = r->data + r->pos + head;
    *n = (Py_ssize_t)size;
    r->pos += head + (Py_ssize_t)size;
    return 0;
}

/* Which of `names` (`count` of them) the string at `at` is; -1 if none. */
static int name_index(const uint8_t *at, Py_ssize_t n, const char *const *names, int count) {
    for (int i = 0; i < count; i++) {
        if ((size_t)n == strlen(names[i]) && memcmp(at, names[i], n) == 0) {
            return i;
        }
    }
    return -1;
}

/* The event kind whose name is there (one of the `count` in `names`); -1 if none is. */
static int read_kind(Reader *r, const char *const *names, int count) {
    const uint8_t *at;
    Py_ssize_t n;
    return read_str(r, &at, &n) < 0 ? -1 : name_index(at, n, names, count);
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

static PyObject *CAST, *UINT32_FORMAT; /* "cast", "I", made once */

/* The ids as an `IdArray`: a memoryview of format "I" over the bytes. */
static PyObject *id_array(PyObject *ids) {
    PyObject *bytes_view = PyMemoryView_FromObject(ids);
    if (bytes_view == NULL) {
        return NULL;
    }
    PyObject *array = PyObject_CallMethodOneArg(bytes_view, CAST, UINT32_FORMAT);
    Py_DECREF(bytes_view);
    return array;
}

/* A `BlockStored` (`classes[BLOCK_STORED]` called with its fields) from its fields after its
 * name, `fields` of them in all, the name counted; NULL as the header says. */
static PyObject *read_stored(Reader *r, Py_ssize_t fields, PyObject *const *classes) {
    if (fields < 5) {
        return NULL;
    }
    PyObject *hashes = NULL, *parent = NULL, *ids = NULL, *size = NULL, *lora = NULL;
    PyObject *event = NULL;
    hashes = read_tuple(r, read_int);
    if (hashes == NULL || (parent = read_optional(r, read_int)) == NULL ||
        (ids = read_ids(r)) == NULL) {
        goto done;
    }
    uint64_t u;
    int64_t s;
    int form = mp_int(r->data, r->len, &r->pos, &u, &s);
    if (!((form == MP_UNSIGNED && u > 0 && u <= INT64_MAX) || (form == MP_SIGNED && s > 0))) {
        goto done; /* msgspec's check: a positive block size */
    }
    size = PyLong_FromLongLong(form == MP_UNSIGNED ? (long long)u : (long long)s);
    if (size == NULL) {
        goto done;
    }
    lora = fields >= 6 ? read_optional(r, read_int) : Py_NewRef(Py_None);
    if (lora == NULL || skip_values(r, fields - 6) < 0) {
        goto done;
    }
    PyObject *array = id_array(ids);
    if (array == NULL) {
        goto done;
    }
    PyObject *args[] = {hashes, parent, array, size, lora};
    event = PyObject_Vectorcall(classes[BLOCK_STORED], args, 5, NULL);
    Py_DECREF(array);

done:
    Py_XDECREF(hashes);
    Py_XDECREF(parent);
    Py_XDECREF(ids);
    Py_XDECREF(size);
    Py_XDECREF(lora);
    return event;
}

/* One event, its kind's class called with its fields; NULL as the header says. */
static PyObject *read_event(Reader *r, PyObject *const *classes) {
    Py_ssize_t fields = read_array(r);
    int kind = fields >= 1 ? read_kind(r, KIND_NAMES, KINDS) : -1;
    switch (kind) {
    case BLOCK_STORED:
        return read_stored(r, fields, classes);
    case ALL_BLOCKS_CLEARED:
        return skip_values(r, fields - 1) < 0 ? NULL
                                              : PyObject_Vectorcall(classes[kind], NULL, 0, NULL);
    case BLOCK_REMOVED:
    case STATES_STORED:
    case STATES_REMOVED:
        if (fields >= 2) {
            PyObject *hashes = read_tuple(r, read_int);
            if (hashes == NULL || skip_values(r, fields - 2) < 0) {
                Py_XDECREF(hashes);
                return NULL;
            }
            PyObject *event = PyObject_Vectorcall(classes[kind], &hashes, 1, NULL);
            Py_DECREF(hashes);
            return event;
        }
        return NULL;
    default:
        return NULL;
    }
}

/* ---- vLLM's layout (SGLang 0.5.23's too): events as maps tagged by a "type" key ---- */

enum map_kind { MAP_BLOCK_STORED, MAP_BLOCK_REMOVED, MAP_ALL_BLOCKS_CLEARED, MAP_KINDS };

static const char *const MAP_KIND_NAMES[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};
static const char *const TYPE_KEY[] = {"type"};

/* The fields read, in the order the classes take them: a `BlockStored` takes all eleven, a
 * `BlockRemoved` (block_hashes, group_idx, medium), an `AllBlocksCleared` none. */
enum field {
    HASHES, PARENT, IDS, SIZE, LORA, GROUP, SPEC, LORA_NAME, SALT, EXTRA, MEDIUM, FIELDS
};

static const char *const FIELD_NAMES[] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",   "group_idx",
    "kv_cache_spec_kind", "lora_name", "cache_salt", "extra_keys", "medium"};

/* The count of the map whose header is there; -1 if none is (or it claims more pairs than
 * the bytes left could hold). */
static Py_ssize_t read_map(Reader *r) {
    if (r->pos >= r->len) {
        return -1;
    }
    uint8_t type = r->data[r->pos];
    Py_ssize_t left = r->len - r->pos;
    uint64_t count;
    if ((type & 0xf0) == 0x80) { /* fixmap */
        count = type & 0x0f;
        r->pos += 1;
    } else if ((type == 0xde && left >= 3) || (type == 0xdf && left >= 5)) {
        int width = type == 0xde ? 2 : 4;
        count = mp_get_be(r->data + r->pos + 1, width);
        r->pos += 1 + width;
    } else {
        return -1;
    }
    return count > (uint64_t)(r->len - r->pos) / 2 ? -1 : (Py_ssize_t)count;
}

/* A hash: a new int (any integer form) or bytes (bin 8, 16, 32); NULL as the header says. */
static PyObject *read_hash(Reader *r) {
    if (r->pos >= r->len) {
        return NULL;
    }
    uint8_t type = r->data[r->pos];
    if (type < 0xc4 || type > 0xc6) {
        return read_int(r);
    }
    int width = 1 << (type - 0xc4);
    Py_ssize_t left = r->len - r->pos;
    if (left < 1 + width) {
        return NULL;
    }
    uint64_t size = mp_get_be(r->data + r->pos + 1, width);
    if ((uint64_t)(left - 1 - width) < size) {
        return NULL;
    }
    const char *at = (const char *)r->data + r->pos + 1 + width;
    r->pos += 1 + width + (Py_ssize_t)size;
    return PyBytes_FromStringAndSize(at, (Py_ssize_t)size);
}

/* A str (valid UTF-8); NULL as the header says (invalid UTF-8: no exception). */
static PyObject *read_text(Reader *r) {
    const uint8_t *at;
    Py_ssize_t n;
    if (read_str(r, &at, &n) < 0) {
        return NULL;
    }
    PyObject *text = PyUnicode_DecodeUTF8((const char *)at, n, NULL);
    if (text == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear(); /* msgspec rejects it: not read here */
    }
    return text;
}

/* A positive block size as a new int; NULL as the header says. */
static PyObject *read_block_size(Reader *r) {
    uint64_t u;
    int64_t s;
    int form = mp_int(r->data, r->len, &r->pos, &u, &s);
    if ((form == MP_UNSIGNED && u > 0 && u <= INT64_MAX) || (form == MP_SIGNED && s > 0)) {
        return PyLong_FromLongLong(form == MP_UNSIGNED ? (long long)u : (long long)s);
    }
    return NULL; /* msgspec's check: a positive block size */
}

/* vLLM's `extra_keys` with no key in them: nil (None), or an array of nils (a list of
 * Nones, as msgspec reads it into `Any`); NULL for any other value, which msgspec then
 * reads (a block keyed by more than its tokens: the decoder decides what that means). */
static PyObject *read_no_extra_keys(Reader *r) {
    if (r->pos < r->len && r->data[r->pos] == 0xc0) {
        r->pos += 1;
        return Py_NewRef(Py_None);
    }
    Py_ssize_t n = read_array(r);
    if (n < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r->data[r->pos + i] != 0xc0) {
            return NULL;
        }
    }
    r->pos += n;
    PyObject *nones = PyList_New(n);
    for (Py_ssize_t i = 0; nones != NULL && i < n; i++) {
        PyList_SET_ITEM(nones, i, Py_NewRef(Py_None));
    }
    return nones;
}

/* Field `field`'s value; NULL as the header says. */
static PyObject *read_field(Reader *r, int field) {
    switch (field) {
    case HASHES:
        return read_tuple(r, read_hash);
    case PARENT:
        return read_optional(r, read_hash);
    case IDS: {
        PyObject *ids = read_ids(r);
        if (ids == NULL) {
            return NULL;
        }
        PyObject *array = id_array(ids);
        Py_DECREF(ids);
        return array;
    }
    case SIZE:
        return read_block_size(r);
    case LORA:
    case GROUP:
        return read_optional(r, read_int);
    case EXTRA:
        return read_no_extra_keys(r);
    default:
        return read_optional(r, read_text);
    }
}

/* One map-form event, its kind's class called with its fields: the "type" key first (as
 * msgspec writes it), then any keys in any order, those the kind does not have skipped;
 * NULL as the header says (a key twice, a required one missing: not read here). */
static PyObject *read_map_event(Reader *r, PyObject *const *classes) {
    Py_ssize_t pairs = read_map(r);
    const uint8_t *at;
    Py_ssize_t n;
    if (pairs < 1 || read_str(r, &at, &n) < 0 || name_index(at, n, TYPE_KEY, 1) != 0) {
        return NULL;
    }
    int kind = read_kind(r, MAP_KIND_NAMES, MAP_KINDS);
    if (kind < 0) {
        return NULL;
    }
    /* the fields the kind has, in its class's order */
    static const int STORED[] = {HASHES, PARENT, IDS,       SIZE, LORA,  GROUP,
                                 SPEC,   LORA_NAME, SALT, EXTRA, MEDIUM};
    static const int REMOVED[] = {HASHES, GROUP, MEDIUM};
    const int *has = kind == MAP_BLOCK_STORED ? STORED : REMOVED;
    int removed = (int)(sizeof REMOVED / sizeof REMOVED[0]);
    int fields = kind == MAP_BLOCK_STORED ? FIELDS : kind == MAP_BLOCK_REMOVED ? removed : 0;
    int required = kind == MAP_BLOCK_STORED ? 4 : kind == MAP_BLOCK_REMOVED ? 1 : 0;
    PyObject *values[FIELDS] = {NULL};
    PyObject *event = NULL;
    for (Py_ssize_t i = 1; i < pairs; i++) {
        if (read_str(r, &at, &n) < 0) {
            goto done;
        }
        int field = name_index(at, n, FIELD_NAMES, FIELDS);
        int slot = -1;
        for (int j = 0; j < fields && slot < 0; j++) {
            if (has[j] == field) {
                slot = j;
            }
        }
        if (slot < 0) { /* a key this kind does not have ("type" again: not read here) */
            if (name_index(at, n, TYPE_KEY, 1) == 0 || skip_value(r, 0) < 0) {
                goto done;
            }
            continue;
        }
        if (values[slot] != NULL || (values[slot] = read_field(r, field)) == NULL) {
            goto done;
        }
    }
    for (int j = 0; j < fields; j++) {
        if (values[j] == NULL) {
            if (j < required) {
                goto done;
            }
            values[j] = Py_NewRef(Py_None);
        }
    }
    event = PyObject_Vectorcall(classes[kind], values, fields, NULL);

done:
    for (int j = 0; j < FIELDS; j++) {
        Py_XDECREF(values[j]);
    }
    return event;
}

/* ---- a batch: [ts, events, rank, ...], in either layout ---- */

typedef PyObject *(*EventReader)(Reader *r, PyObject *const *classes);

/* The batch in `args[0]` built of the classes in `args[1]` (`kinds` events' classes, then
 * the batch's), each event read by `read`; None where it is not one read here. */
static PyObject *scan(PyObject *const *args, Py_ssize_t nargs, int kinds, EventReader read,
                      const char *usage) {
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != kinds + 1) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    PyObject *const *classes = &PyTuple_GET_ITEM(args[1], 0);
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Reader r = {view.buf, view.len, 0};
    PyObject *ts = NULL, *events = NULL, *rank = NULL, *batch = NULL;
    Py_ssize_t fields = read_array(&r);
    if (fields < 2 || (ts = read_float(&r)) == NULL) {
        goto done;
    }
    Py_ssize_t n = read_array(&r);
    if (n < 0 || (events = PyTuple_New(n)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = read(&r, classes);
        if (event == NULL) {
            goto done;
        }
        PyTuple_SET_ITEM(events, i, event);
    }
    rank = fields >= 3 ? read_optional(&r, read_int) : Py_NewRef(Py_None);
    if (rank == NULL || skip_values(&r, fields - 3) < 0 || r.pos != r.len) {
        goto done;
    }
    PyObject *batch_args[] = {ts, events, rank};
    batch = PyObject_Vectorcall(classes[kinds], batch_args, 3, NULL);

done:
    Py_XDECREF(ts);
    Py_XDECREF(events);
    Py_XDECREF(rank);
    PyBuffer_Release(&view);
    if (batch == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE; /* not a batch read here: msgspec decodes it */
    }
    return batch;
}

PyDoc_STRVAR(scan_batch_doc,
"scan_batch(payload, classes, /) -> batch | None\n\n"
"The KV event batch in `payload`, its events positional arrays (PrfaaS's layout, SGLang's\n"
"before 0.5.23), built of `classes`: the events' classes in the order BlockStored,\n"
"BlockRemoved, AllBlocksCleared, StatesStored, StatesRemoved, then the batch's, each\n"
"called with its fields in order (a `BlockStored`'s token ids an `IdArray`: a memoryview\n"
"of format \"I\"); None where the payload is not a batch in the forms read here (decode it\n"
"with msgspec then).");

static PyObject *scan_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return scan(args, nargs, KINDS, read_event,
                "scan_batch takes a payload and a tuple of the 5 events' classes and the "
                "batch's");
}

PyDoc_STRVAR(scan_map_batch_doc,
"scan_map_batch(payload, classes, /) -> batch | None\n\n"
"`scan_batch` for vLLM's layout (SGLang 0.5.23's too), its events maps tagged by \"type\":\n"
"`classes` are BlockStored's (called with block_hashes, parent_block_hash, token_ids,\n"
"block_size, lora_id, group_idx, kv_cache_spec_kind, lora_name, cache_salt, extra_keys,\n"
"medium), BlockRemoved's (block_hashes, group_idx, medium), AllBlocksCleared's, then the\n"
"batch's; hashes are ints or bytes; extra_keys only as None or a list of Nones (other\n"
"values: None, for msgspec).");

static PyObject *scan_map_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return scan(args, nargs, MAP_KINDS, read_map_event,
                "scan_map_batch takes a payload and a tuple of the 3 events' classes and the "
                "batch's");
}

static PyMethodDef methods[] = {
    {"scan_batch", (PyCFunction)(void (*)(void))scan_batch, METH_FASTCALL, scan_batch_doc},
    {"scan_map_batch", (PyCFunction)(void (*)(void))scan_map_batch, METH_FASTCALL,
     scan_map_batch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prfaas.protocol.kv_events._scan",
    .m_doc = "A KV event batch read in one pass (see prfaas.protocol.kv_events.events).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__scan(void) {
    if (CAST == NULL) { /* (a second interpreter inits the module again) */
        CAST = PyUnicode_InternFromString("cast");
        UINT32_FORMAT = PyUnicode_InternFromString("I");
        if (CAST == NULL || UINT32_FORMAT == NULL) {
            Py_CLEAR(CAST);
            Py_CLEAR(UINT32_FORMAT);
            return NULL;
        }
    }
    return PyModule_Create(&module);
}
