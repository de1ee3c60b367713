/* The code every compiled model shares (declared in fastpool.h): growable arrays, the address
 * -> buffer table, buffers, the sorted free keys, allocators, segments, segments by address,
 * the last step of malloc, OOM records, best-fit pools' free with merging, and the restore and
 * layout helpers of the best-fit models (mindspore, torch, regions). */
#include "fastpool.h"

int fp_grow_array(void **ptr, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *p = PyMem_Realloc(*ptr, (size_t)n * item);
    if (!p) { PyErr_NoMemory(); return -1; }
    *ptr = p; *cap = n;
    return 0;
}

int fp_h_resize(Core *c, Py_ssize_t cap) {
    u64 *keys = PyMem_Malloc(sizeof(u64) * cap);
    int32_t *vals = PyMem_Malloc(sizeof(int32_t) * cap);
    if (!keys || !vals) { PyMem_Free(keys); PyMem_Free(vals); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < cap; i++) keys[i] = EMPTY_KEY;
    for (Py_ssize_t i = 0; i < c->hcap; i++) {
        if (c->hkeys[i] == EMPTY_KEY) continue;
        Py_ssize_t j = h_slot(c->hkeys[i], cap);
        while (keys[j] != EMPTY_KEY) j = (j + 1) & (cap - 1);
        keys[j] = c->hkeys[i]; vals[j] = c->hvals[i];
    }
    PyMem_Free(c->hkeys); PyMem_Free(c->hvals);
    c->hkeys = keys; c->hvals = vals; c->hcap = cap;
    return 0;
}

int fp_h_put(Core *c, u64 addr, int32_t buf) {
    if ((c->hcount + 1) * 2 > c->hcap && fp_h_resize(c, c->hcap * 2) < 0) return -1;
    Py_ssize_t mask = c->hcap - 1, j = h_slot(addr, c->hcap);
    while (c->hkeys[j] != EMPTY_KEY && c->hkeys[j] != addr) j = (j + 1) & mask;
    if (c->hkeys[j] == EMPTY_KEY) c->hcount++;
    c->hkeys[j] = addr; c->hvals[j] = buf;
    return 0;
}

void fp_h_del(Core *c, u64 addr) {
    Py_ssize_t mask = c->hcap - 1, j = h_slot(addr, c->hcap);
    while (c->hkeys[j] != addr) {
        if (c->hkeys[j] == EMPTY_KEY) return;
        j = (j + 1) & mask;
    }
    /* backward-shift deletion keeps probe chains intact without tombstones */
    Py_ssize_t hole = j;
    for (;;) {
        j = (j + 1) & mask;
        u64 k = c->hkeys[j];
        if (k == EMPTY_KEY) break;
        Py_ssize_t home = h_slot(k, c->hcap);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            c->hkeys[hole] = k; c->hvals[hole] = c->hvals[j]; hole = j;
        }
    }
    c->hkeys[hole] = EMPTY_KEY;
    c->hcount--;
}

/* ---- buffers -------------------------------------------------------------------------------- */
int32_t fp_buf_new(Core *c, u64 addr, u64 size, int used, int32_t prev, int32_t next, int32_t seg) {
    int32_t i;
    if (c->free_slot >= 0) {
        i = c->free_slot;
        c->free_slot = c->bufs[i].next;
    } else {
        if (fp_grow_array((void **)&c->bufs, &c->capbufs, c->nbufs + 1, sizeof(Buf)) < 0) return -1;
        i = (int32_t)c->nbufs++;
    }
    Buf *b = &c->bufs[i];
    b->addr = addr; b->size = size; b->tie = addr; b->prev = prev; b->next = next; b->seg = seg; b->used = used;
    if (fp_h_put(c, addr, i) < 0) return -1;
    return i;
}

void fp_buf_drop(Core *c, int32_t i) {
    fp_h_del(c, c->bufs[i].addr);
    c->bufs[i].used = -1;
    c->bufs[i].next = c->free_slot;
    c->free_slot = i;
}

