/* The KV index's hash table operated in batches: `table.HashTable`'s find, insert, delete
 * and split, in C, over the table's own numpy arrays.
 *
 * The layout is table.py's: `buckets` rows of WAYS slots, keys (uint64, 0 = empty) packed at
 * each row's start, `fill` (int8) counting them, a 16-bit tag per slot, and any number of
 * columns (one fixed-width value per slot). A key's two candidate buckets and its tag come
 * from its mixed hash exactly as `HashTable._choices` computes them, so a table filled by
 * either implementation is read alike by both.
 *
 * Why in C: in numpy every batch operation is a dozen or more array calls of a few
 * microseconds each, whatever the batch's size, and a flush of 256 blocks makes about a
 * hundred of them; here a batch is one call whose cost is the memory it touches (a key's two
 * buckets: a few cache lines). Inserting one key at a time also needs none of the numpy
 * version's ranking of keys that share a bucket.
 *
 * The table operations take the table as a `layout` tuple (keys, tags, fill, columns,
 * scramble, uniform) of its buckets in use (`split`: of its whole capacity), as `HashTable`
 * builds it after each split; they check every buffer's size against `fill`'s and every
 * slot they are given, never the dtypes (table.py passes its own arrays).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#define WAYS 16
#define MAX_COLUMNS 8
#define MAX_ITEM 8 /* bytes of a column's value, at most */
#define LAYOUT_FIELDS 6
/* Cuckoo steps past the first that `make_room` may take. At most 2: at this depth the only
 * nested calls that may meet a bucket higher up the search path are one-step tries, which
 * fail there as they did at first (a failed try changes nothing); a third level could free
 * a slot in such a bucket and shift its ways under the caller, which then moves the wrong
 * key. */
#define ROOM_DEPTH 2

typedef struct {
    Py_buffer keys, tags, fill;
    Py_buffer columns[MAX_COLUMNS];
    Py_ssize_t ncolumns;
    Py_ssize_t item[MAX_COLUMNS]; /* bytes per value, per column */
    Py_ssize_t buckets;
    uint64_t low_mask, high_mask; /* linear hashing's: see `address` */
    uint64_t scramble;
    int uniform;
} Table;

static uint64_t *keys_of(const Table *t) { return (uint64_t *)t->keys.buf; }
static uint16_t *tags_of(const Table *t) { return (uint16_t *)t->tags.buf; }
static int8_t *fill_of(const Table *t) { return (int8_t *)t->fill.buf; }

/* Set the number of buckets in use, and with it the masks `address` reads. */
static void set_buckets(Table *t, Py_ssize_t buckets) {
    uint64_t level = 1; /* the largest power of two at most `buckets` */
    while (level * 2 <= (uint64_t)buckets) {
        level *= 2;
    }
    t->buckets = buckets;
    t->low_mask = level - 1;
    t->high_mask = 2 * level - 1;
}

static void table_close(Table *t) {
    PyBuffer_Release(&t->keys);
    PyBuffer_Release(&t->tags);
    PyBuffer_Release(&t->fill);
    for (Py_ssize_t c = 0; c < MAX_COLUMNS; c++) {
        PyBuffer_Release(&t->columns[c]);
    }
}

/* Open `layout`'s buffers (writable ones where `writable`); 0, or -1 with an exception set
 * and nothing left open. */
