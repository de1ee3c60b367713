/* AdamW on float32 host buffers in one pass: decoupled decay, moments, update.
 *
 * FusedAdamW's CPU step. MindSpore's CPU kernels offer no single vectorised AdamW off Intel
 * (AdamWeightDecay's vector path is enabled for Intel CPUs only; elsewhere it is a scalar loop
 * with double-precision sqrt and division), so the compiled graph needed a decay pass plus an
 * Adam pass plus a launch; this loop reads each of w, m, v and the gradient once and writes
 * w, m, v once. Per element, in float32, in this order (the graph path's arithmetic):
 *
 *     w = w - decay * w                      decay = lr * weight_decay
 *     m = m + (g - m) * (1 - beta1)
 *     v = v + (g * g - v) * (1 - beta2)
 *     w = w - step * m / (sqrt(v) + eps)     step = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
 *
 * No fused multiply-add (built with -ffp-contract=off), so the vector and scalar code give
 * the same bits. Each piece (one parameter and its gradient) has its own decay and step.
 * float16/bfloat16 parameters: the update runs on the float32 master in the optimizer state,
 * the gradient is widened on the fly, and the parameter is written once, rounded to nearest
 * even (the field report's "one low-precision write").
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MM_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MM_VECTOR_CLONES
#endif

/* One element: updates *m and *v, returns the new weight. Inlined into the loops below. */
static inline float adamw_element(float w, float *m, float *v, float g, float decay, float step, float c1,
                                  float c2, float eps)
{
    w = w - decay * w;
    float mi = *m + (g - *m) * c1;
    float vi = *v + (g * g - *v) * c2;
    *m = mi;
    *v = vi;
    return w - step * mi / (sqrtf(vi) + eps);
}

MM_VECTOR_CLONES
static void adamw_piece(float *restrict w, float *restrict m, float *restrict v, const float *restrict g,
                        int64_t n, float decay, float step, float c1, float c2, float eps)
{
    for (int64_t i = 0; i < n; i++)
        w[i] = adamw_element(w[i], m + i, v + i, g[i], decay, step, c1, c2, eps);
}

/* Round a float32 to float16 / bfloat16, to nearest even (NaN stays NaN, overflow -> inf). */
static uint16_t to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u)                       /* inf, NaN */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u)                       /* >= 65520: rounds past the largest half */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {                      /* below 2^-14: a multiple of 2^-24, or zero */
        float magnitude;
        memcpy(&magnitude, &a, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(magnitude * 16777216.0f));
    }
    a += 0xfffu + ((a >> 13) & 1u);             /* round to nearest even at bit 13 */
    return (uint16_t)(sign | ((a - 0x38000000u) >> 13));
}

static uint16_t to_bfloat16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);   /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static float from_half(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t x;
    if (exponent == 0) {                        /* zero, subnormal: mantissa * 2^-24, exact */
        float magnitude = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
        x = sign | 0x7f800000u | (mantissa << 13);
    else
        x = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static float from_bfloat16(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* 16-bit parameters: w is the float32 master, g the 16-bit gradient, out the 16-bit parameter,
 * written once from the updated master. */
static void adamw_piece_16(float *restrict w, float *restrict m, float *restrict v, const uint16_t *restrict g,
                           uint16_t *restrict out, int64_t n, int bfloat, float decay, float step, float c1,
                           float c2, float eps)
{
    for (int64_t i = 0; i < n; i++) {
        float gi = bfloat ? from_bfloat16(g[i]) : from_half(g[i]);
        float wi = adamw_element(w[i], m + i, v + i, gi, decay, step, c1, c2, eps);
        w[i] = wi;
        out[i] = bfloat ? to_bfloat16(wi) : to_half(wi);
    }
}

/* Pieces k = 0..count-1: addresses of w, m, v, gradient and 16-bit output (0 for float32), their
 * length, kind (0 float32, 1 float16, 2 bfloat16), decay and step. */
void mm_adamw(int64_t count, const int64_t *w, const int64_t *m, const int64_t *v, const int64_t *g,
              const int64_t *out, const int64_t *n, const int64_t *kind, const float *decay, const float *step,
              float beta1, float beta2, float eps)
{
    const float c1 = 1.0f - beta1;
    const float c2 = 1.0f - beta2;
    for (int64_t k = 0; k < count; k++) {
        if (kind[k] == 0)
            adamw_piece((float *)(intptr_t)w[k], (float *)(intptr_t)m[k], (float *)(intptr_t)v[k],
                        (const float *)(intptr_t)g[k], n[k], decay[k], step[k], c1, c2, eps);
        else
            adamw_piece_16((float *)(intptr_t)w[k], (float *)(intptr_t)m[k], (float *)(intptr_t)v[k],
                           (const uint16_t *)(intptr_t)g[k], (uint16_t *)(intptr_t)out[k], n[k], kind[k] == 2,
                           decay[k], step[k], c1, c2, eps);
    }
}
