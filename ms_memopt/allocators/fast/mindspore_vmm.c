/* MindSpore's VMM pool (ms_memopt/allocators/mindspore_vmm.py): one virtual range per
 * (stream, persistent) allocator, physical memory mapped in 2 MiB chunks as buffers need it;
 * idle buffers become eager-free (their whole chunks unmapped) when memory runs short
 * (FreeIdleMemsByEagerFree, defrag). */
#include "fastpool.h"

enum { V_IDLE = 0, V_USED = 1, V_EAGER = 2 };   /* Buf.used */
#define CHUNK_SHIFT 21
#define CHUNK (1ULL << CHUNK_SHIFT)

/* the mapped chunks: _ChunkSet's sorted, disjoint, non-touching runs */
static Py_ssize_t runs_bisect_left(u64 *a, Py_ssize_t n, u64 v) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) { Py_ssize_t mid = (lo + hi) >> 1; if (a[mid] < v) lo = mid + 1; else hi = mid; }
    return lo;
}
static Py_ssize_t runs_bisect_right(u64 *a, Py_ssize_t n, u64 v) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) { Py_ssize_t mid = (lo + hi) >> 1; if (v < a[mid]) hi = mid; else lo = mid + 1; }
    return lo;
}

static u64 chunks_covered(Core *c, u64 first, u64 end) {
    Py_ssize_t i = runs_bisect_right(c->vmm.cstart, c->vmm.nruns, first) - 1;
    if (i >= 0 && c->vmm.cend[i] >= end) return end - first;
    u64 total = 0;
    for (Py_ssize_t k = runs_bisect_right(c->vmm.cend, c->vmm.nruns, first); k < c->vmm.nruns; k++) {
        if (c->vmm.cstart[k] >= end) break;
        u64 lo = c->vmm.cstart[k] > first ? c->vmm.cstart[k] : first, hi = c->vmm.cend[k] < end ? c->vmm.cend[k] : end;
        total += hi - lo;
    }
    return total;
}

/* replace runs [i, j) by the ``n`` runs given */
static int runs_splice(Core *c, Py_ssize_t i, Py_ssize_t j, u64 *starts, u64 *ends, Py_ssize_t n) {
    Py_ssize_t total = c->vmm.nruns - (j - i) + n;
    if (fp_grow_array((void **)&c->vmm.cstart, &c->vmm.capruns, total, sizeof(u64)) < 0) return -1;
    if (fp_grow_array((void **)&c->vmm.cend, &c->vmm.capruns2, total, sizeof(u64)) < 0) return -1;
    memmove(&c->vmm.cstart[i + n], &c->vmm.cstart[j], (size_t)(c->vmm.nruns - j) * sizeof(u64));
    memmove(&c->vmm.cend[i + n], &c->vmm.cend[j], (size_t)(c->vmm.nruns - j) * sizeof(u64));
    for (Py_ssize_t k = 0; k < n; k++) { c->vmm.cstart[i + k] = starts[k]; c->vmm.cend[i + k] = ends[k]; }
    c->vmm.nruns = total;
    return 0;
}

static int chunks_add(Core *c, u64 first, u64 end) {
    if (end <= first) return 0;
    Py_ssize_t i = runs_bisect_left(c->vmm.cend, c->vmm.nruns, first), j = runs_bisect_right(c->vmm.cstart, c->vmm.nruns, end);
    long long added = (long long)(end - first);
    if (i < j) {
        for (Py_ssize_t k = i; k < j; k++) {
            u64 lo = c->vmm.cstart[k] > first ? c->vmm.cstart[k] : first, hi = c->vmm.cend[k] < end ? c->vmm.cend[k] : end;
            added -= (long long)(hi - lo);
        }
        if (c->vmm.cstart[i] < first) first = c->vmm.cstart[i];
        if (c->vmm.cend[j - 1] > end) end = c->vmm.cend[j - 1];
    }
    if (runs_splice(c, i, j, &first, &end, 1) < 0) return -1;
    c->vmm.chunks += added;
    return 0;
}

