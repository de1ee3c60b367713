/* PyTorch's caching allocator (ms_memopt/allocators/torch.py), and torch_npu's (torch_npu.py:
 * the same rules, requests padded by TorchState.pad, page_size:1g): small (<= 1 MiB) and large
 * pools per stream, sizes rounded (roundup_power2_divisions), segments of 2 MiB / 20 MiB / the
 * rounded size at the lowest free address from 1 TiB (or a recorded one), split when enough
 * remains, cached segments released when a new one does not fit; max_split_size_mb's oversize
 * rules and release, garbage_collection_threshold's release by age. Segments are kept by
 * address in Core.order (common.c; torch_expandable.c's ranges too). */
#include "fastpool.h"

#define T_MIN_LARGE_ALLOC (10 * MIB)
#define T_ADDRESS_BASE (1ULL << 40)

static int bit_length(u64 v) { return v ? 64 - __builtin_clzll(v) : 0; }

/* round_size(size + pad, divisions) */
u64 fp_torch_round(Core *c, long long raw) {
    long long padded = raw + (long long)c->torch.pad;
    if (padded < 512) return 512;
    u64 size = (u64)padded, d = c->torch.divisions;
    if (d > 1 && size > 512 * d) {
        if ((size & (size - 1)) == 0) return size;
        u64 floor = 1ULL << (bit_length(size) - 1);
        u64 step = floor >> (bit_length(d) - 1);
        if (step == 0) return floor << 1;
        u64 low = size & ~(step - 1);
        return low == size ? size : low + step;
    }
    return (size + 511) / 512 * 512;
}

/* _segment_size: allocation_size, or torch_npu's whole GiB for the large pool with page_size:1g */
static u64 torch_allocation_size(Core *c, u64 rounded) {
    if (c->torch.page_1g && rounded > SMALL_SIZE) return round_up(rounded, GIB);
    if (rounded <= SMALL_SIZE) return T_SMALL_BUFFER;
    if (rounded < T_MIN_LARGE_ALLOC) return T_LARGE_BUFFER;
    return round_up(rounded, T_ROUND_LARGE);
}

static int torch_is_unused(Core *c, u64 addr, u64 size) {
    Py_ssize_t i = fp_order_search(c, addr);
    if (i < c->norder && c->segs[c->order[i]].addr < addr + size) return 0;
    if (i > 0) {
        Seg *before = &c->segs[c->order[i - 1]];
        if (before->addr + before->size > addr) return 0;
    }
    return 1;
}

static u64 torch_lowest_gap(Core *c, u64 size) {
    u64 cursor = T_ADDRESS_BASE;
    for (Py_ssize_t k = 0; k < c->norder; k++) {
        Seg *s = &c->segs[c->order[k]];
        u64 end = s->addr + s->size;
        if (end <= cursor) continue;
        if (s->addr >= cursor + size) break;
        cursor = round_up(end, T_ROUND_LARGE);
    }
    return cursor;
}

/* _new_segment: -2 when it does not fit in the capacity */
static int32_t torch_new_segment(Core *c, Py_ssize_t ai, u64 size, i64 stream) {
    if (c->bounded && (u64)c->reserved + size > c->capacity) return -2;
    int found = 0;
    u64 addr = 0;
    for (Py_ssize_t i = 0; i < c->torch.ntrec; i++) {
        Recorded *r = &c->torch.trec[i];
        if (r->size == size && r->stream == stream && torch_is_unused(c, r->addr, size)) {
            addr = r->addr;
            memmove(&c->torch.trec[i], &c->torch.trec[i + 1], (size_t)(c->torch.ntrec - i - 1) * sizeof(Recorded));
            c->torch.ntrec--;
            found = 1;
            break;
        }
    }
    if (!found) addr = torch_lowest_gap(c, size);
    int32_t si = fp_new_segment_at(c, ai, addr, size, 1);
    if (si >= 0) c->segment_allocs += 1;
    return si;
}

/* a free buffer that is a whole segment */
static int torch_unsplit_idle(const Buf *b) { return !b->used && b->prev < 0 && b->next < 0; }

static int torch_idle(Core *c, int32_t si) {
    Seg *s = &c->segs[si];
    int32_t h = s->head;
    return s->alive && h >= 0 && torch_unsplit_idle(&c->bufs[h]);
}

/* _release: give the idle, unsplit segment back to the device */
static void torch_release(Core *c, int32_t si) {
    Seg *s = &c->segs[si];
    int32_t h = s->head;
    fp_unindex_buf(c, h);
    fp_buf_drop(c, h);
    fp_order_remove(c, s->addr);
    fp_drop_segment(c, si);
}

/* _release_cached: every idle unsplit segment goes back; how many did */
static int torch_release_cached(Core *c) {
    int released = 0;
    for (Py_ssize_t k = 0; k < c->norder;) {
        int32_t si = c->order[k];
        if (torch_idle(c, si)) { torch_release(c, si); released++; }
        else k++;
    }
    return released;
}

