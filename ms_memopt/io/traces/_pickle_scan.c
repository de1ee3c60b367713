/* The pickle nesting guard in C: the same scan as pickle_nesting's pure-Python reference
 * (ms_memopt/io/traces/torch_snapshot.py, nesting_reference), opcode for opcode, with the same
 * result, the same exceptions and the same messages; tests/test_pickle_scan.py holds the two equal.
 *
 * The opcode table is not written here: torch_snapshot.py builds it from pickletools once and
 * hands it over (set_opcodes). Each stack item is the index of a depth cell (cell 0: every scalar,
 * depth 0, never raised); the memo maps an index to a cell: a dense array for the indices a
 * pickler writes (0, 1, 2, ... and BINPUT's byte), a dict for any other (negative, huge, sparse),
 * so a hostile index reserves no memory. Nothing recurses: a million-deep pickle is scanned in
 * constant C stack.
 *
 * Module: set_opcodes(table), nesting(data, limit) -> int, KINDS, SOURCE_HASH. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* the opcode kinds, in the order of torch_snapshot.py's _KINDS (the loader compares KINDS) */
enum { K_SCALAR, K_MARK, K_EMPTY, K_BUILD_MARK, K_BUILD_N, K_FILL_MARK, K_FILL_N, K_PUT, K_MEMOIZE, K_GET, K_DUP,
       K_POP, K_POP_MARK, K_REFUSE_GLOBAL, K_REFUSE_PERSISTENT, K_NOTHING, K_STOP, K_OTHER, K_COUNT };
static const char KINDS[] = "SCALAR MARK EMPTY BUILD_MARK BUILD_N FILL_MARK FILL_N PUT MEMOIZE GET DUP POP POP_MARK "
                            "REFUSE_GLOBAL REFUSE_PERSISTENT NOTHING STOP OTHER";

typedef struct { int known, kind, arg, items, pops, pushes, text; PyObject *name; } Opcode;
static Opcode opcodes[256];
static int opcodes_set = 0;

/* a growable array of int64 */
typedef struct { int64_t *v; Py_ssize_t n, cap; } Vec;

static int vec_reserve(Vec *vec, Py_ssize_t need) {
    if (need <= vec->cap) return 0;
    Py_ssize_t cap = vec->cap ? vec->cap : 1024;
    while (cap < need) cap *= 2;
    int64_t *grown = PyMem_Realloc(vec->v, (size_t)cap * sizeof(int64_t));
    if (!grown) { PyErr_NoMemory(); return -1; }
    vec->v = grown;
    vec->cap = cap;
    return 0;
}

static inline int vec_push(Vec *vec, int64_t value) {
    if (vec->n == vec->cap && vec_reserve(vec, vec->n + 1) < 0) return -1;
    vec->v[vec->n++] = value;
    return 0;
}

typedef struct {
    Vec cells;      /* depth of each cell; cell 0 is the scalar's */
    Vec stack;      /* cell indices */
    Vec marks;      /* stack lengths */
    Vec dense;      /* memo: index -> cell + 1 (0: unset) */
    PyObject *sparse;   /* memo: other indices (int -> cell as int), NULL until needed */
    Py_ssize_t count;   /* len(memo) of the reference: distinct indices set */
} Scan;

/* the dense memo takes index i when i <= count + DENSE_SLACK: a pickler's indices (MEMOIZE's
 * len(memo), PUT's counter) always do; a far one goes to the dict */
#define DENSE_SLACK 65536

static int memo_set_object(Scan *s, PyObject *key, int64_t cell) {
    if (!s->sparse && !(s->sparse = PyDict_New())) return -1;
    PyObject *value = PyLong_FromLongLong(cell);
    if (!value) return -1;
    int had = PyDict_Contains(s->sparse, key);
    int rc = had < 0 ? -1 : PyDict_SetItem(s->sparse, key, value);
    Py_DECREF(value);
    if (rc == 0 && !had) s->count++;
    return rc;
}

