/* distnorm's CPU kernels in C: the loops the C++ operators of cpu_ops.cpp call (what each computes:
   distnorm/_cpu_kernels.py's module docstring). Built and loaded by distnorm/_cpu_kernels.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* One machine-code version per vector width, picked when the library loads (GCC / clang
   target_clones on x86-64). Every loop below fixes its order of operations in the source
   and no multiply-add is contracted (-ffp-contract=off), so each version gives the same bits. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* for (int64_t VAR = 0; VAR < N; ++VAR) BODY on `threads` OpenMP threads (a variable of that name
   in scope), or with no parallel region at all on one: OpenMP's region of one thread still builds a
   team, a cost a small layer's loop pays more than once a step. */
#define PARALLEL_FOR(VAR, N, ...)                                                                     \
    if (threads > 1) {                                                                                \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
        for (int64_t VAR = 0; VAR < (N); ++VAR) __VA_ARGS__                                           \
    } else {                                                                                          \
        for (int64_t VAR = 0; VAR < (N); ++VAR) __VA_ARGS__                                           \
    }

static inline float bf16_load(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_store(float f) {  /* c10::BFloat16's round-to-nearest-even */
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* dx = (g - m_dy - (x - mean) * k1) * k2 per channel; element i of a dense tensor whose
   channel stride is `inner` (1: channels last) belongs to channel (i / inner) % C. */
#define ELEMT(NAME, T, ACC, LOAD, STORE)                                                              \
CLONES void NAME(const T* g, const T* x, T* out, const ACC* mean, const ACC* invstd, const ACC* weight,     \
          const ACC* sum_dy, const ACC* sum_dy_xmu, int64_t total, int64_t C, int64_t inner,         \
          int64_t numel, int threads, ACC* coef) {                                                   \
    ACC norm = (ACC)1 / (ACC)total;                                                                  \
    ACC* m_dy = coef; ACC* k1 = coef + C; ACC* k2 = coef + 2 * C;                                    \
    for (int64_t c = 0; c < C; ++c) {                                                                \
        m_dy[c] = sum_dy[c] * norm;                                                                  \
        k1[c] = invstd[c] * invstd[c] * sum_dy_xmu[c] * norm;                                        \
        k2[c] = weight[c] * invstd[c];                                                               \
    }                                                                                                \
    if (inner == 1) {                                                                                \
        int64_t rows = numel / C;                                                                    \
        PARALLEL_FOR(r, rows, {                                                                      \
            const T* gr = g + r * C; const T* xr = x + r * C; T* o = out + r * C;                   \
            for (int64_t c = 0; c < C; ++c)                                                          \
                o[c] = STORE((LOAD(gr[c]) - m_dy[c] - (LOAD(xr[c]) - mean[c]) * k1[c]) * k2[c]);     \
        })                                                                                           \
    } else {                                                                                         \
        int64_t rows = numel / inner;                                                                \
        PARALLEL_FOR(r, rows, {                                                                      \
            int64_t c = r % C;                                                                       \
            const ACC md = m_dy[c], a1 = k1[c], a2 = k2[c], mu = mean[c];                            \
            const T* gr = g + r * inner; const T* xr = x + r * inner; T* o = out + r * inner;       \
            for (int64_t i = 0; i < inner; ++i)                                                      \
                o[i] = STORE((LOAD(gr[i]) - md - (LOAD(xr[i]) - mu) * a1) * a2);                    \
        })                                                                                           \
    }                                                                                                \
}

#define SAME(v) (v)
#define TO_F16(v) ((_Float16)(v))
#define FROM_F16(v) ((float)(v))
ELEMT(elemt_f32, float, float, SAME, SAME)
ELEMT(elemt_f64, double, double, SAME, SAME)
ELEMT(elemt_bf16, uint16_t, float, bf16_load, bf16_store)
ELEMT(elemt_f16, _Float16, float, FROM_F16, TO_F16)

/* The forward's output, y = (x - mean) * k + b per channel with k = invstd * weight (invstd where
   there is no weight) and b = bias (0 where there is none): the formula of ATen's CUDA
   batch_norm_elemt (batch_norm_transform_input_kernel), with the two factors multiplied once per
   channel; computed in ACC, rounded once to the input's dtype. Layout as ELEMT's. */
#define AFFINE(NAME, T, ACC, LOAD, STORE)                                                             \
CLONES void NAME(const T* x, T* out, const ACC* mean, const ACC* invstd, const ACC* weight, const ACC* bias, \
                 int64_t C, int64_t inner, int64_t numel, int threads, ACC* coef) {                   \
    ACC* k = coef; ACC* b = coef + C;                                                                 \
    for (int64_t c = 0; c < C; ++c) {                                                                 \
        k[c] = weight ? invstd[c] * weight[c] : invstd[c];                                            \
        b[c] = bias ? bias[c] : (ACC)0;                                                               \
    }                                                                                                 \
    if (inner == 1) {                                                                                 \
        int64_t rows = numel / C;                                                                     \
        PARALLEL_FOR(r, rows, {                                                                       \
            const T* xr = x + r * C; T* o = out + r * C;                                             \
            for (int64_t c = 0; c < C; ++c) o[c] = STORE((LOAD(xr[c]) - mean[c]) * k[c] + b[c]);   \
        })                                                                                            \
    } else {                                                                                          \
        int64_t rows = numel / inner;                                                                 \
        PARALLEL_FOR(r, rows, {                                                                       \
            int64_t c = r % C;                                                                        \
            const ACC mu = mean[c], kc = k[c], bc = b[c];                                             \
            const T* xr = x + r * inner; T* o = out + r * inner;                                     \
            for (int64_t i = 0; i < inner; ++i) o[i] = STORE((LOAD(xr[i]) - mu) * kc + bc);         \
        })                                                                                            \
    }                                                                                                 \
}
AFFINE(affine_f32, float, float, SAME, SAME)
AFFINE(affine_f64, double, double, SAME, SAME)
AFFINE(affine_bf16, uint16_t, float, bf16_load, bf16_store)
AFFINE(affine_f16, _Float16, float, FROM_F16, TO_F16)

/* Per-channel mean and biased variance of a contiguous float32 (N, C, inner) tensor, inner > 1:
   ATen's CPU statistics (batch_norm_cpu_collect_stats_contiguous_impl, which
   batch_norm_update_stats runs for this layout) in the same arithmetic -- the sum of x in
   double, mean = (float)(sum / n), then the sum of the float (x - mean) * (x - mean) in
   double, var = (float)sum_sq / (float)n -- but with LANES partial sums per channel, folded
   by a fixed pairwise tree, instead of one: the same values summed in another fixed order
   (ATen's single running sum is latency-bound). One channel per iteration of the parallel
   loop, so the result does not depend on the number of threads. */
#define LANES 32
static inline double fold(double* a) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) a[j] = a[j] + a[j + w];
    return a[0];
}
/* The lanes a sum over n values in lanes 0, 1, ... (value i in lane i % LANES) can reach: the
   smallest power of two >= min(n, LANES). fold_lanes(a, lanes) is fold(a) when every lane from
   `lanes` on is zero: the tree's steps above `lanes` only add those lanes, and a lane that starts
   at +0.0 is never -0.0 (in round-to-nearest x + -x and +0.0 + -0.0 are +0.0), so adding it
   changes no bit. A small layer so folds a few lanes, not 32. */
