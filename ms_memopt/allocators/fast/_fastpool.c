/* The module: the batch loop (_run) over events or rows, the Python methods of ModelCore, the
 * type and module init. Every model-specific step goes through the Core's Model (fastpool.h);
 * the models are the table MODELS below, by ModelCore's kind=. */
#include "fastpool.h"

PyObject *fp_str_stream, *fp_str_pool, *fp_str_tag, *fp_str_persistent, *fp_str_record_oom, *fp_str_ooms, *fp_str_order,
    *fp_str_popitem, *fp_str_empty, *fp_str_workspace;
static PyObject *fp_str_action, *fp_str_id, *fp_str_size, *fp_str_addr, *fp_str_alloc, *fp_str_free;

/* whether ModelCore.__init__ has not run on ``c`` (no model yet): a TypeError naming ``what`` */
static int not_ready(Core *c, const char *what) {
    if (c->model) return 0;
    PyErr_Format(PyExc_TypeError, "%s on a ModelCore whose __init__ did not run", what);
    return 1;
}

/* whether the model has no ``entry`` (a region has no malloc): a TypeError naming ``what`` */
static int lacks(Core *c, const void *entry, const char *what) {
    if (entry) return 0;
    PyErr_Format(PyExc_TypeError, "%s is not a method of a %s model", what, c->model->kind);
    return 1;
}

static int is_action(PyObject *action, PyObject *name) {
    return action == name || (PyUnicode_Check(action) && PyUnicode_Compare(action, name) == 0);
}

/* Event fields read straight from the slots of ms_memopt.core.events.Event (a slots dataclass):
 * the cheap event encoding is no encoding at all. Other objects go through getattr. */
enum { F_ACTION, F_ID, F_SIZE, F_ADDR, F_STREAM, F_POOL, F_TAG, F_COUNT };
typedef struct { PyTypeObject *type; Py_ssize_t offset[F_COUNT]; PyObject *name[F_COUNT]; } Fields;