/* memo[index] = cell, index an int64 (>= 0 is all a binary opcode can give) */
static int memo_set(Scan *s, int64_t index, int64_t cell) {
    if (s->sparse && PyDict_GET_SIZE(s->sparse)) {   /* an index already in the dict stays there */
        PyObject *key = PyLong_FromLongLong(index);
        if (!key) return -1;
        int had = PyDict_Contains(s->sparse, key);
        int rc = had < 0 ? -1 : had ? memo_set_object(s, key, cell) : 1;
        Py_DECREF(key);
        if (rc <= 0) return rc;
    }
    if (index >= 0 && index <= (int64_t)s->count + DENSE_SLACK) {
        if (index >= s->dense.n) {
            if (vec_reserve(&s->dense, index + 1) < 0) return -1;
            memset(s->dense.v + s->dense.n, 0, (size_t)(index + 1 - s->dense.n) * sizeof(int64_t));
            s->dense.n = index + 1;
        }
        if (!s->dense.v[index]) s->count++;
        s->dense.v[index] = cell + 1;
        return 0;
    }
    PyObject *key = PyLong_FromLongLong(index);
    if (!key) return -1;
    int rc = memo_set_object(s, key, cell);
    Py_DECREF(key);
    return rc;
}

/* memo.get(key, scalar) for a key object; *cell receives it */
static int memo_get_object(Scan *s, PyObject *key, int64_t *cell) {
    *cell = 0;
    if (!s->sparse) return 0;
    PyObject *value = PyDict_GetItemWithError(s->sparse, key);
    if (value) *cell = PyLong_AsLongLong(value);
    return PyErr_Occurred() ? -1 : 0;
}

static int memo_get(Scan *s, int64_t index, int64_t *cell) {
    if (index >= 0 && index < s->dense.n && s->dense.v[index]) {
        *cell = s->dense.v[index] - 1;
        return 0;
    }
    *cell = 0;
    if (!s->sparse || !PyDict_GET_SIZE(s->sparse)) return 0;
    PyObject *key = PyLong_FromLongLong(index);
    if (!key) return -1;
    int rc = memo_get_object(s, key, cell);
    Py_DECREF(key);
    return rc;
}

/* bytes.find(b"\n", start) over data[0:end] (Python's clamping of a negative start included) */
static Py_ssize_t find_newline(const unsigned char *data, Py_ssize_t end, Py_ssize_t start) {
    if (start < 0) start = 0;
    if (start >= end) return -1;
    const unsigned char *hit = memchr(data + start, '\n', (size_t)(end - start));
    return hit ? hit - data : -1;
}

/* int.from_bytes(data[pos:pos + width], "little", signed=signed_) of the bytes that exist */
static void length_field(const unsigned char *data, Py_ssize_t end, Py_ssize_t pos, int width, int signed_,
                         int64_t *value, uint64_t *unsigned_value) {
    Py_ssize_t have = end - pos < width ? (end - pos > 0 ? end - pos : 0) : width;
    uint64_t raw = 0;
    for (Py_ssize_t i = 0; i < have; i++) raw |= (uint64_t)data[pos + i] << (8 * i);
    *unsigned_value = raw;
    *value = 0;
    if (signed_ && have > 0 && have < 8 && (raw >> (8 * have - 1)) & 1)
        *value = (int64_t)(raw | (~(uint64_t)0 << (8 * have)));   /* negative */
    else if (signed_ && have == 8)
        *value = (int64_t)raw;
    else
        *value = raw > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)raw;
}

static PyObject *value_error(const char *format, ...) {
    va_list args;
    va_start(args, format);
    PyObject *message = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (message) {
        PyErr_SetObject(PyExc_ValueError, message);
        Py_DECREF(message);
    }
    return NULL;
}

static PyObject *unpickling_error(PyObject *message) {
    if (!message) return NULL;
    PyObject *pickle = PyImport_ImportModule("pickle");
    PyObject *kind = pickle ? PyObject_GetAttrString(pickle, "UnpicklingError") : NULL;
    if (kind) PyErr_SetObject(kind, message);
    Py_XDECREF(kind);
    Py_XDECREF(pickle);
    Py_DECREF(message);
    return NULL;
}

/* data[a:b].decode("utf-8", "replace") (slice clamped as Python clamps it) */
static PyObject *decoded(const unsigned char *data, Py_ssize_t end, Py_ssize_t a, Py_ssize_t b) {
    if (a < 0) a = 0;
    if (b > end) b = end;
    if (b < a) b = a;
    return PyUnicode_DecodeUTF8((const char *)data + a, b - a, "replace");
}

