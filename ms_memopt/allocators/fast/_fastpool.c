/* Compiled fast path of allocator models: the MindSpore pool (ms_memopt/allocators/mindspore.py,
 * both tie rules), its VMM pool, PyTorch's caching allocator with and without expandable
 * segments (ms_memopt/allocators/torch*.py) and pool mode (ms_memopt/allocators/pool.py: its
 * regions, and its malloc/free with the cache region's eviction).
 *
 * The pure-Python models are the readable reference; this file repeats their rules in C so
 * that replay and simulate run at millions of events per second. tests/test_fastpool.py holds
 * the two to identical addresses, counters and layouts on random traces and on every recorded
 * trace. When the rules change in mindspore.py they must change here too (the test fails
 * until they do).
 *
 * Data structures:
 *   - buffers: one array of records {addr, size, tie, prev, next, seg, used}, doubly linked
 *     inside their segment (pool block); recycled through a free-slot list;
 *   - address -> buffer: open-addressing hash table, linear probing, backward-shift deletion;
 *   - free buffers of an allocator: a sorted array of (size, tie, buffer) searched by binary
 *     search (best fit = one lower_bound); tie = address (AbstractDynamicMemPool) or the turn
 *     the buffer became idle (DynamicMemPoolBestFit's multimap);
 *   - allocators: a small array keyed by (stream, persistent, small).
 * Sizes and addresses are unsigned 64-bit integers (the replay engine refuses >= 2**48).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t u64;
typedef int64_t i64;

#define ALIGN 512ULL
#define SMALL_SIZE (1ULL << 20)
#define SEG_ALIGN (2ULL << 20)
#define BASE_ADDR (1ULL << 32)
#define UNBOUNDED_FREE (1ULL << 62)

typedef struct {
    u64 addr, size, tie;
    int32_t prev, next, seg;
    int32_t used;          /* 1 used, 0 idle; -1 slot free */
} Buf;

typedef struct {
    u64 size, tie;
    int32_t buf;
} Key;

typedef struct {
    u64 addr, size;
    i64 stream;
    int32_t alloc, head;
    int alive;
    u64 page; int fixed;     /* expandable: page size of the range, recorded (fixed) range */
} Seg;

typedef struct {
    i64 stream;
    int persistent, small;
    int32_t *segs; Py_ssize_t nsegs, capsegs;
    Key *keys; Py_ssize_t nkeys, capkeys;
    int32_t *unm; Py_ssize_t nunm, capunm;   /* expandable: unmapped buffers by address */
    Key *ekeys; Py_ssize_t nekeys, capekeys; /* vmm: eager-free buffers by (size, addr) */
} Alloc;

typedef struct { u64 addr, size; i64 stream; } Recorded;

enum { KIND_MINDSPORE, KIND_TORCH, KIND_REGION, KIND_EXPANDABLE, KIND_VMM, KIND_POOLMODE };

#define PM_ROUTES 64          /* pool mode: (tag, pool) -> region pairs remembered by identity */
enum { PM_EVICTING = 1, PM_RING = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *dict;
    int kind;
    /* counters, visible from Python (AllocatorModel's attributes) */
    long long reserved, allocated, peak_reserved, peak_allocated, segment_allocs;
    /* configuration */
    int bounded; u64 capacity; u64 increase_size;
    int grow_add, small_pool, idle_order;
    u64 turn, next_addr;
    /* buffers */
    Buf *bufs; Py_ssize_t nbufs, capbufs; int32_t free_slot;
    /* address -> buffer */
    u64 *hkeys; int32_t *hvals; Py_ssize_t hcap, hcount;
    /* segments, allocators */
    Seg *segs; Py_ssize_t nsegs, capsegs;
    Alloc *allocs; Py_ssize_t nallocs;
    /* recorded segment addresses (a queue) */
    u64 *rec; Py_ssize_t rec_head, rec_tail, rec_cap;
    /* torch: options, segments sorted by address, recorded segments for the next request */
    unsigned divisions;
    int32_t *order; Py_ssize_t norder, caporder;
    Recorded *trec; Py_ssize_t ntrec, captrec;
    /* pool-mode region: its range, ring head, open chunk */
    u64 raddr, rsize, head, stack_top, stack_floor;
    int chunked, stack_open;
    /* torch-expandable: virtual range size and the next range's base */
    u64 range_size, next_base;
    /* mindspore-vmm: mapped 2 MiB chunks as sorted runs [start, end), their count, the cap */
    u64 *cstart, *cend; Py_ssize_t nruns, capruns, capruns2; long long chunks, max_chunks, eager_frees;
    /* pool mode (pool.py's PoolModeAllocator): its regions (FastRegion objects, strong
     * references) with their PM_* flags; the route cache: (tag, pool) objects -> region index
     * (-1: none), held strongly so that identity stays meaningful; addresses evicted since the
     * last drain; address -> tensor id of cache entries placed by _run (forgetting them in
     * address_of without a scan); evictions so far */
    PyObject **pm_regions; int *pm_flags; Py_ssize_t pm_n;
    PyObject *pm_route_tag[PM_ROUTES], *pm_route_pool[PM_ROUTES]; int pm_route_index[PM_ROUTES]; int pm_nroutes;
    PyObject *pm_evicted, *pm_tid_of;
    long long evictions;
} Core;

#define EMPTY_KEY (~0ULL)

static int grow_array(void **ptr, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *p = PyMem_Realloc(*ptr, (size_t)n * item);
    if (!p) { PyErr_NoMemory(); return -1; }
    *ptr = p; *cap = n;
    return 0;
}

/* ---- address -> buffer ------------------------------------------------------------------- */
static inline Py_ssize_t h_slot(u64 addr, Py_ssize_t cap) {
    return (Py_ssize_t)(((addr >> 9) * 0x9E3779B97F4A7C15ULL) >> 20) & (cap - 1);
}

