"""Single-process tests of the layers against float64 references and torch.nn.BatchNorm."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import distnorm
from distnorm import functional as F
from distnorm.specs import CBNSpec
from tests import reference as ref

SHAPES = [(16, 3), (8, 3, 5), (4, 3, 4, 5), (2, 3, 2, 3, 4)]


def _channel_offsets(x: torch.Tensor, offsets) -> torch.Tensor:
    """Give channels different means (positive, negative, ~0) so the AMAT guards trigger."""
    return x + torch.tensor(offsets, dtype=x.dtype).view([1, -1] + [1] * (x.dim() - 2))


def _cbn_state(module: distnorm.layers._CompleteNorm) -> list[torch.Tensor]:
    return [module.amat_mean, module.amat_var, module.amat_initialized,
            module.running_mean, module.running_var, module.num_batches_tracked]


def _frozen_cbn(module, *, eta: float, rho: float = 1.0):
    """CBN as a pure function of (x, gamma, beta): buffers are copied at every call."""
    state = [t.clone() for t in _cbn_state(module)]
    spec = CBNSpec(rho=rho)
    return lambda x, g, b: F.cbn(x, g, b, F.CBNBuffers(*[t.clone() for t in state]), eta=eta, spec=spec)


# --------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("shape", [(6, 3), (3, 3, 2, 2)])
def test_gradcheck_sync_batch_norm(shape):
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, dtype=torch.float64, requires_grad=True) + 0.5
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w, b: F.sync_batch_norm(x, torch.zeros(3, dtype=torch.float64),  # noqa: E731
                                           torch.ones(3, dtype=torch.float64), w, b)
    assert torch.autograd.gradcheck(fn, (x, w, b))


@pytest.mark.parametrize("variant", ["popnorm", "cbn_no_amat", "cbn_amat_first_batch", "cbn_amat_eta0"])
@pytest.mark.parametrize("shape", [(6, 3), (3, 3, 2, 2)])
def test_gradcheck_complete_norm(variant, shape):
    """Numerical gradients where the stop-gradient ratios are exactly 1 (a true function)."""
    x = _channel_offsets(torch.randn(*shape, dtype=torch.float64), [1.0, -2.0, 0.0]).requires_grad_()
    g = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(3, dtype=torch.float64).requires_grad_()
    if variant == "popnorm":
        m = distnorm.POPNorm(3).double()
        kw = dict(rho=m.rho, eta=0.0)
    elif variant == "cbn_no_amat":
        m = distnorm.CBN(3, rho=2.0, amat=False).double()
        kw = dict(rho=2.0, eta=0.0)
    elif variant == "cbn_amat_first_batch":  # not yet initialised: mu_A := mu_B, eta irrelevant
        m = distnorm.CBN(3).double()
        kw = dict(eta=0.7)
    else:  # initialised, but lr >= 1/omega gives eta = 0
        m = distnorm.CBN(3).double()
        m.set_lr(0.01)
        m(torch.randn(*shape, dtype=torch.float64) + 3)
        kw = dict(eta=0.0)
    assert torch.autograd.gradcheck(_frozen_cbn(m, **kw), (x, g, b))


@pytest.mark.parametrize("shape", [(6, 3), (3, 3, 2, 2)])
def test_gradcheck_cbn_amat_history(shape):
    """With history (eta > 0) the ratios are stop-gradients, so finite differences of the
    forward are not the specified gradient w.r.t. x and beta; gamma's gradient is exact."""
    m = distnorm.CBN(3).double()
    m.set_lr(0.03)
    m(_channel_offsets(torch.randn(*shape, dtype=torch.float64), [2.0, -1.0, 0.1]))
    x = _channel_offsets(torch.randn(*shape, dtype=torch.float64), [1.0, -2.0, 0.0])
    b = torch.randn(3, dtype=torch.float64)
    g = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    fn = _frozen_cbn(m, eta=m.eta)
    assert torch.autograd.gradcheck(lambda g: fn(x, g, b), (g,))