static inline int lanes_for(int64_t n) {
    int lanes = 1;
    while (lanes < LANES && lanes < n) lanes *= 2;
    return lanes;
}
static inline double fold_lanes(double* a, int lanes) {
    for (int w = lanes / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) a[j] = a[j] + a[j + w];
    return a[0];
}

CLONES void stats_f32(const float* x, float* mean_out, float* var_out, int64_t C, int64_t inner, int64_t numel,
                      int threads) {
    int64_t batch = numel / (C * inner), n = batch * inner, body = inner - inner % LANES;
    const int lanes = lanes_for(inner);  /* value i of a sample's channel goes to lane i % LANES */
    PARALLEL_FOR(c, C, {
        double acc[LANES] = {0};
        for (int64_t b = 0; b < batch; ++b) {
            const float* xr = x + (b * C + c) * inner;
            for (int64_t i = 0; i < body; i += LANES)
                for (int j = 0; j < LANES; ++j) acc[j] += (double)xr[i + j];
            for (int64_t i = body; i < inner; ++i) acc[i - body] += (double)xr[i];
        }
        float mean = (float)(fold_lanes(acc, lanes) / (double)n);
        for (int j = 0; j < lanes; ++j) acc[j] = 0;
        for (int64_t b = 0; b < batch; ++b) {
            const float* xr = x + (b * C + c) * inner;
            for (int64_t i = 0; i < body; i += LANES)
                for (int j = 0; j < LANES; ++j) { float d = xr[i + j] - mean; acc[j] += (double)(d * d); }
            for (int64_t i = body; i < inner; ++i) { float d = xr[i] - mean; acc[i - body] += (double)(d * d); }
        }
        mean_out[c] = mean;
        var_out[c] = (float)fold_lanes(acc, lanes) / (float)n;
    })
}