static int h_resize(Core *c, Py_ssize_t cap) {
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

static inline int32_t h_get(Core *c, u64 addr) {
    Py_ssize_t mask = c->hcap - 1, j = h_slot(addr, c->hcap);
    for (;;) {
        u64 k = c->hkeys[j];
        if (k == addr) return c->hvals[j];
        if (k == EMPTY_KEY) return -1;
        j = (j + 1) & mask;
    }
}

static int h_put(Core *c, u64 addr, int32_t buf) {
    if ((c->hcount + 1) * 2 > c->hcap && h_resize(c, c->hcap * 2) < 0) return -1;
    Py_ssize_t mask = c->hcap - 1, j = h_slot(addr, c->hcap);
    while (c->hkeys[j] != EMPTY_KEY && c->hkeys[j] != addr) j = (j + 1) & mask;
    if (c->hkeys[j] == EMPTY_KEY) c->hcount++;
    c->hkeys[j] = addr; c->hvals[j] = buf;
    return 0;
}

static void h_del(Core *c, u64 addr) {
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
static int32_t buf_new(Core *c, u64 addr, u64 size, int used, int32_t prev, int32_t next, int32_t seg) {
    int32_t i;
    if (c->free_slot >= 0) {
        i = c->free_slot;
        c->free_slot = c->bufs[i].next;
    } else {
        if (grow_array((void **)&c->bufs, &c->capbufs, c->nbufs + 1, sizeof(Buf)) < 0) return -1;
        i = (int32_t)c->nbufs++;
    }
    Buf *b = &c->bufs[i];
    b->addr = addr; b->size = size; b->tie = addr; b->prev = prev; b->next = next; b->seg = seg; b->used = used;
    if (h_put(c, addr, i) < 0) return -1;
    return i;
}

static void buf_drop(Core *c, int32_t i) {
    h_del(c, c->bufs[i].addr);
    c->bufs[i].used = -1;
    c->bufs[i].next = c->free_slot;
    c->free_slot = i;
}

/* ---- free keys (sorted by size, tie) -------------------------------------------------------- */
static inline int key_less(u64 s1, u64 t1, u64 s2, u64 t2) { return s1 < s2 || (s1 == s2 && t1 < t2); }

/* remove entry ``at`` of a sorted key array of ``*n`` entries */
static inline void key_pop(Key *keys, Py_ssize_t *n, Py_ssize_t at) {
    memmove(&keys[at], &keys[at + 1], (size_t)(*n - at - 1) * sizeof(Key));
    (*n)--;
}

static inline Py_ssize_t lower_bound(Alloc *a, u64 size, u64 tie) {
    Py_ssize_t lo = 0, hi = a->nkeys;
    Key *k = a->keys;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (key_less(k[mid].size, k[mid].tie, size, tie)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int index_buf(Core *c, int32_t i) {
    Buf *b = &c->bufs[i];
    Alloc *a = &c->allocs[c->segs[b->seg].alloc];
    if (c->idle_order) b->tie = ++c->turn;
    if (grow_array((void **)&a->keys, &a->capkeys, a->nkeys + 1, sizeof(Key)) < 0) return -1;
    b = &c->bufs[i];
    Py_ssize_t at = lower_bound(a, b->size, b->tie);
    memmove(&a->keys[at + 1], &a->keys[at], (size_t)(a->nkeys - at) * sizeof(Key));
    a->keys[at].size = b->size; a->keys[at].tie = b->tie; a->keys[at].buf = i;
    a->nkeys++;
    return 0;
}

static void unindex_buf(Core *c, int32_t i) {
    Buf *b = &c->bufs[i];
    Alloc *a = &c->allocs[c->segs[b->seg].alloc];
    Py_ssize_t at = lower_bound(a, b->size, b->tie);
    key_pop(a->keys, &a->nkeys, at);
}

/* ---- allocators, segments ------------------------------------------------------------------- */
static Py_ssize_t get_alloc(Core *c, i64 stream, int persistent, int small) {
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

static inline u64 round_up(u64 v, u64 unit) { return (v + unit - 1) / unit * unit; }

static u64 device_free(Core *c) {
    if (!c->bounded) return UNBOUNDED_FREE;
    return c->capacity > (u64)c->reserved ? c->capacity - (u64)c->reserved : 0;
}

static int overlaps(Core *c, u64 addr, u64 size) {
    u64 end = addr + size;
    for (Py_ssize_t i = 0; i < c->nsegs; i++) {
        Seg *s = &c->segs[i];
        if (s->alive && s->addr < end && addr < s->addr + s->size) return 1;
    }
    return 0;
}

static u64 place(Core *c, u64 size) {
    while (c->rec_head < c->rec_tail) {
        u64 addr = c->rec[c->rec_head++];
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

/* a new segment (pool block) of allocator ``ai``, indexed as one idle buffer; -1 on error */
static int order_insert(Core *c, int32_t si);

static int32_t new_segment_at(Core *c, Py_ssize_t ai, u64 addr, u64 size, int index) {
    if (grow_array((void **)&c->segs, &c->capsegs, c->nsegs + 1, sizeof(Seg)) < 0) return -1;
    Alloc *a = &c->allocs[ai];
    if (grow_array((void **)&a->segs, &a->capsegs, a->nsegs + 1, sizeof(int32_t)) < 0) return -1;
    int32_t si = (int32_t)c->nsegs++;
    Seg *s = &c->segs[si];
    s->addr = addr; s->size = size; s->stream = a->stream; s->alloc = (int32_t)ai; s->head = -1; s->alive = 1;
    a->segs[a->nsegs++] = si;
    if (index) {
        int32_t b = buf_new(c, addr, size, 0, -1, -1, si);
        if (b < 0) return -1;
        c->segs[si].head = b;
        if (index_buf(c, b) < 0) return -1;
    }
    if (c->kind != KIND_VMM) c->reserved += (long long)size;   /* vmm: mapped chunks only */
    if (c->kind == KIND_TORCH) {
        if (order_insert(c, si) < 0) return -1;   /* torch counts in _new_segment, not here */
    } else if (c->kind == KIND_MINDSPORE) {
        c->segment_allocs += 1;
    }
    if (c->reserved > c->peak_reserved) c->peak_reserved = c->reserved;
    return si;
}

static int32_t new_segment(Core *c, Py_ssize_t ai, u64 size) {
    return new_segment_at(c, ai, place(c, size), size, 1);
}

/* ``b`` keeps its first ``size`` bytes; the rest becomes a new buffer after it in ``state``
 * (not indexed); the new buffer, -1 on error */
static int32_t split_off(Core *c, int32_t b, u64 size, int state) {
    int32_t nxt = c->bufs[b].next;
    int32_t rest = buf_new(c, c->bufs[b].addr + size, c->bufs[b].size - size, state, b, nxt, c->bufs[b].seg);
    if (rest < 0) return -1;
    if (nxt >= 0) c->bufs[nxt].prev = rest;
    c->bufs[b].next = rest;
    c->bufs[b].size = size;
    return rest;
}

/* cut ``b`` after ``size`` bytes: the rest becomes an idle, indexed buffer; -1 on error */
static int cut(Core *c, int32_t b, u64 size) {
    int32_t rest = split_off(c, b, size, 0);
    return rest < 0 ? -1 : index_buf(c, rest);
}

/* split ``b`` so that it holds ``size`` bytes (MindSpore: when >= 512 B remain), mark it used */
static int split(Core *c, int32_t b, u64 size) {
    if (c->bufs[b].size - size >= ALIGN && cut(c, b, size) < 0) return -1;
    c->bufs[b].used = 1;
    return 0;
}

static u64 block_size(Core *c, u64 size) {
    u64 dfree = device_free(c);
    if (dfree < size) return 0;
    u64 unit = c->increase_size, block = unit;
    if (c->grow_add) { while (block < size) block += unit; }
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
    unindex_buf(c, b);
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

/* the segment leaves its allocator and the device (its buffers are gone already) */
static void drop_segment(Core *c, int32_t si) {
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

static void release_if_idle(Core *c, int32_t si) {
    Seg *s = &c->segs[si];
    if (!s->alive) return;
    int32_t h = s->head;
    if (h < 0 || c->bufs[h].used || c->bufs[h].next >= 0) return;
    unindex_buf(c, h);
    buf_drop(c, h);
    drop_segment(c, si);
}

static PyObject *str_stream, *str_pool, *str_tag, *str_persistent, *str_record_oom;

/* the model's _record_oom(size, stream, tag) (AllocatorModel's, in Python); -2, or -1 on error */
/* the last step of every model's malloc: buffer ``b`` counted as allocated; its address */
static long long served(Core *c, int32_t b) {
    c->allocated += (long long)c->bufs[b].size;
    if (c->allocated > c->peak_allocated) c->peak_allocated = c->allocated;
    return (long long)c->bufs[b].addr;
}

static long long record_oom(Core *c, PyObject *size, i64 stream, PyObject *tag) {
    PyObject *st = PyLong_FromLongLong(stream);
    PyObject *r = (size && st) ? PyObject_CallMethodObjArgs((PyObject *)c, str_record_oom, size, st, tag, NULL) : NULL;
    Py_XDECREF(size); Py_XDECREF(st);
    if (!r) return -1;
    Py_DECREF(r);
    return -2;
}

/* ---- PyTorch's caching allocator (torch.py) ------------------------------------------------ */
#define MIB (1ULL << 20)
#define T_SMALL_BUFFER (2 * MIB)
#define T_LARGE_BUFFER (20 * MIB)
#define T_MIN_LARGE_ALLOC (10 * MIB)
#define T_ROUND_LARGE (2 * MIB)
#define T_ADDRESS_BASE (1ULL << 40)

static int bit_length(u64 v) { return v ? 64 - __builtin_clzll(v) : 0; }

/* round_size(size, divisions) */
static u64 torch_round(Core *c, long long raw) {
    if (raw < 512) return 512;
    u64 size = (u64)raw, d = c->divisions;
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

static u64 torch_allocation_size(u64 rounded) {
    if (rounded <= SMALL_SIZE) return T_SMALL_BUFFER;
    if (rounded < T_MIN_LARGE_ALLOC) return T_LARGE_BUFFER;
    return round_up(rounded, T_ROUND_LARGE);
}

/* first position in ``order`` whose segment starts at or after ``addr`` */
static Py_ssize_t order_search(Core *c, u64 addr) {
    Py_ssize_t lo = 0, hi = c->norder;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (c->segs[c->order[mid]].addr < addr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int order_insert(Core *c, int32_t si) {
    if (grow_array((void **)&c->order, &c->caporder, c->norder + 1, sizeof(int32_t)) < 0) return -1;
    Py_ssize_t at = order_search(c, c->segs[si].addr);
    memmove(&c->order[at + 1], &c->order[at], (size_t)(c->norder - at) * sizeof(int32_t));
    c->order[at] = si;
    c->norder++;
    return 0;
}

static int torch_is_unused(Core *c, u64 addr, u64 size) {
    Py_ssize_t i = order_search(c, addr);
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
    for (Py_ssize_t i = 0; i < c->ntrec; i++) {
        Recorded *r = &c->trec[i];
        if (r->size == size && r->stream == stream && torch_is_unused(c, r->addr, size)) {
            addr = r->addr;
            memmove(&c->trec[i], &c->trec[i + 1], (size_t)(c->ntrec - i - 1) * sizeof(Recorded));
            c->ntrec--;
            found = 1;
            break;
        }
    }
    if (!found) addr = torch_lowest_gap(c, size);
    int32_t si = new_segment_at(c, ai, addr, size, 1);
    if (si >= 0) c->segment_allocs += 1;
    return si;
}

static int torch_idle(Core *c, int32_t si) {
    Seg *s = &c->segs[si];
    int32_t h = s->head;
    return s->alive && h >= 0 && !c->bufs[h].used && c->bufs[h].prev < 0 && c->bufs[h].next < 0;
}

/* _release: give the idle, unsplit segment back to the device */
static void torch_release(Core *c, int32_t si) {
    Seg *s = &c->segs[si];
    int32_t h = s->head;
    unindex_buf(c, h);
    buf_drop(c, h);
    Py_ssize_t at = order_search(c, s->addr);
    memmove(&c->order[at], &c->order[at + 1], (size_t)(c->norder - at - 1) * sizeof(int32_t));
    c->norder--;
    drop_segment(c, si);
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

/* _grow: the new segment's buffer taken out of the free list; -2 none, -1 error */
static int32_t torch_grow(Core *c, Py_ssize_t ai, u64 rsize, i64 stream) {
    u64 seg_size = torch_allocation_size(rsize);
    int32_t si = torch_new_segment(c, ai, seg_size, stream);
    if (si == -2 && torch_release_cached(c)) si = torch_new_segment(c, ai, seg_size, stream);
    if (si < 0) return si;
    int32_t b = c->segs[si].head;
    unindex_buf(c, b);
    return b;
}

/* the whole malloc of the reference: the address, or -2 after recording an OOM, -1 on error */
static long long torch_malloc(Core *c, long long raw, i64 stream, PyObject *tag) {
    u64 rsize = torch_round(c, raw);
    int small = rsize <= SMALL_SIZE;
    Py_ssize_t ai = get_alloc(c, stream, 0, small);
    if (ai < 0) return -1;
    Alloc *a = &c->allocs[ai];
    int32_t b;
    Py_ssize_t at = lower_bound(a, rsize, 0);
    if (at < a->nkeys) {
        b = a->keys[at].buf;
        key_pop(a->keys, &a->nkeys, at);
    } else {
        b = torch_grow(c, ai, rsize, stream);
        c->ntrec = 0;
        if (b == -1) return -1;
        if (b == -2) return record_oom(c, PyLong_FromLongLong(raw), stream, tag);
    }
    u64 remaining = c->bufs[b].size - rsize;
    if ((small ? remaining >= 512 : remaining > SMALL_SIZE) && cut(c, b, rsize) < 0) return -1;
    c->bufs[b].used = 1;
    return served(c, b);
}

/* ---- a pool-mode region (pool.py's _Region) ------------------------------------------------ */
static int core_free(Core *c, u64 addr);

static int not_region(Core *c) {
    if (c->kind == KIND_REGION) return 0;
    PyErr_SetString(PyExc_TypeError, "a pool-mode region method on a model that is not a region");
    return 1;
}

/* the free buffer containing ``addr``, or -1 */
static int32_t region_free_at(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b >= 0) return c->bufs[b].used ? -1 : b;
    Alloc *a = &c->allocs[0];
    for (Py_ssize_t k = 0; k < a->nkeys; k++) {
        Buf *f = &c->bufs[a->keys[k].buf];
        if (f->addr < addr && addr < f->addr + f->size) return a->keys[k].buf;
    }
    return -1;
}

/* _carve: the free buffer containing ``addr`` split there (its high part returned); -2 none */
static int32_t region_carve(Core *c, u64 addr, u64 size) {
    int32_t b = region_free_at(c, addr);
    if (b < 0 || c->bufs[b].addr + c->bufs[b].size - addr < size) return -2;
    if (c->bufs[b].addr == addr) return b;
    unindex_buf(c, b);
    int32_t high = split_off(c, b, addr - c->bufs[b].addr, 0);
    if (high < 0 || index_buf(c, b) < 0 || index_buf(c, high) < 0) return -1;
    return high;
}

static PyObject *Region_init_range(Core *c, PyObject *args) {
    unsigned long long addr, size;
    int chunked;
    if (not_region(c) || !PyArg_ParseTuple(args, "KKp", &addr, &size, &chunked)) return NULL;
    if (get_alloc(c, 0, 0, 0) < 0) return NULL;
    if (new_segment_at(c, 0, addr, size, size != 0) < 0) return NULL;
    c->raddr = addr; c->rsize = size; c->head = addr; c->stack_floor = addr; c->stack_open = 0;
    c->chunked = chunked;
    Py_RETURN_NONE;
}

/* _Region.take: ``size`` bytes at the ring head (chunked: below the open chunk's top) when
 * ``ring``, else (or when that has no room and ``fallback``) best fit; the address, -2 when
 * nothing fits, -1 on error */
static long long region_take(Core *c, u64 size, int ring, int fallback) {
    int32_t b = -2;
    int stacked = 0;
    if (ring) {
        if (c->chunked) {
            if (c->stack_open && c->stack_top >= c->stack_floor + size) {
                b = region_carve(c, c->stack_top - size, size);
                if (b == -1) return -1;
            }
            stacked = b >= 0;
        } else {
            u64 starts[2] = {c->head, c->raddr};
            for (int k = 0; k < 2 && b < 0; k++) {
                int32_t f = h_get(c, starts[k]);
                if (f >= 0 && !c->bufs[f].used && c->bufs[f].size >= size) b = f;
            }
        }
        if (b < 0 && !fallback) return -2;
    }
    if (c->nallocs == 0) return -2;
    Alloc *a = &c->allocs[0];
    if (b < 0) {
        Py_ssize_t at = lower_bound(a, size, 0);
        if (at == a->nkeys) return -2;
        b = a->keys[at].buf;
        key_pop(a->keys, &a->nkeys, at);
    } else {
        unindex_buf(c, b);
    }
    if (c->bufs[b].size - size >= ALIGN && cut(c, b, size) < 0) return -1;
    c->bufs[b].used = 1;
    c->allocated += (long long)c->bufs[b].size;
    if (stacked) c->stack_top = c->bufs[b].addr;
    else if (ring && !c->chunked) {
        c->head = c->bufs[b].addr + c->bufs[b].size;
        if (c->head >= c->raddr + c->rsize) c->head = c->raddr;
    }
    return (long long)c->bufs[b].addr;
}

/* _Region.release: the bytes freed (0 when no live buffer starts at ``addr``), -1 on error */
static long long region_release(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != 1) return 0;
    u64 freed = c->bufs[b].size;
    if (core_free(c, addr) < 0) return -1;
    return (long long)freed;
}

/* take(size, ring, fallback=True): the address, or None */
static PyObject *Region_take(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"size", "ring", "fallback", NULL};
    unsigned long long size;
    int ring, fallback = 1;
    if (not_region(c) || !PyArg_ParseTupleAndKeywords(args, kwargs, "Kp|p", names, &size, &ring, &fallback)) return NULL;
    long long addr = region_take(c, size, ring, fallback);
    if (addr == -1) return NULL;
    if (addr == -2) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong((u64)addr);
}

static PyObject *Region_open_chunk(Core *c, PyObject *arg) {
    if (not_region(c)) return NULL;
    long long size = PyLong_AsLongLong(arg);
    if (size == -1 && PyErr_Occurred()) return NULL;
    c->stack_open = 0;
    if (size <= 0) Py_RETURN_NONE;
    u64 starts[2] = {c->head, c->raddr};
    for (int k = 0; k < 2; k++) {
        u64 start = starts[k];
        int32_t b = region_free_at(c, start);
        if (b >= 0 && c->bufs[b].addr + c->bufs[b].size - start >= (u64)size) {
            c->stack_open = 1;
            c->stack_top = start + (u64)size;
            c->stack_floor = start;
            c->head = start + (u64)size < c->raddr + c->rsize ? start + (u64)size : c->raddr;
            break;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Region_close_chunk(Core *c, PyObject *unused) {
    c->stack_open = 0;
    Py_RETURN_NONE;
}

static PyObject *Region_release(Core *c, PyObject *arg) {
    if (not_region(c)) return NULL;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return PyLong_FromLong(0); }
    long long freed = region_release(c, addr);
    return freed < 0 ? NULL : PyLong_FromLongLong(freed);
}

static PyObject *Region_size_of(Core *c, PyObject *arg) {
    if (not_region(c)) return NULL;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int32_t b = h_get(c, addr);
    if (b < 0) return PyErr_Format(PyExc_KeyError, "%llu", addr);
    return PyLong_FromUnsignedLongLong(c->bufs[b].size);
}

/* the free list as the reference keeps it: sorted size << 64 | addr */
static PyObject *Region_free_keys(Core *c, void *unused) {
    PyObject *out = PyList_New(0);
    if (!out || c->nallocs == 0) return out;
    Alloc *a = &c->allocs[0];
    for (Py_ssize_t k = 0; k < a->nkeys; k++) {
        PyObject *size = PyLong_FromUnsignedLongLong(a->keys[k].size), *shift = PyLong_FromLong(64);
        PyObject *high = (size && shift) ? PyNumber_Lshift(size, shift) : NULL;
        PyObject *addr = PyLong_FromUnsignedLongLong(c->bufs[a->keys[k].buf].addr);
        PyObject *key = (high && addr) ? PyNumber_Or(high, addr) : NULL;
        Py_XDECREF(size); Py_XDECREF(shift); Py_XDECREF(high); Py_XDECREF(addr);
        if (!key || PyList_Append(out, key) < 0) { Py_XDECREF(key); Py_DECREF(out); return NULL; }
        Py_DECREF(key);
    }
    return out;
}

static PyObject *Region_get(Core *c, void *which) {
    switch ((int)(Py_ssize_t)which) {
    case 0: return PyLong_FromUnsignedLongLong(c->head);
    case 1: if (!c->stack_open) Py_RETURN_NONE; return PyLong_FromUnsignedLongLong(c->stack_top);
    default: return PyLong_FromUnsignedLongLong(c->stack_floor);
    }
}

/* ---- pool mode (pool.py's PoolModeAllocator over FastRegion cores) -------------------------
 * The regions stay separate FastRegion objects (their layouts, metrics and chunks are
 * PoolModeAllocator's Python code); this is its malloc and free: routing, the cache region's
 * eviction in FIFO order (region.order, an OrderedDict, as in the reference), the counters. An
 * address belongs to the region whose range holds it, and is live there exactly when the
 * reference's _owner holds it. */
static PyObject *str_region_for, *str_order, *str_popitem;
static PyTypeObject CoreType;

static inline Core *pm_region(Core *c, Py_ssize_t i) { return (Core *)c->pm_regions[i]; }

/* the region index serving (tag, pool): PoolModeAllocator.region_for's answer, remembered by
 * the identity of the two objects; -1 none, -2 error */
static int pm_route(Core *c, PyObject *tag, PyObject *pool) {
    for (int k = 0; k < c->pm_nroutes; k++)
        if (c->pm_route_tag[k] == tag && c->pm_route_pool[k] == pool) return c->pm_route_index[k];
    PyObject *region = PyObject_CallMethodObjArgs((PyObject *)c, str_region_for, tag, pool, NULL);
    if (!region) return -2;
    int index = -1;
    for (Py_ssize_t i = 0; i < c->pm_n; i++)
        if (c->pm_regions[i] == region) index = (int)i;
    Py_DECREF(region);
    if (c->pm_nroutes < PM_ROUTES) {
        Py_INCREF(tag); Py_INCREF(pool);
        c->pm_route_tag[c->pm_nroutes] = tag; c->pm_route_pool[c->pm_nroutes] = pool;
        c->pm_route_index[c->pm_nroutes++] = index;
    }
    return index;
}

/* evict the oldest entry of the cache region ``ri`` (``order`` its OrderedDict): 1 done, 0
 * nothing left to evict, -1 error */
static int pm_evict_oldest(Core *c, Py_ssize_t ri, PyObject *order) {
    Py_ssize_t left = PyObject_Size(order);
    if (left <= 0) return left < 0 ? -1 : 0;
    PyObject *item = PyObject_CallMethodObjArgs(order, str_popitem, Py_False, NULL);
    if (!item) return -1;
    PyObject *old = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 ? PyTuple_GET_ITEM(item, 0) : NULL;
    unsigned long long addr = old ? PyLong_AsUnsignedLongLong(old) : (unsigned long long)-1;
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(item); return -1; }
    if (!old) { Py_DECREF(item); PyErr_SetString(PyExc_TypeError, "region.order.popitem() gave no (addr, size)"); return -1; }
    long long freed = region_release(pm_region(c, ri), addr);
    int bad = freed < 0 || PyList_Append(c->pm_evicted, old) < 0;
    Py_DECREF(item);
    if (bad) return -1;
    c->allocated -= freed;
    c->evictions++;
    return 1;
}

/* PoolModeAllocator.malloc: the address (``*region`` its region index), -2 after recording an
 * OOM, -1 on error */
static long long pm_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *region) {
    u64 size = raw > (long long)ALIGN ? round_up((u64)raw, ALIGN) : ALIGN;
    int ri = pm_route(c, tag, pool);
    if (ri == -2) return -1;
    if (ri < 0) return record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag);
    Core *r = pm_region(c, ri);
    int evicting = c->pm_flags[ri] & PM_EVICTING, ring = (c->pm_flags[ri] & PM_RING) != 0;
    /* the cache is a strict FIFO ring: the oldest entries (just ahead of the head) go first */
    long long addr = region_take(r, size, ring, !evicting);
    PyObject *order = NULL;
    if (evicting) {
        order = PyObject_GetAttr(c->pm_regions[ri], str_order);
        if (!order) return -1;
        while (addr == -2) {
            int done = pm_evict_oldest(c, ri, order);
            if (done < 0) { Py_DECREF(order); return -1; }
            if (!done) break;
            addr = region_take(r, size, ring, 0);
        }
        if (addr == -2) addr = region_take(r, size, 0, 1);   /* larger than its free space in ring order */
    }
    if (addr == -1) { Py_XDECREF(order); return -1; }
    if (addr == -2) { Py_XDECREF(order); return record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag); }
    if (evicting) {
        PyObject *key = PyLong_FromUnsignedLongLong((u64)addr), *value = PyLong_FromUnsignedLongLong(size);
        int bad = !key || !value || PyObject_SetItem(order, key, value) < 0;
        Py_XDECREF(key); Py_XDECREF(value); Py_DECREF(order);
        if (bad) return -1;
    }
    c->allocated += (long long)r->bufs[h_get(r, (u64)addr)].size;
    if (c->allocated > c->peak_allocated) c->peak_allocated = c->allocated;
    *region = ri;
    return addr;
}

/* the tensor id _run noted for a cache entry at ``addr`` is gone: a malloc that did not note
 * the new entry's id (the method, or _run without forget) placed one there; -1 on error */
static int pm_unnote(Core *c, int region, PyObject *addr) {
    if (!(c->pm_flags[region] & PM_EVICTING) || !PyDict_GET_SIZE(c->pm_tid_of)) return 0;
    if (PyDict_DelItem(c->pm_tid_of, addr) == 0) return 0;
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
    PyErr_Clear();
    return 0;
}

/* PoolModeAllocator.free; -1 on error */
static int pm_free(Core *c, u64 addr) {
    for (Py_ssize_t i = 0; i < c->pm_n; i++) {
        Core *r = pm_region(c, i);
        if (!r->rsize || addr < r->raddr || addr >= r->raddr + r->rsize) continue;
        int32_t b = h_get(r, addr);
        if (b < 0 || r->bufs[b].used != 1) return 0;
        if (c->pm_flags[i] & PM_EVICTING) {
            PyObject *key = PyLong_FromUnsignedLongLong(addr);
            PyObject *order = key ? PyObject_GetAttr(c->pm_regions[i], str_order) : NULL;
            int bad = !order || (PyObject_DelItem(order, key) < 0 && !PyErr_ExceptionMatches(PyExc_KeyError));
            if (!bad) PyErr_Clear();
            if (!bad && PyDict_GET_SIZE(c->pm_tid_of) && PyDict_DelItem(c->pm_tid_of, key) < 0) {
                if (PyErr_ExceptionMatches(PyExc_KeyError)) PyErr_Clear(); else bad = 1;
            }
            Py_XDECREF(key); Py_XDECREF(order);
            if (bad) return -1;
        }
        long long freed = region_release(r, addr);
        if (freed < 0) return -1;
        c->allocated -= freed;
        return 0;
    }
    return 0;
}

/* simulate's _forget inside _run: every address_of entry whose address was evicted goes (the
 * tensor id _run noted for the address when it is still there, else a scan); the list empties */
static int pm_forget(Core *c, PyObject *address_of) {
    Py_ssize_t n = PyList_GET_SIZE(c->pm_evicted);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *addr = PyList_GET_ITEM(c->pm_evicted, k);
        PyObject *tid = PyDict_GetItemWithError(c->pm_tid_of, addr);
        if (!tid && PyErr_Occurred()) return -1;
        if (tid) {
            Py_INCREF(tid);
            if (PyDict_DelItem(c->pm_tid_of, addr) < 0) { Py_DECREF(tid); return -1; }
            PyObject *now = PyDict_GetItemWithError(address_of, tid);
            int same = now ? PyObject_RichCompareBool(now, addr, Py_EQ) : 0;
            if (same > 0 && PyDict_DelItem(address_of, tid) < 0) same = -1;
            Py_DECREF(tid);
            if (same < 0 || (!now && PyErr_Occurred())) return -1;
            if (same) continue;
        }
        /* not placed by _run (or its tensor is gone): the reference's scan */
        PyObject *gone = PyList_New(0), *key, *value;
        Py_ssize_t pos = 0;
        if (!gone) return -1;
        while (PyDict_Next(address_of, &pos, &key, &value)) {
            int eq = PyObject_RichCompareBool(value, addr, Py_EQ);
            if (eq < 0 || (eq && PyList_Append(gone, key) < 0)) { Py_DECREF(gone); return -1; }
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(gone); j++)
            if (PyDict_DelItem(address_of, PyList_GET_ITEM(gone, j)) < 0) { Py_DECREF(gone); return -1; }
        Py_DECREF(gone);
    }
    return PyList_SetSlice(c->pm_evicted, 0, n, NULL);
}

/* _pool_init(regions, flags): the FastRegion objects in the reference's order, PM_* flags */
static PyObject *Pool_init(Core *c, PyObject *args) {
    PyObject *regions, *flags;
    if (c->kind != KIND_POOLMODE) { PyErr_SetString(PyExc_TypeError, "_pool_init on a model that is not pool mode"); return NULL; }
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &regions, &PyTuple_Type, &flags)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(regions);
    if (c->pm_n || PyTuple_GET_SIZE(flags) != n) { PyErr_SetString(PyExc_ValueError, "_pool_init: once, one flag per region"); return NULL; }
    c->pm_regions = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    c->pm_flags = PyMem_Calloc(n ? n : 1, sizeof(int));
    if (!c->pm_regions || !c->pm_flags) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *region = PyTuple_GET_ITEM(regions, i);
        if (!PyObject_TypeCheck(region, &CoreType) || ((Core *)region)->kind != KIND_REGION) {
            PyErr_SetString(PyExc_TypeError, "_pool_init: the regions must be FastRegion objects");
            return NULL;
        }
        long flag = PyLong_AsLong(PyTuple_GET_ITEM(flags, i));
        if (flag == -1 && PyErr_Occurred()) return NULL;
        Py_INCREF(region);
        c->pm_regions[i] = region; c->pm_flags[i] = (int)flag; c->pm_n = i + 1;
    }
    Py_RETURN_NONE;
}

/* drain_evicted(): the addresses evicted since the last call */
static PyObject *Pool_drain(Core *c, PyObject *unused) {
    if (!c->pm_evicted) return PyList_New(0);
    PyObject *out = c->pm_evicted, *fresh = PyList_New(0);
    if (!fresh) return NULL;
    c->pm_evicted = fresh;
    return out;
}

/* ---- PyTorch with expandable segments (torch_expandable.py) ------------------------------- */
enum { X_FREE = 0, X_LIVE = 1, X_UNMAPPED = 2 };   /* Buf.used */
#define GIB (1ULL << 30)

static Py_ssize_t unm_search(Core *c, Alloc *a, u64 addr) {
    Py_ssize_t lo = 0, hi = a->nunm;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (c->bufs[a->unm[mid]].addr < addr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int unm_insert(Core *c, Alloc *a, int32_t b) {
    if (grow_array((void **)&a->unm, &a->capunm, a->nunm + 1, sizeof(int32_t)) < 0) return -1;
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
    buf_drop(c, nxt);
}

/* _merge_free: the free ``b`` merged with free neighbours and indexed; the merged buffer */
static int32_t x_merge_free(Core *c, int32_t b) {
    int32_t prev = c->bufs[b].prev;
    if (prev >= 0 && c->bufs[prev].used == X_FREE) {
        unindex_buf(c, prev);
        x_absorb_next(c, prev);
        b = prev;
    }
    int32_t nxt = c->bufs[b].next;
    if (nxt >= 0 && c->bufs[nxt].used == X_FREE) {
        unindex_buf(c, nxt);
        x_absorb_next(c, b);
    }
    if (index_buf(c, b) < 0) return -1;
    return b;
}

static u64 x_expandable(Core *c, int32_t b) {
    int32_t nxt = c->bufs[b].next;
    if (nxt >= 0 && c->bufs[nxt].used == X_UNMAPPED) return c->bufs[b].size + c->bufs[nxt].size;
    return c->bufs[b].size;
}

/* a new range of allocator ``ai``: one unmapped buffer; the buffer, -1 on error */
static int32_t x_new_range(Core *c, Py_ssize_t ai, u64 base, u64 size, u64 page, int fixed) {
    if (grow_array((void **)&c->segs, &c->capsegs, c->nsegs + 1, sizeof(Seg)) < 0) return -1;
    Alloc *a = &c->allocs[ai];
    if (grow_array((void **)&a->segs, &a->capsegs, a->nsegs + 1, sizeof(int32_t)) < 0) return -1;
    int32_t si = (int32_t)c->nsegs++;
    Seg *s = &c->segs[si];
    s->addr = base; s->size = size; s->stream = a->stream; s->alloc = (int32_t)ai; s->head = -1; s->alive = 1;
    s->page = page; s->fixed = fixed;
    a->segs[a->nsegs++] = si;
    if (order_insert(c, si) < 0) return -1;
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
    u64 size = c->range_size > rsize ? c->range_size : rsize;
    size = round_up(size, page);
    u64 base = c->next_base;
    c->next_base += round_up(size, GIB) + GIB;
    int32_t si = x_new_range(c, ai, base, size, page, 0);
    if (si < 0) return -1;
    int32_t b = buf_new(c, base, size, X_UNMAPPED, -1, -1, si);
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
        int32_t rest = split_off(c, b, size, X_UNMAPPED);
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
            unindex_buf(c, b);
            buf_drop(c, b);
            Py_ssize_t at = order_search(c, c->segs[si].addr);
            memmove(&c->order[at], &c->order[at + 1], (size_t)(c->norder - at - 1) * sizeof(int32_t));
            c->norder--;
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
    unindex_buf(c, b);
    /* carve [addr, begin) free | [begin, end) unmapped | [end, addr + size) free */
    if (end < addr + size) {
        int32_t tail = split_off(c, b, end - addr, X_FREE);
        if (tail < 0 || index_buf(c, tail) < 0) return -1;
    }
    int32_t u;
    if (begin > addr) {
        u = split_off(c, b, begin - addr, X_UNMAPPED);
        if (u < 0 || index_buf(c, b) < 0) return -1;
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

static long long x_malloc(Core *c, long long raw, i64 stream, PyObject *tag) {
    u64 rsize = torch_round(c, raw);
    int small = rsize <= SMALL_SIZE;
    Py_ssize_t ai = get_alloc(c, stream, 0, small);
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
        if (b == -2) return record_oom(c, PyLong_FromLongLong(raw), stream, tag);
        unindex_buf(c, b);
    }
    c->bufs[b].used = X_LIVE;
    u64 remaining = c->bufs[b].size - rsize;
    if (remaining >= 512) {
        int32_t rest = split_off(c, b, rsize, X_FREE);
        if (rest < 0 || x_merge_free(c, rest) < 0) return -1;
    }
    return served(c, b);
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
static PyObject *X_add_range(Core *c, PyObject *args) {
    unsigned long long addr, size;
    long long stream;
    int small;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KKLpO", &addr, &size, &stream, &small, &pieces)) return NULL;
    Py_ssize_t ai = get_alloc(c, stream, 0, small);
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
        int32_t b = buf_new(c, paddr, psize, live ? X_LIVE : X_FREE, prev, -1, si);
        if (b < 0) { Py_DECREF(seq); return NULL; }
        if (prev < 0) c->segs[si].head = b; else c->bufs[prev].next = b;
        if (live) c->allocated += (long long)psize;
        else if (index_buf(c, b) < 0) { Py_DECREF(seq); return NULL; }
        prev = b;
    }
    Py_DECREF(seq);
    if (addr + size > c->next_base) c->next_base = addr + size;
    Py_RETURN_NONE;
}

/* after restoring: the next range starts on a GiB boundary */
static PyObject *X_restored(Core *c, PyObject *unused) {
    c->next_base = round_up(c->next_base, GIB);
    Py_RETURN_NONE;
}

/* [(base, stream, small, [(addr, size, state), ...]), ...] by base; state 0 free 1 live 2 unmapped */
static PyObject *X_ranges(Core *c, PyObject *unused) {
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

/* ---- MindSpore's VMM pool (mindspore_vmm.py) ---------------------------------------------- */
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
    Py_ssize_t i = runs_bisect_right(c->cstart, c->nruns, first) - 1;
    if (i >= 0 && c->cend[i] >= end) return end - first;
    u64 total = 0;
    for (Py_ssize_t k = runs_bisect_right(c->cend, c->nruns, first); k < c->nruns; k++) {
        if (c->cstart[k] >= end) break;
        u64 lo = c->cstart[k] > first ? c->cstart[k] : first, hi = c->cend[k] < end ? c->cend[k] : end;
        total += hi - lo;
    }
    return total;
}

/* replace runs [i, j) by the ``n`` runs given */
static int runs_splice(Core *c, Py_ssize_t i, Py_ssize_t j, u64 *starts, u64 *ends, Py_ssize_t n) {
    Py_ssize_t total = c->nruns - (j - i) + n;
    if (grow_array((void **)&c->cstart, &c->capruns, total, sizeof(u64)) < 0) return -1;
    if (grow_array((void **)&c->cend, &c->capruns2, total, sizeof(u64)) < 0) return -1;
    memmove(&c->cstart[i + n], &c->cstart[j], (size_t)(c->nruns - j) * sizeof(u64));
    memmove(&c->cend[i + n], &c->cend[j], (size_t)(c->nruns - j) * sizeof(u64));
    for (Py_ssize_t k = 0; k < n; k++) { c->cstart[i + k] = starts[k]; c->cend[i + k] = ends[k]; }
    c->nruns = total;
    return 0;
}

static int chunks_add(Core *c, u64 first, u64 end) {
    if (end <= first) return 0;
    Py_ssize_t i = runs_bisect_left(c->cend, c->nruns, first), j = runs_bisect_right(c->cstart, c->nruns, end);
    long long added = (long long)(end - first);
    if (i < j) {
        for (Py_ssize_t k = i; k < j; k++) {
            u64 lo = c->cstart[k] > first ? c->cstart[k] : first, hi = c->cend[k] < end ? c->cend[k] : end;
            added -= (long long)(hi - lo);
        }
        if (c->cstart[i] < first) first = c->cstart[i];
        if (c->cend[j - 1] > end) end = c->cend[j - 1];
    }
    if (runs_splice(c, i, j, &first, &end, 1) < 0) return -1;
    c->chunks += added;
    return 0;
}

static int chunks_remove(Core *c, u64 first, u64 end) {
    if (end <= first) return 0;
    Py_ssize_t i = runs_bisect_right(c->cend, c->nruns, first), j = runs_bisect_left(c->cstart, c->nruns, end);
    if (i >= j) return 0;
    u64 ks[2], ke[2];
    Py_ssize_t n = 0;
    long long removed = 0;
    /* runs i..j-1 overlap [first, end); only the first can start before, only the last end after */
    for (Py_ssize_t k = i; k < j; k++) {
        u64 lo = c->cstart[k], hi = c->cend[k];
        removed += (long long)((hi < end ? hi : end) - (lo > first ? lo : first));
        if (lo < first) { ks[n] = lo; ke[n] = first; n++; }
        if (hi > end) { ks[n] = end; ke[n] = hi; n++; }
    }
    if (runs_splice(c, i, j, ks, ke, n) < 0) return -1;
    c->chunks -= removed;
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
    if (c->bufs[b].used == V_IDLE) return index_buf(c, b);
    Alloc *a = &c->allocs[c->segs[c->bufs[b].seg].alloc];
    if (grow_array((void **)&a->ekeys, &a->capekeys, a->nekeys + 1, sizeof(Key)) < 0) return -1;
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
    if (f->used == V_IDLE) { unindex_buf(c, b); return; }
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
    if (c->max_chunks >= 0 && c->chunks + (long long)fresh > c->max_chunks) return 0;
    if (chunks_add(c, first, last + 1) < 0) return -1;
    c->reserved = c->chunks * (long long)CHUNK;
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
        int32_t rest = split_off(c, b, size, c->bufs[b].used);
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
        buf_drop(c, b);
        b = prev;
    }
    int32_t nxt = c->bufs[b].next;
    if (nxt >= 0 && c->bufs[nxt].used == state) {
        v_unindex(c, nxt);
        c->bufs[b].size += c->bufs[nxt].size;
        int32_t after = c->bufs[nxt].next;
        c->bufs[b].next = after;
        if (after >= 0) c->bufs[after].prev = b;
        buf_drop(c, nxt);
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
    int32_t si = new_segment_at(c, ai, addr, virt, 0);
    if (si < 0) return -1;
    int32_t b = buf_new(c, addr, virt, V_EAGER, -1, -1, si);
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
        unindex_buf(c, b);
        v_unindex(c, nxt);
        h_del(c, c->bufs[nxt].addr);
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
        } else if (h_put(c, c->bufs[nxt].addr, nxt) < 0 || v_index(c, nxt) < 0) {
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
    c->eager_frees += 1;
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
    c->reserved = c->chunks * (long long)CHUNK;
    return 0;
}

static long long v_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag) {
    u64 size = raw <= 0 ? ALIGN : ((u64)raw + ALIGN - 1) & ~(ALIGN - 1);
    int persistent = 0;
    if (pool != Py_None) {
        if (pool == str_persistent) persistent = 1;
        else if (PyUnicode_Check(pool)) persistent = PyUnicode_Compare(pool, str_persistent) == 0;
    }
    Py_ssize_t ai = get_alloc(c, stream, persistent, 0);
    if (ai < 0) return -1;
    int32_t b = v_take(c, ai, size);
    if (b == -2) {
        if (v_defrag(c) < 0) return -1;
        b = v_take(c, ai, size);
        if (b == -2) b = v_expand(c, ai, size);
        if (b == -2 && !persistent) {
            Py_ssize_t other = get_alloc(c, stream, 1, 0);
            if (other < 0) return -1;
            b = v_take(c, other, size);
        }
        if (b == -2) return record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag);
    }
    if (b < 0) return -1;
    return served(c, b);
}

static int v_free(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != V_USED) return 0;
    c->allocated -= (long long)c->bufs[b].size;
    return v_release(c, b, V_IDLE);
}

/* restore one recorded segment: _add_vrange(addr, size, stream, persistent, pieces, seg_end)
 * with pieces [(addr, size, state), ...] (Python's states: 0 used, 1 idle, 2 eager) */
static PyObject *V_add_range(Core *c, PyObject *args) {
    unsigned long long addr, size, seg_end;
    long long stream;
    int persistent;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KKLpOK", &addr, &size, &stream, &persistent, &pieces, &seg_end)) return NULL;
    Py_ssize_t ai = get_alloc(c, stream, persistent, 0);
    if (ai < 0) return NULL;
    int32_t si = new_segment_at(c, ai, addr, size, 0);
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
        int32_t b = buf_new(c, paddr, psize, state, prev, -1, si);
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
    c->reserved = c->chunks * (long long)CHUNK;
    Py_RETURN_NONE;
}

/* (ranges, mapped runs): ranges [(stream, persistent, addr, size, [(addr, size, state), ...])]
 * in allocator order with Python's states (0 used, 1 idle, 2 eager) */
static PyObject *V_state(Core *c, PyObject *unused) {
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
    for (Py_ssize_t k = 0; k < c->nruns; k++) {
        PyObject *t = Py_BuildValue("(KK)", c->cstart[k], c->cend[k]);
        if (!t || PyList_Append(runs, t) < 0) { Py_XDECREF(t); goto fail; }
        Py_DECREF(t);
    }
    return Py_BuildValue("(NN)", ranges, runs);
fail:
    Py_XDECREF(ranges); Py_XDECREF(runs);
    return NULL;
}

static PyObject *V_defrag(Core *c, PyObject *unused) {
    if (v_defrag(c) < 0) return NULL;
    Py_RETURN_NONE;
}

/* ---- Python methods ------------------------------------------------------------------------- */

static int get_u64(PyObject *obj, u64 *out, const char *what) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "%s must be an integer in [0, 2**64), got %R", what, obj);
        return -1;
    }
    *out = v;
    return 0;
}

/* the whole malloc of the reference: the address, or -2 after recording an OOM, -1 on error */
static long long core_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag) {
    u64 size = raw <= 0 ? ALIGN : ((u64)raw + ALIGN - 1) & ~(ALIGN - 1);
    int persistent = 0;
    if (pool != Py_None) {
        if (pool == str_persistent) persistent = 1;
        else if (PyUnicode_Check(pool)) persistent = PyUnicode_Compare(pool, str_persistent) == 0;
    }
    int small = c->small_pool && !persistent && size <= SMALL_SIZE;
    Py_ssize_t ai = get_alloc(c, stream, persistent, small);
    if (ai < 0) return -1;
    int32_t b = take(c, ai, size);
    if (b == -2) {
        if (persistent) {
            Py_ssize_t common = get_alloc(c, stream, 0, 0);
            if (common < 0) return -1;
            b = take(c, common, size);
            ai = common;
        }
        if (b == -2) {
            b = expand(c, ai, size);
            if (b == -2 && !persistent) {
                Py_ssize_t other = get_alloc(c, stream, 1, 0);
                if (other < 0) return -1;
                b = take(c, other, size);
            }
            if (b == -2) return record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag);
        }
    }
    if (b < 0) return -1;
    return served(c, b);
}