# ------------------------------------------------------ CBN / POP-Norm vs float64 reference
def _compare_cbn_steps(module: nn.Module, shape, lrs, *, amat: bool, rho: float, r_max=3.0, seed=0, atol=1e-10,
                       means=None):
    """Run ``module`` and the reference for len(lrs) steps; compare everything. ``means``:
    per step, exact per-channel batch means (each batch standardized, then shifted), so a
    test can put a channel on a chosen side of a guard."""
    gen = torch.Generator().manual_seed(seed)
    c = shape[1]
    state = ref.CBNState(c)
    gamma = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
    beta = torch.randn(c, generator=gen, dtype=torch.float64) * 0.5
    with torch.no_grad():
        module.weight.copy_(gamma)
        module.bias.copy_(beta)
    offsets = [2.0, -1.5, 0.01][:c] + [0.5] * max(0, c - 3)
    for step, lr in enumerate(lrs):
        x = _channel_offsets(torch.randn(*shape, generator=gen, dtype=torch.float64) * 1.5, offsets)
        if means is not None:
            dims = [0] + list(range(2, x.dim()))
            z = (x - x.mean(dims, keepdim=True)) / x.std(dims, unbiased=False, keepdim=True)
            x = _channel_offsets(z, means[step])
        gy = torch.randn(*shape, generator=gen, dtype=torch.float64)
        eta = F.amat_eta(lr, 10.0) if amat else 0.0

        xr, gr, br = (t.clone().requires_grad_() for t in (x, gamma, beta))
        y_ref = ref.cbn_train(xr, gr, br, state, eta=eta, rho=rho, r_max=r_max, amat=amat)
        y_ref.backward(gy)

        module.zero_grad()
        distnorm.set_lr(module, lr)
        xm = x.clone().requires_grad_()
        y = module(xm)
        y.backward(gy)

        torch.testing.assert_close(y, y_ref, atol=atol, rtol=0)
        torch.testing.assert_close(xm.grad, xr.grad, atol=atol, rtol=0)
        torch.testing.assert_close(module.weight.grad, gr.grad, atol=atol, rtol=0)
        torch.testing.assert_close(module.bias.grad, br.grad, atol=atol, rtol=0)
        torch.testing.assert_close(module.amat_mean, state.amat_mean, atol=atol, rtol=0)
        torch.testing.assert_close(module.amat_var, state.amat_var, atol=atol, rtol=0)
        torch.testing.assert_close(module.running_mean, state.running_mean, atol=atol, rtol=0)
        torch.testing.assert_close(module.running_var, state.running_var, atol=atol, rtol=0)
        assert int(module.num_batches_tracked) == state.num_batches_tracked
    return state, gamma, beta


DECAYING_LRS = [0.2, 0.05, 0.02, 0.005, 0.001]  # eta: 0, 0.5, 0.8, 0.95, 0.99


