/* Compiled twin of ms_memopt/analysis/planner/search.py (_Solver._search and what it calls).
 *
 * The Python module is the readable reference; this file follows it step by step so that both
 * visit the same nodes in the same order and return the same offsets (a property test holds
 * them to it). setup.py builds it into ms_memopt.native._lib at install time;
 * ms_memopt/analysis/planner/_native.py loads it through ctypes. All sizes and offsets are int64 bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The sha256 of the C sources ms_memopt.native._lib was built from (setup.py passes it as
 * -DMS_MEMOPT_SOURCE_HASH; ms_memopt/core/_build_hash.py computes it). The library's one hash lives
 * here; ms_memopt/native/__init__.py compares it with the tree's sources and refuses a stale
 * build. Built without the macro, the library carries no hash ("") and counts as stale wherever
 * its sources are present. */
#ifndef MS_MEMOPT_SOURCE_HASH
#define MS_MEMOPT_SOURCE_HASH ""
#endif

const char *ms_memopt_source_hash(void) { return MS_MEMOPT_SOURCE_HASH; }

enum { FOUND = 0, NONE = 1, ABORT = 2 };

typedef struct {
    int64_t n, count, capacity;
    const int64_t *first, *last, *size;
    int64_t *rank;                      /* preorder rank; re-ranked inside each decomposed part */
    const int64_t *area, *width;        /* preorder keys besides the live total */
    char prefer[3];                     /* the preorder's letters, e.g. "TAW" */
    int64_t *epoch;                     /* per placed buffer: the part (ranking) it was placed in */
    int64_t cur_epoch, epochs;
    const int64_t *twin;                /* same lifetime and size, just before by rank; or -1 */
    const int64_t *kin_ptr, *kin;       /* the other buffers of the same lifetime */
    const int64_t *ov_ptr, *ov_idx;     /* overlaps: buffers alive at a common time */
    const int64_t *inc_ptr, *inc_owner; /* section -> buffers, or NULL */
    int64_t *total, *cuts, *floor, *min_off, *offset;
    char *placed;
    int64_t nodes, node_limit;          /* node_limit < 0: none */
    double deadline;                    /* CLOCK_MONOTONIC seconds; < 0: none */
} Solver;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* sort keys of the unplaced buffers of a node: (min offset, rank) */
typedef struct { int64_t off, rank, buffer; } Key;

static int search(Solver *s, const int64_t *members, int64_t m, int64_t lo, int64_t hi,
                  int64_t last_off, int64_t last_rank, const Key *hint, int64_t hint_count);

static int compare_keys(const void *pa, const void *pb) {
    const Key *a = (const Key *)pa, *b = (const Key *)pb;
    if (a->off != b->off) return a->off < b->off ? -1 : 1;
    if (a->rank != b->rank) return a->rank < b->rank ? -1 : 1;
    return 0;
}

/* preorder key of one buffer, for rank_part: smaller first */
typedef struct { int64_t key[3], buffer; } Pre;

static int compare_pre(const void *pa, const void *pb) {
    const Pre *a = (const Pre *)pa, *b = (const Pre *)pb;
    for (int k = 0; k < 3; ++k) {
        if (a->key[k] != b->key[k]) return a->key[k] < b->key[k] ? -1 : 1;
    }
    return a->buffer < b->buffer ? -1 : (a->buffer > b->buffer);
}

/* Rank the buffers of a part by the preorder with the live totals as they are now (the
 * reference: _Solver._rank_part); the old ranks go to saved. */