/* the refusal of GLOBAL / INST / STACK_GLOBAL / EXT*, with the reference's message */
static PyObject *refuse_global(const unsigned char *data, Py_ssize_t end, const Opcode *op, Py_ssize_t start,
                               Py_ssize_t pos, const Py_ssize_t strings[4]) {
    PyObject *what = NULL;
    if (strcmp(PyUnicode_AsUTF8(op->name), "STACK_GLOBAL") == 0) {
        PyObject *first = decoded(data, end, strings[0], strings[1]);
        PyObject *second = decoded(data, end, strings[2], strings[3]);
        if (first && second) what = PyUnicode_FromFormat("%U.%U", first, second);
        Py_XDECREF(first);
        Py_XDECREF(second);
    } else if (op->arg == -6) {
        PyObject *text = decoded(data, end, start, pos);
        PyObject *stripped = text ? PyObject_CallMethod(text, "strip", NULL) : NULL;
        what = stripped ? PyObject_CallMethod(stripped, "replace", "ss", "\n", ".") : NULL;
        Py_XDECREF(text);
        Py_XDECREF(stripped);
    } else {
        uint64_t number = 0;
        for (Py_ssize_t i = 0; i < pos - start; i++) number |= (uint64_t)data[start + i] << (8 * i);
        what = PyUnicode_FromFormat("extension %llu", (unsigned long long)number);
    }
    if (!what) return NULL;
    PyObject *message = PyUnicode_FromFormat("refused to load global %U: snapshots may only hold builtin "
                                             "containers and scalars", what);
    Py_DECREF(what);
    return unpickling_error(message);
}

/* the stack cut of a mark-taking opcode (marks.pop() if marks else 0), clamped to the stack */
static inline Py_ssize_t mark_cut(Scan *s) {
    Py_ssize_t cut = s->marks.n ? (Py_ssize_t)s->marks.v[--s->marks.n] : 0;
    return cut > s->stack.n ? s->stack.n : cut;
}

static inline Py_ssize_t count_cut(Scan *s, int items) {
    return s->stack.n > items ? s->stack.n - items : 0;
}

/* 1 + the deepest cell of stack[cut:] (1 when empty) */
static inline int64_t one_deeper(Scan *s, Py_ssize_t cut) {
    int64_t depth = 0;
    for (Py_ssize_t i = cut; i < s->stack.n; i++)
        if (s->cells.v[s->stack.v[i]] > depth) depth = s->cells.v[s->stack.v[i]];
    return depth + 1;
}

