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
 */
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MM_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MM_VECTOR_CLONES
#endif

MM_VECTOR_CLONES
static void adamw_piece(float *restrict w, float *restrict m, float *restrict v, const float *restrict g,
                        int64_t n, float decay, float step, float c1, float c2, float eps)
{
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float wi = w[i];
        wi = wi - decay * wi;
        float mi = m[i] + (gi - m[i]) * c1;
        float vi = v[i] + (gi * gi - v[i]) * c2;
        m[i] = mi;
        v[i] = vi;
        w[i] = wi - step * mi / (sqrtf(vi) + eps);
    }
}

/* Pieces k = 0..count-1: addresses of w, m, v, gradient (float32), their length, decay, step. */
void mm_adamw_f32(int64_t count, const int64_t *w, const int64_t *m, const int64_t *v, const int64_t *g,
                  const int64_t *n, const float *decay, const float *step, float beta1, float beta2, float eps)
{
    const float c1 = 1.0f - beta1;
    const float c2 = 1.0f - beta2;
    for (int64_t k = 0; k < count; k++)
        adamw_piece((float *)(intptr_t)w[k], (float *)(intptr_t)m[k], (float *)(intptr_t)v[k],
                    (const float *)(intptr_t)g[k], n[k], decay[k], step[k], c1, c2, eps);
}
