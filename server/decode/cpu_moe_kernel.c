/* A mixture-of-experts layer's expert step on the CPU in one call (`cpu_moe_kernel.py` builds, loads and feeds it):
 * the step's token copies grouped by expert, each chosen expert's gate|up and down weights streamed once over all
 * its rows (ROWS at a time), the activation between them, the routing-weighted sum into out. fp32 math over fp32
 * or bf16 weights, which `cpu_moe_kernel.pack` lays out in panels ([E, N / WIDTH, K, WIDTH]: each panel one
 * sequential stream, read WIDTH outputs at a time with no horizontal sums) once at start, in place of the
 * experts' own. Single-threaded: the start-up measurement (`cpu_moe.prepare`) decides whether it beats the loop
 * over oneDNN's threaded linears.
 *
 * No input parsing: every index comes from the router's top-k, every shape checked by the Python caller.
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define LANES 16 /* floats per vector: one AVX-512 register */
#else
#define LANES 8 /* one AVX2 register (two SSE/NEON ones) */
#endif
#define NV 4                 /* accumulator vectors per row */
#define WIDTH (NV * LANES)   /* outputs per panel */
#define ROWS 4               /* token rows computed together, sharing each load of the weights */
#define PREFETCH_BYTES 16384 /* how far ahead of the loads the weights are prefetched into L2 (measured: 8-16 KiB) */

typedef float f32xL __attribute__((vector_size(4 * LANES), aligned(4)));
typedef uint16_t u16xL __attribute__((vector_size(2 * LANES), aligned(2)));
typedef uint32_t u32xL __attribute__((vector_size(4 * LANES)));
typedef int32_t i32xL __attribute__((vector_size(4 * LANES)));

int moe_panel_width(void) { return WIDTH; }

static inline __attribute__((always_inline)) f32xL load_w(const void *w, int bf16, size_t at) {
    if (bf16) {
        u16xL h = *(const u16xL *)((const uint16_t *)w + at);
        return (f32xL)(__builtin_convertvector(h, u32xL) << 16); /* bf16 -> fp32: exact */
    }
    return *(const f32xL *)((const float *)w + at);
}

/* y[r][n..n+WIDTH) = sum_k x[r][k] * panel[k][0..WIDTH) for R rows of x (R <= ROWS). */
static inline __attribute__((always_inline)) void panel_rows(const float *const *x, const int R, int K,
                                                             const void *panel, int bf16, int n, float *const *y) {
    const char *bytes = (const char *)panel;
    const size_t row_bytes = (size_t)WIDTH * (bf16 ? 2 : 4);
    f32xL acc[ROWS][NV] = {{{0}}};
    for (int k = 0; k < K; k++) {
        for (size_t line = 0; line < row_bytes; line += 64)
            __builtin_prefetch(bytes + k * row_bytes + line + PREFETCH_BYTES, 0, 2);
        f32xL wv[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) wv[v] = load_w(panel, bf16, (size_t)k * WIDTH + v * LANES);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const float xs = x[r][k];
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[r][v] += xs * wv[v];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) memcpy(y[r] + n + v * LANES, &acc[r][v], sizeof(f32xL));
}

/* y[m][0..N) = x[m] @ w for M rows of x, w in panels [N / WIDTH][K][WIDTH]: each panel read from memory once for
 * all M rows (ROWS at a time, the panel staying in cache between them). */
static void matmul(const float *const *x, int M, int K, const void *w, int bf16, int N, float *const *y) {
    const size_t elem = bf16 ? 2 : 4;
    for (int n = 0; n < N; n += WIDTH) {
        const void *panel = (const char *)w + (size_t)n * K * elem;
        for (int m = 0; m < M; m += ROWS) {
            switch (M - m < ROWS ? M - m : ROWS) { /* the row count known to the compiler: unrolled */
            case 1: panel_rows(x + m, 1, K, panel, bf16, n, y + m); break;
            case 2: panel_rows(x + m, 2, K, panel, bf16, n, y + m); break;
            case 3: panel_rows(x + m, 3, K, panel, bf16, n, y + m); break;
            default: panel_rows(x + m, ROWS, K, panel, bf16, n, y + m); break;
            }
        }
    }
}

