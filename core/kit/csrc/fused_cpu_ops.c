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

/* out[r, i] = gelu_tanh(x[r, i]) * x[r, n + i] (GeGLU: Gemma): gelu_tanh(g) = g / 2 * (1 + tanh(u)),
 * u = sqrt(2 / pi) * (g + 0.044715 g^3), computed as g * sigmoid(2u) = g / (1 + e^(-2u)) */
int gelu_tanh_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float v = g[i], inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
            o[i] = v / (1.0f + exp_f32(-2.0f * inner)) * u[i];
        }
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

/* ---------------------------------------------------------------- the dense product
 *
 * The native decode step's product for the core's plain float32 weights (lmplug.kit.native_dense):
 * out[m, N] = x[m, K] @ W^T (+ bias), W^T stored [K, N] row-major (the layout the core's
 * Unquantized method keeps on the CPU). A decode's product reads every weight once and is bound by
 * memory: the loops stream W^T's rows in order, four at a time, into output rows that stay in
 * cache (DENSE_COLS columns of DENSE_ROWS rows), each output adding its K products in order (one
 * load and store of it per four products). Portable loops, written for the auto-vectorizer. One
 * thread: the step uses it only where the engine runs products on one thread. */

typedef struct {
    const float *wt;   /* [K, N] */
    const float *bias; /* [N] or NULL */
    int64_t in, out;   /* K, N */
} dense_t;

#define DENSE_ROWS 4
#define DENSE_COLS 4096

static void dense_block(const dense_t *d, const float *x, int64_t rows, int64_t n0, int64_t cols, float *out) {
    const int64_t K = d->in, N = d->out;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) out[r * N + n0 + j] = 0.0f;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *w0 = d->wt + k * N + n0, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
        for (int64_t r = 0; r < rows; r++) {
            const float x0 = x[r * K + k], x1 = x[r * K + k + 1], x2 = x[r * K + k + 2], x3 = x[r * K + k + 3];
            float *o = out + r * N + n0;
            for (int64_t j = 0; j < cols; j++) o[j] = o[j] + x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j];
        }
    }
    for (; k < K; k++) {
        const float *w = d->wt + k * N + n0;
        for (int64_t r = 0; r < rows; r++) {
            const float xv = x[r * K + k];
            float *o = out + r * N + n0;
            for (int64_t j = 0; j < cols; j++) o[j] = o[j] + xv * w[j];
        }
    }
    if (d->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < cols; j++) out[r * N + n0 + j] = out[r * N + n0 + j] + d->bias[n0 + j];
}

int dense_product_f32(void *ctx, const float *x, int64_t m, float *out, int threads) {
    const dense_t *d = ctx;
    (void)threads;
    for (int64_t r0 = 0; r0 < m; r0 += DENSE_ROWS) {
        const int64_t rows = m - r0 < DENSE_ROWS ? m - r0 : DENSE_ROWS;
        for (int64_t n0 = 0; n0 < d->out; n0 += DENSE_COLS)
            dense_block(d, x + r0 * d->in, rows, n0, d->out - n0 < DENSE_COLS ? d->out - n0 : DENSE_COLS,
                        out + r0 * d->out);
    }
    return 0;
}

/* ---------------------------------------------------------------- the native decode step
 *
 * Every decoder layer of a decode step in one call (lmplug.kit.native_step): the products and
 * the attention are the plugins' C functions (lmplug.kit.native's ABI), the rest is this
 * file's functions above, in the order the Python layers run them (lmplug.kit.decoder's
 * DecoderLayer, lmplug_models.blocks' FlexLayer), so every step but the plugins' gives the
 * Python path's bits. Per layer, with n1..n4 its four norms, m its residual multiplier and
 * act SiLU or tanh-GELU:
 *   attn(y) = o(attention(rope(qk_norm(qkv(y)))))     (q/k norms per head or over all heads;
 *                                                      RoPE of its own table and width, or none)
 *   mlp(y)  = down(act(gate) * up)  of gate_up(y)
 *   pre:      h = x + m * attn(n1(x)),     x = h + m * mlp(n2(h))        (Llama, Granite; n1 NULL:
 *                                                                        attn(x), an EAGLE head's layer)
 *   sandwich: h = x + n2(attn(n1(x))),     x = h + n4(mlp(n3(h)))        (Gemma 2/3)
 *   post:     h = x + n2(attn(x)),         x = h + n4(mlp(h))            (OLMo 2) */

typedef int (*product_fn)(void *ctx, const float *x, int64_t m, float *out, int threads);
typedef int (*attention_fn)(void *ctx, int64_t layer, const float *qkv, int64_t qkv_stride, float *out,
                            int threads);

typedef struct {
    product_fn fn;
    void *ctx;
} product_t;

enum { STYLE_PRE = 0, STYLE_SANDWICH, STYLE_POST };
enum { ACT_SILU = 0, ACT_GELU_TANH };
enum { QK_NORM_NONE = 0, QK_NORM_HEAD, QK_NORM_FULL };

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* input_norm: NULL for post (or none: pre);
                                                              q/k: NULL where absent */
    product_t qkv, o, gate_up, down;
    int64_t kv_layer; /* the cache layer its attention reads */
    const float *pre_ff_norm, *post_ff_norm; /* sandwich: both; post: post_ff_norm; pre: NULL */
    const float *cos, *sin;                  /* its RoPE's [max_position, rotary_dim] tables; NULL: none (NoPE) */
    int64_t max_position, rotary_dim;        /* rotary_dim <= head_dim: the first dims of each head rotate */
    int32_t style, act, qk_norm;
    float multiplier; /* the residual multiplier (pre style; 1: none) */
} step_layer_t;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    const int64_t *positions; /* [rows] */
    attention_fn attention;
    void *attention_ctx;
    int threads;
    float *scratch; /* decode_step_scratch(...) floats */
} step_t;

