/* Shared types and code of the compiled allocator models (ms_memopt.allocators.fast._fastpool).
 *
 * One extension module built from several sources (ms_memopt/core/_build_hash.py EXTENSIONS):
 *   common.c            this header's shared code: buffers, the address table, free keys,
 *                       allocators, segments, segments by address, restore and layout helpers;
 *   mindspore.c         MindSpore's best-fit pools (mindspore.py, both tie rules);
 *   mindspore_vmm.c     MindSpore's VMM pool (mindspore_vmm.py);
 *   torch.c             PyTorch's caching allocator (torch.py);
 *   torch_expandable.c  PyTorch with expandable segments (torch_expandable.py);
 *   torch_npu.c         torch_npu's allocator (torch_npu.py): the two above with its constants;
 *   pool.c              pool mode (pool.py): its regions, routing, eviction, malloc and free;
 *   _fastpool.c         the batch loop (_run), the Python methods, the type, module init.
 *
 * A model is a Model record (below): its name (ModelCore's kind=), its malloc and free and its
 * other entry points; Core points at its model and calls through it, so the module file knows
 * no model by name. The pure-Python models are the readable reference; tests/test_fastpool.py
 * holds each C model to identical addresses, counters and layouts.
 *
 * Data structures (common.c):
 *   - buffers: one array of records {addr, size, tie, prev, next, seg, used}, doubly linked
 *     inside their segment (pool block); recycled through a free-slot list;
 *   - address -> buffer: open-addressing hash table, linear probing, backward-shift deletion;
 *   - free buffers of an allocator: a sorted array of (size, tie, buffer) searched by binary
 *     search (best fit = one lower_bound); tie = address (AbstractDynamicMemPool) or the turn
 *     the buffer became idle (DynamicMemPoolBestFit's multimap);
 *   - allocators: a small array keyed by (stream, persistent, small).
 * Sizes and addresses are unsigned 64-bit integers (the replay engine refuses >= 2**48).
 */
#ifndef MS_MEMOPT_FASTPOOL_H
#define MS_MEMOPT_FASTPOOL_H

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
#define MIB (1ULL << 20)
#define GIB (1ULL << 30)
/* PyTorch's block sizes (torch.py; the expandable model maps pages of the first two) */
#define T_SMALL_BUFFER (2 * MIB)
#define T_LARGE_BUFFER (20 * MIB)
#define T_ROUND_LARGE (2 * MIB)    /* kRoundLarge: large segments' unit; torch_npu aligns 2 MiB+ requests */

typedef struct {
    u64 addr, size, tie;
    int32_t prev, next, seg;
    int32_t used;          /* 1 used, 0 idle (each model may use more states); -1 slot free */
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
    long long freed_at;      /* torch's garbage collection: its pool's lookups when a block of it was last freed */
} Seg;

typedef struct {
    i64 stream;
    int persistent, small;
    int32_t *segs; Py_ssize_t nsegs, capsegs;
    Key *keys; Py_ssize_t nkeys, capkeys;
    int32_t *unm; Py_ssize_t nunm, capunm;   /* expandable: unmapped buffers by address */
    Key *ekeys; Py_ssize_t nekeys, capekeys; /* vmm: eager-free buffers by (size, addr) */
    long long lookups;                       /* torch's garbage collection: free-block lookups */
} Alloc;

typedef struct { u64 addr, size; i64 stream; } Recorded;

#define PM_ROUTES 64          /* pool mode: (tag, pool) -> region pairs remembered by identity */
enum { PM_EVICTING = 1, PM_RING = 2 };

/* model-only state, one struct per model (Core holds them all: a few hundred bytes, and a
 * field read by the wrong model is a compile-time name, not a silent alias) */
typedef struct {              /* mindspore.c */
    u64 increase_size;
    int grow_add, small_pool;
    u64 *rec; Py_ssize_t rec_head, rec_tail, rec_cap;   /* recorded segment addresses (a queue) */
} MsState;

