/* PyTorch with expandable segments (ms_memopt/allocators/torch_expandable.py): one virtual
 * range per (stream, small) pool, 1 1/8 x device memory (1 TiB unbounded), mapped in pages of
 * 2 MiB (small) / 20 MiB (large) as requests need them and unmapped when memory runs short or
 * the cache is emptied (a range left with nothing mapped is given back); torch's rounding
 * (torch.c) and best fit preferring blocks that cannot grow. A new range starts at the recorded
 * segment_map that announced it, else in the lowest gap. torch_npu's variant (torch_npu.py):
 * padded rounding, its large page (ExpandableState.large_page) and 2 MiB+ requests aligned
 * (ExpandableState.align). Ranges are kept by address in Core.order (common.c). */
#include "fastpool.h"

enum { X_FREE = 0, X_LIVE = 1, X_UNMAPPED = 2 };   /* Buf.used */

static Py_ssize_t unm_search(Core *c, Alloc *a, u64 addr) {
    Py_ssize_t lo = 0, hi = a->nunm;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (c->bufs[a->unm[mid]].addr < addr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int unm_insert(Core *c, Alloc *a, int32_t b) {
    if (fp_grow_array((void **)&a->unm, &a->capunm, a->nunm + 1, sizeof(int32_t)) < 0) return -1;
    Py_ssize_t at = unm_search(c, a, c->bufs[b].addr);
    memmove(&a->unm[at + 1], &a->unm[at], (size_t)(a->nunm - at) * sizeof(int32_t));
    a->unm[at] = b;
    a->nunm++;
    return 0;
}

static void unm_remove(Core *c, Alloc *a, int32_t b) {
    Py_ssize_t at = unm_search(c, a, c->bufs[b].addr);
    memmove(&a->unm[at], &a->unm[at + 1], (size_t)(a->nunm - at - 1) * sizeof(int32_t));
    a->nunm--;
}

static inline Alloc *x_alloc(Core *c, int32_t b) { return &c->allocs[c->segs[c->bufs[b].seg].alloc]; }

/* _absorb_next: ``b`` takes over its next buffer */
static void x_absorb_next(Core *c, int32_t b) {
    int32_t nxt = c->bufs[b].next;
    c->bufs[b].size += c->bufs[nxt].size;
    int32_t after = c->bufs[nxt].next;
    c->bufs[b].next = after;
    if (after >= 0) c->bufs[after].prev = b;
    fp_buf_drop(c, nxt);
}

/* _merge_free: the free ``b`` merged with free neighbours and indexed; the merged buffer */
static int32_t x_merge_free(Core *c, int32_t b) {
    int32_t prev = c->bufs[b].prev;
    if (prev >= 0 && c->bufs[prev].used == X_FREE) {
        fp_unindex_buf(c, prev);
        x_absorb_next(c, prev);
        b = prev;
    }
    int32_t nxt = c->bufs[b].next;
    if (nxt >= 0 && c->bufs[nxt].used == X_FREE) {
        fp_unindex_buf(c, nxt);
        x_absorb_next(c, b);
    }
    if (fp_index_buf(c, b) < 0) return -1;
    return b;
}

static u64 x_expandable(Core *c, int32_t b) {
    int32_t nxt = c->bufs[b].next;
    if (nxt >= 0 && c->bufs[nxt].used == X_UNMAPPED) return c->bufs[b].size + c->bufs[nxt].size;
    return c->bufs[b].size;
}

/* _tail: a range's last buffer */
static int32_t x_tail(Core *c, Seg *s) {
    int32_t b = s->head;
    while (c->bufs[b].prev >= 0) b = c->bufs[b].prev;
    while (c->bufs[b].next >= 0) b = c->bufs[b].next;
    return b;
}

/* _claim: whether a new range may start at ``addr`` (outside every range, or in the unmapped
 * tail of one, which then ends there) */
static int x_claim(Core *c, u64 addr) {
    Py_ssize_t i = fp_order_search(c, addr + 1);
    if (i == 0) return 1;
    Seg *s = &c->segs[c->order[i - 1]];
    if (addr >= s->addr + s->size) return 1;
    int32_t t = x_tail(c, s);
    if (c->bufs[t].used != X_UNMAPPED || c->bufs[t].addr >= addr) return 0;
    c->bufs[t].size = addr - c->bufs[t].addr;
    s->size = addr - s->addr;
    return 1;
}

/* _range_place: a new range's base (and ``*size``, shortened to the next range above a
 * recorded base) */
static u64 x_range_place(Core *c, i64 stream, u64 *size) {
    for (Py_ssize_t k = 0; k < c->x.nhints; k++) {
        u64 addr = c->x.hints[k].addr;
        if (c->x.hints[k].stream == stream && x_claim(c, addr)) {
            Py_ssize_t i = fp_order_search(c, addr + 1);
            if (i < c->norder && c->segs[c->order[i]].addr - addr < *size) *size = c->segs[c->order[i]].addr - addr;
            return addr;
        }
    }
    u64 cursor = c->x.next_base;
    for (Py_ssize_t k = 0; k < c->norder; k++) {
        Seg *s = &c->segs[c->order[k]];
        u64 end = s->addr + s->size;
        if (end <= cursor) continue;
        if (s->addr >= cursor + *size) break;
        cursor = round_up(end, GIB) + GIB;
    }
    return cursor;
}

/* a new range of allocator ``ai``: one unmapped buffer; the buffer, -1 on error */
static int32_t x_new_range(Core *c, Py_ssize_t ai, u64 base, u64 size, u64 page, int fixed) {
    if (fp_grow_array((void **)&c->segs, &c->capsegs, c->nsegs + 1, sizeof(Seg)) < 0) return -1;
    Alloc *a = &c->allocs[ai];
    if (fp_grow_array((void **)&a->segs, &a->capsegs, a->nsegs + 1, sizeof(int32_t)) < 0) return -1;
    int32_t si = (int32_t)c->nsegs++;
    Seg *s = &c->segs[si];
    s->addr = base; s->size = size; s->stream = a->stream; s->alloc = (int32_t)ai; s->head = -1; s->alive = 1;
    s->page = page; s->fixed = fixed;
    a->segs[a->nsegs++] = si;
    if (fp_order_insert(c, si) < 0) return -1;
    return si;
}

/* _find_expandable: the start of the lowest unmapped stretch (with the free buffer before it)
 * that can hold ``rsize``, else a new range's unmapped buffer */
static int32_t x_find_expandable(Core *c, Py_ssize_t ai, u64 rsize, int small) {
    Alloc *a = &c->allocs[ai];
    for (Py_ssize_t k = 0; k < a->nunm; k++) {
        int32_t start = a->unm[k];
        int32_t prev = c->bufs[start].prev;
        if (prev >= 0 && c->bufs[prev].used == X_FREE) start = prev;
        u64 room = 0;
        int32_t cursor = start;
        while (room < rsize && cursor >= 0 && c->bufs[cursor].used != X_LIVE) {
            room += c->bufs[cursor].size;
            cursor = c->bufs[cursor].next;
        }
        if (room >= rsize) return start;
    }
    u64 page = small ? T_SMALL_BUFFER : (c->x.large_page ? c->x.large_page : T_LARGE_BUFFER);
    u64 size = c->x.range_size > rsize ? c->x.range_size : rsize;
    size = round_up(size, page);
    u64 base = x_range_place(c, c->allocs[ai].stream, &size);
    int32_t si = x_new_range(c, ai, base, size, page, 0);
    if (si < 0) return -1;
    int32_t b = fp_buf_new(c, base, size, X_UNMAPPED, -1, -1, si);
    if (b < 0) return -1;
    c->segs[si].head = b;
    if (unm_insert(c, &c->allocs[ai], b) < 0) return -1;
    return b;
}

/* _map: whole pages covering ``want`` bytes at the start of the unmapped ``b``; -2 no room */
static int32_t x_map(Core *c, int32_t b, u64 want) {
    Seg *rng = &c->segs[c->bufs[b].seg];
    u64 page = rng->page;
    u64 size = round_up(want, page);
    if (size > c->bufs[b].size) size = c->bufs[b].size;
    if (c->bounded && (u64)c->reserved + size > c->capacity) return -2;
    Alloc *a = x_alloc(c, b);
    unm_remove(c, a, b);
    if (size < c->bufs[b].size) {
        int32_t rest = fp_split_off(c, b, size, X_UNMAPPED);
        if (rest < 0 || unm_insert(c, a, rest) < 0) return -1;
    }
    c->bufs[b].used = X_FREE;
    c->reserved += (long long)size;
    c->segment_allocs += 1;
    if (c->reserved > c->peak_reserved) c->peak_reserved = c->reserved;
    return x_merge_free(c, b);
}

static int32_t x_map_for(Core *c, Py_ssize_t ai, u64 rsize, int small) {
    int32_t cand = x_find_expandable(c, ai, rsize, small);
    if (cand < 0) return cand;
    while (c->bufs[cand].size < rsize || c->bufs[cand].used != X_FREE) {
        int32_t to_map;
        u64 want;
        if (c->bufs[cand].used == X_UNMAPPED) { to_map = cand; want = rsize; }
        else { to_map = c->bufs[cand].next; want = rsize - c->bufs[cand].size; }
        cand = x_map(c, to_map, want);
        if (cand < 0) return cand;
    }
    return cand;
}

/* _unmap: the whole pages inside the free ``b`` (within [lo, hi)) go back; 1 when any did */
static int x_unmap(Core *c, int32_t b, u64 lo, u64 hi) {
    Seg *rng = &c->segs[c->bufs[b].seg];
    u64 addr = c->bufs[b].addr, size = c->bufs[b].size;
    Alloc *a = x_alloc(c, b);
    if (rng->fixed) {
        /* a recorded (non-expandable) segment goes back only whole, like cudaFree */
        if (c->bufs[b].prev < 0 && c->bufs[b].next < 0) {
            int32_t si = c->bufs[b].seg;
            fp_unindex_buf(c, b);
            fp_buf_drop(c, b);
            fp_order_remove(c, c->segs[si].addr);
            c->segs[si].alive = 0;
            c->reserved -= (long long)size;
            return 1;
        }
        return 0;
    }
    u64 page = rng->page, base = rng->addr;
    u64 from = addr > lo ? addr : lo, to = addr + size < hi ? addr + size : hi;
    if (from >= to) return 0;
    u64 begin = base + round_up(from - base, page);
    u64 end = base + (to - base) / page * page;
    if (begin >= end) return 0;
    fp_unindex_buf(c, b);
    /* carve [addr, begin) free | [begin, end) unmapped | [end, addr + size) free */
    if (end < addr + size) {
        int32_t tail = fp_split_off(c, b, end - addr, X_FREE);
        if (tail < 0 || fp_index_buf(c, tail) < 0) return -1;
    }
    int32_t u;
    if (begin > addr) {
        u = fp_split_off(c, b, begin - addr, X_UNMAPPED);
        if (u < 0 || fp_index_buf(c, b) < 0) return -1;
    } else {
        c->bufs[b].used = X_UNMAPPED;
        u = b;
    }
    c->reserved -= (long long)(end - begin);
    int32_t prev = c->bufs[u].prev;
    if (prev >= 0 && c->bufs[prev].used == X_UNMAPPED) {
        x_absorb_next(c, prev);
        u = prev;
    } else if (unm_insert(c, a, u) < 0) return -1;
    int32_t nxt = c->bufs[u].next;
    if (nxt >= 0 && c->bufs[nxt].used == X_UNMAPPED) {
        unm_remove(c, a, nxt);
        x_absorb_next(c, u);
    }
    if (c->bufs[u].prev < 0 && c->bufs[u].next < 0) {
        /* release_expandable_segment: nothing mapped is left, the range goes back */
        int32_t si = c->bufs[u].seg;
        unm_remove(c, a, u);
        fp_buf_drop(c, u);
        fp_order_remove(c, c->segs[si].addr);
        c->segs[si].alive = 0;
    }
    return 1;
}

/* _unmap_all: every free buffer's whole pages; 1 when any were unmapped, -1 on error */
static int x_unmap_all(Core *c) {
    int released = 0;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Py_ssize_t n = c->allocs[ai].nkeys;
        int32_t *copy = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
        if (!copy) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t k = 0; k < n; k++) copy[k] = c->allocs[ai].keys[k].buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            int r = x_unmap(c, copy[k], 0, ~0ULL);
            if (r < 0) { PyMem_Free(copy); return -1; }
            released |= r;
        }
        PyMem_Free(copy);
    }
    return released;
}

