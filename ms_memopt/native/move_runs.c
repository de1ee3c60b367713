/* Compaction runs on host memory: many memmoves in one call, each byte read and written once.
 *
 * A compaction that moves more than a cache's worth of bytes gains nothing from keeping the
 * destination in cache: ordinary stores read every destination line before writing it
 * (read-for-ownership), a third memory stream. glibc's memmove avoids that with non-temporal
 * stores only for one large copy whose source and destination do not overlap; a compaction is
 * thousands of ~100 KiB copies, many overlapping their own source. mm_move_runs streams each
 * run's destination with non-temporal stores when asked (the caller decides from the total
 * size), copying forward, which is safe for dst <= src: every block is loaded before it is
 * stored, and stores land below bytes not yet loaded. dst > src with overlap falls back to
 * memmove (never produced by a slide toward low addresses).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define MM_HAVE_STREAM 1
#endif

#ifdef MM_HAVE_STREAM
/* Forward copy, 64 bytes per step, destination streamed (bypasses the cache). dst <= src. */
static void stream_forward(uint8_t *dst, const uint8_t *src, size_t n)
{
    size_t head = (size_t)((64 - ((uintptr_t)dst & 63)) & 63);
    if (head > n)
        head = n;
    if (head) {
        memmove(dst, src, head);
        dst += head;
        src += head;
        n -= head;
    }
    while (n >= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += 64;
        src += 64;
        n -= 64;
    }
    if (n)
        memmove(dst, src, n);
}
#endif

/* Move runs[k] = (src[k], dst[k], size[k]) bytes, offsets from base, in index order.
 * stream_min: runs of at least this many bytes with dst <= src are streamed (0: never).
 * Returns the number of bytes moved. */
int64_t mm_move_runs(uint8_t *base, const int64_t *src, const int64_t *dst, const int64_t *size,
                     int64_t count, int64_t stream_min)
{
    int64_t moved = 0;
    int streamed = 0;
    for (int64_t k = 0; k < count; k++) {
        uint8_t *d = base + dst[k];
        const uint8_t *s = base + src[k];
        size_t n = (size_t)size[k];
        moved += size[k];
        if (d == s || n == 0)
            continue;
#ifdef MM_HAVE_STREAM
        if (stream_min > 0 && (int64_t)n >= stream_min && d < s) {
            stream_forward(d, s, n);
            streamed = 1;
            continue;
        }
#endif
        memmove(d, s, n);
    }
#ifdef MM_HAVE_STREAM
    if (streamed)
        _mm_sfence(); /* streamed stores visible to every other thread before we return */
#endif
    return moved;
}