/* Lane by lane: a where mask (a comparison's all-ones lanes), else b. */
static inline __attribute__((always_inline)) f32xL pick(i32xL mask, f32xL a, f32xL b) {
    return (f32xL)(((i32xL)a & mask) | ((i32xL)b & ~mask));
}

/* e^x lane by lane (within a few ulp of expf over the clamped range [-87.3, 88.7]; the libm call does not
 * vectorise): 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial. */
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
        f32xL g, up, a;
        memcpy(&g, gu + i, sizeof g);
        memcpy(&up, gu + I + i, sizeof up);
        if (act == 0) {
            a = g / (1.0f + vexp(-g));
        } else { /* 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (e^2u + 1) */
            f32xL u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            a = 0.5f * g * (2.0f - 2.0f / (vexp(2.0f * u) + 1.0f));
        }
        a *= up;
        memcpy(h + i, &a, sizeof a);
    }
}

/* out[T, d] = sum over each token's k experts of weight * down(act(gate(x)) * up(x)).
 * x [T, d] fp32; ids [T, k] int64 in [0, E); weights [T, k] fp32; w13 [E, 2I / WIDTH, d, WIDTH] and
 * w2 [E, d / WIDTH, I, WIDTH] (fp32 or bf16) in panels; scratch: at least T * k * (3 * I + d) floats.
 * Returns 0, or -1 for shapes it does not take. */
int moe_experts(const float *x, int T, int d, int I, int E, int k, const int64_t *ids, const float *weights,
                const void *w13, const void *w2, int bf16, int act, float *out, float *scratch) {
    if (d % WIDTH || (2 * I) % WIDTH || I % LANES || T <= 0 || k <= 0 || E <= 0) return -1;
    const int copies = T * k;
    int counts[E + 1], fill[E], order[copies];
    memset(counts, 0, sizeof(int) * (E + 1));
    for (int c = 0; c < copies; c++) counts[ids[c] + 1]++;
    for (int e = 0; e < E; e++) counts[e + 1] += counts[e]; /* counts[e]: expert e's first copy */
    memcpy(fill, counts, sizeof(int) * E);
    for (int c = 0; c < copies; c++) order[fill[ids[c]]++] = c; /* copies sorted by expert, stable */
    const size_t elem = bf16 ? 2 : 4;
    const float *xs[copies], *hs[copies];
    float *gus[copies], *ys[copies];
    for (int c = 0; c < copies; c++) { /* each sorted copy's rows of scratch: gate|up, act * up, down */
        gus[c] = scratch + (size_t)c * (3 * I + d);
        hs[c] = gus[c] + 2 * I;
        ys[c] = gus[c] + 3 * I;
        xs[c] = x + (size_t)(order[c] / k) * d;
    }
    for (int e = 0; e < E; e++) {
        const int first = counts[e], M = counts[e + 1] - counts[e];
        if (!M) continue;
        matmul(xs + first, M, d, (const char *)w13 + (size_t)e * 2 * I * d * elem, bf16, 2 * I, gus + first);
        for (int c = first; c < first + M; c++) activate(gus[c], I, act, (float *)hs[c]);
        matmul(hs + first, M, I, (const char *)w2 + (size_t)e * d * I * elem, bf16, d, ys + first);
    }
    memset(out, 0, sizeof(float) * (size_t)T * d);
    for (int c = 0; c < copies; c++) { /* the weighted sum, in the sorted copies' order */
        const int copy = order[c];
        const float wgt = weights[copy], *yc = ys[c];
        float *o = out + (size_t)(copy / k) * d;
        for (int i = 0; i < d; i++) o[i] += wgt * yc[i];
    }
    return 0;
}