static void fields_init(Fields *f, PyObject *sample) {
    f->name[F_ACTION] = fp_str_action; f->name[F_ID] = fp_str_id; f->name[F_SIZE] = fp_str_size;
    f->name[F_ADDR] = fp_str_addr; f->name[F_STREAM] = fp_str_stream; f->name[F_POOL] = fp_str_pool; f->name[F_TAG] = fp_str_tag;
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

/* a row: a tuple of Event's fields in its order, as ms_memopt.workload.step generates them for
 * simulate. The order is Event's (ms_memopt/core/events.py) and only Event's: ms_memopt/allocators/
 * fast/__init__.py hands it over at import (set_row_layout); these are just the values before that. */
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
 * of ``watch`` (not served), or with ``oom`` true an alloc that failed (OOM recorded; one past
 * full_oom_records is only counted, and the loop goes on). ``known``
 * and ``matched`` count allocs with a recorded address and those placed there. */
static PyObject *Core_run(Core *c, PyObject *args) {
    PyObject *events, *address_of, *watch;
    Py_ssize_t start, stop;
    int use_stream, forget = 0;
    if (!PyArg_ParseTuple(args, "O!nnO!Op|p", &PyList_Type, &events, &start, &stop, &PyDict_Type, &address_of,
                          &watch, &use_stream, &forget)) return NULL;
    if (not_ready(c, "_run")) return NULL;
    const Model *model = c->model;
    /* forget: only a model that reports placements (pool mode) forgets evicted tensors */
    PyObject *forget_into = forget && model->placed ? address_of : NULL;
    if (lacks(c, (const void *)model->malloc, "_run") || lacks(c, (const void *)model->free, "_run")) return NULL;
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
        int alloc = is_action(action, fp_str_alloc), freeing = !alloc && is_action(action, fp_str_free);
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
                else if (model->free(c, a) < 0) return NULL;
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
        c->oom_counted = 0;
        long long addr = model->malloc(c, raw, stream, pool, tag, &region);
        Py_DECREF(tag); Py_DECREF(pool);
        if (addr == -1) return NULL;
        if (addr == -2) {
            if (c->oom_counted) continue;
            oom = 1;
            break;
        }
        PyObject *id = field(&f, ev, F_ID);
        PyObject *addr_obj = PyLong_FromUnsignedLongLong((u64)addr);
        int bad = !id || !addr_obj;
        if (!bad && model->placed) bad = model->placed(c, region, addr_obj, id, forget_into) < 0;
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

static PyObject *Core_malloc(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *stream_obj = NULL, *pool = Py_None, *tag = Py_None;
    if (not_ready(c, "malloc") || lacks(c, (const void *)c->model->malloc, "malloc")) return NULL;
    if (nargs != 1) { PyErr_SetString(PyExc_TypeError, "malloc(size, *, stream=0, pool=None, tag=None)"); return NULL; }
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
            if (name == fp_str_pool || PyUnicode_Compare(name, fp_str_pool) == 0) pool = value;
            else if (name == fp_str_tag || PyUnicode_Compare(name, fp_str_tag) == 0) tag = value;
            else if (name == fp_str_stream || PyUnicode_Compare(name, fp_str_stream) == 0) stream_obj = value;
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
    long long addr = c->model->malloc(c, raw, stream, pool, tag, &region);
    if (addr == -1) return NULL;
    if (addr == -2) Py_RETURN_NONE;
    PyObject *out = PyLong_FromUnsignedLongLong((u64)addr);
    if (out && c->model->placed && c->model->placed(c, region, out, NULL, NULL) < 0) Py_CLEAR(out);
    return out;
}

static PyObject *Core_free(Core *c, PyObject *arg) {
    if (not_ready(c, "free") || lacks(c, (const void *)c->model->free, "free")) return NULL;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (addr == (unsigned long long)-1 && PyErr_Occurred()) {
        /* not an address this model handed out: nothing to free (as the reference) */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (c->model->free(c, addr) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_empty_cache(Core *c, PyObject *unused) {
    if (not_ready(c, "empty_cache")) return NULL;
    if (c->model->empty_cache && c->model->empty_cache(c) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_note_segment_alloc(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"addr", "size", "stream", NULL};
    PyObject *addr_obj, *size_obj = NULL, *stream_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO", names, &addr_obj, &size_obj, &stream_obj)) return NULL;
    if (not_ready(c, "note_segment_alloc")) return NULL;
    if (c->model->note_segment_alloc && c->model->note_segment_alloc(c, addr_obj, size_obj, stream_obj) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_release_segment(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"addr", "size", "stream", NULL};
    PyObject *addr_obj, *size_obj = NULL, *stream_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO", names, &addr_obj, &size_obj, &stream_obj)) return NULL;
    if (not_ready(c, "release_segment")) return NULL;
    if (c->model->release_segment && c->model->release_segment(c, addr_obj, size_obj, stream_obj) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_note_segment_map(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"addr", "size", "stream", NULL};
    PyObject *addr_obj, *size_obj = NULL, *stream_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO", names, &addr_obj, &size_obj, &stream_obj)) return NULL;
    if (not_ready(c, "note_segment_map")) return NULL;
    if (c->model->note_segment_map && c->model->note_segment_map(c, addr_obj, size_obj, stream_obj) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_unmap_range(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"addr", "size", "stream", NULL};
    PyObject *addr_obj, *size_obj = NULL, *stream_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO", names, &addr_obj, &size_obj, &stream_obj)) return NULL;
    if (not_ready(c, "unmap_range")) return NULL;
    if (c->model->unmap_range && c->model->unmap_range(c, addr_obj, size_obj, stream_obj) < 0) return NULL;
    Py_RETURN_NONE;
}

/* the largest idle buffer of any allocator (the models whose free keys are their idle buffers) */
static PyObject *Core_largest_free(Core *c, PyObject *unused) {
    u64 best = 0;
    for (Py_ssize_t ai = 0; ai < c->nallocs; ai++) {
        Alloc *a = &c->allocs[ai];
        if (a->nkeys && a->keys[a->nkeys - 1].size > best) best = a->keys[a->nkeys - 1].size;
    }
    return PyLong_FromUnsignedLongLong(best);
}

static void free_allocs(Core *c) {
    for (Py_ssize_t i = 0; i < c->nallocs; i++) {
        PyMem_Free(c->allocs[i].segs); PyMem_Free(c->allocs[i].keys); PyMem_Free(c->allocs[i].unm);
        PyMem_Free(c->allocs[i].ekeys);
    }
    PyMem_Free(c->allocs); c->allocs = NULL; c->nallocs = 0;
}

/* forget every segment and buffer (torch's and torch-expandable's restore start from nothing);
 * peaks stay */
static PyObject *Core_reset(Core *c, PyObject *unused) {
    free_allocs(c);
    c->nsegs = 0; c->nbufs = 0; c->free_slot = -1; c->norder = 0; c->torch.ntrec = 0;
    c->ms.rec_head = c->ms.rec_tail = 0;
    for (Py_ssize_t i = 0; i < c->hcap; i++) c->hkeys[i] = EMPTY_KEY;
    c->hcount = 0;
    c->reserved = c->allocated = 0;
    c->x.next_base = 1ULL << 44;
    c->x.nhints = 0;
    Py_RETURN_NONE;
}

/* ---- type ----------------------------------------------------------------------------------- */
/* every compiled model, by ModelCore's kind= */
static const Model *const MODELS[] = {&fp_mindspore_model, &fp_torch_model, &fp_region_model, &fp_expandable_model,
                                      &fp_vmm_model, &fp_poolmode_model, &fp_torch_npu_model,
                                      &fp_npu_expandable_model};

static int Core_init(Core *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"capacity", "increase_size", "grow_add", "small_pool", "idle_order", "kind",
                            "divisions", "page_1g", "align", "large_page", "max_split", "gc_threshold", NULL};
    PyObject *capacity = Py_None;
    unsigned long long increase = 1ULL << 30, align = 0, large_page = 0, max_split = 0;
    double gc_threshold = 0.0;
    int grow_add = 0, small_pool = 0, idle_order = 0, page_1g = 0;
    const char *kind = "mindspore";
    unsigned int divisions = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OKpppsIpKKKd", names, &capacity, &increase, &grow_add,
                                     &small_pool, &idle_order, &kind, &divisions, &page_1g, &align,
                                     &large_page, &max_split, &gc_threshold)) return -1;
    const Model *model = NULL;
    for (size_t k = 0; k < sizeof(MODELS) / sizeof(MODELS[0]); k++)
        if (strcmp(kind, MODELS[k]->kind) == 0) model = MODELS[k];
    if (!model) { PyErr_Format(PyExc_ValueError, "kind must be mindspore, torch, region, expandable, vmm, poolmode, torch_npu or npu_expandable, got %s", kind); return -1; }
    if (c->model && c->model != model) { PyErr_SetString(PyExc_ValueError, "ModelCore.__init__ again with another kind"); return -1; }
    c->model = model;
    c->bounded = capacity != Py_None;
    if (c->bounded) {
        long long cap = PyLong_AsLongLong(capacity);
        if (cap == -1 && PyErr_Occurred()) return -1;
        c->capacity = cap > 0 ? (u64)cap : 0;
    }
    if (increase == 0) { PyErr_SetString(PyExc_ValueError, "increase_size must be > 0"); return -1; }
    c->ms.increase_size = increase;
    c->ms.grow_add = grow_add; c->ms.small_pool = small_pool;
    c->torch.divisions = divisions;
    c->torch.page_1g = page_1g;    /* torch_npu's options (torch_npu.c sets its pad) */
    c->torch.max_split = max_split; c->torch.gc_threshold = gc_threshold;   /* checked by the reference */
    c->x.align = align; c->x.large_page = large_page;
    c->idle_order = idle_order;
    c->next_addr = BASE_ADDR;
    c->free_slot = -1;
    c->full_oom_records = -1;
    if (!c->hkeys && fp_h_resize(c, 1024) < 0) return -1;
    return model->init ? model->init(c) : 0;
}

static void Core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    Py_CLEAR(c->dict);
    if (c->model && c->model->clear) c->model->clear(c);
    PyMem_Free(c->pm.regions); PyMem_Free(c->pm.flags);
    free_allocs(c);
    PyMem_Free(c->segs); PyMem_Free(c->vmm.cstart); PyMem_Free(c->vmm.cend); PyMem_Free(c->bufs);
    PyMem_Free(c->hkeys); PyMem_Free(c->hvals); PyMem_Free(c->ms.rec);
    PyMem_Free(c->order); PyMem_Free(c->torch.trec); PyMem_Free(c->x.hints);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->dict);
    return c->model && c->model->traverse ? c->model->traverse(c, visit, arg) : 0;
}

static int Core_clear(Core *c) {
    Py_CLEAR(c->dict);
    if (c->model && c->model->clear) c->model->clear(c);
    return 0;
}

static PyMethodDef Core_methods[] = {
    {"malloc", (PyCFunction)(void (*)(void))Core_malloc, METH_FASTCALL | METH_KEYWORDS,
     "malloc(size, *, stream=0, pool=None, tag=None): the block's address, or None (OOM recorded)"},
    {"free", (PyCFunction)Core_free, METH_O, "free(addr): free the live buffer at addr"},
    {"empty_cache", (PyCFunction)Core_empty_cache, METH_NOARGS, "ReleaseFreeBlocks"},
    {"note_segment_alloc", (PyCFunction)(void (*)(void))Core_note_segment_alloc, METH_VARARGS | METH_KEYWORDS,
     "place the next new block at addr if it is free"},
    {"release_segment", (PyCFunction)(void (*)(void))Core_release_segment, METH_VARARGS | METH_KEYWORDS,
     "release the block at addr if it is idle"},
    {"note_segment_map", (PyCFunction)(void (*)(void))Core_note_segment_map, METH_VARARGS | METH_KEYWORDS,
     "a recorded mapping at addr: where a new virtual range starts"},
    {"unmap_range", (PyCFunction)(void (*)(void))Core_unmap_range, METH_VARARGS | METH_KEYWORDS,
     "unmap the idle pages in [addr, addr + size)"},
    {"_run", (PyCFunction)Core_run, METH_VARARGS,
     "_run(events, start, stop, address_of, watch, use_stream, forget=False) -> (index, allocs, known, matched, oom)"},
    {"largest_free", (PyCFunction)Core_largest_free, METH_NOARGS, "the largest idle buffer, bytes"},
    {"_segments", (PyCFunction)fp_segments, METH_NOARGS, "every segment with its buffers"},
    {"_add_segment", (PyCFunction)fp_add_segment, METH_VARARGS, "restore one recorded segment"},
    {"_pregrow", (PyCFunction)fp_ms_pregrow, METH_O, "set_memory(init_size=2*half)"},
    {"_reset", (PyCFunction)Core_reset, METH_NOARGS, "forget every segment and buffer"},
    {"defrag", (PyCFunction)fp_v_defrag, METH_NOARGS, "vmm: FreeIdleMemsByEagerFree"},
    {"_add_vrange", (PyCFunction)fp_v_add_range, METH_VARARGS, "vmm: restore one recorded segment"},
    {"_vmm_state", (PyCFunction)fp_v_state, METH_NOARGS, "vmm: ranges with their buffers, mapped runs"},
    {"_add_range", (PyCFunction)fp_x_add_range, METH_VARARGS, "expandable: restore one recorded segment"},
    {"_restored", (PyCFunction)fp_x_restored, METH_NOARGS, "expandable: restoring is over"},
    {"_ranges", (PyCFunction)fp_x_ranges, METH_NOARGS, "expandable: every range with its buffers"},
    {"_region_init", (PyCFunction)fp_region_init, METH_VARARGS, "region: its range and kind of ring"},
    {"take", (PyCFunction)(void (*)(void))fp_region_take, METH_VARARGS | METH_KEYWORDS, "region: take(size, ring, fallback=True) -> address or None"},
    {"open_chunk", (PyCFunction)fp_region_open_chunk, METH_O, "region: a micro-batch's chunk opens"},
    {"close_chunk", (PyCFunction)fp_region_close_chunk, METH_NOARGS, "region: the open chunk closes"},
    {"release", (PyCFunction)fp_region_release, METH_O, "region: release(addr) -> bytes freed"},
    {"size_of", (PyCFunction)fp_region_size_of, METH_O, "region: bytes of the buffer at addr"},
    {"_pool_init", (PyCFunction)fp_pool_init, METH_VARARGS, "pool mode: _pool_init(regions, flags, names, route)"},
    {"_route", (PyCFunction)fp_pool_route, METH_VARARGS,
     "pool mode: _route(tag, pool) -> index of the region serving the request, or -1"},
    {"drain_evicted", (PyCFunction)fp_pool_drain, METH_NOARGS,
     "pool mode: the addresses the cache region evicted since the last call"},
    {NULL}
};

static PyMemberDef Core_members[] = {
    {"reserved", T_LONGLONG, offsetof(Core, reserved), 0, "bytes held from the device"},
    {"allocated", T_LONGLONG, offsetof(Core, allocated), 0, "bytes in live buffers"},
    {"peak_reserved", T_LONGLONG, offsetof(Core, peak_reserved), 0, "largest reserved, bytes"},
    {"peak_allocated", T_LONGLONG, offsetof(Core, peak_allocated), 0, "largest allocated, bytes"},
    {"segment_allocs", T_LONGLONG, offsetof(Core, segment_allocs), 0, "blocks taken from the device"},
    {"slow_path_events", T_LONGLONG, offsetof(Core, slow_path_events), 0,
     "requests that took the slow path (MindSpore models: the sync-and-retry of AllocMemBuf)"},
    {"segment_frees", T_LONGLONG, offsetof(Core, segment_frees), 0,
     "idle blocks given back to the device (MindSpore models: ReleaseFreeBlocks)"},
    {"eager_frees", T_LONGLONG, offsetof(Core, vmm.eager_frees), 0, "vmm: eager frees (defrag) so far"},
    {"evictions", T_LONGLONG, offsetof(Core, pm.evictions), 0, "pool mode: cache entries evicted so far"},
    {"ooms_counted", T_LONGLONG, offsetof(Core, ooms_counted), 0,
     "failed requests past full_oom_records, counted without a record"},
    {NULL}
};

/* AllocatorModel.full_oom_records: None or an int >= 1 */
static PyObject *Core_get_full_oom_records(Core *c, void *unused) {
    if (c->full_oom_records < 0) Py_RETURN_NONE;
    return PyLong_FromLongLong(c->full_oom_records);
}

static int Core_set_full_oom_records(Core *c, PyObject *value, void *unused) {
    if (!value || value == Py_None) { c->full_oom_records = -1; return 0; }
    long long n = PyLong_AsLongLong(value);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n < 1) { PyErr_SetString(PyExc_ValueError, "full_oom_records must be None or >= 1"); return -1; }
    c->full_oom_records = n;
    return 0;
}

static PyGetSetDef Core_getset[] = {
    {"full_oom_records", (getter)Core_get_full_oom_records, (setter)Core_set_full_oom_records,
     "failed requests recorded in full (None: every one); later ones only counted (ooms_counted)", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"free_keys", (getter)fp_region_free_keys, NULL, "region: free buffers as sorted size << 64 | addr", NULL},
    {"head", (getter)fp_region_get, NULL, "region: the ring head", (void *)0},
    {"stack_top", (getter)fp_region_get, NULL, "region: the open chunk's top, or None", (void *)1},
    {"stack_floor", (getter)fp_region_get, NULL, "region: the open chunk's start", (void *)2},
    {NULL}
};

PyTypeObject fp_CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ms_memopt.allocators.fast._fastpool.ModelCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Allocator model state and hot path in C (kind: mindspore, torch, region, expandable, vmm or poolmode; "
              "see ms_memopt/allocators/fast/__init__.py)",
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

/* The sha256 of the C sources this module was built from, every .c and .h of it (setup.py passes
 * it as -DMS_MEMOPT_SOURCE_HASH; ms_memopt/core/_build_hash.py computes it): SOURCE_HASH, which
 * ms_memopt/allocators/fast/__init__.py compares with the tree's sources to refuse a stale build. */
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
    fp_str_stream = PyUnicode_InternFromString("stream");
    fp_str_pool = PyUnicode_InternFromString("pool");
    fp_str_tag = PyUnicode_InternFromString("tag");
    fp_str_persistent = PyUnicode_InternFromString("persistent");
    fp_str_record_oom = PyUnicode_InternFromString("_record_oom");
    fp_str_ooms = PyUnicode_InternFromString("ooms");
    fp_str_action = PyUnicode_InternFromString("action");
    fp_str_id = PyUnicode_InternFromString("id");
    fp_str_size = PyUnicode_InternFromString("size");
    fp_str_addr = PyUnicode_InternFromString("addr");
    fp_str_alloc = PyUnicode_InternFromString("alloc");
    fp_str_free = PyUnicode_InternFromString("free");
    fp_str_order = PyUnicode_InternFromString("order");
    fp_str_popitem = PyUnicode_InternFromString("popitem");
    fp_str_empty = PyUnicode_InternFromString("");
    fp_str_workspace = PyUnicode_InternFromString("workspace");
    if (PyErr_Occurred()) return NULL;
    if (PyType_Ready(&fp_CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&fp_CoreType);
    if (PyModule_AddObject(m, "ModelCore", (PyObject *)&fp_CoreType) < 0) { Py_DECREF(&fp_CoreType); Py_DECREF(m); return NULL; }
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", MS_MEMOPT_SOURCE_HASH) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