/* _release_oversize (release_available_cached_blocks): idle cached blocks at or above
 * max_split_size of the request's allocator ``a`` go back: the smallest one of at least
 * max(request, max_split_size), else the largest ones until that much is freed; whether any did */
static int torch_release_oversize(Core *c, Alloc *a, u64 rsize) {
    u64 ms = c->torch.max_split, target = rsize > ms ? rsize : ms;
    for (Py_ssize_t at = lower_bound(a, target, 0); at < a->nkeys; at++) {
        int32_t b = a->keys[at].buf;
        if (torch_unsplit_idle(&c->bufs[b])) { torch_release(c, c->bufs[b].seg); return 1; }
    }
    /* the largest first; a restored state may hold an oversize block inside a split segment: it stays */
    u64 released = 0;
    Py_ssize_t n = 0;
    int32_t *chosen = PyMem_Malloc(sizeof(int32_t) * (size_t)(a->nkeys + 1));
    if (!chosen) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t at = a->nkeys - 1; at >= 0 && released < target && a->keys[at].size >= ms; at--) {
        int32_t b = a->keys[at].buf;
        if (!torch_unsplit_idle(&c->bufs[b])) continue;
        chosen[n++] = c->bufs[b].seg;
        released += a->keys[at].size;
    }
    int freed = released >= target;
    if (freed)
        for (Py_ssize_t k = 0; k < n; k++) torch_release(c, chosen[k]);
    PyMem_Free(chosen);
    return freed;
}

typedef struct { int32_t seg; long long age; } Aged;

static int aged_by_stream(const void *x, const void *y) {
    i64 s1 = ((const Alloc *const *)x)[0]->stream, s2 = ((const Alloc *const *)y)[0]->stream;
    return (s1 > s2) - (s1 < s2);
}

/* _garbage_collect (garbage_collect_cached_blocks): with reserved memory above
 * gc_threshold * capacity, idle unsplit large-pool segments go back, those idle at least the
 * average age first (age: their pool's lookups since the block was freed), in (stream, size,
 * address) order, pass after pass until the excess is reclaimed; -1 on error */
static int torch_garbage_collect(Core *c) {
    u64 threshold = (u64)(c->torch.gc_threshold * (double)c->capacity);
    if ((u64)c->reserved <= threshold) return 0;
    u64 target = (u64)c->reserved - threshold;
    Alloc **large = PyMem_Malloc(sizeof(Alloc *) * (size_t)(c->nallocs + 1));
    Py_ssize_t nlarge = 0, nkeys = 0;
    if (!large) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < c->nallocs; i++)
        if (!c->allocs[i].small) { large[nlarge++] = &c->allocs[i]; nkeys += c->allocs[i].nkeys; }
    qsort(large, (size_t)nlarge, sizeof(Alloc *), aged_by_stream);
    Aged *blocks = PyMem_Malloc(sizeof(Aged) * (size_t)(nkeys + 1));
    if (!blocks) { PyMem_Free(large); PyErr_NoMemory(); return -1; }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < nlarge; i++)
        for (Py_ssize_t at = 0; at < large[i]->nkeys; at++) {
            Buf *b = &c->bufs[large[i]->keys[at].buf];
            if (!torch_unsplit_idle(b)) continue;
            blocks[n].seg = b->seg;
            blocks[n++].age = large[i]->lookups - c->segs[b->seg].freed_at;
        }
    PyMem_Free(large);
    if (n) c->slow_path_events += 1;
    u64 reclaimed = 0;
    while (reclaimed < target && n) {
        __int128 total = 0;
        for (Py_ssize_t k = 0; k < n; k++) total += blocks[k].age;
        Py_ssize_t kept = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            /* age >= the average, in integers; PyTorch does not stop at the target inside one pass */
            if ((__int128)blocks[k].age * n >= total) {
                reclaimed += c->segs[blocks[k].seg].size;
                torch_release(c, blocks[k].seg);
            } else {
                blocks[kept++] = blocks[k];
            }
        }
        n = kept;
    }
    PyMem_Free(blocks);
    return 0;
}

/* _grow: the new segment's buffer taken out of the free list; -2 none, -1 error */
static int32_t torch_grow(Core *c, Py_ssize_t ai, u64 rsize, i64 stream) {
    u64 seg_size = torch_allocation_size(c, rsize);
    if (c->torch.gc_threshold > 0 && c->bounded && torch_garbage_collect(c) < 0) return -1;
    int32_t si = torch_new_segment(c, ai, seg_size, stream);
    if (si == -2 && c->torch.max_split) {
        int released = torch_release_oversize(c, &c->allocs[ai], rsize);
        if (released < 0) return -1;
        if (released) si = torch_new_segment(c, ai, seg_size, stream);
    }
    if (si == -2 && torch_release_cached(c)) {      /* the slow path: release, then retry */
        c->slow_path_events += 1;
        si = torch_new_segment(c, ai, seg_size, stream);
    }
    if (si < 0) return si;
    int32_t b = c->segs[si].head;
    fp_unindex_buf(c, b);
    return b;
}

