/* MindSpore's best-fit pools (ms_memopt/allocators/mindspore.py: MindSporePool, and
 * MindSporeBestFitPool, whose free keys tie on the idle turn: Core.idle_order): allocators by
 * (stream, persistent, small), blocks grown by increase_size (doubling or adding), best fit
 * with a split when >= 512 B remain, recorded block addresses reused first. */
#include "fastpool.h"

static int overlaps(Core *c, u64 addr, u64 size) {
    u64 end = addr + size;
    for (Py_ssize_t i = 0; i < c->nsegs; i++) {
        Seg *s = &c->segs[i];
        if (s->alive && s->addr < end && addr < s->addr + s->size) return 1;
    }
    return 0;
}

/* where a new block goes: the next recorded address it does not overlap, else after the last */
static u64 place(Core *c, u64 size) {
    while (c->ms.rec_head < c->ms.rec_tail) {
        u64 addr = c->ms.rec[c->ms.rec_head++];
        if (!overlaps(c, addr, size)) {
            u64 next = round_up(addr + size, SEG_ALIGN);
            if (next > c->next_addr) c->next_addr = next;
            return addr;
        }
    }
    u64 addr = c->next_addr;
    c->next_addr = round_up(addr + size, SEG_ALIGN);
    return addr;
}


/* a new block of ``size`` bytes for allocator ``ai``, one idle buffer */
static int32_t new_segment(Core *c, Py_ssize_t ai, u64 size) {
    return fp_new_segment_at(c, ai, place(c, size), size, 1);
}

/* split ``b`` so that it holds ``size`` bytes (MindSpore: when >= 512 B remain), mark it used */
static int split(Core *c, int32_t b, u64 size) {
    if (c->bufs[b].size - size >= ALIGN && fp_cut(c, b, size) < 0) return -1;
    c->bufs[b].used = 1;
    return 0;
}

static u64 block_size(Core *c, u64 size) {
    u64 dfree = fp_device_free(c);
    if (dfree < size) return 0;
    u64 unit = c->ms.increase_size, block = unit;
    if (c->ms.grow_add) { while (block < size) block += unit; }
    else { while (block < size) block *= 2; }
    return block < dfree ? block : dfree;
}

/* MallocExpandBlock: -2 when no block can be made, -1 on error, else the buffer */
static int32_t expand(Core *c, Py_ssize_t ai, u64 size) {
    u64 block = block_size(c, size);
    if (block < size) return -2;
    int32_t si = new_segment(c, ai, block);
    if (si < 0) return -1;
    int32_t b = c->segs[si].head;
    fp_unindex_buf(c, b);
    if (split(c, b, size) < 0) return -1;
    return b;
}

/* MemBufAllocator::Malloc: -2 when nothing fits, -1 on error, else the buffer */
static int32_t take(Core *c, Py_ssize_t ai, u64 size) {
    Alloc *a = &c->allocs[ai];
    if (a->nsegs == 0) return expand(c, ai, size);
    Py_ssize_t at = lower_bound(a, size, 0);
    if (at == a->nkeys) return -2;
    int32_t b = a->keys[at].buf;
    key_pop(a->keys, &a->nkeys, at);
    if (split(c, b, size) < 0) return -1;
    return b;
}


/* ReleaseFreeBlocks for one block: gone when it is one idle buffer (one segment free) */
static void release_if_idle(Core *c, int32_t si) {
    Seg *s = &c->segs[si];
    if (!s->alive) return;
    int32_t h = s->head;
    if (h < 0 || c->bufs[h].used || c->bufs[h].next >= 0) return;
    fp_unindex_buf(c, h);
    fp_buf_drop(c, h);
    fp_drop_segment(c, si);
    c->segment_frees += 1;
}

