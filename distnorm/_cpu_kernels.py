"""The CPU kernels of distnorm: the backward's element-wise pass (ATen's CUDA
``batch_norm_backward_elemt``, which the CPU does not have), the forward's statistics
(ATen's own arithmetic, in fewer cycles), CBN's per-channel steps (``cbn_plan``,
``backward_sums``: the Triton kernels' programs, one loop each instead
of some thirty ATen calls on C-sized vectors), and BNP's gradient transform
(``bnp_precondition``: one pass over the weight gradient instead of ATen's five).

A synchronized layer's input gradient is, per channel ``c`` (module plan of
:mod:`distnorm._functions`)::

    dx = (g - sum_dy / n - (x - mean) * invstd^2 * sum_dy_xmu / n) * weight * invstd

— the formula of ATen's CUDA kernel (``batch_norm_backward_elemt_kernel_impl`` in
``aten/src/ATen/native/cuda/Normalization.cuh``), with ``n`` the sum of the int32 ``count``
tensor. On CUDA the layers call that kernel; on the CPU ATen has it only as two passes
(an affine map of ``x``, then ``addcmul_`` of ``g``: 5 activation passes instead of 3), so
this module builds the same kernel in C, once per machine, and declares it as the operator
``distnorm::batch_norm_backward_elemt`` with ATen's schema (:mod:`distnorm._functions`).

The C source computes in the order of the CUDA kernel (``norm = 1 / n``; ``m_dy = sum_dy *
norm``; ``k1 = invstd * invstd * sum_dy_xmu * norm``; ``k2 = weight * invstd``; then ``(g -
m_dy - (x - mean) * k1) * k2``) in float32 for float32 / bfloat16 / float16 input (rounded
once to the input's dtype, round-to-nearest-even) and in float64 for float64, and is
compiled with ``-ffp-contract=off``: no fused multiply-add, so every machine and every rank
computes the same bits whatever its vector width.

The statistics. ATen's CPU ``batch_norm_update_stats`` computes a contiguous float32 input's
per-channel mean and variance as one running double sum per channel, a chain of dependent
additions that takes several times as long as reading the input (``nn.BatchNorm2d``'s
training forward runs the same loop; the profile: ``docs/reference/benchmarks.md``).
``stats_f32`` computes the same quantities in the same precisions (sum of ``x`` in double,
``mean`` rounded to float, the float ``(x - mean)^2`` summed in double) with 32 partial sums
per channel folded in a fixed order, and is declared as ``distnorm::batch_norm_update_stats``
with ATen's schema. The values summed are the same, their order differs: the float results
are ATen's except where a double sum's last bits decide a float rounding (not seen in the
tests). ``stats_f32_cl`` does the same for a channels-last float32 input below ATen's grain
(32,768 values), where ATen's reduction costs a small layer more than the rest of its
statistics step; above it ATen's parallel reduction is the faster (the figures:
``docs/reference/benchmarks.md``). Calls neither covers (other dtypes and sizes, running
buffers) are ATen's, whose channels-last bits change with the number of threads.

Every loop fixes its order of operations in the source, so the versions compiled for each
vector width (``target_clones``: AVX-512, AVX2, baseline) give the same bits.

Build: :data:`SOURCE` with ``$CC`` (default ``cc``) and ``-O3 -fopenmp``, linked with the
operators around it, :data:`CPP_SOURCE` (``distnorm/csrc/cpu_ops.cpp``, compiled by ``$CXX``,
default ``c++``, against the headers of the torch this process imported), into one library
under ``$DISTNORM_CACHE_DIR`` (default ``~/.cache/distnorm``) named by a hash of the sources, the
flags, the compilers and the torch: once per machine and torch (the C++ file reads torch's
headers, which takes most of the build), then each process loads it with
``torch.ops.load_library``. Loaded, its C++ operators take the CPU dispatch key of distnorm's
operators (:mod:`distnorm._ops`), so a call goes from the dispatcher to the loop with no Python
between, where Python wrappers behind the dispatcher cost a CBN step a large part of its host
time (the build's and the step's figures: ``docs/reference/benchmarks.md``). OpenMP's runtime is the one torch already loaded
(``libgomp.so.1``), with ``torch.get_num_threads()`` threads from ATen's grain (32,768 values)
up, one below it.

``DISTNORM_CPU_KERNEL``: ``1`` (default) these kernels; ``0`` ATen's two passes for the
backward and ATen's statistics (the same maths, rounded otherwise: use it on every rank or
none). Which kernels a synchronized layer runs is agreed by its group at the group's first
step (:func:`distnorm._kernel_choice.cpu_kernel_decision`): every rank builds or loads the C kernels
for its vote before using them, and that step's statistics are ATen's on every rank. A rank
without a C or C++ compiler, or whose build fails, is named by every rank, which all raise at that
collective — never a wait for the timeout, never a quiet fallback to other arithmetic on
some ranks. A layer without a group reads the setting at each call and builds the kernels at
its first use.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["BINDINGS_SOURCE", "CPP_SOURCE", "SOURCE", "check_precondition_arguments", "cpu_kernel_enabled", "library",
           "memory_format", "when_loaded"]

SOURCE = r"""
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
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                            \
        for (int64_t r = 0; r < rows; ++r) {                                                         \
            const T* gr = g + r * C; const T* xr = x + r * C; T* o = out + r * C;                   \
            for (int64_t c = 0; c < C; ++c)                                                          \
                o[c] = STORE((LOAD(gr[c]) - m_dy[c] - (LOAD(xr[c]) - mean[c]) * k1[c]) * k2[c]);     \
        }                                                                                            \
    } else {                                                                                         \
        int64_t rows = numel / inner;                                                                \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                            \
        for (int64_t r = 0; r < rows; ++r) {                                                         \
            int64_t c = r % C;                                                                       \
            const ACC md = m_dy[c], a1 = k1[c], a2 = k2[c], mu = mean[c];                            \
            const T* gr = g + r * inner; const T* xr = x + r * inner; T* o = out + r * inner;       \
            for (int64_t i = 0; i < inner; ++i)                                                      \
                o[i] = STORE((LOAD(gr[i]) - md - (LOAD(xr[i]) - mu) * a1) * a2);                    \
        }                                                                                            \
    }                                                                                                \
}