long long fp_x_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *unused) {
    u64 rsize = fp_torch_round(c, raw);
    int small = rsize <= SMALL_SIZE;
    Py_ssize_t ai = fp_get_alloc(c, stream, 0, small);
    if (ai < 0) return -1;
    Alloc *a = &c->allocs[ai];
    int32_t b;
    Py_ssize_t i = lower_bound(a, rsize, 0);
    if (i < a->nkeys) {
        /* prefer blocks that cannot grow into unmapped space (their "expandable size") */
        while (i + 1 < a->nkeys && x_expandable(c, a->keys[i + 1].buf) < x_expandable(c, a->keys[i].buf)) i++;
        b = a->keys[i].buf;
        key_pop(a->keys, &a->nkeys, i);
    } else {
        b = x_map_for(c, ai, rsize, small);
        if (b == -2) {
            int r = x_unmap_all(c);
            if (r < 0) return -1;
            if (r) b = x_map_for(c, ai, rsize, small);
        }
        c->x.nhints = 0;
        if (b == -1) return -1;
        if (b == -2) return fp_record_oom(c, PyLong_FromLongLong(raw), stream, tag);
        fp_unindex_buf(c, b);
    }
    c->x.nhints = 0;          /* they announced this request's mappings, no later one's */
    u64 align = c->x.align;
    if (rsize >= T_ROUND_LARGE && align && c->bufs[b].addr % align) {
        /* torch_npu's _place: start on the next ``align`` boundary, the bytes before stay free */
        u64 offset = align - c->bufs[b].addr % align;
        if (offset + rsize <= c->bufs[b].size) {
            int32_t start = fp_split_off(c, b, offset, X_FREE);
            if (start < 0 || fp_index_buf(c, b) < 0) return -1;
            b = start;
        }
    }
    c->bufs[b].used = X_LIVE;
    u64 remaining = c->bufs[b].size - rsize;
    if (remaining >= 512) {
        int32_t rest = fp_split_off(c, b, rsize, X_FREE);
        if (rest < 0 || x_merge_free(c, rest) < 0) return -1;
    }
    return fp_served(c, b);
}

