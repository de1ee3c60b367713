/* Pool mode (ms_memopt/allocators/pool.py), all of its rules: a region (_Region: ring head,
 * chunks filled from their top down, carving, best fit, merges) and PoolModeAllocator's
 * routing (region_for: which region serves a (tag, pool), from the route table _pool_init hands
 * over once), malloc with the cache region's FIFO eviction, free and the counters.
 *
 * The regions stay separate FastRegion objects (their layouts, metrics and the chunk marks'
 * dispatch are PoolModeAllocator's Python code, reading them); the cache's FIFO order is the
 * region's ``order`` OrderedDict, as in the reference. An address belongs to the region whose
 * range holds it, and is live there exactly when the reference's _owner holds it. */
#include "fastpool.h"

/* ---- a pool-mode region (pool.py's _Region) ------------------------------------------------ */
static int not_region(Core *c) {
    if (c->model == &fp_region_model) return 0;
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
    fp_unindex_buf(c, b);
    int32_t high = fp_split_off(c, b, addr - c->bufs[b].addr, 0);
    if (high < 0 || fp_index_buf(c, b) < 0 || fp_index_buf(c, high) < 0) return -1;
    return high;
}

PyObject *fp_region_init(Core *c, PyObject *args) {
    unsigned long long addr, size;
    int chunked;
    if (not_region(c) || !PyArg_ParseTuple(args, "KKp", &addr, &size, &chunked)) return NULL;
    if (fp_get_alloc(c, 0, 0, 0) < 0) return NULL;
    if (fp_new_segment_at(c, 0, addr, size, size != 0) < 0) return NULL;
    c->region.raddr = addr; c->region.rsize = size; c->region.head = addr; c->region.stack_floor = addr; c->region.stack_open = 0;
    c->region.chunked = chunked;
    Py_RETURN_NONE;
}

/* _Region.take: ``size`` bytes at the ring head (chunked: below the open chunk's top) when
 * ``ring``, else (or when that has no room and ``fallback``) best fit; the address, -2 when
 * nothing fits, -1 on error */
static long long region_take(Core *c, u64 size, int ring, int fallback) {
    int32_t b = -2;
    int stacked = 0;
    if (ring) {
        if (c->region.chunked) {
            if (c->region.stack_open && c->region.stack_top >= c->region.stack_floor + size) {
                b = region_carve(c, c->region.stack_top - size, size);
                if (b == -1) return -1;
            }
            stacked = b >= 0;
        } else {
            u64 starts[2] = {c->region.head, c->region.raddr};
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
        fp_unindex_buf(c, b);
    }
    if (c->bufs[b].size - size >= ALIGN && fp_cut(c, b, size) < 0) return -1;
    c->bufs[b].used = 1;
    c->allocated += (long long)c->bufs[b].size;
    if (stacked) c->region.stack_top = c->bufs[b].addr;
    else if (ring && !c->region.chunked) {
        c->region.head = c->bufs[b].addr + c->bufs[b].size;
        if (c->region.head >= c->region.raddr + c->region.rsize) c->region.head = c->region.raddr;
    }
    return (long long)c->bufs[b].addr;
}

/* _Region.release: the bytes freed (0 when no live buffer starts at ``addr``), -1 on error */
static long long region_release(Core *c, u64 addr) {
    int32_t b = h_get(c, addr);
    if (b < 0 || c->bufs[b].used != 1) return 0;
    u64 freed = c->bufs[b].size;
    if (fp_free_merge(c, addr, &c->region.head) < 0) return -1;
    return (long long)freed;
}

/* take(size, ring, fallback=True): the address, or None */
PyObject *fp_region_take(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"size", "ring", "fallback", NULL};
    unsigned long long size;
    int ring, fallback = 1;
    if (not_region(c) || !PyArg_ParseTupleAndKeywords(args, kwargs, "Kp|p", names, &size, &ring, &fallback)) return NULL;
    long long addr = region_take(c, size, ring, fallback);
    if (addr == -1) return NULL;
    if (addr == -2) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong((u64)addr);
}

PyObject *fp_region_open_chunk(Core *c, PyObject *arg) {
    if (not_region(c)) return NULL;
    long long size = PyLong_AsLongLong(arg);
    if (size == -1 && PyErr_Occurred()) return NULL;
    c->region.stack_open = 0;
    if (size <= 0) Py_RETURN_NONE;
    u64 starts[2] = {c->region.head, c->region.raddr};
    for (int k = 0; k < 2; k++) {
        u64 start = starts[k];
        int32_t b = region_free_at(c, start);
        if (b >= 0 && c->bufs[b].addr + c->bufs[b].size - start >= (u64)size) {
            c->region.stack_open = 1;
            c->region.stack_top = start + (u64)size;
            c->region.stack_floor = start;
            c->region.head = start + (u64)size < c->region.raddr + c->region.rsize ? start + (u64)size : c->region.raddr;
            break;
        }
    }
    Py_RETURN_NONE;
}