static int table_open(PyObject *layout, Table *t, int writable) {
    memset(t, 0, sizeof *t);
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != LAYOUT_FIELDS) {
        PyErr_SetString(PyExc_TypeError,
                        "layout: (keys, tags, fill, columns, scramble, uniform)");
        return -1;
    }
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    PyObject *columns = PyTuple_GET_ITEM(layout, 3);
    if (!PyTuple_Check(columns) || PyTuple_GET_SIZE(columns) > MAX_COLUMNS) {
        PyErr_Format(PyExc_TypeError, "layout: columns must be a tuple of at most %d",
                     MAX_COLUMNS);
        return -1;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(layout, 0), &t->keys, flags) < 0 ||
        PyObject_GetBuffer(PyTuple_GET_ITEM(layout, 1), &t->tags, flags) < 0 ||
        PyObject_GetBuffer(PyTuple_GET_ITEM(layout, 2), &t->fill, flags) < 0) {
        goto fail;
    }
    set_buckets(t, t->fill.len);
    Py_ssize_t slots = t->buckets * WAYS;
    if (t->buckets < 1 || t->keys.len != slots * 8 || t->tags.len != slots * 2) {
        PyErr_SetString(PyExc_ValueError, "layout: keys, tags and fill sizes disagree");
        goto fail;
    }
    t->ncolumns = PyTuple_GET_SIZE(columns);
    for (Py_ssize_t c = 0; c < t->ncolumns; c++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(columns, c), &t->columns[c], flags) < 0) {
            goto fail;
        }
        t->item[c] = t->columns[c].len / slots;
        if (t->columns[c].len % slots || t->item[c] < 1 || t->item[c] > MAX_ITEM) {
            PyErr_SetString(PyExc_ValueError, "layout: a column's size is not the table's");
            goto fail;
        }
    }
    t->scramble = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(layout, 4));
    if (t->scramble == (uint64_t)-1 && PyErr_Occurred()) {
        goto fail;
    }
    t->uniform = PyObject_IsTrue(PyTuple_GET_ITEM(layout, 5));
    if (t->uniform < 0) {
        goto fail;
    }
    return 0;
fail:
    table_close(t);
    return -1;
}

/* A read-only (or writable) buffer of `count` items of `item` bytes; -1 with an exception
 * when its size is not that. */