int fp_x_free(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != X_LIVE) return 0;
    c->bufs[b].used = X_FREE;
    c->allocated -= (long long)c->bufs[b].size;
    return x_merge_free(c, b) < 0 ? -1 : 0;
}

/* restore one range as torch_expandable.restore_ranges plans it: _add_range(addr, size, stream,
 * small, pieces, page, fixed) with ``pieces`` [(addr, size, state), ...] tiling it (state 0 free,
 * 1 live, 2 unmapped; free neighbours merged); page and fixed default to a fixed, fully mapped
 * range of one page */
PyObject *fp_x_add_range(Core *c, PyObject *args) {
    unsigned long long addr, size, page = 0;
    long long stream;
    int small, fixed = 1;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KKLpO|Kp", &addr, &size, &stream, &small, &pieces, &page, &fixed)) return NULL;
    Py_ssize_t ai = fp_get_alloc(c, stream, 0, small);
    if (ai < 0) return NULL;
    int32_t si = x_new_range(c, ai, addr, size, page ? page : size, fixed);
    if (si < 0) return NULL;
    PyObject *seq = PySequence_Fast(pieces, "pieces must be a sequence");
    if (!seq) return NULL;
    int32_t prev = -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        unsigned long long paddr, psize;
        int state;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKi", &paddr, &psize, &state)) { Py_DECREF(seq); return NULL; }
        if (state < X_FREE || state > X_UNMAPPED) {
            PyErr_Format(PyExc_ValueError, "piece state must be 0 (free), 1 (live) or 2 (unmapped), got %d", state);
            Py_DECREF(seq);
            return NULL;
        }
        int32_t b = fp_buf_new(c, paddr, psize, state, prev, -1, si);
        if (b < 0) { Py_DECREF(seq); return NULL; }
        if (prev < 0) c->segs[si].head = b; else c->bufs[prev].next = b;
        if (state != X_UNMAPPED) c->reserved += (long long)psize;
        if (state == X_LIVE) c->allocated += (long long)psize;
        else if (state == X_FREE ? fp_index_buf(c, b) < 0 : unm_insert(c, &c->allocs[ai], b) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        prev = b;
    }
    Py_DECREF(seq);
    if (addr + size > c->x.next_base) c->x.next_base = addr + size;
    Py_RETURN_NONE;
}