@pytest.mark.parametrize("shape", SHAPES)
def test_cbn_matches_reference(shape):
    m = distnorm.CBN(3, rho=1.5).double()
    state, gamma, beta = _compare_cbn_steps(m, shape, DECAYING_LRS, amat=True, rho=1.5)
    m.eval()
    x = torch.randn(*shape, dtype=torch.float64) + 1
    torch.testing.assert_close(m(x), ref.cbn_eval(x, gamma, beta, state, rho=1.5), atol=1e-12, rtol=0)
    m.eval_stats = "running"
    torch.testing.assert_close(m(x), ref.cbn_eval(x, gamma, beta, state, rho=1.5, eval_stats="running"),
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_popnorm_matches_reference(shape):
    m = distnorm.POPNorm(3, kappa=4.0).double()
    state, gamma, beta = _compare_cbn_steps(m, shape, DECAYING_LRS, amat=False, rho=4.0)
    m.eval()
    x = torch.randn(*shape, dtype=torch.float64)
    expected = ref.cbn_eval(x, gamma, beta, state, rho=4.0, eval_stats="running")
    torch.testing.assert_close(m(x), expected, atol=1e-12, rtol=0)


def test_cbn_without_amat_matches_reference():
    m = distnorm.CBN(3, rho=2.0, amat=False).double()
    _compare_cbn_steps(m, (8, 3, 3, 3), DECAYING_LRS, amat=False, rho=2.0)


def test_cbn_ratio_guard_and_clamp_only_change_gradients():
    """A channel whose batch mean is ~0 (guarded) and one whose ratio exceeds r_max (clamped):
    the forward value still uses the AMAT statistics exactly, and the gradients are the
    reference's. The guard is more than its sign test (``ratio > 0``): reduced to it, a batch
    mean of 0.02 sd under an AMAT mean of 0.5 gave r_mu = clamp(25) = r_max instead of 1 —
    missed by the random batches, whose ~0 channel never had both signs equal."""
    m = distnorm.CBN(2, r_max=1.5).double()
    m.set_lr(0.001)  # eta = 0.99
    m(torch.randn(64, 2, dtype=torch.float64) + torch.tensor([10.0, 0.0], dtype=torch.float64))
    x = torch.randn(64, 2, dtype=torch.float64) + torch.tensor([1.0, 0.0], dtype=torch.float64)
    mu_a, var_a = m.amat_mean.clone(), m.amat_var.clone()
    y = m(x)
    mu_u = 0.99 * mu_a + 0.01 * x.mean(0)
    x1 = x - mu_u + m.bias.detach()
    var_u = 0.99 * var_a + 0.01 * (x1**2).mean(0)
    torch.testing.assert_close(y, m.weight.detach() * x1 / torch.sqrt(var_u + 1e-5), atol=1e-12, rtol=0)
    _compare_cbn_steps(distnorm.CBN(2, r_max=1.5).double(), (64, 2), [0.001] * 4, amat=True, rho=1.0, r_max=1.5)
    # Channel 1: mu_B = 0.02 sd (< 0.1 sd: guarded) of mu_U's sign; channel 0: a meaningful ratio.
    _compare_cbn_steps(distnorm.CBN(2, r_max=1.5).double(), (64, 2), [0.001] * 3, amat=True, rho=1.0, r_max=1.5,
                       means=[[1.0, 0.5], [1.2, 0.02], [0.9, 0.02]])


def test_amat_eta_follows_learning_rate():
    m = distnorm.CBN(4, omega=10.0)
    assert m.eta == 0.0  # no learning rate yet
    for lr, eta in [(0.2, 0.0), (0.1, 0.0), (0.05, 0.5), (0.001, 0.99), (0.0, 1.0)]:
        assert distnorm.set_lr(nn.Sequential(m), lr) == 1
        assert m.eta == pytest.approx(eta)
    assert distnorm.POPNorm(4).eta == 0.0
    with pytest.raises(ValueError, match="learning rate"):
        distnorm.set_lr(m, float("nan"))


def test_amat_initialised_from_first_batch():
    m = distnorm.CBN(3)
    m.set_lr(0.001)
    assert not bool(m.amat_initialized)
    x = torch.randn(32, 3) * 2 + 5
    y = m(x)
    assert bool(m.amat_initialized)
    torch.testing.assert_close(m.amat_mean, x.mean(0))
    torch.testing.assert_close(m.amat_var, x.var(0, unbiased=False))  # beta = 0
    # plain CBN on the first step, whatever eta is
    torch.testing.assert_close(y, (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-5), atol=1e-5, rtol=0)


def test_missing_learning_rate_warns_once(monkeypatch):
    monkeypatch.setattr(distnorm.layers, "_warned_no_lr", False)
    model = nn.Sequential(distnorm.CBN(3), distnorm.CBN(3))
    with pytest.warns(UserWarning, match="set_lr") as record:
        model(torch.randn(8, 3))
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(8, 3))


