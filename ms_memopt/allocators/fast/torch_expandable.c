/* PyTorch with expandable segments (ms_memopt/allocators/torch_expandable.py): one virtual
 * range per (stream, small) pool, 1 1/8 x device memory (1 TiB unbounded), mapped in pages of
 * 2 MiB (small) / 20 MiB (large) as requests need them and unmapped when memory runs short or
 * the cache is emptied; torch's rounding (torch.c) and best fit preferring blocks that cannot
 * grow. Ranges are kept by address in Core.order (common.c). */
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
    u64 page = small ? T_SMALL_BUFFER : T_LARGE_BUFFER;
    u64 size = c->x.range_size > rsize ? c->x.range_size : rsize;
    size = round_up(size, page);
    u64 base = c->x.next_base;
    c->x.next_base += round_up(size, GIB) + GIB;
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

/* _unmap: the whole pages inside the free ``b`` go back; 1 when any did */
static int x_unmap(Core *c, int32_t b) {
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
    u64 begin = base + round_up(addr - base, page);
    u64 end = base + (addr + size - base) / page * page;
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
            int r = x_unmap(c, copy[k]);
            if (r < 0) { PyMem_Free(copy); return -1; }
            released |= r;
        }
        PyMem_Free(copy);
    }
    return released;
}

static long long x_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *unused) {
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
        if (b == -1) return -1;
        if (b == -2) return fp_record_oom(c, PyLong_FromLongLong(raw), stream, tag);
        fp_unindex_buf(c, b);
    }
    c->bufs[b].used = X_LIVE;
    u64 remaining = c->bufs[b].size - rsize;
    if (remaining >= 512) {
        int32_t rest = fp_split_off(c, b, rsize, X_FREE);
        if (rest < 0 || x_merge_free(c, rest) < 0) return -1;
    }
    return fp_served(c, b);
}

static int x_free(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != X_LIVE) return 0;
    c->bufs[b].used = X_FREE;
    c->allocated -= (long long)c->bufs[b].size;
    return x_merge_free(c, b) < 0 ? -1 : 0;
}

/* restore one recorded segment as a fixed, fully mapped range: _add_range(addr, size, stream,
 * small, pieces) with ``pieces`` [(addr, size, live), ...] free neighbours merged */
PyObject *fp_x_add_range(Core *c, PyObject *args) {
    unsigned long long addr, size;
    long long stream;
    int small;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KKLpO", &addr, &size, &stream, &small, &pieces)) return NULL;
    Py_ssize_t ai = fp_get_alloc(c, stream, 0, small);
    if (ai < 0) return NULL;
    int32_t si = x_new_range(c, ai, addr, size, size, 1);
    if (si < 0) return NULL;
    c->reserved += (long long)size;
    PyObject *seq = PySequence_Fast(pieces, "pieces must be a sequence");
    if (!seq) return NULL;
    int32_t prev = -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        unsigned long long paddr, psize;
        int live;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKp", &paddr, &psize, &live)) { Py_DECREF(seq); return NULL; }
        int32_t b = fp_buf_new(c, paddr, psize, live ? X_LIVE : X_FREE, prev, -1, si);
        if (b < 0) { Py_DECREF(seq); return NULL; }
        if (prev < 0) c->segs[si].head = b; else c->bufs[prev].next = b;
        if (live) c->allocated += (long long)psize;
        else if (fp_index_buf(c, b) < 0) { Py_DECREF(seq); return NULL; }
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

static int x_empty_cache(Core *c) { return x_unmap_all(c) < 0 ? -1 : 0; }

/* a recorded segment_free means the recording released cached memory: unmap here too */
static int x_release_segment(Core *c, PyObject *addr, PyObject *size, PyObject *stream) { return x_empty_cache(c); }

/* a new range's base: from 16 TiB */
static int x_init(Core *c) {
    c->x.range_size = c->bounded ? c->capacity + c->capacity / 8 : (1ULL << 40);
    c->x.next_base = 1ULL << 44;
    return 0;
}

const Model fp_expandable_model = {
    .kind = "expandable",
    .malloc = x_malloc,
    .free = x_free,
    .init = x_init,
    .empty_cache = x_empty_cache,
    .release_segment = x_release_segment,   /* recorded segment_allocs place nothing here */
};