static void rank_part(Solver *s, const int64_t *inside, int64_t count, int64_t *saved) {
    Pre *pre = (Pre *)malloc(sizeof(Pre) * (size_t)(count > 0 ? count : 1));
    for (int64_t j = 0; j < count; ++j) {
        const int64_t v = inside[j];
        int64_t total = 0;
        for (int64_t t = s->first[v]; t < s->last[v]; ++t) {
            if (s->total[t] > total) total = s->total[t];
        }
        for (int k = 0; k < 3; ++k) {
            const char c = s->prefer[k];
            pre[j].key[k] = c == 'T' ? -total : c == 'A' ? -s->area[v] : -s->width[v];
        }
        pre[j].buffer = v;
        saved[j] = s->rank[v];
    }
    qsort(pre, (size_t)count, sizeof(Pre), compare_pre);
    for (int64_t j = 0; j < count; ++j) s->rank[pre[j].buffer] = j;
    free(pre);
}

/* Search one part with its own ranking and epoch; restore the ranks afterwards. */
static int search_part(Solver *s, int64_t *inside, int64_t count, int64_t lo, int64_t hi) {
    int64_t *saved = (int64_t *)malloc(sizeof(int64_t) * (size_t)(count > 0 ? count : 1));
    rank_part(s, inside, count, saved);
    const int64_t outer = s->cur_epoch;
    s->cur_epoch = ++s->epochs;
    int status = search(s, inside, count, lo, hi, -1, -1, NULL, 0);
    s->cur_epoch = outer;
    for (int64_t j = 0; j < count; ++j) s->rank[inside[j]] = saved[j];
    free(saved);
    return status;
}

static int decompose(Solver *s, const int64_t *members, int64_t m, int64_t lo, int64_t hi) {
    int64_t *inside = (int64_t *)malloc(sizeof(int64_t) * (size_t)(m > 0 ? m : 1));
    int status = FOUND;
    int64_t part_lo = lo;
    for (int64_t k = lo; k < hi && status == FOUND; ++k) {
        /* a part ends at hi or at a boundary that no unplaced buffer crosses */
        int64_t part_hi;
        if (k + 1 < hi && s->cuts[k] != 0) continue;
        part_hi = k + 1;
        int64_t count = 0;
        for (int64_t j = 0; j < m; ++j) {
            int64_t v = members[j];
            if (!s->placed[v] && s->first[v] < part_hi && s->last[v] > part_lo) inside[count++] = v;
        }
        if (count > 0) status = search_part(s, inside, count, part_lo, part_hi);
        part_lo = part_hi;
    }
    free(inside);
    return status;
}