static PyObject *scan(const unsigned char *data, Py_ssize_t end, long long limit, Scan *s) {
    int64_t deepest = 0;
    Py_ssize_t strings[4] = {0, 0, 0, 0};   /* the last two text arguments: (start, end) twice */
    Py_ssize_t pos = 0;
    if (vec_push(&s->cells, 0) < 0) return NULL;     /* the scalar cell */
#define PUSH(cell) do { if (vec_push(&s->stack, (cell)) < 0) return NULL; } while (0)
    while (pos < end) {
        unsigned char code = data[pos];
        /* the opcodes a snapshot is mostly made of, as the reference's first branch takes them */
        if (code == 0x8C && pos + 1 < end) {             /* SHORT_BINUNICODE */
            Py_ssize_t start = pos + 2;
            pos = start + data[pos + 1];
            strings[0] = strings[2]; strings[1] = strings[3]; strings[2] = start; strings[3] = pos;
            PUSH(0);
            continue;
        }
        if (code == 0x4B || code == 0x4E) {              /* BININT1, NONE */
            pos += code == 0x4B ? 2 : 1;
            PUSH(0);
            continue;
        }
        if (code == 0x94) {                              /* MEMOIZE */
            if (s->stack.n && memo_set(s, (int64_t)s->count, s->stack.v[s->stack.n - 1]) < 0) return NULL;
            pos += 1;
            continue;
        }
        if ((code == 0x71 || code == 0x68) && pos + 1 < end) {   /* BINPUT, BINGET */
            if (code == 0x71) {
                if (s->stack.n && memo_set(s, data[pos + 1], s->stack.v[s->stack.n - 1]) < 0) return NULL;
            } else {
                int64_t cell;
                if (memo_get(s, data[pos + 1], &cell) < 0) return NULL;
                PUSH(cell);
            }
            pos += 2;
            continue;
        }
        if (code == 0x28) {                              /* MARK */
            if (vec_push(&s->marks, s->stack.n) < 0) return NULL;
            pos += 1;
            continue;
        }
        const Opcode *op = &opcodes[code];
        if (!op->known)
            return value_error("malformed: unknown opcode 0x%x at byte %zd", (unsigned)code, pos);
        pos += 1;
        Py_ssize_t start = pos;
        int past = 0;   /* the argument runs past the end */
        if (op->arg > 0) {
            pos += op->arg;
        } else if (op->arg == -1) {
            pos = find_newline(data, end, pos) + 1;
            if (!pos) return value_error("truncated: no newline after %U", op->name);
        } else if (op->arg == -6) {
            pos = find_newline(data, end, find_newline(data, end, pos) + 1) + 1;
            if (!pos) return value_error("truncated: no newline after %U", op->name);
        } else if (op->arg) {
            int width = op->arg == -2 ? 1 : op->arg == -5 ? 8 : 4;
            int64_t size;
            uint64_t unsigned_size;
            length_field(data, end, pos, width, op->arg == -3, &size, &unsigned_size);
            if (size < 0) return value_error("malformed: negative length in %U", op->name);
            start = pos + width;
            past = start > end || unsigned_size > (uint64_t)(end - start);
            pos = past ? end + 1 : start + (Py_ssize_t)unsigned_size;
            if (op->text && !past) {
                strings[0] = strings[2]; strings[1] = strings[3]; strings[2] = start; strings[3] = pos;
            }
        }
        if (past || pos > end)
            return value_error("truncated: %U at byte %zd runs past the end", op->name, start - 1);
        switch (op->kind) {
        case K_SCALAR:
            PUSH(0);
            break;
        case K_MEMOIZE:
            if (s->stack.n && memo_set(s, (int64_t)s->count, s->stack.v[s->stack.n - 1]) < 0) return NULL;
            break;
        case K_FILL_MARK:
        case K_FILL_N: {
            Py_ssize_t cut = op->kind == K_FILL_N ? count_cut(s, op->items) : mark_cut(s);
            if (cut > 0 && cut < s->stack.n && s->stack.v[cut - 1] != 0) {
                int64_t depth = one_deeper(s, cut);
                int64_t target = s->stack.v[cut - 1];
                if (depth > s->cells.v[target]) {
                    s->cells.v[target] = depth;
                    if (depth > deepest) deepest = depth;
                }
            }
            s->stack.n = cut;
            break;
        }
        case K_MARK:
            if (vec_push(&s->marks, s->stack.n) < 0) return NULL;
            break;
        case K_EMPTY:
            if (vec_push(&s->cells, 1) < 0) return NULL;
            PUSH(s->cells.n - 1);
            if (!deepest) deepest = 1;
            break;
        case K_BUILD_MARK:
        case K_BUILD_N: {
            Py_ssize_t cut = op->kind == K_BUILD_N ? count_cut(s, op->items) : mark_cut(s);
            int64_t depth = one_deeper(s, cut);
            s->stack.n = cut;
            if (vec_push(&s->cells, depth) < 0) return NULL;
            PUSH(s->cells.n - 1);
            if (depth > deepest) deepest = depth;
            break;
        }
        case K_PUT:
        case K_GET: {
            int64_t cell = 0;
            if (op->arg == -1) {     /* PUT / GET: a decimal line, as int() reads it */
                PyObject *number = pos - 1 > start
                    ? PyObject_CallFunction((PyObject *)&PyLong_Type, "y#", (const char *)data + start, pos - 1 - start)
                    : PyLong_FromLong(-1);
                if (!number) return NULL;
                int rc = 0;
                if (op->kind == K_PUT) {
                    if (s->stack.n) {
                        int overflow = 0;
                        long long index = PyLong_AsLongLongAndOverflow(number, &overflow);
                        rc = overflow || index < 0 ? memo_set_object(s, number, s->stack.v[s->stack.n - 1])
                                                   : memo_set(s, index, s->stack.v[s->stack.n - 1]);
                    }
                } else {
                    int overflow = 0;
                    long long index = PyLong_AsLongLongAndOverflow(number, &overflow);
                    rc = overflow || index < 0 ? memo_get_object(s, number, &cell) : memo_get(s, index, &cell);
                    if (rc == 0 && vec_push(&s->stack, cell) < 0) rc = -1;
                }
                Py_DECREF(number);
                if (rc < 0) return NULL;
                break;
            }
            int64_t index = 0;
            for (Py_ssize_t i = 0; i < pos - start; i++) index |= (int64_t)data[start + i] << (8 * i);
            if (op->kind == K_PUT) {
                if (s->stack.n && memo_set(s, index, s->stack.v[s->stack.n - 1]) < 0) return NULL;
            } else {
                if (memo_get(s, index, &cell) < 0) return NULL;
                PUSH(cell);
            }
            break;
        }
        case K_DUP:
            if (s->stack.n) PUSH(s->stack.v[s->stack.n - 1]);
            break;
        case K_POP:
            if (s->stack.n) s->stack.n--;
            break;
        case K_POP_MARK:
            s->stack.n = mark_cut(s);
            break;
        case K_REFUSE_GLOBAL:
            return refuse_global(data, end, op, start, pos, strings);
        case K_REFUSE_PERSISTENT:
            return unpickling_error(PyUnicode_FromString(
                "refused a persistent id: snapshots may not reference external objects"));
        case K_STOP:
            return PyLong_FromLongLong(deepest);
        case K_OTHER:   /* REDUCE, BUILD, NEWOBJ & co.: nothing they need can exist without a global */
            s->stack.n = op->pops < 0 ? mark_cut(s) : count_cut(s, op->pops);
            for (int i = 0; i < op->pushes; i++) PUSH(0);
            break;
        default:        /* K_NOTHING: PROTO, FRAME */
            break;
        }
        if (deepest > limit) return PyLong_FromLongLong(deepest);
    }
#undef PUSH
    return value_error("truncated: the pickle ends before its STOP opcode");
}