# ------------------------------------------------------------ SyncBatchNorm vs torch BN
TORCH_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batch_norm_matches_torch(shape, momentum):
    ours = distnorm.SyncBatchNorm(3, momentum=momentum).double()
    theirs = TORCH_BN[len(shape)](3, momentum=momentum).double()
    with torch.no_grad():
        for p in (ours.weight, theirs.weight):
            p.copy_(torch.tensor([0.5, 1.0, 2.0]))
        for p in (ours.bias, theirs.bias):
            p.copy_(torch.tensor([0.1, -0.2, 0.3]))
    for _ in range(3):
        x = torch.randn(*shape, dtype=torch.float64) * 3 + 1
        gy = torch.randn(*shape, dtype=torch.float64)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = ours(x1), theirs(x2)
        y1.backward(gy)
        y2.backward(gy)
        torch.testing.assert_close(y1, y2, atol=1e-12, rtol=0)
        torch.testing.assert_close(x1.grad, x2.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(ours.running_mean, theirs.running_mean, atol=1e-12, rtol=0)
        torch.testing.assert_close(ours.running_var, theirs.running_var, atol=1e-12, rtol=0)
        assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked)
    ours.eval(), theirs.eval()
    x = torch.randn(*shape, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-12, rtol=0)
    assert ours.state_dict().keys() == theirs.state_dict().keys()


@pytest.mark.parametrize("affine,track", [(False, True), (True, False), (False, False)])
def test_sync_batch_norm_options_match_torch(affine, track):
    ours = distnorm.SyncBatchNorm(4, affine=affine, track_running_stats=track)
    theirs = nn.BatchNorm2d(4, affine=affine, track_running_stats=track)
    for mode in ("train", "eval"):
        getattr(ours, mode)(), getattr(theirs, mode)()
        x1 = (torch.randn(4, 4, 3, 3) * 2).requires_grad_()
        x2 = x1.detach().clone().requires_grad_()
        y1, y2 = ours(x1), theirs(x2)
        y1.square().sum().backward()
        y2.square().sum().backward()
        torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x1.grad, x2.grad, atol=1e-4, rtol=1e-4)
    assert ours.state_dict().keys() == theirs.state_dict().keys()


# ----------------------------------------------------- numerics, precision and layout
@pytest.mark.parametrize("make", [lambda: distnorm.CBN(8), lambda: distnorm.POPNorm(8), lambda: distnorm.SyncBatchNorm(8)])
def test_large_mean_matches_float64_reference(make):
    """SPEC: inputs with mean 1e3 and std 1 must match a float64 reference to 1e-4."""
    x32 = torch.randn(16, 8, 6, 6) + 1e3
    gy = torch.randn_like(x32)
    m32 = make()
    m64 = copy.deepcopy(m32).double()
    for m in (m32, m64):
        distnorm.set_lr(m, 0.05)
    xa = x32.clone().requires_grad_()
    xb = x32.double().requires_grad_()
    ya, yb = m32(xa), m64(xb)
    ya.backward(gy)
    yb.backward(gy.double())
    torch.testing.assert_close(ya.double(), yb, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(xa.grad.double(), xb.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m32.running_var.double(), m64.running_var, rtol=1e-4, atol=0)
    torch.testing.assert_close(m32.running_mean.double(), m64.running_mean, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [lambda: distnorm.CBN(8), lambda: distnorm.SyncBatchNorm(8)])
def test_low_precision_inputs(dtype, make):
    m_lp, m32 = make(), make()
    for m in (m_lp, m32):
        distnorm.set_lr(m, 0.05)
    x = torch.randn(8, 8, 5, 5) * 2 + 1
    gy = torch.randn_like(x)
    xa = x.to(dtype).requires_grad_()
    xb = x.to(dtype).float().requires_grad_()
    ya, yb = m_lp(xa), m32(xb)
    assert ya.dtype == dtype
    ya.backward(gy.to(dtype))
    yb.backward(gy.to(dtype).float())
    assert xa.grad.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(ya.float(), yb, atol=tol, rtol=tol)
    torch.testing.assert_close(xa.grad.float(), xb.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(m_lp.weight.grad, m32.weight.grad, atol=tol * 10, rtol=tol)
    assert m_lp.running_mean.dtype == torch.float32
    torch.testing.assert_close(m_lp.running_var, m32.running_var, atol=1e-4, rtol=1e-4)


def test_buffers_stay_float32_after_half():
    model = nn.Sequential(distnorm.CBN(4), nn.Conv2d(4, 4, 1), distnorm.SyncBatchNorm(4)).half()
    for name, buf in model.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, name
    assert model[0].weight.dtype == torch.float16
    distnorm.set_lr(model, 0.05)
    y = model(torch.randn(4, 4, 3, 3).half())
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float16
    model.double()
    assert model[0].running_mean.dtype == torch.float64


def test_cpu_autocast():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), distnorm.CBN(8), nn.ReLU(), distnorm.SyncBatchNorm(8))
    distnorm.set_lr(model, 0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(4, 3, 8, 8))
    y.float().sum().backward()
    assert model[1].weight.grad is not None and model[1].running_mean.dtype == torch.float32