static int place_and_recurse(Solver *s, int64_t u, int64_t off, int64_t rank,
                             const int64_t *members, int64_t m, int64_t lo, int64_t hi,
                             const Key *order, int64_t order_count) {
    const int64_t size = s->size[u], top = off + size;
    const int64_t a = s->first[u], b = s->last[u];
    int64_t *min_off = s->min_off, *floor = s->floor, *total = s->total;
    char *placed = s->placed;
    placed[u] = 1;
    s->offset[u] = off;
    s->epoch[u] = s->cur_epoch;
    /* raise the minimum offset of the unplaced buffers u overlaps */
    const int64_t ov_begin = s->ov_ptr[u], ov_end = s->ov_ptr[u + 1];
    int64_t *raised = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)(ov_end - ov_begin + 1));
    int64_t n_raised = 0, span_lo = a, span_hi = b;
    for (int64_t j = ov_begin; j < ov_end; ++j) {
        int64_t v = s->ov_idx[j];
        if (!placed[v] && min_off[v] < top) {
            raised[2 * n_raised] = v;
            raised[2 * n_raised + 1] = min_off[v];
            ++n_raised;
            min_off[v] = top;
        }
    }
    const int use_incidence = n_raised > 0 && s->inc_ptr != NULL;
    if (use_incidence) {
        for (int64_t j = 0; j < n_raised; ++j) {
            int64_t v = raised[2 * j];
            if (s->first[v] < span_lo) span_lo = s->first[v];
            if (s->last[v] > span_hi) span_hi = s->last[v];
        }
    }
    int64_t *old_floor = (int64_t *)malloc(sizeof(int64_t) * (size_t)(span_hi - span_lo));
    memcpy(old_floor, floor + span_lo, sizeof(int64_t) * (size_t)(span_hi - span_lo));
    for (int64_t t = a; t < b; ++t) {
        floor[t] = top;
        total[t] -= size;
    }
    if (use_incidence) {
        for (int64_t t = span_lo; t < span_hi; ++t) {
            int64_t lowest = s->capacity;
            for (int64_t j = s->inc_ptr[t]; j < s->inc_ptr[t + 1]; ++j) {
                int64_t v = s->inc_owner[j];
                if (!placed[v] && min_off[v] < lowest) lowest = min_off[v];
            }
            if (lowest > floor[t]) floor[t] = lowest;
        }
    }
    int split = 0;
    for (int64_t t = a; t + 1 < b; ++t) {
        if (--s->cuts[t] == 0) split = 1;
    }
    int status = NONE, fits = 1;
    /* Only sections in [span_lo, span_hi) changed; elsewhere floor + unplaced bytes fit at the
     * parent and off <= capacity - unplaced bytes (the caller's cut-off), so the result is the
     * Python reference's check over all of [lo, hi). */
    const int64_t check_lo = span_lo > lo ? span_lo : lo, check_hi = span_hi < hi ? span_hi : hi;
    for (int64_t t = check_lo; t < check_hi; ++t) {
        int64_t base = floor[t] > off ? floor[t] : off;
        if (base + total[t] > s->capacity) { fits = 0; break; }
    }
    if (fits) {
        status = split ? decompose(s, members, m, lo, hi)
                       : search(s, members, m, lo, hi, off, rank, order, order_count);
    }
    for (int64_t t = a; t + 1 < b; ++t) ++s->cuts[t];
    for (int64_t t = a; t < b; ++t) total[t] += size;
    memcpy(floor + span_lo, old_floor, sizeof(int64_t) * (size_t)(span_hi - span_lo));
    for (int64_t j = n_raised - 1; j >= 0; --j) min_off[raised[2 * j]] = raised[2 * j + 1];
    placed[u] = 0;
    free(old_floor);
    free(raised);
    return status;
}

/* The node's unplaced buffers sorted by (min offset, rank). With the parent's order as a hint
 * (the same buffers less the one just placed, a few keys raised), an insertion sort of that
 * nearly sorted list replaces a full sort: the same order, found in about linear time. */
static int64_t sorted_keys(Solver *s, const int64_t *members, int64_t m, const Key *hint,
                           int64_t hint_count, Key *keys) {
    int64_t count = 0;
    if (hint == NULL) {
        for (int64_t j = 0; j < m; ++j) {
            int64_t v = members[j];
            if (s->placed[v]) continue;
            keys[count].off = s->min_off[v];
            keys[count].rank = s->rank[v];
            keys[count].buffer = v;
            ++count;
        }
        qsort(keys, (size_t)count, sizeof(Key), compare_keys);
        return count;
    }
    for (int64_t j = 0; j < hint_count; ++j) {
        int64_t v = hint[j].buffer;
        if (s->placed[v]) continue;
        Key key = {s->min_off[v], s->rank[v], v};
        int64_t k = count++;
        while (k > 0 && compare_keys(&keys[k - 1], &key) > 0) {
            keys[k] = keys[k - 1];
            --k;
        }
        keys[k] = key;
    }
    return count;
}

