"""Float64 reference implementations written straight from SPEC §1–3 with plain torch ops.

Autograd differentiates these; the stop-gradient ratios of SPEC §1 are written literally
as ``r * stat_B + (stat_U - r * stat_B).detach()``. They run on the *whole* global batch in
one process, so "N ranks with split batches equal the reference on the concatenated batch"
is the central test shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _view(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


@dataclass
class CBNState:
    """The buffers of one CBN layer (float64 unless told otherwise)."""

    channels: int
    dtype: torch.dtype = torch.float64
    amat_mean: torch.Tensor = field(init=False)
    amat_var: torch.Tensor = field(init=False)
    initialized: bool = False
    running_mean: torch.Tensor = field(init=False)
    running_var: torch.Tensor = field(init=False)
    num_batches_tracked: int = 0
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        c, kw = self.channels, dict(dtype=self.dtype, device=self.device)
        self.amat_mean = torch.zeros(c, **kw)
        self.amat_var = torch.ones(c, **kw)
        self.running_mean = torch.zeros(c, **kw)
        self.running_var = torch.ones(c, **kw)


def cbn_train(x, gamma, beta, state: CBNState, *, eta, rho=1.0, eps=1e-5, momentum=0.1, r_max=3.0, amat=True):
    """One CBN training forward on the global batch ``x``; updates ``state``; returns y."""
    dims = _dims(x)
    n = x.numel() // x.shape[1]
    mu_b = x.mean(dims)
    var_x = x.var(dims, unbiased=False)
    if not amat:
        eta = 0.0
    if state.initialized:
        mu_a, var_a = state.amat_mean, state.amat_var
    else:  # SPEC: initialised from the first batch, so the first step is plain CBN
        mu_a = mu_b.detach()
        var_a = (var_x + beta**2).detach()
    mu_u = eta * mu_a + (1 - eta) * mu_b
    sd_x = torch.sqrt(var_x + eps)
    meaningful = ((mu_u * mu_b) > 0) & (mu_b.abs() > 0.1 * sd_x)
    r_mu = torch.where(meaningful, mu_u / mu_b, torch.ones_like(mu_b)).clamp(1 / r_max, r_max).detach()
    mu_used = r_mu * mu_b + (mu_u - r_mu * mu_b).detach()
    x1 = x - _view(mu_used, x) + _view(beta, x)
    var_b = (x1**2).mean(dims)
    s = torch.sqrt(var_b + eps)
    var_u = eta * var_a + (1 - eta) * var_b
    s_u = torch.sqrt(var_u + eps)
    r_sig = (s_u / s).clamp(1 / r_max, r_max).detach()
    s_used = r_sig * s + (s_u - r_sig * s).detach()
    y = _view(gamma / rho, x) * x1 / _view(s_used, x)

    with torch.no_grad():
        state.amat_mean = mu_u.detach().clone()
        state.amat_var = var_u.detach().clone()
        state.initialized = True
        state.running_mean = (1 - momentum) * state.running_mean + momentum * mu_b
        state.running_var = (1 - momentum) * state.running_var + momentum * var_x * n / (n - 1)
        state.num_batches_tracked += 1
    return y


def cbn_eval(x, gamma, beta, state: CBNState, *, rho=1.0, eps=1e-5, eval_stats="amat"):
    if eval_stats == "amat":
        mean, var = state.amat_mean, state.amat_var
    else:
        mean, var = state.running_mean, state.running_var + beta**2
    return _view(gamma / rho, x) * (x - _view(mean, x) + _view(beta, x)) / _view(torch.sqrt(var + eps), x)