typedef struct {              /* torch.c (order, divisions and pad: torch_expandable.c too) */
    unsigned divisions;
    unsigned pad;             /* bytes added before rounding (torch_npu's round_size: 32) */
    int page_1g;              /* torch_npu's page_size:1g: large-pool segments in whole GiB */
    u64 max_split;            /* max_split_size_mb in bytes (0: not set) */
    double gc_threshold;      /* garbage_collection_threshold (0: not set; acts only with a capacity) */
    Recorded *trec; Py_ssize_t ntrec, captrec;   /* recorded segments for the next request */
} TorchState;

typedef struct {              /* torch_expandable.c: virtual range size and where new ranges go */
    u64 range_size, next_base;
    u64 large_page;           /* the large pool's page (0: 20 MiB; torch_npu's segment_size_mb, page_size:1g) */
    u64 align;                /* torch_npu: 2 MiB+ requests start on this boundary (0: off) */
    Recorded *hints; Py_ssize_t nhints, caphints;   /* recorded segment_map addresses for this request */
} ExpandableState;

typedef struct {              /* mindspore_vmm.c: mapped 2 MiB chunks as sorted runs [start, end) */
    u64 *cstart, *cend; Py_ssize_t nruns, capruns, capruns2;
    long long chunks, max_chunks, eager_frees;
} VmmState;

typedef struct {              /* pool.c, a region: its range, ring head, open chunk */
    u64 raddr, rsize, head, stack_top, stack_floor;
    int chunked, stack_open;
} RegionState;

typedef struct {              /* pool.c, pool mode (pool.py's PoolModeAllocator) */
    /* its regions (FastRegion objects, strong references) with their PM_* flags */
    PyObject **regions; int *flags; Py_ssize_t n;
    /* the routing table handed over once by _pool_init: tag -> region name (the route dict,
     * copied), region name -> index */
    PyObject *route, *index;
    /* the route cache: (tag, pool) objects -> region index (-1: none), held strongly so that
     * identity stays meaningful */
    PyObject *route_tag[PM_ROUTES], *route_pool[PM_ROUTES]; int route_index[PM_ROUTES]; int nroutes;
    /* addresses evicted since the last drain; address -> tensor id of cache entries placed by
     * _run (forgetting them in address_of without a scan) */
    PyObject *evicted, *tid_of;
    long long evictions;
} PoolState;

struct Model;

typedef struct {
    PyObject_HEAD
    PyObject *dict;
    const struct Model *model;
    /* counters, visible from Python (AllocatorModel's attributes) */
    long long reserved, allocated, peak_reserved, peak_allocated, segment_allocs;
    /* requests on the slow path and idle blocks given back to the device (the MindSpore
     * models: mindspore.c, mindspore_vmm.c; base.py documents both) */
    long long slow_path_events, segment_frees;
    /* OOM records (AllocatorModel.full_oom_records: -1 every failure in full; n: the first n, the
     * later ones only counted in ooms_counted, without calling back into Python); oom_counted:
     * the last failure was only counted (the batch loop goes on past it) */
    long long full_oom_records, ooms_counted;
    int oom_counted;
    /* configuration */
    int bounded; u64 capacity;
    int idle_order; u64 turn;       /* free keys tie on the idle turn (best-fit pool) */
    u64 next_addr;                  /* the next new segment's address (mindspore, vmm) */
    /* buffers */
    Buf *bufs; Py_ssize_t nbufs, capbufs; int32_t free_slot;
    /* address -> buffer */
    u64 *hkeys; int32_t *hvals; Py_ssize_t hcap, hcount;
    /* segments, allocators */
    Seg *segs; Py_ssize_t nsegs, capsegs;
    Alloc *allocs; Py_ssize_t nallocs;
    /* segments sorted by address (torch, torch-expandable) */
    int32_t *order; Py_ssize_t norder, caporder;
    MsState ms;
    TorchState torch;
    ExpandableState x;
    VmmState vmm;
    RegionState region;
    PoolState pm;
} Core;

