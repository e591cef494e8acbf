/* Fused float32 CPU ops for batch-1 decode: RMSNorm (with the residual add), SiLU * mul, RoPE.
 *
 * At batch 1 the model's elementwise work is a few hundred floats per op, so the cost of
 * each op is its dispatch, not its arithmetic: torch's RMSNorm is ~24 ATen calls, its
 * rotate-half RoPE ~42 per layer. Each function here is one call with no allocation and
 * no threads (a parallel region over 576 floats costs more than it saves); the GEMVs keep
 * the cores.
 *
 * Built with -ffp-contract=off so that RoPE's products and sums round as torch's separate
 * mul / add do (its result is bit for bit the PyTorch path's). The reductions (RMSNorm's
 * mean of squares) sum in a different order from torch's and agree to float32 rounding.
 *
 * Every function returns 0, or a nonzero code the Python side turns into an error.
 */
#include <math.h>
#include <stdint.h>

/* sum of squares of n floats, in 8 lanes (vectorisable without reassociation flags) */
static float sum_squares(const float *x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float total = 0.0f;
    for (; i < n; i++) total += x[i] * x[i];
    for (int j = 0; j < 8; j++) total += acc[j];
    return total;
}

static void norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float rstd = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * rstd * w[i];
}

/* out = x * rsqrt(mean(x^2) + eps) * w over rows of n floats: x's rows are (outer, inner) pairs at
 * x + o * outer_stride + i * inner_stride (a [T, H, D] view of a fused qkv row too); out is
 * contiguous [outer, inner, n] */
int rms_norm_f32(const float *x, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                 const float *w, float *out, int64_t n, float eps) {
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++)
            norm_row(x + o * outer_stride + i * inner_stride, w, out + (o * inner + i) * n, n, eps);
    return 0;
}

/* sum = a + b (sum may be a or b), out = rms_norm(sum) * w; contiguous [rows, n] */
int add_rms_norm_f32(const float *a, const float *b, float *sum, const float *w, float *out,
                     int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *ar = a + r * n, *br = b + r * n;
        float *sr = sum + r * n;
        for (int64_t i = 0; i < n; i++) sr[i] = ar[i] + br[i];
        norm_row(sr, w, out + r * n, n, eps);
    }
    return 0;
}

/* e^x to ~1 ulp (Cephes' expf: x = k ln2 + r, a degree-5 polynomial in r, times 2^k), written
 * without branches or libm calls so the loop below vectorises (libm's expf does not) */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)k + 127) << 23};
    return y * scale.f;
}

/* out[r, i] = silu(x[r, i]) * x[r, n + i]: x is [rows, 2n] (gate then up, row stride x_stride) */
int silu_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
    return 0;
}

/* Rotate-half RoPE in place: token t's heads [0, heads) of dim d start at x + t * token_stride
 * and lie head_stride apart; cos / sin are [max_position, d] tables (cat(freqs, freqs) layout).
 * Returns 1 + t for the first token whose position lies outside [0, max_position). */
int rope_f32(float *x, int64_t token_stride, int64_t head_stride, int64_t heads, const int64_t *positions,
             int64_t tokens, const float *cos_table, const float *sin_table, int64_t max_position, int64_t d) {
    int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t p = positions[t];
        if (p < 0 || p >= max_position) return (int)(1 + t);
        const float *c = cos_table + p * d, *s = sin_table + p * d;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * token_stride + h * head_stride;
            for (int64_t i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                /* torch: x * cos + cat(-x2, x1) * sin, each product rounded, then the sum */
                float lo_a = x1 * c[i], lo_b = -x2 * s[i];
                float hi_a = x2 * c[i + half], hi_b = x1 * s[i + half];
                v[i] = lo_a + lo_b;
                v[i + half] = hi_a + hi_b;
            }
        }
    }
    return 0;
}