static int open_array(PyObject *obj, Py_buffer *view, int flags, Py_ssize_t count,
                      Py_ssize_t item, const char *name) {
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    if (view->len != count * item) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", name, view->len,
                     count * item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* splitmix64's finaliser, as table.py's `_mix`. */
static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The bucket that hash bits `h` choose (linear hashing, as `table._address`): their low bits
 * one past the level, or at the level where that bucket is not split yet. */
static inline Py_ssize_t address(const Table *t, uint64_t h) {
    uint64_t bucket = h & t->high_mask;
    return (Py_ssize_t)(bucket < (uint64_t)t->buckets ? bucket : h & t->low_mask);
}

/* A key's two buckets and its tag, as `HashTable._choices`. */
static inline void choose(const Table *t, uint64_t key, Py_ssize_t *first, Py_ssize_t *second,
                          uint16_t *tag) {
    uint64_t mixed = (t->uniform ? key : mix(key)) * t->scramble;
    *first = address(t, mixed & 0xFFFFFFFFull);
    *second = address(t, mixed >> 32);
    *tag = (uint16_t)((mixed * 0x9E3779B97F4A7C15ull) >> 48);
}

/* Ask for the cache lines of a key's two buckets (fill, tags, keys and columns) a few keys
 * before it is inserted: the buckets of a large table are memory misses, and asked for
 * together they overlap. */
#define AHEAD 8
static inline void prefetch_buckets(const Table *t, uint64_t key) {
    Py_ssize_t bucket[2];
    uint16_t tag;
    choose(t, key, &bucket[0], &bucket[1], &tag);
    for (int i = 0; i < 2; i++) {
        __builtin_prefetch(fill_of(t) + bucket[i]);
        __builtin_prefetch(tags_of(t) + bucket[i] * WAYS);
        __builtin_prefetch(keys_of(t) + bucket[i] * WAYS);
        __builtin_prefetch(keys_of(t) + bucket[i] * WAYS + WAYS / 2);
        for (Py_ssize_t c = 0; c < t->ncolumns; c++) {
            __builtin_prefetch((char *)t->columns[c].buf + bucket[i] * WAYS * t->item[c]);
        }
    }
}

static inline void prefetch_tags(const Table *t, uint64_t key) {
    Py_ssize_t first, second;
    uint16_t tag;
    choose(t, key, &first, &second, &tag);
    __builtin_prefetch(tags_of(t) + first * WAYS);
    __builtin_prefetch(tags_of(t) + second * WAYS);
}

/* The first slot of a key's two buckets with the key's tag, -1 where none has it (then the
 * key is absent: every key's slot has its tag). Reads the tags only (an emptied slot may
 * keep its old tag: its key, 0, then does not match). */
static inline Py_ssize_t tag_match(const Table *t, uint64_t key) {
    Py_ssize_t bucket[2];
    uint16_t tag;
    choose(t, key, &bucket[0], &bucket[1], &tag);
    for (int i = 0; i < 2; i++) {
        const uint16_t *tags = tags_of(t) + bucket[i] * WAYS;
        for (int way = 0; way < WAYS; way++) {
            if (tags[way] == tag) {
                return bucket[i] * WAYS + way;
            }
        }
    }
    return -1;
}

static inline Py_ssize_t find_in(const Table *t, Py_ssize_t bucket, uint64_t key,
                                 uint16_t tag) {
    const uint64_t *keys = keys_of(t) + bucket * WAYS;
    const uint16_t *tags = tags_of(t) + bucket * WAYS;
    int fill = fill_of(t)[bucket];
    for (int way = 0; way < fill; way++) {
        if (tags[way] == tag && keys[way] == key) {
            return bucket * WAYS + way;
        }
    }
    return -1;
}

/* Copy slot `src`'s key, tag and column values to slot `dst`. */
static void copy_slot(Table *t, Py_ssize_t dst, Py_ssize_t src) {
    keys_of(t)[dst] = keys_of(t)[src];
    tags_of(t)[dst] = tags_of(t)[src];
    for (Py_ssize_t c = 0; c < t->ncolumns; c++) {
        char *column = t->columns[c].buf;
        memcpy(column + dst * t->item[c], column + src * t->item[c], (size_t)t->item[c]);
    }
}

/* Empty way `way` of `bucket`, the later ways moving down one (the row stays packed, in
 * order, as `HashTable.delete` repacks it). */
static void remove_way(Table *t, Py_ssize_t bucket, int way) {
    int8_t *fill = &fill_of(t)[bucket];
    for (int w = way; w + 1 < *fill; w++) {
        copy_slot(t, bucket * WAYS + w, bucket * WAYS + w + 1);
    }
    *fill -= 1;
    keys_of(t)[bucket * WAYS + *fill] = 0;
}

/* Free a slot in full `bucket` by moving one of its keys to that key's other bucket, where
 * it has room (one step of cuckoo hashing, as `HashTable._make_room`), else, `depth` more
 * times over, where that other bucket can itself free a slot so; whether it could. Two
 * levels deep, a table whose unsplit buckets fill twice as fast as its split ones (linear
 * hashing) still places every key at 80% load, where one step left one in a few thousand. */
static int make_room(Table *t, Py_ssize_t bucket, int depth) {
    int8_t *fill = fill_of(t);
    Py_ssize_t others[WAYS];
    for (int way = 0; way < fill[bucket]; way++) {
        Py_ssize_t first, second;
        uint16_t tag;
        choose(t, keys_of(t)[bucket * WAYS + way], &first, &second, &tag);
        others[way] = first == bucket ? second : first;
        if (others[way] != bucket && fill[others[way]] < WAYS) {
            copy_slot(t, others[way] * WAYS + fill[others[way]], bucket * WAYS + way);
            fill[others[way]] += 1;
            remove_way(t, bucket, way);
            return 1;
        }
    }
    for (int way = 0; depth > 0 && way < fill[bucket]; way++) {
        Py_ssize_t other = others[way];
        if (other != bucket && make_room(t, other, depth - 1)) {
            copy_slot(t, other * WAYS + fill[other], bucket * WAYS + way);
            fill[other] += 1;
            remove_way(t, bucket, way);
            return 1;
        }
    }
    return 0;
}

/* `value`'s low bytes as an integer `item` bytes wide (1, 2, 4 or 8), in this machine's
 * byte order. */
static void store_int(char *dst, size_t item, uint64_t value) {
    uint8_t i8 = (uint8_t)value;
    uint16_t i16 = (uint16_t)value;
    uint32_t i32 = (uint32_t)value;
    uint64_t i64 = value;
    switch (item) {
    case 1: memcpy(dst, &i8, 1); break;
    case 2: memcpy(dst, &i16, 2); break;
    case 4: memcpy(dst, &i32, 4); break;
    default: memcpy(dst, &i64, sizeof i64); break;
    }
}

PyDoc_STRVAR(find_doc,
"find(layout, keys, out, column=-1, values=None, missing=0, /) -> None\n\n"
"Write the slot of each of `keys` (uint64) into `out` (int64), -1 where absent; with a\n"
"`column` (its index in the layout), also that column's value at each key's slot into\n"
"`values` (an array of the column's item size), `missing` (its low bytes) where absent:\n"
"read in the same pass, while the slot's cache lines are being fetched anyway.");

static PyObject *find(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "find(layout, keys, out[, column, values, missing])");
        return NULL;
    }
    Py_ssize_t column = -1;
    uint64_t missing = 0;
    if (nargs == 6) {
        column = PyLong_AsSsize_t(args[3]);
        missing = column == -1 && PyErr_Occurred() ? (uint64_t)-1
                                                   : PyLong_AsUnsignedLongLongMask(args[5]);
        if (missing == (uint64_t)-1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    Table t;
    if (table_open(args[0], &t, 0) < 0) {
        return NULL;
    }
    if (column < -1 || column >= t.ncolumns || (nargs == 6 && column < 0)) {
        table_close(&t);
        PyErr_Format(PyExc_ValueError, "column %zd is not one of %zd", column, t.ncolumns);
        return NULL;
    }
    Py_buffer query = {0}, out = {0}, values = {0};
    if (PyObject_GetBuffer(args[1], &query, PyBUF_SIMPLE) < 0 || query.len % 8 ||
        open_array(args[2], &out, PyBUF_WRITABLE, query.len / 8, 8, "out") < 0 ||
        (column >= 0 && open_array(args[4], &values, PyBUF_WRITABLE, query.len / 8,
                                   t.item[column], "values") < 0)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "keys: not a whole number of uint64");
        }
        PyBuffer_Release(&out);
        PyBuffer_Release(&query);
        table_close(&t);
        return NULL;
    }
    const uint64_t *keys = query.buf;
    int64_t *slots = out.buf;
    Py_ssize_t n = query.len / 8;
    size_t item = column >= 0 ? (size_t)t.item[column] : 0;
    const char *cells = column >= 0 ? t.columns[column].buf : NULL;
    char *gathered = values.buf;
    char absent[MAX_ITEM]; /* `missing` as a value of the column's width */
    store_int(absent, item, missing);
    /* A pipeline over the keys, as a batch of finds in a large table is a batch of memory
     * misses: each key's tag rows are asked for first, its tags compared AHEAD keys later
     * (and the key at the slot whose tag matched asked for, and its column value), and
     * that key compared AHEAD keys after that; only a key whose tag matched another key's
     * is looked for again. */
    for (Py_ssize_t i = 0; i < n + 2 * AHEAD; i++) {
        if (i < n) {
            prefetch_tags(&t, keys[i]);
        }
        Py_ssize_t j = i - AHEAD;
        if (j >= 0 && j < n) {
            slots[j] = tag_match(&t, keys[j]);
            if (slots[j] >= 0) {
                __builtin_prefetch(keys_of(&t) + slots[j]);
                if (cells != NULL) {
                    __builtin_prefetch(cells + (size_t)slots[j] * item);
                }
            }
        }
        Py_ssize_t k = i - 2 * AHEAD;
        if (k < 0 || k >= n) {
            continue;
        }
        if (slots[k] >= 0 && keys_of(&t)[slots[k]] != keys[k]) {
            Py_ssize_t first, second;
            uint16_t tag;
            choose(&t, keys[k], &first, &second, &tag);
            Py_ssize_t slot = find_in(&t, first, keys[k], tag);
            slots[k] = slot >= 0 ? slot : find_in(&t, second, keys[k], tag);
        }
        if (cells != NULL) {
            const char *value = slots[k] >= 0 ? cells + (size_t)slots[k] * item : absent;
            memcpy(gathered + (size_t)k * item, value, item);
        }
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    PyBuffer_Release(&query);
    table_close(&t);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(insert_doc,
"insert(layout, keys, values, placed, /) -> int\n\n"
"Add `keys` (uint64, distinct, absent, none 0) one at a time, each with its value of every\n"
"column (`values`: one array per column, in the layout's order), into the emptier of its\n"
"two buckets, else the other, else where a cuckoo search (`make_room`, up to ROOM_DEPTH\n"
"steps past the first) frees a slot in either. Marks in `placed` (bool) which went in;\n"
"returns how many.");

static PyObject *insert(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "insert(layout, keys, values: tuple, placed)");
        return NULL;
    }
    Table t;
    if (table_open(args[0], &t, 1) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer query = {0}, placed = {0}, values[MAX_COLUMNS] = {{0}};
    if (PyTuple_GET_SIZE(args[2]) != t.ncolumns) {
        PyErr_SetString(PyExc_ValueError, "values: one array per column");
        goto done;
    }
    if (PyObject_GetBuffer(args[1], &query, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    if (query.len % 8) {
        PyErr_SetString(PyExc_ValueError, "keys: not a whole number of uint64");
        goto done;
    }
    Py_ssize_t n = query.len / 8;
    if (open_array(args[3], &placed, PyBUF_WRITABLE, n, 1, "placed") < 0) {
        goto done;
    }
    for (Py_ssize_t c = 0; c < t.ncolumns; c++) {
        if (open_array(PyTuple_GET_ITEM(args[2], c), &values[c], PyBUF_SIMPLE, n, t.item[c],
                       "values") < 0) {
            goto done;
        }
    }
    const uint64_t *keys = query.buf;
    uint8_t *went_in = placed.buf;
    int8_t *fill = fill_of(&t);
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            prefetch_buckets(&t, keys[i + AHEAD]);
        }
        Py_ssize_t first, second;
        uint16_t tag;
        choose(&t, keys[i], &first, &second, &tag);
        Py_ssize_t bucket;
        Py_ssize_t emptier = fill[second] < fill[first] ? second : first;
        Py_ssize_t fuller = emptier == first ? second : first;
        if (fill[emptier] < WAYS) {
            bucket = emptier;
        } else if (fill[fuller] < WAYS) {
            bucket = fuller;
        } else if (make_room(&t, first, 0)) {
            bucket = first;
        } else if (make_room(&t, second, 0)) {
            bucket = second;
        } else if (make_room(&t, first, ROOM_DEPTH)) {
            bucket = first;
        } else if (make_room(&t, second, ROOM_DEPTH)) {
            bucket = second;
        } else {
            went_in[i] = 0;
            continue;
        }
        Py_ssize_t slot = bucket * WAYS + fill[bucket];
        keys_of(&t)[slot] = keys[i];
        tags_of(&t)[slot] = tag;
        for (Py_ssize_t c = 0; c < t.ncolumns; c++) {
            memcpy((char *)t.columns[c].buf + slot * t.item[c],
                   (const char *)values[c].buf + i * t.item[c], (size_t)t.item[c]);
        }
        fill[bucket] += 1;
        went_in[i] = 1;
        count++;
    }
    result = PyLong_FromSsize_t(count);
done:
    for (Py_ssize_t c = 0; c < MAX_COLUMNS; c++) {
        PyBuffer_Release(&values[c]);
    }
    PyBuffer_Release(&placed);
    PyBuffer_Release(&query);
    table_close(&t);
    return result;
}

