/* A mixture-of-experts layer's expert step on the CPU in one call (`cpu_moe_kernel.py` builds and loads it):
 * the step's token copies grouped by expert, each chosen expert's gate|up and down weights streamed once over
 * all its rows (up to ROWS at a time), the activation between them, the routing-weighted sum into out. fp32
 * math; fp32 or bf16 weights read in place from the experts' stacked tensors ([E, 2I, d] and [E, d, I], row
 * major, as `cuda_moe.stack_experts` lays them out), so nothing is repacked or copied. Single-threaded: the
 * start-up measurement (`cpu_moe.prepare`) decides whether it beats the loop over oneDNN's threaded linears.
 *
 * No input parsing: every index comes from the router's top-k, every shape checked by the Python caller.
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define LANES 16 /* floats per accumulator: one AVX-512 register */
#else
#define LANES 8 /* one AVX2 register (two SSE/NEON ones) */
#endif
#ifndef COLS
#define COLS 4 /* weight rows (outputs) computed together, sharing each load of x */
#endif
#ifndef ROWS
#define ROWS 4 /* token rows computed together, sharing each load of the weights */
#endif

typedef float f32xL __attribute__((vector_size(4 * LANES), aligned(4)));
typedef uint16_t u16xL __attribute__((vector_size(2 * LANES), aligned(2)));
typedef uint32_t u32xL __attribute__((vector_size(4 * LANES)));

static inline __attribute__((always_inline)) f32xL load_w(const void *w, int bf16, size_t at) {
    if (bf16) {
        u16xL h = *(const u16xL *)((const uint16_t *)w + at);
        return (f32xL)(__builtin_convertvector(h, u32xL) << 16); /* bf16 -> fp32: exact */
    }
    return *(const f32xL *)((const float *)w + at);
}

static inline __attribute__((always_inline)) float hsum(f32xL v) {
#if LANES == 16
    typedef float f32x8 __attribute__((vector_size(32)));
    f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    typedef float f32x8 __attribute__((vector_size(32)));
    f32x8 h = v;
#endif
    typedef float f32x4 __attribute__((vector_size(16)));
    f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    q += __builtin_shufflevector(q, q, 2, 3, 0, 1);
    return q[0] + q[1];
}