static int search(Solver *s, const int64_t *members, int64_t m, int64_t lo, int64_t hi,
                  int64_t last_off, int64_t last_rank, const Key *hint, int64_t hint_count) {
    s->nodes += 1;
    if (s->node_limit >= 0 && s->nodes > s->node_limit) return ABORT;
    if (s->deadline >= 0 && (s->nodes & 63) == 0 && now_seconds() > s->deadline) return ABORT;
    Key *keys = (Key *)malloc(sizeof(Key) * (size_t)(m > 0 ? m : 1));
    int64_t min_height = INT64_MAX, highest_total = 0;
    const int64_t count = sorted_keys(s, members, m, hint, hint_count, keys);
    if (count == 0) {
        free(keys);
        return FOUND;
    }
    for (int64_t k = 0; k < count; ++k) {
        int64_t top = keys[k].off + s->size[keys[k].buffer];
        if (top < min_height) min_height = top;
    }
    for (int64_t t = lo; t < hi; ++t) {
        if (s->total[t] > highest_total) highest_total = s->total[t];
    }
    const int64_t highest = s->capacity - highest_total;
    int status = NONE;
    for (int64_t k = 0; k < count; ++k) {
        const int64_t off = keys[k].off;
        if (off < last_off) continue;
        if (off >= min_height || off > highest) break;
        if (off == last_off && keys[k].rank < last_rank) continue;
        const int64_t twin = s->twin[keys[k].buffer];
        if (twin >= 0 && !s->placed[twin]) continue;  /* its identical predecessor goes first */
        /* not directly on a placed buffer of the same lifetime and a higher rank */
        int stacked = 0;
        const int64_t u = keys[k].buffer;
        for (int64_t j = s->kin_ptr[u]; j < s->kin_ptr[u + 1] && !stacked; ++j) {
            const int64_t w = s->kin[j];
            stacked = s->placed[w] && s->epoch[w] == s->cur_epoch && s->offset[w] + s->size[w] == off &&
                      s->rank[w] > keys[k].rank;
        }
        if (stacked) continue;
        status = place_and_recurse(s, keys[k].buffer, off, keys[k].rank, members, m, lo, hi, keys, count);
        if (status != NONE) break;
    }
    free(keys);
    return status;
}

/* Entry point: returns FOUND / NONE / ABORT; offsets and the node count are written back. */
int ms_memopt_search(int64_t n, int64_t count, int64_t capacity,
                     const int64_t *first, const int64_t *last, const int64_t *size,
                     int64_t *rank, const int64_t *area, const int64_t *width, const char *prefer,
                     const int64_t *twin, const int64_t *kin_ptr,
                     const int64_t *kin, const int64_t *ov_ptr,
                     const int64_t *ov_idx,
                     const int64_t *inc_ptr, const int64_t *inc_owner,
                     int64_t *total, int64_t *cuts, int64_t *offset,
                     int64_t node_limit, double seconds, int64_t *nodes_out) {
    Solver s;
    s.n = n; s.count = count; s.capacity = capacity;
    s.first = first; s.last = last; s.size = size; s.rank = rank; s.twin = twin;
    s.area = area; s.width = width;
    memcpy(s.prefer, prefer, 3);
    s.epoch = (int64_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    s.cur_epoch = 0;
    s.epochs = 0;
    s.kin_ptr = kin_ptr; s.kin = kin;
    s.ov_ptr = ov_ptr; s.ov_idx = ov_idx; s.inc_ptr = inc_ptr; s.inc_owner = inc_owner;
    s.total = total; s.cuts = cuts; s.offset = offset;
    s.floor = (int64_t *)calloc((size_t)(count > 0 ? count : 1), sizeof(int64_t));
    s.min_off = (int64_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    s.placed = (char *)calloc((size_t)(n > 0 ? n : 1), 1);
    s.nodes = 0;
    s.node_limit = node_limit;
    s.deadline = seconds >= 0 ? now_seconds() + seconds : -1.0;
    int64_t *members = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    int status = FOUND;
    int64_t part_lo = 0;
    for (int64_t k = 0; k < count && status == FOUND; ++k) {
        if (k + 1 < count && cuts[k] != 0) continue;
        int64_t part_hi = k + 1, m = 0;
        for (int64_t v = 0; v < n; ++v) {
            if (first[v] < part_hi && last[v] > part_lo) members[m++] = v;
        }
        status = search_part(&s, members, m, part_lo, part_hi);
        part_lo = part_hi;
    }
    *nodes_out = s.nodes;
    free(s.epoch);
    free(members);
    free(s.floor);
    free(s.min_off);
    free(s.placed);
    return status;
}