PyDoc_STRVAR(split_doc,
"split(layout, buckets, count, /) -> int\n\n"
"Add `count` buckets to a table of `buckets` whose `layout` spans its whole capacity\n"
"(linear hashing): each new bucket is the split of the next bucket in order, which keeps\n"
"its keys that still choose it and gives the new one the others. Returns the buckets now.");

static PyObject *split(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "split(layout, buckets, count)");
        return NULL;
    }
    Py_ssize_t buckets = PyLong_AsSsize_t(args[1]);
    Py_ssize_t count = buckets == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[2]);
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Table t;
    if (table_open(args[0], &t, 1) < 0) {
        return NULL;
    }
    Py_ssize_t capacity = t.buckets;
    if (buckets < 1 || count < 0 || buckets > capacity - count) {
        table_close(&t);
        PyErr_Format(PyExc_ValueError, "%zd + %zd buckets do not fit a capacity of %zd",
                     buckets, count, capacity);
        return NULL;
    }
    int8_t *fill = fill_of(&t);
    for (Py_ssize_t i = 0; i < count; i++, buckets++) {
        set_buckets(&t, buckets);
        Py_ssize_t from = buckets - (Py_ssize_t)(t.low_mask + 1), to = buckets;
        set_buckets(&t, buckets + 1);
        int kept = 0, held = fill[from];
        for (int way = 0; way < held; way++) {
            Py_ssize_t first, second, slot = from * WAYS + way;
            uint16_t tag;
            choose(&t, keys_of(&t)[slot], &first, &second, &tag);
            if (first == from || second == from) {
                if (way != kept) {
                    copy_slot(&t, from * WAYS + kept, slot);
                }
                kept++;
            } else { /* the choice that was `from` is `to` now */
                copy_slot(&t, to * WAYS + fill[to], slot);
                fill[to] += 1;
            }
        }
        for (int way = kept; way < held; way++) {
            keys_of(&t)[from * WAYS + way] = 0;
        }
        fill[from] = (int8_t)kept;
    }
    table_close(&t);
    return PyLong_FromSsize_t(buckets);
}