static PyObject *nesting(PyObject *self, PyObject *args) {
    Py_buffer buffer;
    long long limit;
    if (!PyArg_ParseTuple(args, "y*L", &buffer, &limit)) return NULL;
    if (!opcodes_set) {
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_RuntimeError, "set_opcodes() was not called");
        return NULL;
    }
    Scan s;
    memset(&s, 0, sizeof s);
    PyObject *result = scan((const unsigned char *)buffer.buf, buffer.len, limit, &s);
    PyMem_Free(s.cells.v);
    PyMem_Free(s.stack.v);
    PyMem_Free(s.marks.v);
    PyMem_Free(s.dense.v);
    Py_XDECREF(s.sparse);
    PyBuffer_Release(&buffer);
    return result;
}

/* set_opcodes(table): 256 entries, each None (unknown) or (kind, arg, items, pops, pushes, name, text) */
static PyObject *set_opcodes(PyObject *self, PyObject *args) {
    PyObject *table;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &table)) return NULL;
    if (PyTuple_GET_SIZE(table) != 256) {
        PyErr_SetString(PyExc_ValueError, "set_opcodes: 256 entries expected");
        return NULL;
    }
    Opcode parsed[256];
    memset(parsed, 0, sizeof parsed);
    for (int code = 0; code < 256; code++) {
        PyObject *entry = PyTuple_GET_ITEM(table, code);
        if (entry == Py_None) continue;
        Opcode *op = &parsed[code];
        if (!PyArg_ParseTuple(entry, "iiiiiUp", &op->kind, &op->arg, &op->items, &op->pops, &op->pushes, &op->name,
                              &op->text))
            return NULL;
        if (op->kind < 0 || op->kind >= K_COUNT || op->arg < -6 || op->arg > 8) {
            PyErr_Format(PyExc_ValueError, "set_opcodes: bad entry for opcode %d", code);
            return NULL;
        }
        op->known = 1;
    }
    for (int code = 0; code < 256; code++) {
        Py_XINCREF(parsed[code].name);
        Py_XDECREF(opcodes[code].name);
        opcodes[code] = parsed[code];
    }
    opcodes_set = 1;
    Py_RETURN_NONE;
}

#ifndef MS_MEMOPT_SOURCE_HASH
#define MS_MEMOPT_SOURCE_HASH ""
#endif

static PyMethodDef methods[] = {
    {"set_opcodes", set_opcodes, METH_VARARGS, "set_opcodes(table): the opcode table (256 entries)"},
    {"nesting", nesting, METH_VARARGS, "nesting(data, limit) -> the deepest nesting (see pickle_nesting)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pickle_scan", "The pickle nesting guard in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__pickle_scan(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "KINDS", KINDS) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", MS_MEMOPT_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