static int chunks_remove(Core *c, u64 first, u64 end) {
    if (end <= first) return 0;
    Py_ssize_t i = runs_bisect_right(c->vmm.cend, c->vmm.nruns, first), j = runs_bisect_left(c->vmm.cstart, c->vmm.nruns, end);
    if (i >= j) return 0;
    u64 ks[2], ke[2];
    Py_ssize_t n = 0;
    long long removed = 0;
    /* runs i..j-1 overlap [first, end); only the first can start before, only the last end after */
    for (Py_ssize_t k = i; k < j; k++) {
        u64 lo = c->vmm.cstart[k], hi = c->vmm.cend[k];
        removed += (long long)((hi < end ? hi : end) - (lo > first ? lo : first));
        if (lo < first) { ks[n] = lo; ke[n] = first; n++; }
        if (hi > end) { ks[n] = end; ke[n] = hi; n++; }
    }
    if (runs_splice(c, i, j, ks, ke, n) < 0) return -1;
    c->vmm.chunks -= removed;
    return 0;
}

/* the eager-free keys of ``a`` seen as an allocator's key array (for lower_bound) */
static inline Alloc eager_view(Alloc *a) {
    Alloc view;
    memset(&view, 0, sizeof(view));
    view.keys = a->ekeys; view.nkeys = a->nekeys;
    return view;
}

/* sorted key arrays: the idle ones are Alloc.keys (index_buf), the eager ones Alloc.ekeys */
static int v_index(Core *c, int32_t b) {
    if (c->bufs[b].used == V_IDLE) return fp_index_buf(c, b);
    Alloc *a = &c->allocs[c->segs[c->bufs[b].seg].alloc];
    if (fp_grow_array((void **)&a->ekeys, &a->capekeys, a->nekeys + 1, sizeof(Key)) < 0) return -1;
    Buf *f = &c->bufs[b];
    Alloc view = eager_view(a);
    Py_ssize_t at = lower_bound(&view, f->size, f->addr);
    memmove(&a->ekeys[at + 1], &a->ekeys[at], (size_t)(a->nekeys - at) * sizeof(Key));
    a->ekeys[at].size = f->size; a->ekeys[at].tie = f->addr; a->ekeys[at].buf = b;
    a->nekeys++;
    return 0;
}

static void v_unindex(Core *c, int32_t b) {
    Buf *f = &c->bufs[b];
    if (f->used == V_IDLE) { fp_unindex_buf(c, b); return; }
    Alloc *a = &c->allocs[c->segs[f->seg].alloc];
    Alloc view = eager_view(a);
    Py_ssize_t at = lower_bound(&view, f->size, f->addr);
    key_pop(a->ekeys, &a->nekeys, at);
}

/* _map: 1 mapped (or already), 0 the device has no chunk left, -1 error */
static int v_map(Core *c, u64 addr, u64 size) {
    u64 first = addr >> CHUNK_SHIFT, last = (addr + size - 1) >> CHUNK_SHIFT;
    u64 fresh = last + 1 - first - chunks_covered(c, first, last + 1);
    if (!fresh) return 1;
    if (c->vmm.max_chunks >= 0 && c->vmm.chunks + (long long)fresh > c->vmm.max_chunks) return 0;
    if (chunks_add(c, first, last + 1) < 0) return -1;
    c->reserved = c->vmm.chunks * (long long)CHUNK;
    if (c->reserved > c->peak_reserved) c->peak_reserved = c->reserved;
    return 1;
}

static int v_unmap(Core *c, u64 addr, u64 size) {
    u64 first = (addr + CHUNK - 1) >> CHUNK_SHIFT, end = (addr + size) >> CHUNK_SHIFT;
    return end > first ? chunks_remove(c, first, end) : 0;
}

/* _split: ``b`` keeps ``size`` bytes (the rest, >= 512 B, keeps b's state) and is used */
static int v_split(Core *c, int32_t b, u64 size) {
    u64 remaining = c->bufs[b].size - size;
    if (remaining >= ALIGN) {
        int32_t rest = fp_split_off(c, b, size, c->bufs[b].used);
        if (rest < 0 || v_index(c, rest) < 0) return -1;
    }
    c->bufs[b].used = V_USED;
    return 0;
}