/* Repack `bucket` after some of its keys were set to 0: taken slots first, then the emptied
 * ones, each in their order (numpy's stable sort in `HashTable.delete` does the same). */
static void repack(Table *t, Py_ssize_t bucket) {
    int fill = fill_of(t)[bucket];
    uint64_t *keys = keys_of(t) + bucket * WAYS;
    int empty = 0;
    for (int way = 0; way < fill; way++) {
        empty += keys[way] == 0;
    }
    if (!empty) {
        return; /* done already: another deleted slot shares the bucket */
    }
    int order[WAYS];
    int at = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int way = 0; way < fill; way++) {
            if ((keys[way] != 0) == (pass == 0)) {
                order[at++] = way;
            }
        }
    }
    uint64_t keys_copy[WAYS];
    uint16_t tags_copy[WAYS];
    uint16_t *tags = tags_of(t) + bucket * WAYS;
    memcpy(keys_copy, keys, sizeof keys_copy);
    memcpy(tags_copy, tags, sizeof tags_copy);
    for (int way = 0; way < fill; way++) {
        keys[way] = keys_copy[order[way]];
        tags[way] = tags_copy[order[way]];
    }
    for (Py_ssize_t c = 0; c < t->ncolumns; c++) {
        size_t item = (size_t)t->item[c];
        char *row = (char *)t->columns[c].buf + bucket * WAYS * t->item[c];
        char copy[WAYS * MAX_ITEM];
        memcpy(copy, row, WAYS * item);
        for (int way = 0; way < fill; way++) {
            memcpy(row + way * item, copy + order[way] * item, item);
        }
    }
    fill_of(t)[bucket] = (int8_t)(fill - empty);
}