/* the whole malloc of the reference: the address, or -2 after recording an OOM, -1 on error */
long long fp_torch_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *unused) {
    u64 rsize = fp_torch_round(c, raw);
    int small = rsize <= SMALL_SIZE;
    Py_ssize_t ai = fp_get_alloc(c, stream, 0, small);
    if (ai < 0) return -1;
    Alloc *a = &c->allocs[ai];
    int32_t b;
    u64 ms = c->torch.max_split;
    a->lookups++;
    Py_ssize_t at = lower_bound(a, rsize, 0);
    /* get_free_block: with max_split_size, a request below it takes no oversize block and a
     * larger one only a block less than 20 MiB (kLargeBuffer) above it */
    if (at < a->nkeys && !(ms && (rsize < ms ? a->keys[at].size >= ms : a->keys[at].size >= rsize + T_LARGE_BUFFER))) {
        b = a->keys[at].buf;
        key_pop(a->keys, &a->nkeys, at);
    } else {
        b = torch_grow(c, ai, rsize, stream);
        c->torch.ntrec = 0;
        if (b == -1) return -1;
        if (b == -2) return fp_record_oom(c, PyLong_FromLongLong(raw), stream, tag);
    }
    u64 remaining = c->bufs[b].size - rsize;
    if ((small ? remaining >= 512 : remaining > SMALL_SIZE && (!ms || rsize < ms)) && fp_cut(c, b, rsize) < 0)
        return -1;
    c->bufs[b].used = 1;
    return fp_served(c, b);
}

/* free with merging; the segment remembers its pool's lookups (the last free of a segment's
 * blocks is the one that leaves it idle: garbage collection reads its age from it) */
int fp_torch_free(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b >= 0 && c->bufs[b].used == 1) {
        Seg *s = &c->segs[c->bufs[b].seg];
        s->freed_at = c->allocs[s->alloc].lookups;
    }
    return fp_free_merge(c, addr, NULL);
}

/* a new segment counts as reserved bytes and takes its place by address */
int fp_torch_segment_added(Core *c, int32_t si) {
    c->segs[si].freed_at = 0;
    c->reserved += (long long)c->segs[si].size;
    return fp_order_insert(c, si);
}

int fp_torch_empty_cache(Core *c) {
    torch_release_cached(c);
    return 0;
}

/* a recorded segment_alloc: the next new segment of that size and stream goes there if free */
int fp_torch_note_segment_alloc(Core *c, PyObject *addr_obj, PyObject *size_obj, PyObject *stream_obj) {
    if (addr_obj == Py_None) return 0;
    u64 addr, size = 0;
    i64 stream = 0;
    if (fp_get_u64(addr_obj, &addr, "addr") < 0 || (size_obj && fp_get_u64(size_obj, &size, "size") < 0)) return -1;
    if (stream_obj && (stream = PyLong_AsLongLong(stream_obj)) == -1 && PyErr_Occurred()) return -1;
    TorchState *t = &c->torch;
    if (fp_grow_array((void **)&t->trec, &t->captrec, t->ntrec + 1, sizeof(Recorded)) < 0) return -1;
    t->trec[t->ntrec].addr = addr; t->trec[t->ntrec].size = size; t->trec[t->ntrec].stream = stream;
    t->ntrec++;
    return 0;
}

/* a recorded segment_free: the recorded segment if idle here, else an idle one of the same size
 * and stream */
int fp_torch_release_segment(Core *c, PyObject *addr_obj, PyObject *size_obj, PyObject *stream_obj) {
    u64 addr, size = 0;
    i64 stream = 0;
    if (fp_get_u64(addr_obj, &addr, "addr") < 0) return -1;
    if ((size_obj && fp_get_u64(size_obj, &size, "size") < 0)) return -1;
    if (stream_obj && (stream = PyLong_AsLongLong(stream_obj)) == -1 && PyErr_Occurred()) return -1;
    Py_ssize_t at = fp_order_search(c, addr);
    if (at < c->norder && c->segs[c->order[at]].addr == addr && torch_idle(c, c->order[at])) {
        torch_release(c, c->order[at]);
        return 0;
    }
    for (Py_ssize_t k = 0; k < c->norder; k++) {
        Seg *seg = &c->segs[c->order[k]];
        if (seg->size == size && seg->stream == stream && torch_idle(c, c->order[k])) {
            torch_release(c, c->order[k]);
            break;
        }
    }
    return 0;
}

const char *fp_torch_pool_name(const Alloc *a) { return a->small ? "small" : "large"; }

const Model fp_torch_model = {
    .kind = "torch",
    .malloc = fp_torch_malloc,
    .free = fp_torch_free,
    .segment_added = fp_torch_segment_added,
    .empty_cache = fp_torch_empty_cache,
    .note_segment_alloc = fp_torch_note_segment_alloc,
    .release_segment = fp_torch_release_segment,
    .pool_name = fp_torch_pool_name,
};