/* _release: ``b`` becomes ``state``, merges with neighbours of that state, is indexed */
static int v_release(Core *c, int32_t b, int state) {
    c->bufs[b].used = state;
    int32_t prev = c->bufs[b].prev;
    if (prev >= 0 && c->bufs[prev].used == state) {
        v_unindex(c, prev);
        c->bufs[prev].size += c->bufs[b].size;
        int32_t nxt = c->bufs[b].next;
        c->bufs[prev].next = nxt;
        if (nxt >= 0) c->bufs[nxt].prev = prev;
        fp_buf_drop(c, b);
        b = prev;
    }
    int32_t nxt = c->bufs[b].next;
    if (nxt >= 0 && c->bufs[nxt].used == state) {
        v_unindex(c, nxt);
        c->bufs[b].size += c->bufs[nxt].size;
        int32_t after = c->bufs[nxt].next;
        c->bufs[b].next = after;
        if (after >= 0) c->bufs[after].prev = b;
        fp_buf_drop(c, nxt);
    }
    return v_index(c, b);
}

/* _expand: a new virtual range; -2 none, -1 error, else the buffer */
static int32_t v_expand(Core *c, Py_ssize_t ai, u64 size) {
    if (c->bounded && (long long)c->capacity - c->reserved < (long long)size) return -2;
    u64 virt = c->bounded ? c->capacity : (1ULL << 40);
    if (size > virt) virt = size;
    virt = round_up(virt, CHUNK);
    u64 addr = c->next_addr;
    c->next_addr += virt + CHUNK;
    int32_t si = fp_new_segment_at(c, ai, addr, virt, 0);
    if (si < 0) return -1;
    int32_t b = fp_buf_new(c, addr, virt, V_EAGER, -1, -1, si);
    if (b < 0) return -1;
    c->segs[si].head = b;
    c->segment_allocs += 1;
    int r = v_map(c, addr, virt - size >= ALIGN ? size : virt);
    if (r < 0) return -1;
    if (!r) return v_index(c, b) < 0 ? -1 : -2;
    return v_split(c, b, size) < 0 ? -1 : b;
}

/* _extend_idle: an idle buffer grown into the eager-free one after it; -2 none */
static int32_t v_extend_idle(Core *c, Py_ssize_t ai, u64 size) {
    Alloc *a = &c->allocs[ai];
    for (Py_ssize_t k = a->nkeys - 1; k >= 0; k--) {
        int32_t b = a->keys[k].buf, nxt = c->bufs[b].next;
        if (nxt < 0 || c->bufs[nxt].used != V_EAGER || c->bufs[b].size + c->bufs[nxt].size < size) continue;
        u64 need = size - c->bufs[b].size;
        int r = v_map(c, c->bufs[nxt].addr, need);
        if (r <= 0) return r < 0 ? -1 : -2;
        fp_unindex_buf(c, b);
        v_unindex(c, nxt);
        fp_h_del(c, c->bufs[nxt].addr);
        c->bufs[b].size = size;
        c->bufs[b].used = V_USED;
        c->bufs[nxt].addr += need;
        c->bufs[nxt].size -= need;
        if (c->bufs[nxt].size == 0) {
            int32_t after = c->bufs[nxt].next;
            c->bufs[b].next = after;
            if (after >= 0) c->bufs[after].prev = b;
            c->bufs[nxt].used = -1;                  /* the slot is free (already out of the table) */
            c->bufs[nxt].next = c->free_slot;
            c->free_slot = nxt;
        } else if (fp_h_put(c, c->bufs[nxt].addr, nxt) < 0 || v_index(c, nxt) < 0) {
            return -1;
        }
        return b;
    }
    return -2;
}