/* after restoring: the next range starts on a GiB boundary */
PyObject *fp_x_restored(Core *c, PyObject *unused) {
    c->x.next_base = round_up(c->x.next_base, GIB);
    Py_RETURN_NONE;
}

/* [(base, stream, small, [(addr, size, state), ...]), ...] by base; state 0 free 1 live 2 unmapped */
PyObject *fp_x_ranges(Core *c, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t k = 0; k < c->norder; k++) {
        Seg *s = &c->segs[c->order[k]];
        PyObject *blocks = PyList_New(0);
        if (!blocks) { Py_DECREF(out); return NULL; }
        int32_t b = s->head;
        while (b >= 0 && c->bufs[b].prev >= 0) b = c->bufs[b].prev;   /* the range's first buffer */
        for (; b >= 0; b = c->bufs[b].next) {
            PyObject *t = Py_BuildValue("(KKi)", c->bufs[b].addr, c->bufs[b].size, c->bufs[b].used);
            if (!t || PyList_Append(blocks, t) < 0) { Py_XDECREF(t); Py_DECREF(blocks); Py_DECREF(out); return NULL; }
            Py_DECREF(t);
        }
        PyObject *r = Py_BuildValue("(KLON)", s->addr, (long long)s->stream,
                                    c->allocs[s->alloc].small ? Py_True : Py_False, blocks);
        if (!r || PyList_Append(out, r) < 0) { Py_XDECREF(r); Py_DECREF(out); return NULL; }
        Py_DECREF(r);
    }
    return out;
}