static PyObject *Core_malloc(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *stream_obj = NULL, *pool = Py_None, *tag = Py_None;
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "malloc(size, *, stream=0, pool=None, tag=None)"); return NULL; }
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
            if (name == str_pool || PyUnicode_Compare(name, str_pool) == 0) pool = value;
            else if (name == str_tag || PyUnicode_Compare(name, str_tag) == 0) tag = value;
            else if (name == str_stream || PyUnicode_Compare(name, str_stream) == 0) stream_obj = value;
            else { PyErr_Format(PyExc_TypeError, "malloc() got an unexpected keyword argument %R", name); return NULL; }
        }
    }
    long long raw = PyLong_AsLongLong(args[0]);
    if (raw == -1 && PyErr_Occurred()) return NULL;
    i64 stream = 0;
    if (stream_obj && stream_obj != Py_None) {
        stream = PyLong_AsLongLong(stream_obj);
        if (stream == -1 && PyErr_Occurred()) return NULL;
    }
    int region = -1;
    long long addr = c->kind == KIND_TORCH ? torch_malloc(c, raw, stream, tag)
                   : c->kind == KIND_EXPANDABLE ? x_malloc(c, raw, stream, tag)
                   : c->kind == KIND_VMM ? v_malloc(c, raw, stream, pool, tag)
                   : c->kind == KIND_POOLMODE ? pm_malloc(c, raw, stream, pool, tag, &region)
                   : core_malloc(c, raw, stream, pool, tag);
    if (addr == -1) return NULL;
    if (addr == -2) Py_RETURN_NONE;
    PyObject *out = PyLong_FromUnsignedLongLong((u64)addr);
    if (out && c->kind == KIND_POOLMODE && pm_unnote(c, region, out) < 0) Py_CLEAR(out);
    return out;
}