/* _take: MemBufAllocator::Malloc with eager free; -2 none, -1 error */
static int32_t v_take(Core *c, Py_ssize_t ai, u64 size) {
    Alloc *a = &c->allocs[ai];
    if (a->nsegs == 0) return v_expand(c, ai, size);
    Py_ssize_t at = lower_bound(a, size, 0);
    if (at < a->nkeys) {
        int32_t b = a->keys[at].buf;
        key_pop(a->keys, &a->nkeys, at);
        return v_split(c, b, size) < 0 ? -1 : b;
    }
    int32_t b = v_extend_idle(c, ai, size);
    if (b != -2) return b;
    a = &c->allocs[ai];
    Alloc view = eager_view(a);
    at = lower_bound(&view, size, 0);
    if (at < a->nekeys) {
        b = a->ekeys[at].buf;
        u64 map_size = c->bufs[b].size - size >= ALIGN ? size : c->bufs[b].size;
        int r = v_map(c, c->bufs[b].addr, map_size);
        if (r <= 0) return r < 0 ? -1 : -2;
        key_pop(a->ekeys, &a->nekeys, at);
        return v_split(c, b, size) < 0 ? -1 : b;
    }
    return -2;
}

/* defrag (FreeIdleMemsByEagerFree): idle buffers become eager-free; wholly free chunks unmap */
static int v_defrag(Core *c) {
    c->vmm.eager_frees += 1;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Alloc *a = &c->allocs[ai];
        Py_ssize_t n = a->nkeys;
        int32_t *idle = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
        if (!idle) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t k = 0; k < n; k++) idle[k] = a->keys[k].buf;
        a->nkeys = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            c->bufs[idle[k]].used = V_USED;          /* a used buffer turning eager-free */
            if (v_release(c, idle[k], V_EAGER) < 0) { PyMem_Free(idle); return -1; }
        }
        PyMem_Free(idle);
        a = &c->allocs[ai];
        for (Py_ssize_t k = 0; k < a->nekeys; k++)
            if (v_unmap(c, c->bufs[a->ekeys[k].buf].addr, a->ekeys[k].size) < 0) return -1;
    }
    c->reserved = c->vmm.chunks * (long long)CHUNK;
    return 0;
}

static long long v_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *unused) {
    u64 size = raw <= 0 ? ALIGN : ((u64)raw + ALIGN - 1) & ~(ALIGN - 1);
    int persistent = fp_persistent(pool);
    Py_ssize_t ai = fp_get_alloc(c, stream, persistent, 0);
    if (ai < 0) return -1;
    int32_t b = v_take(c, ai, size);
    if (b == -2) {
        c->slow_path_events += 1;        /* SyncAllStreams + FreeIdleMemsByEagerFree, then retry */
        if (v_defrag(c) < 0) return -1;
        b = v_take(c, ai, size);
        if (b == -2) b = v_expand(c, ai, size);
        if (b == -2 && !persistent) {
            Py_ssize_t other = fp_get_alloc(c, stream, 1, 0);
            if (other < 0) return -1;
            b = v_take(c, other, size);
        }
        if (b == -2) return fp_record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag);
    }
    if (b < 0) return -1;
    return fp_served(c, b);
}

static int v_free(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != V_USED) return 0;
    c->allocated -= (long long)c->bufs[b].size;
    return v_release(c, b, V_IDLE);
}

/* restore one recorded segment: _add_vrange(addr, size, stream, persistent, pieces, seg_end)
 * with pieces [(addr, size, state), ...] (Python's states: 0 used, 1 idle, 2 eager) */