/* The same statistics of a channels-last float32 input, (rows, C) row-major with rows = N * H * W:
   per channel the sum of x in double over LANES partial sums (row r in lane r % LANES), folded as
   above, mean = (float)(sum / n), then the float (x - mean)^2 summed so, var = (float)sum / (float)n.
   Rows are read whole, CL_BLOCK channels at a time (partial sums laid out lane-major, so the loop
   over a row's channels is vectorized); one block per iteration of the parallel loop, so the result
   does not depend on the number of threads (ATen's channels-last statistics do). */
#define CL_BLOCK 16
CLONES void stats_f32_cl(const float* x, float* mean_out, float* var_out, int64_t C, int64_t rows, int threads) {
    int64_t blocks = (C + CL_BLOCK - 1) / CL_BLOCK;
    const int lanes = lanes_for(rows);  /* row r goes to lane r % LANES */
    PARALLEL_FOR(blk, blocks, {
        int64_t c0 = blk * CL_BLOCK, width = C - c0 < CL_BLOCK ? C - c0 : CL_BLOCK;
        double acc[LANES][CL_BLOCK], lane_sums[LANES];
        float mean[CL_BLOCK];
        memset(acc, 0, sizeof(acc[0]) * lanes);
        for (int64_t r = 0; r < rows; ++r) {
            const float* xr = x + r * C + c0; double* a = acc[r % LANES];
            for (int64_t k = 0; k < width; ++k) a[k] += (double)xr[k];
        }
        for (int64_t k = 0; k < width; ++k) {
            for (int j = 0; j < lanes; ++j) lane_sums[j] = acc[j][k];
            mean[k] = (float)(fold_lanes(lane_sums, lanes) / (double)rows);
        }
        memset(acc, 0, sizeof(acc[0]) * lanes);
        for (int64_t r = 0; r < rows; ++r) {
            const float* xr = x + r * C + c0; double* a = acc[r % LANES];
            for (int64_t k = 0; k < width; ++k) { float d = xr[k] - mean[k]; a[k] += (double)(d * d); }
        }
        for (int64_t k = 0; k < width; ++k) {
            for (int j = 0; j < lanes; ++j) lane_sums[j] = acc[j][k];
            mean_out[c0 + k] = mean[k];
            var_out[c0 + k] = (float)fold_lanes(lane_sums, lanes) / (float)rows;
        }
    })
}

/* The backward's local sums per channel, sum_dy = sum(g) and sum_dy_xmu = sum(g * (x - mean)): the
   sums of ATen's CUDA batch_norm_backward_reduce, in double over LANES partial sums folded as the
   statistics' (x - mean in ACC, its product with g in double), rounded once to ACC. Contiguous (N, C, inner): one channel per iteration of the parallel loop;
   channels last (inner = 1): CL_BLOCK channels per iteration, row r in lane r % LANES. The result
   does not depend on the number of threads. */