/* y[r][n..n+COLS) = sum_k x[r][k] * w[n + j][k] for R rows of x (R <= ROWS); w is fp32 (bf16 == 0) or bf16. */
static inline __attribute__((always_inline)) void block(const float *const *x, const int R, int K, const void *w,
                                                        int bf16, int n, float *const *y) {
    f32xL acc[ROWS][COLS] = {{{0}}};
    for (int k = 0; k < K; k += LANES) {
        f32xL wv[COLS];
#pragma GCC unroll 8
        for (int j = 0; j < COLS; j++) wv[j] = load_w(w, bf16, (size_t)(n + j) * K + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            f32xL xv = *(const f32xL *)(x[r] + k);
#pragma GCC unroll 8
            for (int j = 0; j < COLS; j++) acc[r][j] += xv * wv[j];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < COLS; j++) y[r][n + j] = hsum(acc[r][j]);
}

/* y[m][n] = sum_k x[m][k] * w[n][k] for M rows of x and N outputs (N % COLS == 0, K % LANES == 0): each block of
 * COLS weight rows read from memory once for all M rows (ROWS at a time, the block staying in L1 between them). */
static void matmul(const float *const *x, int M, int K, const void *w, int bf16, int N, float *const *y) {
    for (int n = 0; n < N; n += COLS)
        for (int m = 0; m < M; m += ROWS) {
            switch (M - m < ROWS ? M - m : ROWS) {
            case 1: block(x + m, 1, K, w, bf16, n, y + m); break;
            case 2: block(x + m, 2, K, w, bf16, n, y + m); break;
            case 3: block(x + m, 3, K, w, bf16, n, y + m); break;
#if ROWS > 4
            case 4: block(x + m, 4, K, w, bf16, n, y + m); break;
            case 5: block(x + m, 5, K, w, bf16, n, y + m); break;
#endif
#if ROWS > 6
            case 6: block(x + m, 6, K, w, bf16, n, y + m); break;
            case 7: block(x + m, 7, K, w, bf16, n, y + m); break;
#endif
            default: block(x + m, ROWS, K, w, bf16, n, y + m); break;
            }
        }
}

typedef int32_t i32xL __attribute__((vector_size(4 * LANES)));

/* Lane by lane: a where mask (a comparison's all-ones lanes), else b. */
static inline __attribute__((always_inline)) f32xL pick(i32xL mask, f32xL a, f32xL b) {
    return (f32xL)(((i32xL)a & mask) | ((i32xL)b & ~mask));
}

/* e^x lane by lane (within a few ulp of expf over the clamped range [-87.3, 88.7]): 2^n e^r with
 * n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial (the libm call does not
 * vectorise). */
static inline __attribute__((always_inline)) f32xL vexp(f32xL x) {
    x = pick(x < 88.7f, x, (f32xL){} + 88.7f);
    x = pick(x > -87.3f, x, (f32xL){} - 87.3f);
    f32xL n = x * 1.44269504088896341f;
    n = __builtin_convertvector(__builtin_convertvector(n + pick(n < 0.0f, (f32xL){} - 0.5f, (f32xL){} + 0.5f),
                                                       i32xL), f32xL); /* rounded to the nearest */
    f32xL r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln 2 in two parts: r exact */
    f32xL p = (f32xL){} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    i32xL scale = (__builtin_convertvector(n, i32xL) + 127) << 23;
    return p * (f32xL)scale;
}

/* h[i] = act(gate[i]) * up[i] for gate = gu[0:I], up = gu[I:2I] (I % LANES == 0); act 0: SiLU, 1: tanh-GELU. */
static void activate(const float *gu, int I, int act, float *h) {
    for (int i = 0; i < I; i += LANES) {
        f32xL g = *(const f32xL *)(gu + i), up = *(const f32xL *)(gu + I + i), a;
        if (act == 0) {
            a = g / (1.0f + vexp(-g));
        } else { /* 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (e^2u + 1) */
            f32xL u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            a = 0.5f * g * (2.0f - 2.0f / (vexp(2.0f * u) + 1.0f));
        }
        *(f32xL *)(h + i) = a * up;
    }
}

/* out[T, d] = sum over each token's k experts of weight * down(act(gate(x)) * up(x)).
 * x [T, d] fp32; ids [T, k] int64 in [0, E); weights [T, k] fp32; w13 [E, 2I, d], w2 [E, d, I] (fp32 or bf16);
 * scratch: at least T * k * (3 * I + d) floats. Returns 0, or -1 for shapes it does not take. */
int moe_experts(const float *x, int T, int d, int I, int E, int k, const int64_t *ids, const float *weights,
                const void *w13, const void *w2, int bf16, int act, float *out, float *scratch) {
    if (d % LANES || I % LANES || (2 * I) % COLS || d % COLS || T <= 0 || k <= 0 || E <= 0) return -1;
    const int copies = T * k;
    int counts[E + 1], fill[E], order[copies];
    memset(counts, 0, sizeof(int) * (E + 1));
    for (int c = 0; c < copies; c++) counts[ids[c] + 1]++;
    for (int e = 0; e < E; e++) counts[e + 1] += counts[e]; /* counts[e]: expert e's first copy */
    memcpy(fill, counts, sizeof(int) * E);
    for (int c = 0; c < copies; c++) order[fill[ids[c]]++] = c; /* copies sorted by expert, stable */
    memset(out, 0, sizeof(float) * (size_t)T * d);
    const size_t elem = bf16 ? 2 : 4;
    const float *xs[copies], *hs[copies];
    float *gus[copies], *hw[copies], *ys[copies];
    for (int c = 0; c < copies; c++) { /* each sorted copy's rows of scratch */
        gus[c] = scratch + (size_t)c * (3 * I + d);
        hw[c] = gus[c] + 2 * I;
        hs[c] = hw[c];
        ys[c] = hw[c] + I;
        xs[c] = x + (size_t)(order[c] / k) * d;
    }
    for (int e = 0; e < E; e++) {
        const int first = counts[e], M = counts[e + 1] - counts[e];
        if (!M) continue;
        matmul(xs + first, M, d, (const char *)w13 + (size_t)e * 2 * I * d * elem, bf16, 2 * I, gus + first);
        for (int c = first; c < first + M; c++) activate(gus[c], I, act, hw[c]);
        matmul(hs + first, M, I, (const char *)w2 + (size_t)e * d * I * elem, bf16, d, ys + first);
    }
    for (int c = 0; c < copies; c++) { /* the weighted sum, in the sorted copies' order */
        const int copy = order[c];
        const float wgt = weights[copy], *yc = ys[c];
        float *o = out + (size_t)(copy / k) * d;
        for (int i = 0; i < d; i++) o[i] += wgt * yc[i];
    }
    return 0;
}