/* A model's entry points. malloc: the address, -2 after recording an OOM (or nothing fits, for
 * a region), -1 on error; ``*region`` may be set to what ``placed`` needs. free: -1 on error.
 * The others may be NULL (nothing to do). */
typedef struct Model {
    const char *kind;
    long long (*malloc)(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *region);
    int (*free)(Core *c, u64 addr);
    int (*init)(Core *c);                               /* after the common fields are set */
    int (*segment_added)(Core *c, int32_t si);          /* fp_new_segment_at's model part */
    int (*empty_cache)(Core *c);
    int (*note_segment_alloc)(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
    int (*release_segment)(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
    int (*note_segment_map)(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
    int (*unmap_range)(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
    const char *(*pool_name)(const Alloc *a);           /* Core_segments' pool names */
    /* after malloc handed out ``addr`` (a Python int; ``id`` the tensor's, or NULL): with
     * ``address_of`` (_run's forget=True) the tensors evicted meanwhile leave it */
    int (*placed)(Core *c, int region, PyObject *addr, PyObject *id, PyObject *address_of);
    int (*traverse)(Core *c, visitproc visit, void *arg);
    void (*clear)(Core *c);
} Model;

#define EMPTY_KEY (~0ULL)

#pragma GCC visibility push(hidden)

extern const Model fp_mindspore_model, fp_torch_model, fp_expandable_model, fp_vmm_model, fp_region_model,
    fp_poolmode_model, fp_torch_npu_model, fp_npu_expandable_model;
extern PyTypeObject fp_CoreType;
extern PyObject *fp_str_stream, *fp_str_pool, *fp_str_tag, *fp_str_persistent, *fp_str_record_oom, *fp_str_ooms,
    *fp_str_order, *fp_str_popitem, *fp_str_empty, *fp_str_workspace;

/* ---- common.c ------------------------------------------------------------------------------- */
int fp_grow_array(void **ptr, Py_ssize_t *cap, Py_ssize_t need, size_t item);
int fp_h_resize(Core *c, Py_ssize_t cap);
int fp_h_put(Core *c, u64 addr, int32_t buf);
void fp_h_del(Core *c, u64 addr);
int32_t fp_buf_new(Core *c, u64 addr, u64 size, int used, int32_t prev, int32_t next, int32_t seg);
void fp_buf_drop(Core *c, int32_t i);
int fp_index_buf(Core *c, int32_t i);
void fp_unindex_buf(Core *c, int32_t i);
Py_ssize_t fp_get_alloc(Core *c, i64 stream, int persistent, int small);
u64 fp_device_free(Core *c);
int32_t fp_new_segment_at(Core *c, Py_ssize_t ai, u64 addr, u64 size, int index);
int32_t fp_split_off(Core *c, int32_t b, u64 size, int state);
int fp_cut(Core *c, int32_t b, u64 size);
void fp_drop_segment(Core *c, int32_t si);
long long fp_served(Core *c, int32_t b);
long long fp_record_oom(Core *c, PyObject *size, i64 stream, PyObject *tag);
int fp_free_merge(Core *c, u64 addr, u64 *head);
int fp_persistent(PyObject *pool);
Py_ssize_t fp_order_search(Core *c, u64 addr);
int fp_order_insert(Core *c, int32_t si);
void fp_order_remove(Core *c, u64 addr);
int fp_get_u64(PyObject *obj, u64 *out, const char *what);
PyObject *fp_segments(Core *c, PyObject *unused);
PyObject *fp_add_segment(Core *c, PyObject *args);

/* ---- the models' Python methods ----------------------------------------------------------- */
PyObject *fp_ms_pregrow(Core *c, PyObject *arg);                           /* mindspore.c */
u64 fp_torch_round(Core *c, long long raw);                                /* torch.c */
/* the entry points of torch.c's and torch_expandable.c's Model records (torch_npu.c's reuse them) */
long long fp_torch_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *unused);
int fp_torch_free(Core *c, u64 addr);
int fp_torch_segment_added(Core *c, int32_t si);
int fp_torch_empty_cache(Core *c);
int fp_torch_note_segment_alloc(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
int fp_torch_release_segment(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
const char *fp_torch_pool_name(const Alloc *a);
long long fp_x_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *unused);
int fp_x_free(Core *c, u64 addr);
int fp_x_init(Core *c);
int fp_x_empty_cache(Core *c);
int fp_x_release_segment(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
int fp_x_note_segment_map(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
int fp_x_unmap_range(Core *c, PyObject *addr, PyObject *size, PyObject *stream);
PyObject *fp_x_add_range(Core *c, PyObject *args);                         /* torch_expandable.c */
PyObject *fp_x_restored(Core *c, PyObject *unused);
PyObject *fp_x_ranges(Core *c, PyObject *unused);
PyObject *fp_v_add_range(Core *c, PyObject *args);                         /* mindspore_vmm.c */
PyObject *fp_v_state(Core *c, PyObject *unused);
PyObject *fp_v_defrag(Core *c, PyObject *unused);
PyObject *fp_region_init(Core *c, PyObject *args);                         /* pool.c */
PyObject *fp_region_take(Core *c, PyObject *args, PyObject *kwargs);
PyObject *fp_region_open_chunk(Core *c, PyObject *arg);
PyObject *fp_region_close_chunk(Core *c, PyObject *unused);
PyObject *fp_region_release(Core *c, PyObject *arg);
PyObject *fp_region_size_of(Core *c, PyObject *arg);
PyObject *fp_region_free_keys(Core *c, void *unused);
PyObject *fp_region_get(Core *c, void *which);
PyObject *fp_pool_init(Core *c, PyObject *args);
PyObject *fp_pool_route(Core *c, PyObject *args);
PyObject *fp_pool_drain(Core *c, PyObject *unused);

#pragma GCC visibility pop

/* ---- small shared helpers (inline: the hot path) ------------------------------------------- */
static inline u64 round_up(u64 v, u64 unit) { return (v + unit - 1) / unit * unit; }

static inline Py_ssize_t h_slot(u64 addr, Py_ssize_t cap) {
    return (Py_ssize_t)(((addr >> 9) * 0x9E3779B97F4A7C15ULL) >> 20) & (cap - 1);
}

/* the buffer at ``addr``, or -1 */
static inline int32_t h_get(Core *c, u64 addr) {
    Py_ssize_t mask = c->hcap - 1, j = h_slot(addr, c->hcap);
    for (;;) {
        u64 k = c->hkeys[j];
        if (k == addr) return c->hvals[j];
        if (k == EMPTY_KEY) return -1;
        j = (j + 1) & mask;
    }
}

static inline int key_less(u64 s1, u64 t1, u64 s2, u64 t2) { return s1 < s2 || (s1 == s2 && t1 < t2); }

/* remove entry ``at`` of a sorted key array of ``*n`` entries */
static inline void key_pop(Key *keys, Py_ssize_t *n, Py_ssize_t at) {
    memmove(&keys[at], &keys[at + 1], (size_t)(*n - at - 1) * sizeof(Key));
    (*n)--;
}

/* first position in ``keys[0:n]`` not below (size, tie) */
static inline Py_ssize_t keys_lower_bound(const Key *k, Py_ssize_t n, u64 size, u64 tie) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (key_less(k[mid].size, k[mid].tie, size, tie)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static inline Py_ssize_t lower_bound(Alloc *a, u64 size, u64 tie) { return keys_lower_bound(a->keys, a->nkeys, size, tie); }

#endif