#define REDUCE(NAME, T, ACC, LOAD)                                                                    \
CLONES void NAME(const T* g, const T* x, const ACC* mean, ACC* sum_dy, ACC* sum_dy_xmu, int64_t C,        \
                 int64_t inner, int64_t numel, int threads) {                                         \
    if (inner == 1) {                                                                                 \
        int64_t rows = numel / C, blocks = (C + CL_BLOCK - 1) / CL_BLOCK;                             \
        const int lanes = lanes_for(rows);                                                            \
        PARALLEL_FOR(blk, blocks, {                                                                   \
            int64_t c0 = blk * CL_BLOCK, width = C - c0 < CL_BLOCK ? C - c0 : CL_BLOCK;               \
            double s1[LANES][CL_BLOCK], s2[LANES][CL_BLOCK], lane_sums[LANES];                        \
            memset(s1, 0, sizeof(s1[0]) * lanes);                                                     \
            memset(s2, 0, sizeof(s2[0]) * lanes);                                                     \
            for (int64_t r = 0; r < rows; ++r) {                                                      \
                const T* gr = g + r * C + c0; const T* xr = x + r * C + c0;                           \
                double* a1 = s1[r % LANES]; double* a2 = s2[r % LANES];                               \
                for (int64_t k = 0; k < width; ++k) {                                                 \
                    ACC gv = LOAD(gr[k]), d = LOAD(xr[k]) - mean[c0 + k];                            \
                    a1[k] += (double)gv; a2[k] += (double)gv * (double)d;                             \
                }                                                                                     \
            }                                                                                         \
            for (int64_t k = 0; k < width; ++k) {                                                     \
                for (int j = 0; j < lanes; ++j) lane_sums[j] = s1[j][k];                              \
                sum_dy[c0 + k] = (ACC)fold_lanes(lane_sums, lanes);                                   \
                for (int j = 0; j < lanes; ++j) lane_sums[j] = s2[j][k];                              \
                sum_dy_xmu[c0 + k] = (ACC)fold_lanes(lane_sums, lanes);                               \
            }                                                                                         \
        })                                                                                            \
        return;                                                                                       \
    }                                                                                                 \
    int64_t batch = numel / (C * inner), body = inner - inner % LANES;                                \
    const int lanes = lanes_for(inner);                                                               \
    PARALLEL_FOR(c, C, {                                                                              \
        double a1[LANES] = {0}, a2[LANES] = {0};                                                      \
        const ACC mu = mean[c];                                                                       \
        for (int64_t b = 0; b < batch; ++b) {                                                         \
            const T* gr = g + (b * C + c) * inner; const T* xr = x + (b * C + c) * inner;             \
            for (int64_t i = 0; i < body; i += LANES)                                                 \
                for (int j = 0; j < LANES; ++j) {                                                     \
                    ACC gv = LOAD(gr[i + j]), d = LOAD(xr[i + j]) - mu;                               \
                    a1[j] += (double)gv; a2[j] += (double)gv * (double)d;                             \
                }                                                                                     \
            for (int64_t i = body; i < inner; ++i) {                                                  \
                ACC gv = LOAD(gr[i]), d = LOAD(xr[i]) - mu;                                           \
                a1[i - body] += (double)gv; a2[i - body] += (double)gv * (double)d;                   \
            }                                                                                         \
        }                                                                                             \
        sum_dy[c] = (ACC)fold_lanes(a1, lanes);                                                       \
        sum_dy_xmu[c] = (ACC)fold_lanes(a2, lanes);                                                   \
    })                                                                                                \
}
REDUCE(reduce_f32, float, float, SAME)
REDUCE(reduce_f64, double, double, SAME)
REDUCE(reduce_bf16, uint16_t, float, bf16_load)
REDUCE(reduce_f16, _Float16, float, FROM_F16)