int fp_index_buf(Core *c, int32_t i) {
    Buf *b = &c->bufs[i];
    Alloc *a = &c->allocs[c->segs[b->seg].alloc];
    if (c->idle_order) b->tie = ++c->turn;
    if (fp_grow_array((void **)&a->keys, &a->capkeys, a->nkeys + 1, sizeof(Key)) < 0) return -1;
    b = &c->bufs[i];
    Py_ssize_t at = lower_bound(a, b->size, b->tie);
    memmove(&a->keys[at + 1], &a->keys[at], (size_t)(a->nkeys - at) * sizeof(Key));
    a->keys[at].size = b->size; a->keys[at].tie = b->tie; a->keys[at].buf = i;
    a->nkeys++;
    return 0;
}

void fp_unindex_buf(Core *c, int32_t i) {
    Buf *b = &c->bufs[i];
    Alloc *a = &c->allocs[c->segs[b->seg].alloc];
    Py_ssize_t at = lower_bound(a, b->size, b->tie);
    key_pop(a->keys, &a->nkeys, at);
}

/* ---- allocators, segments ------------------------------------------------------------------- */
Py_ssize_t fp_get_alloc(Core *c, i64 stream, int persistent, int small) {
    for (Py_ssize_t i = 0; i < c->nallocs; i++) {
        Alloc *a = &c->allocs[i];
        if (a->stream == stream && a->persistent == persistent && a->small == small) return i;
    }
    Alloc *p = PyMem_Realloc(c->allocs, sizeof(Alloc) * (c->nallocs + 1));
    if (!p) { PyErr_NoMemory(); return -1; }
    c->allocs = p;
    Alloc *a = &c->allocs[c->nallocs];
    memset(a, 0, sizeof(Alloc));
    a->stream = stream; a->persistent = persistent; a->small = small;
    return c->nallocs++;
}

u64 fp_device_free(Core *c) {
    if (!c->bounded) return UNBOUNDED_FREE;
    return c->capacity > (u64)c->reserved ? c->capacity - (u64)c->reserved : 0;
}

int32_t fp_new_segment_at(Core *c, Py_ssize_t ai, u64 addr, u64 size, int index) {
    if (fp_grow_array((void **)&c->segs, &c->capsegs, c->nsegs + 1, sizeof(Seg)) < 0) return -1;
    Alloc *a = &c->allocs[ai];
    if (fp_grow_array((void **)&a->segs, &a->capsegs, a->nsegs + 1, sizeof(int32_t)) < 0) return -1;
    int32_t si = (int32_t)c->nsegs++;
    Seg *s = &c->segs[si];
    s->addr = addr; s->size = size; s->stream = a->stream; s->alloc = (int32_t)ai; s->head = -1; s->alive = 1;
    a->segs[a->nsegs++] = si;
    if (index) {
        int32_t b = fp_buf_new(c, addr, size, 0, -1, -1, si);
        if (b < 0) return -1;
        c->segs[si].head = b;
        if (fp_index_buf(c, b) < 0) return -1;
    }
    /* what the segment counts for is the model's: reserved bytes (vmm: mapped chunks only), a
     * segment alloc (torch counts in _new_segment, not here), its place by address */
    if (c->model->segment_added && c->model->segment_added(c, si) < 0) return -1;
    if (c->reserved > c->peak_reserved) c->peak_reserved = c->reserved;
    return si;
}

/* ``b`` keeps its first ``size`` bytes; the rest becomes a new buffer after it in ``state``
 * (not indexed); the new buffer, -1 on error */
int32_t fp_split_off(Core *c, int32_t b, u64 size, int state) {
    int32_t nxt = c->bufs[b].next;
    int32_t rest = fp_buf_new(c, c->bufs[b].addr + size, c->bufs[b].size - size, state, b, nxt, c->bufs[b].seg);
    if (rest < 0) return -1;
    if (nxt >= 0) c->bufs[nxt].prev = rest;
    c->bufs[b].next = rest;
    c->bufs[b].size = size;
    return rest;
}

/* cut ``b`` after ``size`` bytes: the rest becomes an idle, indexed buffer; -1 on error */
int fp_cut(Core *c, int32_t b, u64 size) {
    int32_t rest = fp_split_off(c, b, size, 0);
    return rest < 0 ? -1 : fp_index_buf(c, rest);
}

