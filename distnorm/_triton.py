"""CUDA kernels of the fused per-channel steps and of BNP's gradient transform
(:mod:`distnorm._kernels`), in Triton.

In the per-channel steps one program walks every channel in blocks, so the scalars a step
also updates (the AMAT flag, ``num_batches_tracked``) are read before and written after every
channel in the same program: no race between programs, a barrier between the program's warps
before the scalars are stored, and one launch per step. BNP's transform runs one program per
output channel (its row of the weight gradient, and its bias's row sum). Each launch runs on its tensors' device
(``torch.cuda.device``), whatever the current device is. Each kernel is the
composite of :mod:`distnorm._composite` written element-wise, in the same order of operations
(``torch.lerp``'s two-sided formula included; the transform's row sum in its own order);
``tests/test_fused.py`` and ``tests/test_bnp.py`` run every kernel through Triton's
interpreter on the CPU against the composite.

This module imports Triton; :mod:`distnorm._kernels` imports it only where a CUDA tensor
meets a supported case, so a machine without Triton never loads it.
"""


import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "KERNELS", "backward_sums", "bnp_precondition", "cbn_plan", "group_norm", "group_norm_backward"]

#: Channels per block of the single program (a power of two; C > BLOCK loops).
BLOCK = 1024


@triton.jit
def _lerp(start, end, weight):
    """``torch.lerp`` (ATen's ``lerp`` in ``Lerp.h``): the formula switches at 0.5."""
    return tl.where(tl.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


@triton.jit
def _clamp(x, lo, hi):
    """``torch.clamp``: NaN stays NaN (compiled ``tl.maximum`` / ``tl.minimum`` would drop it)."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _add(a, b):
    """The combine of a sum (``tl.sum`` is a Triton helper in Triton's language module, which
    the interpreter of :func:`distnorm._kernels.load_interpreted` does not run)."""
    return a + b


# A Triton kernel takes each tensor as a pointer, so its parameters are the step's tensors one
# by one; and it is one program, every channel block and the scalars' update in one launch
# (the launch is what it exists to save), so it is as long as the composite it mirrors.
@triton.jit
def _cbn_plan_kernel(
    mean_ptr, var_ptr, count_ptr, weight_ptr, bias_ptr, eta_ptr,
    amat_mean_ptr, amat_var_ptr, amat_init_ptr, run_mean_ptr, run_var_ptr, nbt_ptr,
    center_ptr, var_u_ptr, invstd_ptr, a_ptr, coef_ptr, beta_coef_ptr,
    C, host_count, bessel, eps, momentum, inv_rho, r_min, r_max,
    HISTORY: tl.constexpr, DEVICE_COUNT: tl.constexpr, CUMULATIVE: tl.constexpr, SCALE_A: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # The step is valid (its buffers updated) when the global count exceeds 1: known on
    # the host for a host count (the launcher only takes valid host counts), else read
    # from the device count and applied as a mask on every rank, masked or not, so ranks
    # hold bit-identical buffers.
    if DEVICE_COUNT:
        valid = tl.load(count_ptr) > 1.0
    else:
        valid = tl.full((), 1, tl.int1)
    initialized = tl.load(amat_init_ptr) != 0
    nbt = tl.load(nbt_ptr)
    nbt_new = nbt + valid.to(tl.int64)
    if CUMULATIVE:
        run_weight = tl.div_rn(1.0, tl.maximum(nbt_new.to(tl.float32), 1.0))
    else:
        run_weight = momentum
    if HISTORY:
        eta = tl.load(eta_ptr).to(tl.float32)
    for start in range(0, C, BLOCK_C):
        offs = start + tl.arange(0, BLOCK_C)
        m = offs < C
        mu_b = tl.load(mean_ptr + offs, mask=m, other=1.0)
        var_x = tl.load(var_ptr + offs, mask=m, other=1.0)
        beta = tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32)
        gamma = tl.load(weight_ptr + offs, mask=m, other=0.0).to(tl.float32)
        amat_mean = tl.load(amat_mean_ptr + offs, mask=m, other=0.0)
        amat_var = tl.load(amat_var_ptr + offs, mask=m, other=1.0)
        if DEVICE_COUNT:
            n = tl.load(count_ptr + offs, mask=m, other=2.0)
        if HISTORY:
            mu_a = tl.where(initialized, amat_mean, mu_b)
            var_a = tl.where(initialized, amat_var, var_x + beta * beta)
            delta = mu_a - mu_b
            mu_u = mu_b + delta * eta
            d = beta - delta * eta
            var_b = var_x + d * d
            var_u = _lerp(var_b, var_a, eta)
            inv_s = tl.div_rn(1.0, tl.sqrt_rn(var_b + eps))
            invstd = tl.div_rn(1.0, tl.sqrt_rn(var_u + eps))
            r_sig = _clamp(tl.div_rn(inv_s, invstd), r_min, r_max)
            q = r_sig * inv_s
            ratio = tl.div_rn(mu_u, mu_b)
            meaningful = (ratio > 0) & ((var_x - 100.0 * mu_b * mu_b) < -eps)
            r_mu = tl.where(meaningful, _clamp(ratio, r_min, r_max), 1.0)
            center = mu_u - beta
            w = center + r_mu * d
        else:
            mu_u = mu_b
            d = beta
            r_mu = 1.0
            var_u = var_x + beta * beta
            invstd = tl.div_rn(1.0, tl.sqrt_rn(var_u + eps))
            q = invstd
            center = mu_b - beta
            w = mu_b
        a = invstd * gamma
        if SCALE_A:
            a = a * inv_rho
        if not DEVICE_COUNT:
            n = host_count
        tl.store(center_ptr + offs, center, mask=m)
        tl.store(var_u_ptr + offs, var_u, mask=m)
        tl.store(invstd_ptr + offs, invstd, mask=m)
        tl.store(a_ptr + offs, a, mask=m)
        # grad_coef (2, 2, C) = [[r_mu, q], [w, n]]
        tl.store(coef_ptr + offs, r_mu + 0.0 * q, mask=m)  # r_mu may be the scalar 1.0: a block
        tl.store(coef_ptr + C + offs, q, mask=m)
        tl.store(coef_ptr + 2 * C + offs, w, mask=m)
        tl.store(coef_ptr + 3 * C + offs, n + 0.0 * q, mask=m)
        tl.store(beta_coef_ptr + offs, q * d, mask=m)
        # AMAT buffers <- (mu_U, var_U); running statistics (unbiased, global count).
        tl.store(amat_mean_ptr + offs, tl.where(valid, mu_u, amat_mean), mask=m)
        tl.store(amat_var_ptr + offs, tl.where(valid, var_u, amat_var), mask=m)
        if DEVICE_COUNT:
            var_unbiased = var_x * tl.div_rn(n, n - 1.0)
        else:
            var_unbiased = var_x * bessel
        run_mean = tl.load(run_mean_ptr + offs, mask=m, other=0.0)
        run_var = tl.load(run_var_ptr + offs, mask=m, other=1.0)
        tl.store(run_mean_ptr + offs, tl.where(valid, _lerp(run_mean, mu_b, run_weight), run_mean), mask=m)
        tl.store(run_var_ptr + offs, tl.where(valid, _lerp(run_var, var_unbiased, run_weight), run_var), mask=m)
    # Every thread of the program loaded the two scalars at entry; the stores below come
    # from one thread, so wait until all warps are past the loop (and so past those loads).
    tl.debug_barrier()
    tl.store(amat_init_ptr, initialized | valid)
    tl.store(nbt_ptr, nbt_new)


@triton.jit  # its tensors as pointers, one by one (as _cbn_plan_kernel)
def _backward_sums_kernel(s1_ptr, t_ptr, beta_coef_ptr, a_ptr, coef_ptr, sums_ptr, grad_w_ptr, grad_b_ptr, w_ptr,
                          count_ptr, C, inv_rho, BLOCK_C: tl.constexpr):
    for start in range(0, C, BLOCK_C):
        offs = start + tl.arange(0, BLOCK_C)
        m = offs < C
        s1 = tl.load(s1_ptr + offs, mask=m, other=0.0)
        t = tl.load(t_ptr + offs, mask=m, other=0.0)
        beta_coef = tl.load(beta_coef_ptr + offs, mask=m, other=0.0)
        a = tl.load(a_ptr + offs, mask=m, other=0.0)
        r_mu = tl.load(coef_ptr + offs, mask=m, other=0.0)
        q = tl.load(coef_ptr + C + offs, mask=m, other=0.0)
        w = tl.load(coef_ptr + 2 * C + offs, mask=m, other=0.0)
        tl.store(sums_ptr + offs, r_mu * s1, mask=m)
        tl.store(sums_ptr + C + offs, q * t, mask=m)
        tl.store(grad_w_ptr + offs, t * inv_rho, mask=m)
        tl.store(grad_b_ptr + offs, (s1 - beta_coef * t) * a, mask=m)
        tl.store(w_ptr + offs, w, mask=m)
    tl.store(count_ptr, tl.load(coef_ptr + 3 * C).to(tl.int32))


@triton.jit
def _bnp_precondition_kernel(gw_ptr, gb_ptr, mu_ptr, vt_ptr, q2_ptr, out_w_ptr, out_b_ptr, row_len, kernel_size,
                             rows_per_group, per_group, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per output channel d: its row of the dense (C_out, per_group * kernel)
    # gradient in blocks, the bias's row sum in float32 lanes reduced in a fixed tree (the
    # same bits at every launch). Input channel of row position j: first + j // kernel_size.
    d = tl.program_id(0).to(tl.int64)
    q2 = tl.load(q2_ptr).to(tl.float32)
    first = (d // rows_per_group) * per_group
    row = d * row_len
    if HAS_BIAS:
        g = tl.load(gb_ptr + d).to(tl.float32)
        acc = tl.full([BLOCK_K], 0.0, tl.float32)
    for start in range(0, row_len, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        m = offs < row_len
        p = first + offs // kernel_size
        den = tl.load(vt_ptr + p, mask=m, other=1.0) * q2
        src = tl.load(gw_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            mu = tl.load(mu_ptr + p, mask=m, other=0.0)
            new = tl.div_rn(src - mu * g, den)
            acc += mu * new  # masked lanes: mu = 0
        else:
            new = tl.div_rn(src, den)
        tl.store(out_w_ptr + row + offs, new.to(out_w_ptr.dtype.element_ty), mask=m)
    if HAS_BIAS:
        tl.store(out_b_ptr + d, (tl.div_rn(g, q2) - tl.reduce(acc, 0, _add)).to(out_b_ptr.dtype.element_ty))


# GroupNorm in the input's own layout and dtype (distnorm._gn_kernels.group_norm_cuda says when).
# The input is read as (N, C, S), S the spatial positions, through its strides: NCHW has
# (C S, S, 1), channels_last (S C, 1, C). Each pass tiles one sample's (S, C) plane into
# slices of `rows` positions by blocks of BLOCK_C channels, a program each (grid (N, slices,
# channel blocks)), so a channels_last row of channels is read in one coalesced piece and a
# sample is spread over many programs. Sums are float32 and in a fixed order (no atomics):
# the same bits at every launch.
@triton.jit
def _gn_tile(ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S: tl.constexpr,
             BLOCK_C: tl.constexpr):
    """Offsets and mask of the tile of positions ``r0 + [0, BLOCK_S)`` (within slice ``sl``)
    and channel block ``cb`` of sample ``n``."""
    r = r0 + tl.arange(0, BLOCK_S)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    end = tl.minimum((sl + 1) * rows, S)
    mask = (r < end)[:, None] & (c < C)[None, :]
    offs = n * stride_n + r[:, None].to(tl.int64) * stride_s + c[None, :].to(tl.int64) * stride_c
    return ptr + offs, mask


@triton.jit
def _gn_channels(mean_ptr, rstd_ptr, w_ptr, n, cb, C, G, HAS_W: tl.constexpr, BLOCK_C: tl.constexpr):
    """Channel block ``cb`` of sample ``n``: its channels, their mask, their groups' index
    into the ``(N, G)`` statistics, each channel's group mean and ``rstd * w``."""
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    grp = n * G + c // (C // G)
    mean = tl.load(mean_ptr + grp, mask=cm, other=0.0)
    scale = tl.load(rstd_ptr + grp, mask=cm, other=0.0)
    if HAS_W:
        scale = scale * tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    return c, cm, grp, mean, scale


@triton.jit
def _group_norm_moments_kernel(x_ptr, part_ptr, C, S, stride_n, stride_c, stride_s, rows,
                               BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # Per channel of the slice: (mean, M2) over its positions, tile by tile with Chan's update
    # (no sum of squares, whose cancellation float32 could not afford).
    n, sl, cb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mean = tl.full([BLOCK_C], 0.0, tl.float32)
    m2 = tl.full([BLOCK_C], 0.0, tl.float32)
    count = tl.full((), 0.0, tl.float32)
    start = sl * rows
    end = tl.minimum(start + rows, S)
    for r0 in range(start, end, BLOCK_S):
        ptrs, mask = _gn_tile(x_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        k = tl.minimum(end - r0, BLOCK_S).to(tl.float32)
        tile_mean = tl.reduce(v, 0, _add) / k
        d = tl.where(mask, v - tile_mean[None, :], 0.0)
        total = count + k
        delta = tile_mean - mean
        mean = mean + delta * (k / total)
        m2 = m2 + tl.reduce(d * d, 0, _add) + delta * delta * (count * k / total)
        count = total
    out = part_ptr + (n * tl.num_programs(1) + sl) * 2 * C + c
    tl.store(out, mean, mask=c < C)
    tl.store(out + C, m2, mask=c < C)


@triton.jit
def _group_norm_stats_kernel(part_ptr, mean_ptr, rstd_ptr, C, S, G, slices, rows, eps, inv_m, BLOCK: tl.constexpr):
    # One program per (sample, group): its channels' partials over every slice, merged exactly
    # (the mean of the means by count, then M2 = sum(M2_i + n_i (mean_i - mean)^2)).
    p = tl.program_id(0).to(tl.int64)
    n, g = p // G, p % G
    per_group = C // G
    parts = slices * per_group
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for j0 in range(0, parts, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < parts
        s = j // per_group
        cnt = tl.minimum(rows, S - s * rows).to(tl.float32)
        at = part_ptr + (n * slices + s) * 2 * C + g * per_group + j % per_group
        acc += tl.where(m, cnt * tl.load(at, mask=m, other=0.0), 0.0)
    mean = tl.reduce(acc, 0, _add) * inv_m
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for j0 in range(0, parts, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < parts
        s = j // per_group
        cnt = tl.minimum(rows, S - s * rows).to(tl.float32)
        at = part_ptr + (n * slices + s) * 2 * C + g * per_group + j % per_group
        d = tl.load(at, mask=m, other=0.0) - mean
        acc += tl.where(m, tl.load(at + C, mask=m, other=0.0) + cnt * d * d, 0.0)
    var = tl.reduce(acc, 0, _add) * inv_m
    tl.store(mean_ptr + p, mean)
    tl.store(rstd_ptr + p, tl.div_rn(1.0, tl.sqrt_rn(var + eps)))


@triton.jit
def _group_norm_apply_kernel(x_ptr, y_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, C, S, G, stride_n, stride_c, stride_s,
                             rows, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_S: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    # y = (x - mean) * (rstd * w) + b, the output in its own dtype and the input's strides.
    n, sl, cb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    c, cm, _, mean, scale = _gn_channels(mean_ptr, rstd_ptr, w_ptr, n, cb, C, G, HAS_W, BLOCK_C)
    if HAS_B:
        shift = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    else:
        shift = tl.full([BLOCK_C], 0.0, tl.float32)
    for r0 in range(sl * rows, tl.minimum((sl + 1) * rows, S), BLOCK_S):
        src, mask = _gn_tile(x_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        dst, _ = _gn_tile(y_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        v = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        out = (v - mean[None, :]) * scale[None, :] + shift[None, :]
        tl.store(dst, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_norm_backward_sums_kernel(dy_ptr, x_ptr, mean_ptr, part_ptr, C, S, G, stride_n, stride_c, stride_s, rows,
                                     BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # Per channel of the slice: sum(dy (x - mean)) and sum(dy), centred by the group's mean.
    n, sl, cb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    mean = tl.load(mean_ptr + n * G + c // (C // G), mask=cm, other=0.0)
    dot = tl.full([BLOCK_S, BLOCK_C], 0.0, tl.float32)  # reduced once, after the loop
    total = tl.full([BLOCK_S, BLOCK_C], 0.0, tl.float32)
    for r0 in range(sl * rows, tl.minimum((sl + 1) * rows, S), BLOCK_S):
        xs, mask = _gn_tile(x_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        gs, _ = _gn_tile(dy_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        g = tl.load(gs, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, tl.load(xs, mask=mask, other=0.0).to(tl.float32) - mean[None, :], 0.0)
        dot += g * xc
        total += g
    dot = tl.reduce(dot, 0, _add)
    total = tl.reduce(total, 0, _add)
    out = part_ptr + (n * tl.num_programs(1) + sl) * 2 * C + c
    tl.store(out, dot, mask=cm)
    tl.store(out + C, total, mask=cm)


@triton.jit
def _group_norm_backward_coef_kernel(part_ptr, rstd_ptr, w_ptr, coef_ptr, param_ptr, N, C, G, slices, inv_m,
                                     HAS_W: tl.constexpr, BLOCK_SL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (sample, group): its channels' sums over the slices (a tile of slices by
    # channels at a time), then the input gradient's coefficients, dx = rstd w dy +
    # c2 (x - mean) + c3 with M = C/G * S (inv_m = 1 / M, from the host), c2 = -rstd^3
    # sum_c(w dot) / M and c3 = -rstd sum_c(w total) / M, and each channel's share of the
    # parameters' gradients, (dot rstd, total) (summed over samples afterwards).
    p = tl.program_id(0).to(tl.int64)
    n, g = p // G, p % G
    per_group = C // G
    rstd = tl.load(rstd_ptr + p)
    s1 = tl.full([BLOCK], 0.0, tl.float32)
    s2 = tl.full([BLOCK], 0.0, tl.float32)
    for c0 in range(0, per_group, BLOCK):
        k = c0 + tl.arange(0, BLOCK)
        m = k < per_group
        c = g * per_group + k
        dot = tl.full([BLOCK_SL, BLOCK], 0.0, tl.float32)
        total = tl.full([BLOCK_SL, BLOCK], 0.0, tl.float32)
        for s0 in range(0, slices, BLOCK_SL):
            s = s0 + tl.arange(0, BLOCK_SL)
            tile = (s < slices)[:, None] & m[None, :]
            at = part_ptr + ((n * slices + s[:, None]) * 2) * C + c[None, :]
            dot += tl.load(at, mask=tile, other=0.0)
            total += tl.load(at + C, mask=tile, other=0.0)
        dot_c = tl.reduce(dot, 0, _add)
        total_c = tl.reduce(total, 0, _add)
        if HAS_W:
            w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        else:
            w = tl.where(m, 1.0, 0.0)
        s1 += w * dot_c
        s2 += w * total_c
        tl.store(param_ptr + n * C + c, dot_c * rstd, mask=m)
        tl.store(param_ptr + N * C + n * C + c, total_c, mask=m)
    tl.store(coef_ptr + p, -rstd * rstd * rstd * tl.reduce(s1, 0, _add) * inv_m)
    tl.store(coef_ptr + N * G + p, -rstd * tl.reduce(s2, 0, _add) * inv_m)


@triton.jit
def _group_norm_backward_input_kernel(dy_ptr, x_ptr, dx_ptr, mean_ptr, rstd_ptr, w_ptr, coef_ptr, N, C, S, G,
                                      stride_n, stride_c, stride_s, rows, HAS_W: tl.constexpr,
                                      BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    n, sl, cb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    _, cm, grp, mean, c1 = _gn_channels(mean_ptr, rstd_ptr, w_ptr, n, cb, C, G, HAS_W, BLOCK_C)
    c2 = tl.load(coef_ptr + grp, mask=cm, other=0.0)
    c3 = tl.load(coef_ptr + N * G + grp, mask=cm, other=0.0)
    for r0 in range(sl * rows, tl.minimum((sl + 1) * rows, S), BLOCK_S):
        xs, mask = _gn_tile(x_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        gs, _ = _gn_tile(dy_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        ds, _ = _gn_tile(dx_ptr, n, sl, cb, C, S, stride_n, stride_c, stride_s, rows, r0, BLOCK_S, BLOCK_C)
        g = tl.load(gs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
        out = c1[None, :] * g + c2[None, :] * (v - mean[None, :]) + c3[None, :]
        tl.store(ds, out.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_norm_param_grads_kernel(param_ptr, dw_ptr, db_ptr, N, C, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    # Each channel's shares summed over the samples, BLOCK_N at a time, in a fixed order.
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    dw = tl.full([BLOCK_N, BLOCK], 0.0, tl.float32)
    db = tl.full([BLOCK_N, BLOCK], 0.0, tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        tile = (n < N)[:, None] & m[None, :]
        at = param_ptr + n[:, None].to(tl.int64) * C + c[None, :]
        dw += tl.load(at, mask=tile, other=0.0)
        db += tl.load(at + N * C, mask=tile, other=0.0)
    if HAS_W:
        tl.store(dw_ptr + c, tl.reduce(dw, 0, _add).to(dw_ptr.dtype.element_ty), mask=m)
    if HAS_B:
        tl.store(db_ptr + c, tl.reduce(db, 0, _add).to(db_ptr.dtype.element_ty), mask=m)

#: The compiled kernels by name; tests swap in interpreted ones (``kernels=``).
KERNELS = {"cbn_plan": _cbn_plan_kernel, "backward_sums": _backward_sums_kernel,
           "bnp_precondition": _bnp_precondition_kernel, "group_norm_moments": _group_norm_moments_kernel,
           "group_norm_stats": _group_norm_stats_kernel, "group_norm_apply": _group_norm_apply_kernel,
           "group_norm_backward_sums": _group_norm_backward_sums_kernel,
           "group_norm_backward_coef": _group_norm_backward_coef_kernel,
           "group_norm_backward_input": _group_norm_backward_input_kernel,
           "group_norm_param_grads": _group_norm_param_grads_kernel}


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for the launch: Triton launches on the current CUDA device and
    its current stream, not on its tensors' device (CPU tensors: the interpreter, tests)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _block(channels: int) -> int:
    return min(BLOCK, max(16, triton.next_power_of_2(max(channels, 1))))


def cbn_plan(mean, var, count, weight, bias, eta, buffers, host_count, hyper, momentum, kernels=KERNELS):
    """The CUDA kernel of ``distnorm::cbn_plan`` (the arguments of
    :func:`distnorm._composite.cbn_plan_composite` less ``valid``, a device count's mask being
    the kernel's own, ``count > 1``; float32 accumulation; valid host counts)."""
    weight, bias = weight.contiguous(), bias.contiguous()
    eps, rho, r_max = hyper
    channels = mean.shape[0]
    empty = lambda *shape: torch.empty(shape, dtype=mean.dtype, device=mean.device)  # noqa: E731
    center, var_u, invstd, a, beta_coef = (empty(channels) for _ in range(5))
    grad_coef = empty(2, 2, channels)
    n = float(max(host_count, 1))  # a host count is valid here (> 1); the guard is the composite's
    with _on(mean.device):
        kernels["cbn_plan"][(1,)](
            mean, var, count if count is not None else mean, weight, bias, eta if eta is not None else mean, *buffers,
            center, var_u, invstd, a, grad_coef, beta_coef,
            channels, n, host_count / max(host_count - 1, 1), eps,
            0.0 if momentum is None else momentum, 1.0 / rho, 1.0 / r_max, r_max,
            HISTORY=eta is not None, DEVICE_COUNT=count is not None, CUMULATIVE=momentum is None, SCALE_A=rho != 1.0,
            BLOCK_C=_block(channels),
        )
    return center, var_u, invstd, a, grad_coef, beta_coef


def backward_sums(s1, t, beta_coef, grad_scale, grad_coef, inv_rho, kernels=KERNELS):
    """The CUDA kernel of ``distnorm::backward_sums``: ``(sums, dgamma, dbeta, w, count)``."""
    channels = s1.shape[0]
    sums = torch.empty(2, channels, dtype=s1.dtype, device=s1.device)
    grad_w, grad_b, w = torch.empty_like(s1), torch.empty_like(s1), torch.empty_like(s1)
    count = torch.empty(1, dtype=torch.int32, device=s1.device)
    with _on(s1.device):
        kernels["backward_sums"][(1,)](s1, t, beta_coef, grad_scale, grad_coef, sums, grad_w, grad_b, w, count,
                                       channels, inv_rho, BLOCK_C=_block(channels))
    return sums, grad_w, grad_b, w, count


def bnp_precondition(grad_weight, grad_bias, mean, var_t, q2, groups, kernels=KERNELS):
    """The CUDA kernel of ``distnorm::bnp_precondition`` (the arguments of
    :func:`distnorm._composite.bnp_precondition`, ``q2`` a 0-dim tensor on the gradient's
    device): one launch, one read of the weight gradient and one write of its transform, in
    float32 (the gradient's dtype: float32, bfloat16 or float16; the moments float32), for a
    non-empty gradient. Without a bias the second result is empty."""
    gw = grad_weight.contiguous()
    out_channels, kernel_size = gw.shape[0], gw[0, 0].numel() if gw.dim() > 2 else 1
    row_len = gw[0].numel() if out_channels else 0
    out_w = torch.empty_like(gw)
    out_b = gw.new_empty(out_channels if grad_bias is not None else 0,
                         dtype=grad_bias.dtype if grad_bias is not None else gw.dtype)
    gb = grad_bias.contiguous() if grad_bias is not None else gw
    with _on(gw.device):
        kernels["bnp_precondition"][(out_channels,)](
            gw, gb, mean.contiguous(), var_t.contiguous(), q2, out_w, out_b, row_len, kernel_size,
            out_channels // groups, mean.numel() // groups, HAS_BIAS=grad_bias is not None,
            BLOCK_K=min(BLOCK, max(16, triton.next_power_of_2(row_len))))
    return out_w, out_b


#: Values a GroupNorm program reads per tile, and at least per slice (GPU-sized: thousands of
#: programs for a ResNet-50 batch).
_GN_TILE = 2048
_GN_SLICE = 16384
#: Values a program of the backward's per-group step reads at a time (slices by channels).
_GN_COEF_TILE = 256


def _gn_plan(x):
    """``x`` as ``(N, C, S)``: its strides and the tiling, for a contiguous or channels_last
    input (the caller's contract): tiles along the layout's contiguous axis."""
    n, c = x.shape[0], x.shape[1]
    s = x[0, 0].numel()
    channels_inner = x.dim() > 2 and x.stride(1) == 1 and c > 1
    stride_s = c if channels_inner else 1
    if channels_inner:
        block_c = min(triton.next_power_of_2(c), 128)
        block_s = max(1, _GN_TILE // block_c)
    else:
        block_s = min(triton.next_power_of_2(max(s, 1)), _GN_TILE)
        block_c = min(triton.next_power_of_2(c), max(1, _GN_TILE // block_s))
    rows = max(block_s, (_GN_SLICE // block_c) // block_s * block_s)
    slices = triton.cdiv(s, rows)
    return dict(n=n, c=c, s=s, strides=(x.stride(0), x.stride(1), stride_s), rows=rows, slices=slices,
                block_s=block_s, block_c=block_c, grid=(n, slices, triton.cdiv(c, block_c)))


def group_norm(x, weight, bias, groups, eps, kernels=KERNELS):
    """The CUDA kernels of ``distnorm::group_norm`` for a non-empty contiguous or channels_last
    ``x`` (float32, bfloat16 or float16): ``(y, mean, rstd)``, ``y`` in ``x``'s dtype and
    strides, the statistics ``(N, groups)`` float32. Three launches: the slices' moments, the
    groups' statistics, the output."""
    plan = _gn_plan(x)
    n, c, s, rows, slices = plan["n"], plan["c"], plan["s"], plan["rows"], plan["slices"]
    part = torch.empty(n, slices, 2, c, dtype=torch.float32, device=x.device)
    mean = torch.empty(n, groups, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    y = torch.empty_like(x)
    w = weight.contiguous() if weight is not None else mean
    b = bias.contiguous() if bias is not None else mean
    tiles = dict(BLOCK_S=plan["block_s"], BLOCK_C=plan["block_c"])
    with _on(x.device):
        kernels["group_norm_moments"][plan["grid"]](x, part, c, s, *plan["strides"], rows, **tiles)
        kernels["group_norm_stats"][(n * groups,)](
            part, mean, rstd, c, s, groups, slices, rows, eps, 1.0 / (c // groups * s),
            BLOCK=min(BLOCK, triton.next_power_of_2(max(slices * (c // groups), 16))), num_warps=1)
        kernels["group_norm_apply"][plan["grid"]](x, y, mean, rstd, w, b, c, s, groups, *plan["strides"], rows,
                                                  HAS_W=weight is not None, HAS_B=bias is not None, **tiles)
    return y, mean, rstd


def group_norm_backward(grad_out, x, mean, rstd, weight, groups, mask, kernels=KERNELS):
    """The CUDA kernels of ``distnorm::group_norm_backward``, for ``grad_out`` with ``x``'s
    strides (the caller's contract): ``(grad_input, grad_weight, grad_bias)``, the parameters'
    in the weight's dtype (float32 without one), each empty where ``mask`` does not ask. Up to
    four launches: the slices' sums, the groups' coefficients, the input gradient, the
    parameters'."""
    plan = _gn_plan(x)
    n, c, s, rows, slices = plan["n"], plan["c"], plan["s"], plan["rows"], plan["slices"]
    part = torch.empty(n, slices, 2, c, dtype=torch.float32, device=x.device)
    coef = torch.empty(2, n, groups, dtype=torch.float32, device=x.device)
    param = torch.empty(2, n, c, dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if mask[0] else x.new_empty(0)
    w = weight.contiguous() if weight is not None else mean
    pdt = weight.dtype if weight is not None else torch.float32
    grad_w = torch.empty(c if mask[1] else 0, dtype=pdt, device=x.device)
    grad_b = torch.empty(c if mask[2] else 0, dtype=pdt, device=x.device)
    tiles = dict(BLOCK_S=plan["block_s"], BLOCK_C=plan["block_c"])
    with _on(x.device):
        kernels["group_norm_backward_sums"][plan["grid"]](grad_out, x, mean, part, c, s, groups, *plan["strides"],
                                                          rows, **tiles)
        per_group = min(_GN_COEF_TILE, triton.next_power_of_2(c // groups))
        kernels["group_norm_backward_coef"][(n * groups,)](
            part, rstd, w, coef, param, n, c, groups, slices, 1.0 / (c // groups * s), HAS_W=weight is not None,
            BLOCK_SL=max(1, min(triton.next_power_of_2(slices), _GN_COEF_TILE // per_group)), BLOCK=per_group,
            num_warps=1)
        if mask[0]:
            kernels["group_norm_backward_input"][plan["grid"]](grad_out, x, grad_x, mean, rstd, w, coef, n, c, s,
                                                               groups, *plan["strides"], rows,
                                                               HAS_W=weight is not None, **tiles)
        if mask[1] or mask[2]:
            block = min(32, triton.next_power_of_2(c))
            kernels["group_norm_param_grads"][(triton.cdiv(c, block),)](
                param, grad_w if mask[1] else param, grad_b if mask[2] else param, n, c, HAS_W=bool(mask[1]),
                HAS_B=bool(mask[2]), BLOCK_N=min(32, triton.next_power_of_2(n)), BLOCK=block, num_warps=1)
    return grad_x, grad_w, grad_b