PyObject *fp_v_add_range(Core *c, PyObject *args) {
    unsigned long long addr, size, seg_end;
    long long stream;
    int persistent;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KKLpOK", &addr, &size, &stream, &persistent, &pieces, &seg_end)) return NULL;
    Py_ssize_t ai = fp_get_alloc(c, stream, persistent, 0);
    if (ai < 0) return NULL;
    int32_t si = fp_new_segment_at(c, ai, addr, size, 0);
    if (si < 0) return NULL;
    c->segment_allocs += 1;
    PyObject *seq = PySequence_Fast(pieces, "pieces must be a sequence");
    if (!seq) return NULL;
    int32_t prev = -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        unsigned long long paddr, psize;
        int pystate;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKi", &paddr, &psize, &pystate)) { Py_DECREF(seq); return NULL; }
        int state = pystate == 0 ? V_USED : pystate == 1 ? V_IDLE : V_EAGER;
        int32_t b = fp_buf_new(c, paddr, psize, state, prev, -1, si);
        if (b < 0) { Py_DECREF(seq); return NULL; }
        if (prev < 0) c->segs[si].head = b; else c->bufs[prev].next = b;
        prev = b;
    }
    Py_DECREF(seq);
    for (int32_t b = c->segs[si].head; b >= 0; b = c->bufs[b].next) {
        if (c->bufs[b].used == V_USED) c->allocated += (long long)c->bufs[b].size;
        else if (v_index(c, b) < 0) return NULL;
    }
    if (chunks_add(c, addr >> CHUNK_SHIFT, ((seg_end - 1) >> CHUNK_SHIFT) + 1) < 0) return NULL;
    if (addr + size + CHUNK > c->next_addr) c->next_addr = addr + size + CHUNK;
    c->reserved = c->vmm.chunks * (long long)CHUNK;
    Py_RETURN_NONE;
}

/* (ranges, mapped runs): ranges [(stream, persistent, addr, size, [(addr, size, state), ...])]
 * in allocator order with Python's states (0 used, 1 idle, 2 eager) */
PyObject *fp_v_state(Core *c, PyObject *unused) {
    PyObject *ranges = PyList_New(0), *runs = PyList_New(0);
    if (!ranges || !runs) goto fail;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Alloc *a = &c->allocs[ai];
        for (Py_ssize_t k = 0; k < a->nsegs; k++) {
            Seg *s = &c->segs[a->segs[k]];
            PyObject *pieces = PyList_New(0);
            if (!pieces) goto fail;
            for (int32_t b = s->head; b >= 0; b = c->bufs[b].next) {
                int state = c->bufs[b].used == V_USED ? 0 : c->bufs[b].used == V_IDLE ? 1 : 2;
                PyObject *t = Py_BuildValue("(KKi)", c->bufs[b].addr, c->bufs[b].size, state);
                if (!t || PyList_Append(pieces, t) < 0) { Py_XDECREF(t); Py_DECREF(pieces); goto fail; }
                Py_DECREF(t);
            }
            PyObject *r = Py_BuildValue("(LOKKN)", (long long)a->stream, a->persistent ? Py_True : Py_False,
                                        s->addr, s->size, pieces);
            if (!r || PyList_Append(ranges, r) < 0) { Py_XDECREF(r); goto fail; }
            Py_DECREF(r);
        }
    }
    for (Py_ssize_t k = 0; k < c->vmm.nruns; k++) {
        PyObject *t = Py_BuildValue("(KK)", c->vmm.cstart[k], c->vmm.cend[k]);
        if (!t || PyList_Append(runs, t) < 0) { Py_XDECREF(t); goto fail; }
        Py_DECREF(t);
    }
    return Py_BuildValue("(NN)", ranges, runs);
fail:
    Py_XDECREF(ranges); Py_XDECREF(runs);
    return NULL;
}

PyObject *fp_v_defrag(Core *c, PyObject *unused) {
    if (v_defrag(c) < 0) return NULL;
    Py_RETURN_NONE;
}

static int v_empty_cache(Core *c) { return v_defrag(c); }

/* virtual addresses from 1 TiB; the device holds capacity // 2 MiB chunks */
static int v_init(Core *c) {
    c->next_addr = 1ULL << 40;
    c->vmm.max_chunks = c->bounded ? (long long)(c->capacity >> CHUNK_SHIFT) : -1;
    return 0;
}

/* recorded segment_allocs and segment_frees: the VMM model places and releases nothing on them;
 * a new range counts nothing itself (reserved is the mapped chunks; v_expand counts the alloc) */
const Model fp_vmm_model = {
    .kind = "vmm",
    .malloc = v_malloc,
    .free = v_free,
    .init = v_init,
    .empty_cache = v_empty_cache,
};