/* free the live buffer at ``addr`` (nothing when there is none); -1 on error */
static int core_free(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != 1) return 0;
    Buf *bufs = c->bufs;
    c->allocated -= (long long)bufs[b].size;
    bufs[b].used = 0;
    int32_t prev = bufs[b].prev;
    if (prev >= 0 && !bufs[prev].used) {
        unindex_buf(c, prev);
        bufs[prev].size += bufs[b].size;
        int32_t nxt = bufs[b].next;
        bufs[prev].next = nxt;
        if (nxt >= 0) bufs[nxt].prev = prev;
        if (c->kind == KIND_REGION && c->head == bufs[b].addr) c->head = bufs[prev].addr;
        buf_drop(c, b);
        b = prev;
    }
    int32_t nxt = bufs[b].next;
    if (nxt >= 0 && !bufs[nxt].used) {
        unindex_buf(c, nxt);
        bufs[b].size += bufs[nxt].size;
        int32_t after = bufs[nxt].next;
        bufs[b].next = after;
        if (after >= 0) bufs[after].prev = b;
        if (c->kind == KIND_REGION && c->head == bufs[nxt].addr) c->head = bufs[b].addr;
        buf_drop(c, nxt);
    }
    return index_buf(c, b);
}

static int model_free(Core *c, u64 addr) {
    return c->kind == KIND_EXPANDABLE ? x_free(c, addr) : c->kind == KIND_VMM ? v_free(c, addr)
         : c->kind == KIND_POOLMODE ? pm_free(c, addr) : core_free(c, addr);
}