#define SAME(v) (v)
#define TO_F16(v) ((_Float16)(v))
#define FROM_F16(v) ((float)(v))
ELEMT(elemt_f32, float, float, SAME, SAME)
ELEMT(elemt_f64, double, double, SAME, SAME)
ELEMT(elemt_bf16, uint16_t, float, bf16_load, bf16_store)
ELEMT(elemt_f16, _Float16, float, FROM_F16, TO_F16)

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
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t c = 0; c < C; ++c) {
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
    }
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
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t blk = 0; blk < blocks; ++blk) {
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
    }
}

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
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                 \
    for (int64_t d = 0; d < out_ch; ++d) {                                                            \
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
    }                                                                                                 \
}
PRECONDITION(bnp_precondition_f32, float)
PRECONDITION(bnp_precondition_f64, double)
"""

_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
#: The C++ operators around the C kernels, registered under the CPU dispatch key.
CPP_SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
#: Python's calls into the operators through the dispatcher's typed handles (the module
#: :func:`library` imports from the same library).
BINDINGS_SOURCE = Path(__file__).with_name("csrc") / "bindings.cpp"
#: The Python module's name, ``PYBIND11_MODULE(_cpu_ops, ...)`` in :data:`BINDINGS_SOURCE`.
_BINDINGS = "distnorm._cpu_ops"


def cpu_kernel_enabled() -> bool:
    """``DISTNORM_CPU_KERNEL`` is not ``0``: the backward's element-wise pass runs this kernel."""
    return os.environ.get("DISTNORM_CPU_KERNEL", "1").strip() != "0"


def _cache_dir() -> Path:
    root = os.environ.get("DISTNORM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "distnorm")
    return Path(root)


def _failure(why: str) -> RuntimeError:
    return RuntimeError(
        f"distnorm: the CPU kernel of the backward's element-wise pass cannot be built: {why}. Install a C and "
        "C++ compiler (gcc / g++ or clang; set CC and CXX to choose them), or set DISTNORM_CPU_KERNEL=0 on every "
        "rank to run ATen's two passes instead (the same maths, rounded twice).")


def _compilers() -> tuple[str, str]:
    """The C and C++ compilers (``$CC``, default ``cc``; ``$CXX``, default ``c++``)."""
    found = []
    for variable, default, language in (("CC", "cc", "C"), ("CXX", "c++", "C++")):
        compiler = shutil.which(os.environ.get(variable, default))
        if compiler is None:
            raise _failure(f"no {language} compiler ({os.environ.get(variable, default)!r} is not on PATH)")
        found.append(compiler)
    return found[0], found[1]


def _torch_flags() -> list[str]:
    """What a C++ file needs to include torch's and Python's headers (the paths, C++ standard and
    ABI of ``torch.utils.cpp_extension``, which is not imported: it looks for CUDA at import)."""
    root = Path(torch.__file__).parent
    return ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}"]