PyDoc_STRVAR(delete_doc,
"delete(layout, slots, /) -> int\n\n"
"Empty `slots` (int64) and repack their buckets; returns how many held a key. Every slot\n"
"is checked to be in the table before any is emptied (IndexError).");

static PyObject *delete(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "delete(layout, slots)");
        return NULL;
    }
    Table t;
    if (table_open(args[0], &t, 1) < 0) {
        return NULL;
    }
    Py_buffer view = {0};
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) {
        table_close(&t);
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *slots = view.buf;
    Py_ssize_t n = view.len / 8;
    Py_ssize_t total = t.buckets * WAYS;
    if (view.len % 8) {
        PyErr_SetString(PyExc_ValueError, "slots: not a whole number of int64");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= total) {
            PyErr_Format(PyExc_IndexError, "slot %lld is not in the table",
                         (long long)slots[i]);
            goto done;
        }
    }
    Py_ssize_t emptied = 0;
    uint64_t *keys = keys_of(&t);
    for (Py_ssize_t i = 0; i < n; i++) {
        emptied += keys[slots[i]] != 0;
        keys[slots[i]] = 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        repack(&t, slots[i] / WAYS);
    }
    result = PyLong_FromSsize_t(emptied);
done:
    PyBuffer_Release(&view);
    table_close(&t);
    return result;
}