PyObject *fp_region_close_chunk(Core *c, PyObject *unused) {
    c->region.stack_open = 0;
    Py_RETURN_NONE;
}

PyObject *fp_region_release(Core *c, PyObject *arg) {
    if (not_region(c)) return NULL;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return PyLong_FromLong(0); }
    long long freed = region_release(c, addr);
    return freed < 0 ? NULL : PyLong_FromLongLong(freed);
}

PyObject *fp_region_size_of(Core *c, PyObject *arg) {
    if (not_region(c)) return NULL;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int32_t b = h_get(c, addr);
    if (b < 0) return PyErr_Format(PyExc_KeyError, "%llu", addr);
    return PyLong_FromUnsignedLongLong(c->bufs[b].size);
}

/* the free list as the reference keeps it: sorted size << 64 | addr */
PyObject *fp_region_free_keys(Core *c, void *unused) {
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

PyObject *fp_region_get(Core *c, void *which) {
    switch ((int)(Py_ssize_t)which) {
    case 0: return PyLong_FromUnsignedLongLong(c->region.head);
    case 1: if (!c->region.stack_open) Py_RETURN_NONE; return PyLong_FromUnsignedLongLong(c->region.stack_top);
    default: return PyLong_FromUnsignedLongLong(c->region.stack_floor);
    }
}

/* ---- pool mode (pool.py's PoolModeAllocator over FastRegion cores) ------------------------ */
static inline Core *pm_region(Core *c, Py_ssize_t i) { return (Core *)c->pm.regions[i]; }

/* a region's index by name, -1 when there is none; -2 error */
static int pm_index_of(Core *c, PyObject *name) {
    PyObject *index = PyDict_GetItemWithError(c->pm.index, name);
    if (!index) return PyErr_Occurred() ? -2 : -1;
    return (int)PyLong_AsLong(index);
}

/* PoolModeAllocator.region_for's rule: the region the route table names for ``tag`` (``tag or
 * ""``), else the region named ``pool``, else the workspace; a route to a region that is not
 * there serves from the workspace. The region index, -1 none (no workspace either), -2 error */
static int pm_rule(Core *c, PyObject *tag, PyObject *pool) {
    int tagged = tag == Py_None ? 0 : PyObject_IsTrue(tag);
    if (tagged < 0) return -2;
    PyObject *name = PyDict_GetItemWithError(c->pm.route, tagged ? tag : fp_str_empty);
    if (!name && PyErr_Occurred()) return -2;
    int named = name ? PyObject_IsTrue(name) : 0;
    if (named < 0) return -2;
    if (named) {
        int index = pm_index_of(c, name);
        return index == -1 ? pm_index_of(c, fp_str_workspace) : index;
    }
    if (pool != Py_None) {
        int index = pm_index_of(c, pool), truthy = PyObject_IsTrue(pool);
        if (index == -2 || truthy < 0) return -2;
        if (index >= 0 && truthy) return index;
    }
    return pm_index_of(c, fp_str_workspace);
}

/* pm_rule remembered by the identity of the two objects (the route table does not change
 * after _pool_init; the first PM_ROUTES pairs are kept) */
static int pm_route(Core *c, PyObject *tag, PyObject *pool) {
    PoolState *p = &c->pm;
    for (int k = 0; k < p->nroutes; k++)
        if (p->route_tag[k] == tag && p->route_pool[k] == pool) return p->route_index[k];
    int index = pm_rule(c, tag, pool);
    if (index == -2) return -2;
    if (p->nroutes < PM_ROUTES) {
        Py_INCREF(tag); Py_INCREF(pool);
        p->route_tag[p->nroutes] = tag; p->route_pool[p->nroutes] = pool;
        p->route_index[p->nroutes++] = index;
    }
    return index;
}

/* evict the oldest entry of the cache region ``ri`` (``order`` its OrderedDict): 1 done, 0
 * nothing left to evict, -1 error */
static int pm_evict_oldest(Core *c, Py_ssize_t ri, PyObject *order) {
    Py_ssize_t left = PyObject_Size(order);
    if (left <= 0) return left < 0 ? -1 : 0;
    PyObject *item = PyObject_CallMethodObjArgs(order, fp_str_popitem, Py_False, NULL);
    if (!item) return -1;
    PyObject *old = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 ? PyTuple_GET_ITEM(item, 0) : NULL;
    unsigned long long addr = old ? PyLong_AsUnsignedLongLong(old) : (unsigned long long)-1;
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(item); return -1; }
    if (!old) { Py_DECREF(item); PyErr_SetString(PyExc_TypeError, "region.order.popitem() gave no (addr, size)"); return -1; }
    long long freed = region_release(pm_region(c, ri), addr);
    int bad = freed < 0 || PyList_Append(c->pm.evicted, old) < 0;
    Py_DECREF(item);
    if (bad) return -1;
    c->allocated -= freed;
    c->pm.evictions++;
    return 1;
}