/* the segment leaves its allocator and the device (its buffers are gone already) */
void fp_drop_segment(Core *c, int32_t si) {
    Seg *s = &c->segs[si];
    Alloc *a = &c->allocs[s->alloc];
    for (Py_ssize_t k = 0; k < a->nsegs; k++) {
        if (a->segs[k] == si) {
            memmove(&a->segs[k], &a->segs[k + 1], (size_t)(a->nsegs - k - 1) * sizeof(int32_t));
            a->nsegs--;
            break;
        }
    }
    s->alive = 0;
    c->reserved -= (long long)s->size;
}

/* the last step of every model's malloc: buffer ``b`` counted as allocated; its address */
long long fp_served(Core *c, int32_t b) {
    c->allocated += (long long)c->bufs[b].size;
    if (c->allocated > c->peak_allocated) c->peak_allocated = c->allocated;
    return (long long)c->bufs[b].addr;
}

/* the model's _record_oom(size, stream, tag) (AllocatorModel's, in Python; ``size`` a new
 * reference, consumed), or past full_oom_records a count (oom_counted set); -2, or -1 on error */
long long fp_record_oom(Core *c, PyObject *size, i64 stream, PyObject *tag) {
    c->oom_counted = 0;
    if (c->full_oom_records >= 0) {
        PyObject *ooms = PyObject_GetAttr((PyObject *)c, fp_str_ooms);
        Py_ssize_t made = ooms ? PyObject_Length(ooms) : -1;
        Py_XDECREF(ooms);
        if (made < 0) { Py_XDECREF(size); return -1; }
        if (made >= c->full_oom_records) {
            Py_XDECREF(size);
            c->ooms_counted++;
            c->oom_counted = 1;
            return -2;
        }
    }
    PyObject *st = PyLong_FromLongLong(stream);
    PyObject *r = (size && st) ? PyObject_CallMethodObjArgs((PyObject *)c, fp_str_record_oom, size, st, tag, NULL) : NULL;
    Py_XDECREF(size); Py_XDECREF(st);
    if (!r) return -1;
    Py_DECREF(r);
    return -2;
}

/* first position in ``order`` whose segment starts at or after ``addr`` */
Py_ssize_t fp_order_search(Core *c, u64 addr) {
    Py_ssize_t lo = 0, hi = c->norder;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (c->segs[c->order[mid]].addr < addr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

int fp_order_insert(Core *c, int32_t si) {
    if (fp_grow_array((void **)&c->order, &c->caporder, c->norder + 1, sizeof(int32_t)) < 0) return -1;
    Py_ssize_t at = fp_order_search(c, c->segs[si].addr);
    memmove(&c->order[at + 1], &c->order[at], (size_t)(c->norder - at) * sizeof(int32_t));
    c->order[at] = si;
    c->norder++;
    return 0;
}

/* the segment starting at ``addr`` leaves ``order`` */
void fp_order_remove(Core *c, u64 addr) {
    Py_ssize_t at = fp_order_search(c, addr);
    memmove(&c->order[at], &c->order[at + 1], (size_t)(c->norder - at - 1) * sizeof(int32_t));
    c->norder--;
}

int fp_get_u64(PyObject *obj, u64 *out, const char *what) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "%s must be an integer in [0, 2**64), got %R", what, obj);
        return -1;
    }
    *out = v;
    return 0;
}

/* free the live buffer at ``addr`` (nothing when there is none), merged with idle neighbours
 * (MindSpore's and torch's free, a region's release): a ring ``head`` (a region's, else NULL)
 * at a merged-away buffer moves to the merged one; -1 on error */