def _link_flags() -> list[str]:
    """What the library links against: the torch this process imported."""
    lib = Path(torch.__file__).parent / "lib"
    return [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch_python"]


def _run_all(commands: list[list[str]]) -> None:
    """Run ``commands`` side by side (the C++ files take most of the build); raise for the first
    that fails."""
    running = [(command, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
               for command in commands]
    finished = [(command, process, process.communicate()[1]) for command, process in running]
    for command, process, stderr in finished:
        if process.returncode != 0:
            raise _failure(f"{command[0]} failed (exit status {process.returncode})" + (
                f":\n{stderr.strip()[-2000:]}\n" if stderr.strip() else ""))


def _build(cc: str, cxx: str, target: Path) -> None:
    """Compile :data:`SOURCE` (C), :data:`CPP_SOURCE` and :data:`BINDINGS_SOURCE` (C++) into the
    shared library ``target`` (atomically: concurrent processes may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "kernels.c", Path(tmp) / target.name
        objects = [Path(tmp) / name for name in ("kernels.o", "cpu_ops.o", "bindings.o")]
        src.write_text(SOURCE)
        _run_all([[cc, *_FLAGS, "-c", str(src), "-o", str(objects[0])],
                  [cxx, *_FLAGS, *_torch_flags(), "-c", str(CPP_SOURCE), "-o", str(objects[1])],
                  [cxx, *_FLAGS, *_torch_flags(), "-c", str(BINDINGS_SOURCE), "-o", str(objects[2])]])
        _run_all([[cxx, *_FLAGS, "-shared", *map(str, objects), "-o", str(lib), *_link_flags()]])
        os.replace(lib, target)


#: Called with the bindings module once the library is loaded (:func:`when_loaded`).
_HOOKS: list[Callable[[ModuleType], None]] = []


def when_loaded(hook: Callable[[ModuleType], None]) -> None:
    """Call ``hook(bindings)`` once :func:`library` has loaded the library (at once if it has):
    ``bindings`` is the module of :data:`BINDINGS_SOURCE`, one function per operator. How
    :mod:`distnorm._ops`, which declares the operators, learns of their faster calls without this
    module importing it."""
    _HOOKS.append(hook)
    if library.cache_info().currsize:
        hook(sys.modules[_BINDINGS])


def _import_bindings(target: Path) -> ModuleType:
    """The Python module of :data:`BINDINGS_SOURCE` in the loaded library ``target``."""
    spec = importlib.util.spec_from_file_location(_BINDINGS, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_BINDINGS] = module
    return module


@functools.cache
def library() -> Path:
    """Build this machine's kernels at their first call, load them into this process once
    (their C++ operators then take the CPU dispatch key of distnorm's operators:
    :mod:`distnorm._ops`; the bindings module goes to the :func:`when_loaded` hooks), and return
    the library's path. Raises, naming the fix, where they cannot be built."""
    cc, cxx = _compilers()
    key = hashlib.sha256("\0".join([SOURCE, CPP_SOURCE.read_text(), BINDINGS_SOURCE.read_text(), *_FLAGS,
                                     *_torch_flags(), *_link_flags(), cc, cxx, sys.platform, sys.version,
                                     torch.__version__, torch.__file__]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu-ops-{key}.so"
    if not target.exists():
        # The one step that takes a while (tens of seconds, once per machine and torch): said, not silent.
        logger.info("distnorm: building the CPU kernels into %s (once per machine and torch version)", target)
        try:
            _build(cc, cxx, target)
        except OSError:  # an unwritable cache: this process's own temporary directory
            target = Path(tempfile.gettempdir()) / f"distnorm-{os.getuid()}" / target.name
            if not target.exists():
                _build(cc, cxx, target)
    torch.ops.load_library(str(target))
    bindings = _import_bindings(target)
    for hook in _HOOKS:
        hook(bindings)
    return target


def memory_format(t: Tensor) -> torch.memory_format:
    """``t``'s layout: channels_last(_3d) for a tensor laid out so and not also contiguous."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def check_precondition_arguments(grad_weight: torch.Tensor, grad_bias: torch.Tensor | None, mean: torch.Tensor,
                                 var_t: torch.Tensor, groups: int) -> None:
    """Raise ``ValueError`` unless the arguments of BNP's transform fit together (shapes as in
    :func:`distnorm._composite.bnp_precondition`): the check of its ATen calls and of the
    C kernel :func:`bnp_precondition`, which reads raw pointers."""
    in_channels = mean.numel()
    if (grad_weight.dim() < 2 or groups < 1 or grad_weight.shape[0] % groups
            or in_channels != groups * grad_weight.shape[1] or var_t.numel() != in_channels
            or (grad_bias is not None and grad_bias.numel() != grad_weight.shape[0])):
        raise ValueError(
            f"bnp_precondition: weight gradient of shape {tuple(grad_weight.shape)}, bias gradient of "
            f"{None if grad_bias is None else grad_bias.numel()} values and {in_channels} / {var_t.numel()} "
            f"input-channel moments do not match in {groups} group(s)")