/* stages reported in *failed (layer * 8 + stage) */
enum { STAGE_QKV = 1, STAGE_ROPE, STAGE_ATTENTION, STAGE_O, STAGE_GATE_UP, STAGE_DOWN };

int64_t decode_step_scratch(int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t intermediate) {
    return rows * (3 * hidden + (heads + 2 * kv_heads) * head_dim + heads * head_dim + 3 * intermediate);
}

static void scale_f32(float *x, int64_t n, float m) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * m;
}

/* q/k norms of every row of qkv in place (norm_row reads a value before writing it) */
static void qk_norms(const step_layer_t *L, const step_t *s, float *qkv, int64_t qkv_width) {
    const int64_t T = s->rows, D = s->head_dim;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * qkv_width;
        if (L->qk_norm == QK_NORM_FULL) {
            norm_row(row, L->q_norm, row, s->heads * D, s->eps);
            norm_row(row + s->heads * D, L->k_norm, row + s->heads * D, s->kv_heads * D, s->eps);
            continue;
        }
        for (int64_t i = 0; i < s->heads + s->kv_heads; i++)
            norm_row(row + i * D, i < s->heads ? L->q_norm : L->k_norm, row + i * D, D, s->eps);
    }
}

/* x [rows, hidden] in place, through layers [0, n_layers). Returns 0, or the failing stage's
 * code with *failed = layer * 8 + stage. */
int decode_step_f32(const step_layer_t *layers, int64_t n_layers, const step_t *s, float *x, int64_t *failed) {
    const int64_t T = s->rows, h = s->hidden, D = s->head_dim, I = s->intermediate;
    const int64_t qkv_width = (s->heads + 2 * s->kv_heads) * D;
    float *normed = s->scratch, *qkv = normed + T * h, *att = qkv + T * qkv_width, *o = att + T * s->heads * D;
    float *gu = o + T * h, *act = gu + T * 2 * I, *down = act + T * I;
    for (int64_t l = 0; l < n_layers; l++) {
        const step_layer_t *L = &layers[l];
        const int post = L->style == STYLE_POST, sandwich = L->style == STYLE_SANDWICH;
        int status;
#define STAGE(code, call)                      \
        if ((status = (call)) != 0) {          \
            *failed = l * 8 + (code);          \
            return status;                     \
        }
        const int normed_in = !post && L->input_norm; /* else the attention reads x itself */
        if (normed_in) rms_norm_f32(x, T, h, 1, 0, L->input_norm, normed, h, s->eps);
        STAGE(STAGE_QKV, L->qkv.fn(L->qkv.ctx, normed_in ? normed : x, T, qkv, s->threads));
        if (L->qk_norm != QK_NORM_NONE) qk_norms(L, s, qkv, qkv_width);
        if (L->cos)
            STAGE(STAGE_ROPE, rope_f32(qkv, qkv_width, D, s->heads + s->kv_heads, s->positions, T, L->cos, L->sin,
                                       L->max_position, L->rotary_dim));
        STAGE(STAGE_ATTENTION, s->attention(s->attention_ctx, L->kv_layer, qkv, qkv_width, att, s->threads));
        STAGE(STAGE_O, L->o.fn(L->o.ctx, att, T, o, s->threads));
        const float *mlp_in = normed;
        if (post) { /* h = x + n2(a): the MLP reads h itself */
            rms_norm_f32(o, T, h, 1, 0, L->post_norm, o, h, s->eps);
            for (int64_t i = 0; i < T * h; i++) x[i] = x[i] + o[i];
            mlp_in = x;
        } else if (sandwich) { /* h = x + n2(a), normed = n3(h) */
            rms_norm_f32(o, T, h, 1, 0, L->post_norm, o, h, s->eps);
            add_rms_norm_f32(o, x, x, L->pre_ff_norm, normed, T, h, s->eps);
        } else {
            if (L->multiplier != 1.0f) scale_f32(o, T * h, L->multiplier);
            add_rms_norm_f32(o, x, x, L->post_norm, normed, T, h, s->eps);
        }
        STAGE(STAGE_GATE_UP, L->gate_up.fn(L->gate_up.ctx, mlp_in, T, gu, s->threads));
        if (L->act == ACT_GELU_TANH)
            gelu_tanh_mul_f32(gu, 2 * I, act, T, I);
        else
            silu_mul_f32(gu, 2 * I, act, T, I);
        STAGE(STAGE_DOWN, L->down.fn(L->down.ctx, act, T, down, s->threads));
        if (L->post_ff_norm) rms_norm_f32(down, T, h, 1, 0, L->post_ff_norm, down, h, s->eps);
        else if (L->multiplier != 1.0f) scale_f32(down, T * h, L->multiplier);
        for (int64_t i = 0; i < T * h; i++) x[i] = x[i] + down[i];
#undef STAGE
    }
    return 0;
}