static PyObject *Core_free(Core *c, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) {
        /* not an address this model handed out: nothing to free (as the reference) */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (model_free(c, addr) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *str_action, *str_id, *str_size, *str_addr, *str_alloc, *str_free;

static int is_action(PyObject *action, PyObject *name) {
    return action == name || (PyUnicode_Check(action) && PyUnicode_Compare(action, name) == 0);
}

/* Event fields read straight from the slots of ms_memopt.core.events.Event (a slots dataclass):
 * the cheap event encoding is no encoding at all. Other objects go through getattr. */
enum { F_ACTION, F_ID, F_SIZE, F_ADDR, F_STREAM, F_POOL, F_TAG, F_COUNT };
typedef struct { PyTypeObject *type; Py_ssize_t offset[F_COUNT]; PyObject *name[F_COUNT]; } Fields;

static void fields_init(Fields *f, PyObject *sample) {
    f->name[F_ACTION] = str_action; f->name[F_ID] = str_id; f->name[F_SIZE] = str_size;
    f->name[F_ADDR] = str_addr; f->name[F_STREAM] = str_stream; f->name[F_POOL] = str_pool; f->name[F_TAG] = str_tag;
    f->type = NULL;
    if (!sample) return;
    PyTypeObject *type = Py_TYPE(sample);
    for (int k = 0; k < F_COUNT; k++) {
        PyObject *descr = _PyType_Lookup(type, f->name[k]);      /* borrowed */
        if (!descr || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) return;
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX && m->type != T_OBJECT) return;
        f->offset[k] = m->offset;
    }
    f->type = type;
}

/* a row: a tuple of Event's fields in its order, as ms_memopt.engine.workload generates them for
 * simulate. The order is Event's (ms_memopt/core/events.py) and only Event's: ms_memopt/allocators/
 * fast.py hands it over at import (set_row_layout); these are just the values before that. */
static Py_ssize_t ROW_FIELDS = 9;
static int ROW_INDEX[F_COUNT] = {0, 1, 2, 3, 4, 5, 7};

/* set_row_layout(count, (action, id, size, addr, stream, pool, tag)): a row's length and where
 * each field the loop reads sits in it */
static PyObject *set_row_layout(PyObject *self, PyObject *args) {
    Py_ssize_t count;
    int index[F_COUNT];
    if (!PyArg_ParseTuple(args, "n(iiiiiii)", &count, &index[F_ACTION], &index[F_ID], &index[F_SIZE],
                          &index[F_ADDR], &index[F_STREAM], &index[F_POOL], &index[F_TAG])) return NULL;
    for (int k = 0; k < F_COUNT; k++) {
        if (index[k] < 0 || index[k] >= count) {
            PyErr_SetString(PyExc_ValueError, "a row field index outside the row");
            return NULL;
        }
    }
    ROW_FIELDS = count;
    memcpy(ROW_INDEX, index, sizeof(index));
    Py_RETURN_NONE;
}

/* a new reference to field ``k`` of ``ev``, or NULL with an exception */
static inline PyObject *field(Fields *f, PyObject *ev, int k) {
    if (Py_TYPE(ev) == f->type) {
        PyObject *v = *(PyObject **)((char *)ev + f->offset[k]);
        if (v) { Py_INCREF(v); return v; }
    } else if (PyTuple_CheckExact(ev) && PyTuple_GET_SIZE(ev) == ROW_FIELDS) {
        PyObject *v = PyTuple_GET_ITEM(ev, ROW_INDEX[k]);
        Py_INCREF(v);
        return v;
    }
    return PyObject_GetAttr(ev, f->name[k]);
}

/* The replay/simulate hot loop: events[start:stop] while they are allocs and frees.
 * run(events, start, stop, address_of, watch, use_stream, forget=False) -> (index, allocs, known, matched, oom)
 * ``forget`` (pool mode; simulate): the tensors a cache eviction drops leave ``address_of``
 * before the new entry goes in (simulate's drain_evicted + _forget after every malloc).
 * ``index`` is the first event not handled: a non-alloc/free event, an alloc whose tag is a key
 * of ``watch`` (not served), or with ``oom`` true an alloc that failed (OOM recorded). ``known``
 * and ``matched`` count allocs with a recorded address and those placed there. */
static PyObject *Core_run(Core *c, PyObject *args) {
    PyObject *events, *address_of, *watch;
    Py_ssize_t start, stop;
    int use_stream, forget = 0;
    if (!PyArg_ParseTuple(args, "O!nnO!Op|p", &PyList_Type, &events, &start, &stop, &PyDict_Type, &address_of,
                          &watch, &use_stream, &forget)) return NULL;
    forget = forget && c->kind == KIND_POOLMODE;
    if (watch != Py_None && !PyDict_Check(watch)) { PyErr_SetString(PyExc_TypeError, "watch must be a dict or None"); return NULL; }
    if (stop > PyList_GET_SIZE(events)) stop = PyList_GET_SIZE(events);
    long long allocs = 0, known = 0, matched = 0;
    int oom = 0;
    Py_ssize_t i;
    Fields f;
    fields_init(&f, start < stop ? PyList_GET_ITEM(events, start) : NULL);
    for (i = start; i < stop; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        PyObject *action = field(&f, ev, F_ACTION);
        if (!action) return NULL;
        int alloc = is_action(action, str_alloc), freeing = !alloc && is_action(action, str_free);
        Py_DECREF(action);
        if (freeing) {
            PyObject *id = field(&f, ev, F_ID);
            if (!id) return NULL;
            PyObject *addr = PyDict_GetItemWithError(address_of, id);
            if (addr) {
                Py_INCREF(addr);
                if (PyDict_DelItem(address_of, id) < 0) { Py_DECREF(addr); Py_DECREF(id); return NULL; }
            }
            Py_DECREF(id);
            if (!addr && PyErr_Occurred()) return NULL;
            if (addr) {
                unsigned long long a = PyLong_AsUnsignedLongLong(addr);
                Py_DECREF(addr);
                if (a == (unsigned long long)-1 && PyErr_Occurred()) PyErr_Clear();
                else if (model_free(c, a) < 0) return NULL;
            }
            continue;
        }
        if (!alloc) break;
        PyObject *tag = field(&f, ev, F_TAG);
        if (!tag) return NULL;
        if (watch != Py_None && tag != Py_None) {
            int hit = PyDict_Contains(watch, tag);
            if (hit) { Py_DECREF(tag); if (hit < 0) return NULL; break; }
        }
        PyObject *size_obj = field(&f, ev, F_SIZE);
        PyObject *pool = field(&f, ev, F_POOL);
        PyObject *stream_obj = use_stream ? field(&f, ev, F_STREAM) : NULL;
        long long raw = size_obj ? PyLong_AsLongLong(size_obj) : -1;
        i64 stream = stream_obj ? PyLong_AsLongLong(stream_obj) : 0;
        Py_XDECREF(size_obj); Py_XDECREF(stream_obj);
        if (!size_obj || !pool || (use_stream && !stream_obj) || PyErr_Occurred()) { Py_DECREF(tag); Py_XDECREF(pool); return NULL; }
        allocs++;
        int region = -1;
        long long addr = c->kind == KIND_TORCH ? torch_malloc(c, raw, stream, tag)
                       : c->kind == KIND_EXPANDABLE ? x_malloc(c, raw, stream, tag)
                       : c->kind == KIND_VMM ? v_malloc(c, raw, stream, pool, tag)
                       : c->kind == KIND_POOLMODE ? pm_malloc(c, raw, stream, pool, tag, &region)
                       : core_malloc(c, raw, stream, pool, tag);
        Py_DECREF(tag); Py_DECREF(pool);
        if (addr == -1) return NULL;
        if (addr == -2) { oom = 1; break; }
        PyObject *id = field(&f, ev, F_ID);
        PyObject *addr_obj = PyLong_FromUnsignedLongLong((u64)addr);
        int bad = !id || !addr_obj;
        if (!bad && forget) {
            /* the evicted tensors go first (the new entry may sit at an evicted address) */
            bad = PyList_GET_SIZE(c->pm_evicted) && pm_forget(c, address_of) < 0;
            if (!bad && (c->pm_flags[region] & PM_EVICTING)) bad = PyDict_SetItem(c->pm_tid_of, addr_obj, id) < 0;
        } else if (!bad && c->kind == KIND_POOLMODE) {
            bad = pm_unnote(c, region, addr_obj) < 0;
        }
        if (bad || PyDict_SetItem(address_of, id, addr_obj) < 0) { Py_XDECREF(id); Py_XDECREF(addr_obj); return NULL; }
        Py_DECREF(id); Py_DECREF(addr_obj);
        PyObject *rec = field(&f, ev, F_ADDR);
        if (!rec) return NULL;
        if (rec != Py_None) {
            known++;
            unsigned long long r = PyLong_AsUnsignedLongLong(rec);
            if (r == (unsigned long long)-1 && PyErr_Occurred()) PyErr_Clear();
            else matched += r == (u64)addr;
        }
        Py_DECREF(rec);
    }
    return Py_BuildValue("(nLLLO)", i, allocs, known, matched, oom ? Py_True : Py_False);
}

static PyObject *Core_empty_cache(Core *c, PyObject *unused) {
    if (c->kind == KIND_VMM) return V_defrag(c, NULL);
    if (c->kind == KIND_EXPANDABLE) {
        if (x_unmap_all(c) < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (c->kind == KIND_TORCH) {
        torch_release_cached(c);
        Py_RETURN_NONE;
    }
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        /* a copy: releasing edits the allocator's list */
        Alloc *a = &c->allocs[ai];
        Py_ssize_t n = a->nsegs;
        int32_t *copy = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
        if (!copy) return PyErr_NoMemory();
        memcpy(copy, a->segs, sizeof(int32_t) * n);
        for (Py_ssize_t k = 0; k < n; k++) release_if_idle(c, copy[k]);
        PyMem_Free(copy);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_note_segment_alloc(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"addr", "size", "stream", NULL};
    PyObject *addr_obj, *size_obj = NULL, *stream_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO", names, &addr_obj, &size_obj, &stream_obj)) return NULL;
    u64 addr;
    /* expandable and vmm place no recorded segments */
    if (c->kind == KIND_EXPANDABLE || c->kind == KIND_VMM) Py_RETURN_NONE;
    if (c->kind == KIND_TORCH) {
        if (addr_obj == Py_None) Py_RETURN_NONE;
        u64 size = 0;
        i64 stream = 0;
        if (get_u64(addr_obj, &addr, "addr") < 0 || (size_obj && get_u64(size_obj, &size, "size") < 0)) return NULL;
        if (stream_obj && (stream = PyLong_AsLongLong(stream_obj)) == -1 && PyErr_Occurred()) return NULL;
        if (grow_array((void **)&c->trec, &c->captrec, c->ntrec + 1, sizeof(Recorded)) < 0) return NULL;
        c->trec[c->ntrec].addr = addr; c->trec[c->ntrec].size = size; c->trec[c->ntrec].stream = stream;
        c->ntrec++;
        Py_RETURN_NONE;
    }
    if (get_u64(addr_obj, &addr, "addr") < 0) return NULL;
    if (c->rec_tail == c->rec_cap) {
        if (c->rec_head > 0) {
            memmove(c->rec, c->rec + c->rec_head, sizeof(u64) * (c->rec_tail - c->rec_head));
            c->rec_tail -= c->rec_head; c->rec_head = 0;
        }
        if (grow_array((void **)&c->rec, &c->rec_cap, c->rec_tail + 1, sizeof(u64)) < 0) return NULL;
    }
    c->rec[c->rec_tail++] = addr;
    Py_RETURN_NONE;
}

static PyObject *Core_release_segment(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"addr", "size", "stream", NULL};
    PyObject *addr_obj, *size_obj = NULL, *stream_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO", names, &addr_obj, &size_obj, &stream_obj)) return NULL;
    u64 addr;
    if (c->kind == KIND_EXPANDABLE) {
        /* a recorded segment_free means the recording released cached memory: unmap here too */
        if (x_unmap_all(c) < 0) return NULL;
        Py_RETURN_NONE;
    }
    if (c->kind == KIND_VMM) Py_RETURN_NONE;          /* the VMM model releases nothing on it */
    if (get_u64(addr_obj, &addr, "addr") < 0) return NULL;
    if (c->kind == KIND_TORCH) {
        /* the recorded segment if idle here, else an idle one of the same size and stream */
        u64 size = 0;
        i64 stream = 0;
        if ((size_obj && get_u64(size_obj, &size, "size") < 0)) return NULL;
        if (stream_obj && (stream = PyLong_AsLongLong(stream_obj)) == -1 && PyErr_Occurred()) return NULL;
        Py_ssize_t at = order_search(c, addr);
        if (at < c->norder && c->segs[c->order[at]].addr == addr && torch_idle(c, c->order[at])) {
            torch_release(c, c->order[at]);
            Py_RETURN_NONE;
        }
        for (Py_ssize_t k = 0; k < c->norder; k++) {
            Seg *seg = &c->segs[c->order[k]];
            if (seg->size == size && seg->stream == stream && torch_idle(c, c->order[k])) {
                torch_release(c, c->order[k]);
                break;
            }
        }
        Py_RETURN_NONE;
    }
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Alloc *a = &c->allocs[ai];
        for (Py_ssize_t k = 0; k < a->nsegs; k++) {
            if (c->segs[a->segs[k]].addr == addr) {
                release_if_idle(c, a->segs[k]);
                Py_RETURN_NONE;
            }
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Core_largest_free(Core *c, PyObject *unused) {
    u64 best = 0;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Alloc *a = &c->allocs[ai];
        if (a->nkeys && a->keys[a->nkeys - 1].size > best) best = a->keys[a->nkeys - 1].size;
    }
    return PyLong_FromUnsignedLongLong(best);
}

static const char *pool_name(Core *c, Alloc *a) {
    if (c->kind == KIND_TORCH) return a->small ? "small" : "large";
    return a->persistent ? "persistent" : (a->small ? "small" : "common");
}

/* [(addr, size, stream, pool, [(addr, size, used), ...]), ...] for every segment, allocator order */
static PyObject *Core_segments(Core *c, PyObject *unused) {
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
static PyObject *Core_add_segment(Core *c, PyObject *args) {
    unsigned long long addr, size;
    long long stream;
    int persistent, small;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KKLppO", &addr, &size, &stream, &persistent, &small, &pieces)) return NULL;
    Py_ssize_t ai = get_alloc(c, stream, persistent, small);
    if (ai < 0) return NULL;
    int32_t si = new_segment_at(c, ai, addr, size, 0);
    if (si < 0) return NULL;
    PyObject *seq = PySequence_Fast(pieces, "pieces must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int32_t prev = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long paddr, psize;
        int live;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKp", &paddr, &psize, &live)) { Py_DECREF(seq); return NULL; }
        int32_t b = buf_new(c, paddr, psize, live, prev, -1, si);
        if (b < 0) { Py_DECREF(seq); return NULL; }
        if (prev < 0) c->segs[si].head = b; else c->bufs[prev].next = b;
        if (live) c->allocated += (long long)psize;
        prev = b;
    }
    Py_DECREF(seq);
    for (int32_t b = c->segs[si].head; b >= 0; b = c->bufs[b].next)
        if (!c->bufs[b].used && index_buf(c, b) < 0) return NULL;
    u64 next = round_up(addr + size, SEG_ALIGN);
    if (next > c->next_addr) c->next_addr = next;
    Py_RETURN_NONE;
}

/* forget every segment and buffer (torch's restore starts from nothing); peaks stay */
static PyObject *Core_reset(Core *c, PyObject *unused) {
    for (Py_ssize_t i = 0; i < c->nallocs; i++) {
        PyMem_Free(c->allocs[i].segs); PyMem_Free(c->allocs[i].keys); PyMem_Free(c->allocs[i].unm);
    }
    PyMem_Free(c->allocs); c->allocs = NULL; c->nallocs = 0;
    c->nsegs = 0; c->nbufs = 0; c->free_slot = -1; c->norder = 0; c->ntrec = 0;
    c->rec_head = c->rec_tail = 0;
    for (Py_ssize_t i = 0; i < c->hcap; i++) c->hkeys[i] = EMPTY_KEY;
    c->hcount = 0;
    c->reserved = c->allocated = 0;
    c->next_base = 1ULL << 44;
    Py_RETURN_NONE;
}

/* set_memory(init_size=): two blocks of ``half`` bytes (persistent, then common, stream 0) */
static PyObject *Core_pregrow(Core *c, PyObject *arg) {
    u64 half;
    if (get_u64(arg, &half, "half") < 0) return NULL;
    for (int persistent = 1; persistent >= 0; persistent--) {
        Py_ssize_t ai = get_alloc(c, 0, persistent, 0);
        if (ai < 0) return NULL;
        u64 dfree = device_free(c);
        if (new_segment(c, ai, half < dfree ? half : dfree) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- type ----------------------------------------------------------------------------------- */
static int Core_init(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"capacity", "increase_size", "grow_add", "small_pool", "idle_order", "kind",
                            "divisions", NULL};
    PyObject *capacity = Py_None;
    unsigned long long increase = 1ULL << 30;
    int grow_add = 0, small_pool = 0, idle_order = 0;
    const char *kind = "mindspore";
    unsigned int divisions = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OKpppsI", names, &capacity, &increase, &grow_add,
                                     &small_pool, &idle_order, &kind, &divisions)) return -1;
    if (strcmp(kind, "torch") == 0) c->kind = KIND_TORCH;
    else if (strcmp(kind, "mindspore") == 0) c->kind = KIND_MINDSPORE;
    else if (strcmp(kind, "region") == 0) c->kind = KIND_REGION;
    else if (strcmp(kind, "expandable") == 0) c->kind = KIND_EXPANDABLE;
    else if (strcmp(kind, "vmm") == 0) c->kind = KIND_VMM;
    else if (strcmp(kind, "poolmode") == 0) c->kind = KIND_POOLMODE;
    else { PyErr_Format(PyExc_ValueError, "kind must be mindspore, torch, region, expandable, vmm or poolmode, got %s", kind); return -1; }
    if (c->kind == KIND_POOLMODE && !c->pm_evicted) {
        c->pm_evicted = PyList_New(0);
        c->pm_tid_of = PyDict_New();
        if (!c->pm_evicted || !c->pm_tid_of) return -1;
    }
    c->divisions = divisions;
    c->bounded = capacity != Py_None;
    if (c->bounded) {
        long long cap = PyLong_AsLongLong(capacity);
        if (cap == -1 && PyErr_Occurred()) return -1;
        c->capacity = cap > 0 ? (u64)cap : 0;
    }
    if (increase == 0) { PyErr_SetString(PyExc_ValueError, "increase_size must be > 0"); return -1; }
    c->increase_size = increase;
    /* expandable: one virtual range of 1 1/8 x device memory per pool (1 TiB when unbounded) */
    c->range_size = c->bounded ? c->capacity + c->capacity / 8 : (1ULL << 40);
    c->next_base = 1ULL << 44;
    c->grow_add = grow_add; c->small_pool = small_pool; c->idle_order = idle_order;
    c->next_addr = BASE_ADDR;
    c->free_slot = -1;
    /* vmm: virtual addresses from 1 TiB; the device holds capacity // 2 MiB chunks */
    if (c->kind == KIND_VMM) c->next_addr = 1ULL << 40;
    c->max_chunks = c->bounded ? (long long)(c->capacity >> 21) : -1;
    if (!c->hkeys && h_resize(c, 1024) < 0) return -1;
    return 0;
}

static void pm_clear(Core *c) {
    for (Py_ssize_t i = 0; i < c->pm_n; i++) Py_CLEAR(c->pm_regions[i]);
    for (int k = 0; k < c->pm_nroutes; k++) { Py_CLEAR(c->pm_route_tag[k]); Py_CLEAR(c->pm_route_pool[k]); }
    c->pm_nroutes = 0;
    Py_CLEAR(c->pm_evicted); Py_CLEAR(c->pm_tid_of);
}

static void Core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    Py_CLEAR(c->dict);
    pm_clear(c);
    PyMem_Free(c->pm_regions); PyMem_Free(c->pm_flags);
    for (Py_ssize_t i = 0; i < c->nallocs; i++) {
        PyMem_Free(c->allocs[i].segs); PyMem_Free(c->allocs[i].keys); PyMem_Free(c->allocs[i].unm);
        PyMem_Free(c->allocs[i].ekeys);
    }
    PyMem_Free(c->allocs); PyMem_Free(c->segs); PyMem_Free(c->cstart); PyMem_Free(c->cend); PyMem_Free(c->bufs);
    PyMem_Free(c->hkeys); PyMem_Free(c->hvals); PyMem_Free(c->rec);
    PyMem_Free(c->order); PyMem_Free(c->trec);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->dict);
    for (Py_ssize_t i = 0; i < c->pm_n; i++) Py_VISIT(c->pm_regions[i]);
    Py_VISIT(c->pm_evicted); Py_VISIT(c->pm_tid_of);
    return 0;
}
static int Core_clear(Core *c) { Py_CLEAR(c->dict); pm_clear(c); return 0; }

static PyMethodDef Core_methods[] = {
    {"malloc", (PyCFunction)(void (*)(void))Core_malloc, METH_FASTCALL | METH_KEYWORDS,
     "malloc(size, *, stream=0, pool=None, tag=None): the block's address, or None (OOM recorded)"},
    {"free", (PyCFunction)Core_free, METH_O, "free(addr): free the live buffer at addr"},
    {"empty_cache", (PyCFunction)Core_empty_cache, METH_NOARGS, "ReleaseFreeBlocks"},
    {"note_segment_alloc", (PyCFunction)(void (*)(void))Core_note_segment_alloc, METH_VARARGS | METH_KEYWORDS,
     "place the next new block at addr if it is free"},
    {"release_segment", (PyCFunction)(void (*)(void))Core_release_segment, METH_VARARGS | METH_KEYWORDS,
     "release the block at addr if it is idle"},
    {"_run", (PyCFunction)Core_run, METH_VARARGS,
     "_run(events, start, stop, address_of, watch, use_stream, forget=False) -> (index, allocs, known, matched, oom)"},
    {"largest_free", (PyCFunction)Core_largest_free, METH_NOARGS, "the largest idle buffer, bytes"},
    {"_segments", (PyCFunction)Core_segments, METH_NOARGS, "every segment with its buffers"},
    {"_add_segment", (PyCFunction)Core_add_segment, METH_VARARGS, "restore one recorded segment"},
    {"_pregrow", (PyCFunction)Core_pregrow, METH_O, "set_memory(init_size=2*half)"},
    {"_reset", (PyCFunction)Core_reset, METH_NOARGS, "forget every segment and buffer"},
    {"defrag", (PyCFunction)V_defrag, METH_NOARGS, "vmm: FreeIdleMemsByEagerFree"},
    {"_add_vrange", (PyCFunction)V_add_range, METH_VARARGS, "vmm: restore one recorded segment"},
    {"_vmm_state", (PyCFunction)V_state, METH_NOARGS, "vmm: ranges with their buffers, mapped runs"},
    {"_add_range", (PyCFunction)X_add_range, METH_VARARGS, "expandable: restore one recorded segment"},
    {"_restored", (PyCFunction)X_restored, METH_NOARGS, "expandable: restoring is over"},
    {"_ranges", (PyCFunction)X_ranges, METH_NOARGS, "expandable: every range with its buffers"},
    {"_region_init", (PyCFunction)Region_init_range, METH_VARARGS, "region: its range and kind of ring"},
    {"take", (PyCFunction)(void (*)(void))Region_take, METH_VARARGS | METH_KEYWORDS, "region: take(size, ring, fallback=True) -> address or None"},
    {"open_chunk", (PyCFunction)Region_open_chunk, METH_O, "region: a micro-batch's chunk opens"},
    {"close_chunk", (PyCFunction)Region_close_chunk, METH_NOARGS, "region: the open chunk closes"},
    {"release", (PyCFunction)Region_release, METH_O, "region: release(addr) -> bytes freed"},
    {"size_of", (PyCFunction)Region_size_of, METH_O, "region: bytes of the buffer at addr"},
    {"_pool_init", (PyCFunction)Pool_init, METH_VARARGS, "pool mode: _pool_init(regions, flags)"},
    {"drain_evicted", (PyCFunction)Pool_drain, METH_NOARGS,
     "pool mode: the addresses the cache region evicted since the last call"},
    {NULL}
};

static PyMemberDef Core_members[] = {
    {"reserved", T_LONGLONG, offsetof(Core, reserved), 0, "bytes held from the device"},
    {"allocated", T_LONGLONG, offsetof(Core, allocated), 0, "bytes in live buffers"},
    {"peak_reserved", T_LONGLONG, offsetof(Core, peak_reserved), 0, "largest reserved, bytes"},
    {"peak_allocated", T_LONGLONG, offsetof(Core, peak_allocated), 0, "largest allocated, bytes"},
    {"segment_allocs", T_LONGLONG, offsetof(Core, segment_allocs), 0, "blocks taken from the device"},
    {"eager_frees", T_LONGLONG, offsetof(Core, eager_frees), 0, "vmm: eager frees (defrag) so far"},
    {"evictions", T_LONGLONG, offsetof(Core, evictions), 0, "pool mode: cache entries evicted so far"},
    {NULL}
};

static PyGetSetDef Core_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"free_keys", (getter)Region_free_keys, NULL, "region: free buffers as sorted size << 64 | addr", NULL},
    {"head", (getter)Region_get, NULL, "region: the ring head", (void *)0},
    {"stack_top", (getter)Region_get, NULL, "region: the open chunk's top, or None", (void *)1},
    {"stack_floor", (getter)Region_get, NULL, "region: the open chunk's start", (void *)2},
    {NULL}
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ms_memopt.allocators.fast._fastpool.ModelCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Allocator model state and hot path in C (kind: mindspore or torch) (see ms_memopt/allocators/fast/__init__.py)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_getset = Core_getset,
    .tp_dictoffset = offsetof(Core, dict),
};