@pytest.mark.parametrize("make", [lambda: distnorm.CBN(6), lambda: distnorm.POPNorm(6), lambda: distnorm.SyncBatchNorm(6)])
def test_channels_last(make):
    m1 = make()
    m2 = copy.deepcopy(m1)
    warm_up = torch.randn(4, 6, 5, 5)
    for m in (m1, m2):
        distnorm.set_lr(m, 0.02)
        m(warm_up)  # initialise AMAT so the history path runs too
    x = torch.randn(4, 6, 5, 5) + 0.5
    gy = torch.randn_like(x)
    xa = x.clone().requires_grad_()
    xb = x.clone().to(memory_format=torch.channels_last).requires_grad_()
    ya, yb = m1(xa), m2(xb)
    assert yb.is_contiguous(memory_format=torch.channels_last)
    ya.backward(gy)
    yb.backward(gy.to(memory_format=torch.channels_last))
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m1.running_var, m2.running_var)


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("make", [lambda: distnorm.CBN(4), lambda: distnorm.POPNorm(4), lambda: distnorm.SyncBatchNorm(4)])
def test_bad_inputs_raise_clear_errors(make):
    m = make()
    with pytest.raises(ValueError, match=r"expected 4 channels.*\(8, 3, 2, 2\)"):
        m(torch.randn(8, 3, 2, 2))
    with pytest.raises(ValueError, match="2-D to 5-D"):
        m(torch.randn(8))
    with pytest.raises(ValueError, match="2-D to 5-D"):
        m(torch.randn(2, 4, 1, 1, 1, 1))
    with pytest.raises(TypeError, match="floating-point"):
        m(torch.ones(8, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        m(torch.randn(1, 4))
    m.eval()
    assert m(torch.randn(1, 4)).shape == (1, 4)  # a single sample is fine at evaluation


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: distnorm.CBN(0), "num_features"),
        (lambda: distnorm.CBN(4, rho=0), "rho"),
        (lambda: distnorm.POPNorm(4, kappa=-1), "kappa"),
        (lambda: distnorm.CBN(4, omega=-1), "omega"),
        (lambda: distnorm.CBN(4, r_max=0.5), "r_max"),
        (lambda: distnorm.CBN(4, eval_stats="batch"), "eval_stats"),
        (lambda: distnorm.CBN(4, momentum=2.0), "momentum"),
        (lambda: distnorm.SyncBatchNorm(4, eps=0), "eps"),
        (lambda: distnorm.SyncBatchNorm(4, eps=None), "SyncBatchNorm: eps must be a positive"),
    ],
)
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_public_names_and_state_dict():
    cbn = distnorm.CBN(4)
    assert set(dict(cbn.named_parameters())) == {"weight", "bias"}
    assert {"amat_mean", "amat_var", "running_mean", "running_var", "num_batches_tracked"} <= set(cbn.state_dict())
    pop = distnorm.POPNorm(4, kappa=3.0)
    assert pop.kappa == 3.0 and not pop.amat
    copy_ = distnorm.CBN(4)
    distnorm.set_lr(cbn, 0.01)
    cbn(torch.randn(8, 4) + 2)
    copy_.load_state_dict(cbn.state_dict())
    cbn.eval(), copy_.eval()
    x = torch.randn(3, 4)
    torch.testing.assert_close(cbn(x), copy_(x))