int fp_x_empty_cache(Core *c) { return x_unmap_all(c) < 0 ? -1 : 0; }

/* a recorded segment_free means the recording released cached memory: unmap here too */
int fp_x_release_segment(Core *c, PyObject *addr, PyObject *size, PyObject *stream) { return fp_x_empty_cache(c); }

static int x_read(PyObject *addr_obj, PyObject *size_obj, PyObject *stream_obj, u64 *addr, u64 *size, i64 *stream) {
    *size = 0; *stream = 0;
    if (fp_get_u64(addr_obj, addr, "addr") < 0 || (size_obj && fp_get_u64(size_obj, size, "size") < 0)) return -1;
    if (stream_obj && (*stream = PyLong_AsLongLong(stream_obj)) == -1 && PyErr_Occurred()) return -1;
    return 0;
}

/* a recorded segment_map: a new range the next request needs starts there */
int fp_x_note_segment_map(Core *c, PyObject *addr_obj, PyObject *size_obj, PyObject *stream_obj) {
    if (addr_obj == Py_None) return 0;
    u64 addr, size;
    i64 stream;
    if (x_read(addr_obj, size_obj, stream_obj, &addr, &size, &stream) < 0) return -1;
    if (fp_grow_array((void **)&c->x.hints, &c->x.caphints, c->x.nhints + 1, sizeof(Recorded)) < 0) return -1;
    c->x.hints[c->x.nhints].addr = addr; c->x.hints[c->x.nhints].size = size; c->x.hints[c->x.nhints].stream = stream;
    c->x.nhints++;
    return 0;
}

/* a recorded segment_unmap of [addr, addr + size): the free pages there go back */
int fp_x_unmap_range(Core *c, PyObject *addr_obj, PyObject *size_obj, PyObject *stream_obj) {
    u64 addr, size;
    i64 stream;
    if (x_read(addr_obj, size_obj, stream_obj, &addr, &size, &stream) < 0) return -1;
    u64 end = addr + size;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Py_ssize_t n = c->allocs[ai].nkeys;
        int32_t *copy = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
        if (!copy) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t k = 0; k < n; k++) copy[k] = c->allocs[ai].keys[k].buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            Buf *f = &c->bufs[copy[k]];
            if (f->used != X_FREE || f->addr >= end || f->addr + f->size <= addr) continue;
            if (x_unmap(c, copy[k], addr, end) < 0) { PyMem_Free(copy); return -1; }
        }
        PyMem_Free(copy);
    }
    return 0;
}

/* a new range's base: from 16 TiB */
int fp_x_init(Core *c) {
    c->x.range_size = c->bounded ? c->capacity + c->capacity / 8 : (1ULL << 40);
    c->x.next_base = 1ULL << 44;
    return 0;
}

const Model fp_expandable_model = {
    .kind = "expandable",
    .malloc = fp_x_malloc,
    .free = fp_x_free,
    .init = fp_x_init,
    .empty_cache = fp_x_empty_cache,
    .release_segment = fp_x_release_segment,   /* recorded segment_allocs place nothing here */
    .note_segment_map = fp_x_note_segment_map,
    .unmap_range = fp_x_unmap_range,
};