/* PoolModeAllocator.malloc: the address (``*region`` its region index), -2 after recording an
 * OOM, -1 on error */
static long long pm_malloc(Core *c, long long raw, i64 stream, PyObject *pool, PyObject *tag, int *region) {
    u64 size = raw > (long long)ALIGN ? round_up((u64)raw, ALIGN) : ALIGN;
    if (!c->pm.route) { PyErr_SetString(PyExc_RuntimeError, "pool mode's malloc before _pool_init"); return -1; }
    int ri = pm_route(c, tag, pool);
    if (ri == -2) return -1;
    if (ri < 0) return fp_record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag);
    Core *r = pm_region(c, ri);
    int evicting = c->pm.flags[ri] & PM_EVICTING, ring = (c->pm.flags[ri] & PM_RING) != 0;
    /* the cache is a strict FIFO ring: the oldest entries (just ahead of the head) go first */
    long long addr = region_take(r, size, ring, !evicting);
    PyObject *order = NULL;
    if (evicting) {
        order = PyObject_GetAttr(c->pm.regions[ri], fp_str_order);
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
    if (addr == -2) { Py_XDECREF(order); return fp_record_oom(c, PyLong_FromUnsignedLongLong(size), stream, tag); }
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
    if (!(c->pm.flags[region] & PM_EVICTING) || !PyDict_GET_SIZE(c->pm.tid_of)) return 0;
    if (PyDict_DelItem(c->pm.tid_of, addr) == 0) return 0;
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
    PyErr_Clear();
    return 0;
}