/* the whole malloc of the reference: the address, or -2 after recording an OOM, -1 on error */
static long long ms_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *unused) {
    u64 size = raw <= 0 ? ALIGN : ((u64)raw + ALIGN - 1) & ~(ALIGN - 1);
    int persistent = fp_persistent(pool);
    int small = c->ms.small_pool && !persistent && size <= SMALL_SIZE;
    Py_ssize_t ai = fp_get_alloc(c, stream, persistent, small);
    if (ai < 0) return -1;
    int32_t b = take(c, ai, size);
    if (b == -2) {
        if (persistent) {
            Py_ssize_t common = fp_get_alloc(c, stream, 0, 0);
            if (common < 0) return -1;
            b = take(c, common, size);
            ai = common;
        }
        if (b == -2) {
            b = expand(c, ai, size);
            if (b == -2 && !persistent) {
                Py_ssize_t other = fp_get_alloc(c, stream, 1, 0);
                if (other < 0) return -1;
                b = take(c, other, size);
            }
            if (b == -2) {
                /* DoSyncAllEvents and one more Malloc: the slow path; frees are already applied,
                 * so the retry cannot find more than the first try did */
                c->slow_path_events += 1;
                return fp_record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag);
            }
        }
    }
    if (b < 0) return -1;
    return fp_served(c, b);
}

/* set_memory(init_size=): two blocks of ``half`` bytes (persistent, then common, stream 0) */
PyObject *fp_ms_pregrow(Core *c, PyObject *arg) {
    u64 half;
    if (fp_get_u64(arg, &half, "half") < 0) return NULL;
    for (int persistent = 1; persistent >= 0; persistent--) {
        Py_ssize_t ai = fp_get_alloc(c, 0, persistent, 0);
        if (ai < 0) return NULL;
        u64 dfree = fp_device_free(c);
        if (new_segment(c, ai, half < dfree ? half : dfree) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static int ms_free(Core *c, u64 addr) { return fp_free_merge(c, addr, NULL); }

/* a new block counts as reserved bytes and a segment alloc */
static int ms_segment_added(Core *c, int32_t si) {
    c->reserved += (long long)c->segs[si].size;
    c->segment_allocs += 1;
    return 0;
}

/* ReleaseFreeBlocks: every block that is one idle buffer goes back */
static int ms_empty_cache(Core *c) {
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        /* a copy: releasing edits the allocator's list */
        Alloc *a = &c->allocs[ai];
        Py_ssize_t n = a->nsegs;
        int32_t *copy = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
        if (!copy) { PyErr_NoMemory(); return -1; }
        memcpy(copy, a->segs, sizeof(int32_t) * n);
        for (Py_ssize_t k = 0; k < n; k++) release_if_idle(c, copy[k]);
        PyMem_Free(copy);
    }
    return 0;
}

/* a recorded segment_alloc: its address is where the next new block goes if it is free */
static int ms_note_segment_alloc(Core *c, PyObject *addr_obj, PyObject *size_obj, PyObject *stream_obj) {
    u64 addr;
    if (fp_get_u64(addr_obj, &addr, "addr") < 0) return -1;
    MsState *m = &c->ms;
    if (m->rec_tail == m->rec_cap) {
        if (m->rec_head > 0) {
            memmove(m->rec, m->rec + m->rec_head, sizeof(u64) * (m->rec_tail - m->rec_head));
            m->rec_tail -= m->rec_head; m->rec_head = 0;
        }
        if (fp_grow_array((void **)&m->rec, &m->rec_cap, m->rec_tail + 1, sizeof(u64)) < 0) return -1;
    }
    m->rec[m->rec_tail++] = addr;
    return 0;
}

/* a recorded segment_free: the block at ``addr`` goes back if it is idle */
static int ms_release_segment(Core *c, PyObject *addr_obj, PyObject *size_obj, PyObject *stream_obj) {
    u64 addr;
    if (fp_get_u64(addr_obj, &addr, "addr") < 0) return -1;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Alloc *a = &c->allocs[ai];
        for (Py_ssize_t k = 0; k < a->nsegs; k++) {
            if (c->segs[a->segs[k]].addr == addr) {
                release_if_idle(c, a->segs[k]);
                return 0;
            }
        }
    }
    return 0;
}

const Model fp_mindspore_model = {
    .kind = "mindspore",
    .malloc = ms_malloc,
    .free = ms_free,
    .segment_added = ms_segment_added,
    .empty_cache = ms_empty_cache,
    .note_segment_alloc = ms_note_segment_alloc,
    .release_segment = ms_release_segment,
};