/* The sha256 of the C source this module was built from (setup.py passes it as
 * -DMS_MEMOPT_SOURCE_HASH; ms_memopt/core/_build_hash.py computes it): SOURCE_HASH, which
 * ms_memopt/allocators/fast/__init__.py compares with the tree's source to refuse a stale build. */
#ifndef MS_MEMOPT_SOURCE_HASH
#define MS_MEMOPT_SOURCE_HASH ""
#endif

static PyMethodDef module_methods[] = {
    {"set_row_layout", set_row_layout, METH_VARARGS, "set_row_layout(count, (action, id, size, addr, stream, pool, tag))"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastpool", "Compiled fast path of the allocator models.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__fastpool(void) {
    str_stream = PyUnicode_InternFromString("stream");
    str_pool = PyUnicode_InternFromString("pool");
    str_tag = PyUnicode_InternFromString("tag");
    str_persistent = PyUnicode_InternFromString("persistent");
    str_record_oom = PyUnicode_InternFromString("_record_oom");
    str_action = PyUnicode_InternFromString("action");
    str_id = PyUnicode_InternFromString("id");
    str_size = PyUnicode_InternFromString("size");
    str_addr = PyUnicode_InternFromString("addr");
    str_alloc = PyUnicode_InternFromString("alloc");
    str_free = PyUnicode_InternFromString("free");
    str_region_for = PyUnicode_InternFromString("region_for");
    str_order = PyUnicode_InternFromString("order");
    str_popitem = PyUnicode_InternFromString("popitem");
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "ModelCore", (PyObject *)&CoreType) < 0) { Py_DECREF(&CoreType); Py_DECREF(m); return NULL; }
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", MS_MEMOPT_SOURCE_HASH) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