# ---------------------------------------------------------------- the paths GPU users take
def test_eval_stats_auto_switches_to_amat_once_it_averages_enough():
    """CBN's default ``eval_stats='auto'`` evaluates with the running statistics while eta = 0
    (lr >= 0.1), where AMAT's statistics are the last training batch alone (what
    ``eval_stats='amat'`` evaluates with there), and with AMAT's once they average as much
    history as the running ones (eta = 0.9 = 1 - momentum); the choice travels with the state
    dict."""
    torch.manual_seed(0)
    layer = distnorm.CBN(3)
    assert layer.eval_stats == "auto"
    batches = [torch.randn(16, 3) * (1 + i) + i for i in range(4)]
    for lr in (0.2, 0.2, 0.2):
        distnorm.set_lr(layer, lr)
        for x in batches:
            layer(x)
    layer.eval()
    x = torch.randn(5, 3)
    running = copy.deepcopy(layer)
    running.eval_stats = "running"
    amat = copy.deepcopy(layer)
    amat.eval_stats = "amat"
    assert torch.equal(layer(x), running(x))  # eta = 0: the running statistics
    assert not torch.allclose(layer(x), amat(x))
    layer.train()
    distnorm.set_lr(layer, 0.01)  # eta = 0.9 = 1 - momentum: AMAT averages as much history
    layer(batches[0])
    layer.eval()
    for other in (running, amat):
        other.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x), amat(x))
    reloaded = distnorm.CBN(3)
    reloaded.load_state_dict(layer.state_dict())  # the choice travels with the state dict
    reloaded.eval()
    assert torch.equal(reloaded(x), layer(x))


@pytest.mark.parametrize("make", [lambda: distnorm.CBN(8), lambda: distnorm.SyncBatchNorm(8)])
def test_bf16_input_gradient_scale_stays_float32(make):
    """With bf16 inputs the per-channel factor of g in dx stays float32: the bf16 input
    gradient's per-channel scale against the float32 one is within 2e-4 of 1. Rounded to bf16, the
    factor gave a systematic per-channel error of up to 0.16 %."""
    torch.manual_seed(0)
    layer = make()
    with torch.no_grad():  # scales whose bf16 rounding error is large
        layer.weight.copy_(1.0 + torch.arange(8) * 0.00390625 + 0.0019)
    distnorm.set_lr(layer, 0.2)
    x = torch.randn(64, 8, 16, 16).bfloat16()
    g = torch.randn_like(x, dtype=torch.float32).bfloat16()
    ref = copy.deepcopy(layer)
    xa, xb = x.clone().requires_grad_(), x.float().requires_grad_()
    layer(xa).backward(g)
    ref(xb).backward(g.float())
    # Per-channel least-squares scale of the bf16 gradient against the float32 one: random
    # rounding averages out over 16k values per channel, a rounded factor does not.
    dims = (0, 2, 3)
    scale = (xa.grad.float() * xb.grad).sum(dims) / (xb.grad * xb.grad).sum(dims)
    assert (scale - 1).abs().max() < 2e-4, scale


@pytest.mark.parametrize("make", [lambda: distnorm.CBN(3), lambda: distnorm.SyncBatchNorm(3)])
def test_a_second_derivative_is_refused_by_name(make):
    """The hand-written backward is differentiable once: a backward that asks for a graph
    (``create_graph=True``) gets ``once_differentiable``'s refusal when the second derivative
    is taken, never a silently wrong one. (Plain backward passes skip that decorator's
    ``no_grad`` block, which only such a pass needs.)"""
    layer = make()
    distnorm.set_lr(layer, 0.01)
    x = torch.randn(6, 3, 4, requires_grad=True)
    (grad_x,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_x.sum().backward()