int fp_free_merge(Core *c, u64 addr, u64 *head) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != 1) return 0;
    Buf *bufs = c->bufs;
    c->allocated -= (long long)bufs[b].size;
    bufs[b].used = 0;
    int32_t prev = bufs[b].prev;
    if (prev >= 0 && !bufs[prev].used) {
        fp_unindex_buf(c, prev);
        bufs[prev].size += bufs[b].size;
        int32_t nxt = bufs[b].next;
        bufs[prev].next = nxt;
        if (nxt >= 0) bufs[nxt].prev = prev;
        if (head && *head == bufs[b].addr) *head = bufs[prev].addr;
        fp_buf_drop(c, b);
        b = prev;
    }
    int32_t nxt = bufs[b].next;
    if (nxt >= 0 && !bufs[nxt].used) {
        fp_unindex_buf(c, nxt);
        bufs[b].size += bufs[nxt].size;
        int32_t after = bufs[nxt].next;
        bufs[b].next = after;
        if (after >= 0) bufs[after].prev = b;
        if (head && *head == bufs[nxt].addr) *head = bufs[b].addr;
        fp_buf_drop(c, nxt);
    }
    return fp_index_buf(c, b);
}

/* MindSpore's pool names; a model may name its allocators otherwise (Model.pool_name) */
static const char *pool_name(Core *c, const Alloc *a) {
    if (c->model->pool_name) return c->model->pool_name(a);
    return a->persistent ? "persistent" : (a->small ? "small" : "common");
}

/* whether a request's ``pool`` is "persistent" (MindSpore's persistent pool) */
int fp_persistent(PyObject *pool) {
    if (pool == Py_None) return 0;
    if (pool == fp_str_persistent) return 1;
    return PyUnicode_Check(pool) && PyUnicode_Compare(pool, fp_str_persistent) == 0;
}

/* [(addr, size, stream, pool, [(addr, size, used), ...]), ...] for every segment, allocator order */
PyObject *fp_segments(Core *c, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Alloc *a = &c->allocs[ai];
        for (Py_ssize_t k = 0; k < a->nsegs; k++) {
            Seg *s = &c->segs[a->segs[k]];
            PyObject *blocks = PyList_New(0);
            if (!blocks) goto fail;
            for (int32_t b = s->head; b >= 0; b = c->bufs[b].next) {
                PyObject *t = Py_BuildValue("(KKO)", c->bufs[b].addr, c->bufs[b].size,
                                            c->bufs[b].used ? Py_True : Py_False);
                if (!t || PyList_Append(blocks, t) < 0) { Py_XDECREF(t); Py_DECREF(blocks); goto fail; }
                Py_DECREF(t);
            }
            PyObject *seg = Py_BuildValue("(KKLsN)", s->addr, s->size, (long long)s->stream, pool_name(c, a), blocks);
            if (!seg || PyList_Append(out, seg) < 0) { Py_XDECREF(seg); goto fail; }
            Py_DECREF(seg);
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* restore one recorded segment: add_segment(addr, size, stream, persistent, small, pieces)
 * with ``pieces`` [(addr, size, live), ...] tiling it, idle neighbours already merged */
PyObject *fp_add_segment(Core *c, PyObject *args) {
    unsigned long long addr, size;
    long long stream;
    int persistent, small;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KKLppO", &addr, &size, &stream, &persistent, &small, &pieces)) return NULL;
    Py_ssize_t ai = fp_get_alloc(c, stream, persistent, small);
    if (ai < 0) return NULL;
    int32_t si = fp_new_segment_at(c, ai, addr, size, 0);
    if (si < 0) return NULL;
    PyObject *seq = PySequence_Fast(pieces, "pieces must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int32_t prev = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long paddr, psize;
        int live;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKp", &paddr, &psize, &live)) { Py_DECREF(seq); return NULL; }
        int32_t b = fp_buf_new(c, paddr, psize, live, prev, -1, si);
        if (b < 0) { Py_DECREF(seq); return NULL; }
        if (prev < 0) c->segs[si].head = b; else c->bufs[prev].next = b;
        if (live) c->allocated += (long long)psize;
        prev = b;
    }
    Py_DECREF(seq);
    for (int32_t b = c->segs[si].head; b >= 0; b = c->bufs[b].next)
        if (!c->bufs[b].used && fp_index_buf(c, b) < 0) return NULL;
    u64 next = round_up(addr + size, SEG_ALIGN);
    if (next > c->next_addr) c->next_addr = next;
    Py_RETURN_NONE;
}