/* An int as a uint64 (OverflowError outside [0, 2**64)). Where unsigned long is 64 bits,
 * its conversion, which reads the int's digits directly: CPython's unsigned long long
 * conversion goes through a generic byte-array one, about twice as slow. */
static inline uint64_t as_u64(PyObject *number) {
#if ULONG_MAX == UINT64_MAX
    return PyLong_AsUnsignedLong(number);
#else
    return PyLong_AsUnsignedLongLong(number);
#endif
}

PyDoc_STRVAR(as_keys_doc,
"as_keys(values, out, stand_in, /) -> None\n\n"
"Write `values` (a list or tuple of ints in [0, 2**64)) into `out` (uint64) as table keys:\n"
"0, which marks an empty slot, as `stand_in` (table.py's `ZERO_STAND_IN`).");

static PyObject *as_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !(PyList_Check(args[0]) || PyTuple_Check(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "as_keys(values: list | tuple, out, stand_in)");
        return NULL;
    }
    uint64_t stand_in = PyLong_AsUnsignedLongLong(args[2]);
    if (stand_in == (uint64_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *values = args[0];
    Py_buffer out;
    if (open_array(args[1], &out, PyBUF_WRITABLE, PySequence_Fast_GET_SIZE(values), 8,
                   "out") < 0) {
        return NULL;
    }
    uint64_t *keys = out.buf;
    Py_ssize_t i = 0;
    /* exact ints (what the block hash makes) read straight from the items: no Python code
     * runs while they are read, so the sequence cannot change under the loop */
    PyObject **items = PySequence_Fast_ITEMS(values);
    for (; i < out.len / 8 && PyLong_CheckExact(items[i]); i++) {
        uint64_t key = as_u64(items[i]);
        if (key == (uint64_t)-1 && PyErr_Occurred()) {
            goto fail;
        }
        keys[i] = key ? key : stand_in;
    }
    for (; i < out.len / 8; i++) {
        /* checked access: a list may change size while an item's __index__ runs */
        PyObject *item = PyList_Check(values) ? PyList_GetItem(values, i)
                                              : PyTuple_GetItem(values, i);
        if (item == NULL) {
            goto fail;
        }
        Py_INCREF(item);
        PyObject *number = PyLong_CheckExact(item) ? Py_NewRef(item) : PyNumber_Index(item);
        Py_DECREF(item);
        if (number == NULL) {
            goto fail;
        }
        uint64_t key = as_u64(number);
        Py_DECREF(number);
        if (key == (uint64_t)-1 && PyErr_Occurred()) {
            goto fail;
        }
        keys[i] = key ? key : stand_in;
    }
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"as_keys", (PyCFunction)(void (*)(void))as_keys, METH_FASTCALL, as_keys_doc},
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL, find_doc},
    {"insert", (PyCFunction)(void (*)(void))insert, METH_FASTCALL, insert_doc},
    {"delete", (PyCFunction)(void (*)(void))delete, METH_FASTCALL, delete_doc},
    {"split", (PyCFunction)(void (*)(void))split, METH_FASTCALL, split_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prfaas.gateway.kv_index._buckets",
    .m_doc = "The KV index's hash table's batch operations (see table.py).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__buckets(void) { return PyModule_Create(&module); }