/* CBN's per-channel step in float32: distnorm._composite.cbn_plan_composite's formulas in its
   order of operations, one loop over the channels instead of some thirty ATen calls (the
   Triton kernel of distnorm/_triton.py is the same program for CUDA). count: the device's
   per-channel count, or NULL for the host's (host_n, bessel); eta: NULL without history. */
static inline float lerp_f(float start, float end, float weight) {  /* ATen's lerp (Lerp.h) */
    return fabsf(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}
static inline float clamp_f(float x, float lo, float hi) {  /* torch.clamp: NaN stays NaN */
    if (x != x) return x;
    return x < lo ? lo : (x > hi ? hi : x);
}
void cbn_plan_f32(const float* mean, const float* var, const float* count, const float* weight, const float* bias,
                  const float* eta_ptr, float* amat_mean, float* amat_var, uint8_t* amat_init, float* run_mean,
                  float* run_var, int64_t* nbt, float* center_out, float* var_u_out, float* invstd_out, float* a_out,
                  float* coef, float* beta_coef, int64_t C, float host_n, float bessel, float eps, int cumulative,
                  float momentum, float inv_rho, int scale_a, float r_min, float r_max) {
    int valid = count ? count[0] > 1.0f : 1;
    int initialized = amat_init[0] != 0;
    int64_t nbt_new = nbt[0] + valid;
    float steps = (float)nbt_new;
    float run_weight = cumulative ? 1.0f / (steps > 1.0f ? steps : 1.0f) : momentum;
    float eta = eta_ptr ? eta_ptr[0] : 0.0f;
    for (int64_t c = 0; c < C; ++c) {
        float mu_b = mean[c], var_x = var[c], beta = bias[c], gamma = weight[c];
        float mu_u, d, var_u, invstd, q, r_mu, center, w;
        if (eta_ptr) {
            float mu_a = initialized ? amat_mean[c] : mu_b;
            float var_a = initialized ? amat_var[c] : var_x + beta * beta;
            float delta = mu_a - mu_b;
            mu_u = mu_b + delta * eta;
            d = beta - delta * eta;
            float var_b = var_x + d * d;
            var_u = lerp_f(var_b, var_a, eta);
            float inv_s = 1.0f / sqrtf(var_b + eps);
            invstd = 1.0f / sqrtf(var_u + eps);
            float r_sig = clamp_f(inv_s / invstd, r_min, r_max);
            q = r_sig * inv_s;
            float ratio = mu_u / mu_b;
            int meaningful = ratio > 0.0f && (var_x + (-100.0f * mu_b) * mu_b) < -eps;
            r_mu = meaningful ? clamp_f(ratio, r_min, r_max) : 1.0f;
            center = mu_u - beta;
            w = center + r_mu * d;
        } else {
            mu_u = mu_b; d = beta; r_mu = 1.0f;
            var_u = var_x + beta * beta;
            invstd = q = 1.0f / sqrtf(var_u + eps);
            center = mu_b - beta;
            w = mu_b;
        }
        float a = invstd * gamma;
        if (scale_a) a = a * inv_rho;
        float n = count ? count[c] : host_n;
        center_out[c] = center; var_u_out[c] = var_u; invstd_out[c] = invstd; a_out[c] = a;
        coef[c] = r_mu; coef[C + c] = q; coef[2 * C + c] = w; coef[3 * C + c] = n;
        beta_coef[c] = q * d;
        if (valid) {
            amat_mean[c] = mu_u; amat_var[c] = var_u;
            float var_unbiased = var_x * (count ? n / (n - 1.0f) : bessel);
            run_mean[c] = lerp_f(run_mean[c], mu_b, run_weight);
            run_var[c] = lerp_f(run_var[c], var_unbiased, run_weight);
        }
    }
    amat_init[0] = (uint8_t)(initialized | valid);
    nbt[0] = nbt_new;
}

/* The backward's per-channel operator (distnorm._composite's backward_sums_composite), float32: from the local
   S1, T and grad_coef = [[r_mu, q], [w, n]]: sums = [r_mu S1, q T], dgamma = T inv_rho,
   dbeta = (S1 - beta_coef T) a, w, and the count as int32. */
void backward_sums_f32(const float* s1, const float* t, const float* beta_coef, const float* a, const float* coef,
                       float* sums, float* grad_weight, float* grad_bias, float* w, int32_t* count, int64_t C,
                       float inv_rho) {
    for (int64_t c = 0; c < C; ++c) {
        sums[c] = coef[c] * s1[c];
        sums[C + c] = coef[C + c] * t[c];
        grad_weight[c] = t[c] * inv_rho;
        grad_bias[c] = (s1[c] + (-1.0f * beta_coef[c]) * t[c]) * a[c];
        w[c] = coef[2 * C + c];
    }
    count[0] = (int32_t)coef[3 * C];
}

/* BNP's gradient transform (distnorm._composite.bnp_precondition) in one pass over the weight
   gradient instead of ATen's five: per output channel d, input channel p of its group, kernel
   position k (row d of the dense (C_out, per_group * kernel) gradient),
       new_w[d, p, k] = (gw[d, p, k] - mu[p] * gb[d]) / (vt[p] * q2)
       new_b[d]       = gb[d] / q2 - sum_{p, k} mu[p] * new_w[d, p, k]
   (without a bias only new_w = gw / (vt[p] * q2)). table: 2 * C_in * kernel scratch values, mu and
   vt * q2 repeated per kernel position, so that each row is one vectorizable loop. The bias's sum is
   taken in double, LANES partial sums folded in a fixed order: the same bits at every vector width
   and thread count (one row per iteration of the parallel loop). */
#define PRECONDITION(NAME, T)                                                                         \
CLONES void NAME(const T* gw, const T* gb, const T* mu, const T* vt, T q2, T* out_w, T* out_b, T* table,   \
                 int64_t out_ch, int64_t in_ch, int64_t per_group, int64_t kernel, int64_t groups,         \
                 int threads) {                                                                        \
    const int64_t row_len = per_group * kernel, rows_per_group = out_ch / groups, size = in_ch * kernel; \
    T* mu_k = table; T* den_k = table + size;                                                         \
    for (int64_t c = 0; c < in_ch; ++c) {                                                             \
        const T den = vt[c] * q2;                                                                     \
        for (int64_t k = 0; k < kernel; ++k) { mu_k[c * kernel + k] = mu[c]; den_k[c * kernel + k] = den; } \
    }                                                                                                 \
    PARALLEL_FOR(d, out_ch, {                                                                         \
        const T* m = mu_k + (d / rows_per_group) * row_len;                                           \
        const T* den = den_k + (d / rows_per_group) * row_len;                                        \
        const T* src = gw + d * row_len; T* dst = out_w + d * row_len;                                \
        if (!gb) {                                                                                    \
            for (int64_t j = 0; j < row_len; ++j) dst[j] = src[j] / den[j];                           \
            continue;                                                                                 \
        }                                                                                             \
        const T g = gb[d];                                                                            \
        for (int64_t j = 0; j < row_len; ++j) dst[j] = (src[j] - m[j] * g) / den[j];                  \
        double acc[LANES] = {0};                                                                      \
        const int64_t body = row_len - row_len % LANES;                                               \
        for (int64_t i = 0; i < body; i += LANES)                                                     \
            for (int l = 0; l < LANES; ++l) acc[l] += (double)m[i + l] * (double)dst[i + l];           \
        for (int64_t i = body; i < row_len; ++i) acc[i - body] += (double)m[i] * (double)dst[i];      \
        out_b[d] = (T)((double)(g / q2) - fold(acc));                                                 \
    })                                                                                                \
}
PRECONDITION(bnp_precondition_f32, float)
PRECONDITION(bnp_precondition_f64, double)