/* PoolModeAllocator.free; -1 on error */
static int pm_free(Core *c, u64 addr) {
    for (Py_ssize_t i = 0; i < c->pm.n; i++) {
        Core *r = pm_region(c, i);
        if (!r->region.rsize || addr < r->region.raddr || addr >= r->region.raddr + r->region.rsize) continue;
        int32_t b = h_get(r, addr);
        if (b < 0 || r->bufs[b].used != 1) return 0;
        if (c->pm.flags[i] & PM_EVICTING) {
            PyObject *key = PyLong_FromUnsignedLongLong(addr);
            PyObject *order = key ? PyObject_GetAttr(c->pm.regions[i], fp_str_order) : NULL;
            int bad = !order || (PyObject_DelItem(order, key) < 0 && !PyErr_ExceptionMatches(PyExc_KeyError));
            if (!bad) PyErr_Clear();
            if (!bad && PyDict_GET_SIZE(c->pm.tid_of) && PyDict_DelItem(c->pm.tid_of, key) < 0) {
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
    Py_ssize_t n = PyList_GET_SIZE(c->pm.evicted);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *addr = PyList_GET_ITEM(c->pm.evicted, k);
        PyObject *tid = PyDict_GetItemWithError(c->pm.tid_of, addr);
        if (!tid && PyErr_Occurred()) return -1;
        if (tid) {
            Py_INCREF(tid);
            if (PyDict_DelItem(c->pm.tid_of, addr) < 0) { Py_DECREF(tid); return -1; }
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
    return PyList_SetSlice(c->pm.evicted, 0, n, NULL);
}

static int pm_not_pool(Core *c, const char *what) {
    if (c->model == &fp_poolmode_model) return 0;
    PyErr_Format(PyExc_TypeError, "%s on a model that is not pool mode", what);
    return 1;
}

/* _pool_init(regions, flags, names, route): the FastRegion objects in the reference's order,
 * their PM_* flags and names, and the route table (tag -> region name; copied: later edits of
 * the dict do not route here) */
PyObject *fp_pool_init(Core *c, PyObject *args) {
    PyObject *regions, *flags, *names, *route;
    if (pm_not_pool(c, "_pool_init")) return NULL;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyTuple_Type, &regions, &PyTuple_Type, &flags, &PyTuple_Type, &names,
                          &PyDict_Type, &route)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(regions);
    if (c->pm.n || c->pm.route || PyTuple_GET_SIZE(flags) != n || PyTuple_GET_SIZE(names) != n) {
        PyErr_SetString(PyExc_ValueError, "_pool_init: once, one flag and one name per region");
        return NULL;
    }
    c->pm.regions = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    c->pm.flags = PyMem_Calloc(n ? n : 1, sizeof(int));
    c->pm.route = PyDict_Copy(route);
    c->pm.index = PyDict_New();
    if (!c->pm.regions || !c->pm.flags) return PyErr_NoMemory();
    if (!c->pm.route || !c->pm.index) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *region = PyTuple_GET_ITEM(regions, i);
        if (!PyObject_TypeCheck(region, &fp_CoreType) || ((Core *)region)->model != &fp_region_model) {
            PyErr_SetString(PyExc_TypeError, "_pool_init: the regions must be FastRegion objects");
            return NULL;
        }
        long flag = PyLong_AsLong(PyTuple_GET_ITEM(flags, i));
        if (flag == -1 && PyErr_Occurred()) return NULL;
        PyObject *index = PyLong_FromSsize_t(i);
        int bad = !index || PyDict_SetItem(c->pm.index, PyTuple_GET_ITEM(names, i), index) < 0;
        Py_XDECREF(index);
        if (bad) return NULL;
        Py_INCREF(region);
        c->pm.regions[i] = region; c->pm.flags[i] = (int)flag; c->pm.n = i + 1;
    }
    Py_RETURN_NONE;
}

/* _route(tag, pool): the index (in _pool_init's order) of the region serving the request, or -1 */
PyObject *fp_pool_route(Core *c, PyObject *args) {
    PyObject *tag, *pool;
    if (pm_not_pool(c, "_route") || !PyArg_ParseTuple(args, "OO", &tag, &pool)) return NULL;
    if (!c->pm.route) { PyErr_SetString(PyExc_RuntimeError, "_route before _pool_init"); return NULL; }
    int index = pm_route(c, tag, pool);
    return index == -2 ? NULL : PyLong_FromLong(index);
}

/* drain_evicted(): the addresses evicted since the last call */
PyObject *fp_pool_drain(Core *c, PyObject *unused) {
    if (!c->pm.evicted) return PyList_New(0);
    PyObject *out = c->pm.evicted, *fresh = PyList_New(0);
    if (!fresh) return NULL;
    c->pm.evicted = fresh;
    return out;
}

/* after a malloc: without ``address_of`` the cache entry's noted tensor id is forgotten (see
 * pm_unnote); with it (_run's forget=True) the evicted tensors leave it first (the new entry
 * may sit at an evicted address) and a cache entry's id is noted */
static int pm_placed(Core *c, int region, PyObject *addr, PyObject *id, PyObject *address_of) {
    if (!address_of) return pm_unnote(c, region, addr);
    if (PyList_GET_SIZE(c->pm.evicted) && pm_forget(c, address_of) < 0) return -1;
    if (c->pm.flags[region] & PM_EVICTING) return PyDict_SetItem(c->pm.tid_of, addr, id);
    return 0;
}

static int pm_init(Core *c) {
    if (!c->pm.evicted) {
        c->pm.evicted = PyList_New(0);
        c->pm.tid_of = PyDict_New();
        if (!c->pm.evicted || !c->pm.tid_of) return -1;
    }
    return 0;
}

static int pm_traverse(Core *c, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < c->pm.n; i++) Py_VISIT(c->pm.regions[i]);
    Py_VISIT(c->pm.evicted); Py_VISIT(c->pm.tid_of); Py_VISIT(c->pm.route); Py_VISIT(c->pm.index);
    return 0;
}

static void pm_clear(Core *c) {
    PoolState *p = &c->pm;
    for (Py_ssize_t i = 0; i < p->n; i++) Py_CLEAR(p->regions[i]);
    for (int k = 0; k < p->nroutes; k++) { Py_CLEAR(p->route_tag[k]); Py_CLEAR(p->route_pool[k]); }
    p->nroutes = 0;
    Py_CLEAR(p->evicted); Py_CLEAR(p->tid_of); Py_CLEAR(p->route); Py_CLEAR(p->index);
}

/* a region's free: its release (the ring head follows merges) */
static int region_free(Core *c, u64 addr) { return fp_free_merge(c, addr, &c->region.head); }

static int region_segment_added(Core *c, int32_t si) {
    c->reserved += (long long)c->segs[si].size;
    return 0;
}

/* a region is taken from (take), not malloc'ed: ModelCore.malloc on one is a TypeError */
const Model fp_region_model = {
    .kind = "region",
    .free = region_free,
    .segment_added = region_segment_added,
};

/* empty_cache, note_segment_alloc and release_segment: AllocatorModel's (Python), nothing here */
const Model fp_poolmode_model = {
    .kind = "poolmode",
    .malloc = pm_malloc,
    .free = pm_free,
    .init = pm_init,
    .placed = pm_placed,
    .traverse = pm_traverse,
    .clear = pm_clear,
};
