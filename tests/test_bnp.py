"""BNP: the gradient transform against explicit float64 matrices, DDP equivalence, detach."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distnorm
from tests.dispatch import OpCounter
from tests.distributed import run_distributed

RHO = 0.5  # a small momentum makes the running moments move visibly in two steps


def _input_moments(layer: nn.Module, x: torch.Tensor):
    """Per-input-channel mean and biased variance, computed independently of distnorm."""
    if isinstance(layer, nn.Linear):
        h = x.reshape(-1, x.shape[-1])
        return h.mean(0), h.var(0, unbiased=False), h.shape[0]
    dims = [0] + list(range(2, x.dim()))
    return x.mean(dims), x.var(dims, unbiased=False), x.shape[0]


def _q2(layer: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> float:
    fan_in = math.prod(layer.weight.shape[1:])
    if isinstance(layer, nn.Linear):
        return max(fan_in / n, 1.0)
    return max(fan_in / n, math.sqrt(math.prod(y.shape[2:])))


def _explicit_transform(grad_w, grad_b, mu, var_t, q2, groups):
    """(1/q²) P Pᵀ [G_b; G_w] built as explicit matrices, one output channel at a time."""
    out = grad_w.shape[0]
    per_group = grad_w.shape[1]
    ksize = math.prod(grad_w.shape[2:])
    new_w, new_b = torch.empty_like(grad_w), torch.empty(out, dtype=grad_w.dtype)
    for d in range(out):
        g = d // (out // groups)
        channels = torch.arange(g * per_group, (g + 1) * per_group)
        m = mu[channels].repeat_interleave(ksize)  # mu ⊗ e, in vec(G_w[d]) order
        v = var_t[channels].repeat_interleave(ksize)
        k = m.numel()
        if grad_b is None:
            D = torch.diag(1 / torch.sqrt(v))
            new_w[d] = ((D @ D.T @ grad_w[d].reshape(-1)) / q2).view_as(grad_w[d])
            continue
        U = torch.eye(k + 1, dtype=torch.float64)
        U[0, 1:] = -m
        D = torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), 1 / torch.sqrt(v)]))
        P = U @ D
        vec = torch.cat([grad_b[d].view(1), grad_w[d].reshape(-1)])
        res = P @ P.T @ vec / q2
        new_b[d] = res[0]
        new_w[d] = res[1:].view_as(grad_w[d])
    return new_w, (None if grad_b is None else new_b)


LAYERS = {
    "dense": (lambda: nn.Linear(5, 3), (7, 5)),
    "dense_3d_input": (lambda: nn.Linear(5, 3), (2, 4, 5)),
    "dense_no_bias": (lambda: nn.Linear(5, 3, bias=False), (7, 5)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (5, 3, 9)),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, padding=1), (3, 4, 6, 5)),
    "conv2d_strided_no_bias": (lambda: nn.Conv2d(4, 6, 3, stride=2, bias=False), (3, 4, 9, 9)),
    "grouped": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (3, 4, 5, 5)),
    "depthwise": (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), (3, 4, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), (2, 2, 4, 4, 3)),
}


@pytest.mark.parametrize("kernel", ["c", "aten"])
@pytest.mark.parametrize("add_bias", [True, False])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_transform_equals_explicit_matrices(kind, add_bias, kernel, monkeypatch):
    """Both ways the CPU computes the transform: the C kernel (``distnorm::bnp_precondition``,
    the default) and ATen's calls (``DISTNORM_CPU_KERNEL=0``)."""
    monkeypatch.setenv("DISTNORM_CPU_KERNEL", "1" if kernel == "c" else "0")
    make, shape = LAYERS[kind]
    plain = make().double()
    layer = copy.deepcopy(plain)
    distnorm.bnp.attach(layer, decay=RHO, add_bias=add_bias)
    if layer.bias is not None and plain.bias is None:  # BNP added a (zero) bias
        plain.bias = nn.Parameter(torch.zeros_like(layer.bias))
    mu = torch.zeros(shape[-1] if isinstance(plain, nn.Linear) else shape[1], dtype=torch.float64)
    var = torch.ones_like(mu)
    for step in range(2):
        x = torch.randn(*shape, dtype=torch.float64) * (1 + step) + torch.linspace(-2, 2, mu.numel()).view(
            [1] * (len(shape) - 1) + [-1] if isinstance(plain, nn.Linear) else [1, -1] + [1] * (len(shape) - 2))
        gy = None
        for model in (plain, layer):
            model.zero_grad()
            y = model(x)
            if gy is None:
                gy = torch.randn_like(y)
            y.backward(gy)
        m_h, v_h, n = _input_moments(plain, x)
        mu = RHO * mu + (1 - RHO) * m_h
        var = RHO * var + (1 - RHO) * v_h
        torch.testing.assert_close(layer.bnp_mean, mu, atol=1e-12, rtol=0)
        torch.testing.assert_close(layer.bnp_var, var, atol=1e-12, rtol=0)
        var_t = var + 1e-2 * var.max() + 1e-4
        q2 = _q2(plain, x, y, n)
        grad_b = plain.bias.grad if layer.bias is not None else None
        want_w, want_b = _explicit_transform(plain.weight.grad, grad_b, mu, var_t, q2, getattr(plain, "groups", 1))
        torch.testing.assert_close(layer.weight.grad, want_w, atol=1e-10, rtol=1e-10)
        if want_b is not None:
            torch.testing.assert_close(layer.bias.grad, want_b, atol=1e-10, rtol=1e-10)
    if kind.endswith("no_bias") or kind == "depthwise":
        assert (layer.bias is not None) == add_bias


# (weight gradient shape, groups, bias, the weight-sized passes of ATen's calls): a dense row
# longer than the kernel's 32 partial sums (ATen: addcmul, div_, then mu times the whole row),
# 3 x 3 convolutions (one group, two, depthwise; ATen: addcmul, div_, the kernel's sum), and
# no bias (one division either way).
PRECONDITIONED = [((6, 40), 1, True, 7.0), ((16, 8, 3, 3), 1, True, 5.0), ((16, 4, 3, 3), 2, True, 5.0),
                  ((8, 1, 3, 3), 8, True, 5.0), ((16, 8, 3, 3), 1, False, 2.0)]


def _transform_grads(weight, bias_param, mean, var_t, q2, groups, kernel, grad_w, grad_b):
    """``(G_w, G_b)`` preconditioned by :class:`BNPGradientFunction`'s backward with ``kernel``."""
    from distnorm._bnp_functions import BNPGradientFunction

    aliases = BNPGradientFunction.apply(weight, bias_param, mean, var_t, q2, groups, kernel)
    inputs = [weight] + ([bias_param] if bias_param is not None else [])
    return torch.autograd.grad(aliases[:len(inputs)], inputs, [grad_w] + ([grad_b] if grad_b is not None else []))


@pytest.mark.parametrize("shape,groups,bias,aten_passes", PRECONDITIONED)
def test_the_cpu_kernel_preconditions_in_one_pass_over_the_weight_gradient(shape, groups, bias, aten_passes):
    """BNP's backward on the CPU, float32: the C kernel (``distnorm::bnp_precondition``) reads
    the weight gradient once and writes its transform once — 2 weight-sized passes, where
    ATen's calls (``DISTNORM_CPU_KERNEL=0``) make 5 to 7 — and both equal the explicit float64
    matrices to float32 rounding; the kernel's bits do not depend on the thread count. The pass
    count shows that the kernel is used (left unused: 5 passes), and each group's rows read
    that group's statistics, not group 0's."""
    torch.manual_seed(0)
    in_channels = shape[1] * groups
    weight = torch.randn(shape, requires_grad=True)
    bias_param = torch.randn(shape[0], requires_grad=True) if bias else None
    mean, var_t, q2 = torch.randn(in_channels), torch.rand(in_channels) + 0.5, torch.tensor(3.0)
    grad_w, grad_b = torch.randn(shape), torch.randn(shape[0]) if bias else None
    want_w, want_b = _explicit_transform(grad_w.double(), grad_b.double() if bias else None, mean.double(),
                                         var_t.double(), 3.0, groups)
    results, passes = {}, {}
    for kernel in ("cpu", None):
        with OpCounter(activation=weight) as counter:
            results[kernel] = _transform_grads(weight, bias_param, mean, var_t, q2, groups, kernel, grad_w, grad_b)
        passes[kernel] = counter.passes
        torch.testing.assert_close(results[kernel][0].double(), want_w, rtol=1e-5, atol=1e-6)
        if bias:
            torch.testing.assert_close(results[kernel][1].double(), want_b, rtol=1e-5, atol=1e-5)
    assert passes == {"cpu": 2.0, None: aten_passes}, passes
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _transform_grads(weight, bias_param, mean, var_t, q2, groups, "cpu", grad_w, grad_b)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one_thread, results["cpu"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,groups,bias,aten_passes", PRECONDITIONED)
def test_the_triton_kernel_preconditions_in_one_pass(shape, groups, bias, aten_passes, dtype, monkeypatch):
    """BNP's backward on CUDA runs Triton's kernel (``distnorm::bnp_precondition`` under
    ``CUDA``), run here by Triton's interpreter (``DISTNORM_TRITON=interpret``): one read of
    the weight gradient and one write of its transform, equal to the explicit float64 matrices
    to the gradient dtype's rounding (float32 arithmetic for a bfloat16 gradient, as the
    composite's), each group's rows with their group's statistics, the bias's row sum longer
    than one block included (a dense row of 40)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("DISTNORM_TRITON", "interpret")
    torch.manual_seed(0)
    in_channels = shape[1] * groups
    weight = torch.randn(shape, dtype=dtype, requires_grad=True)
    bias_param = torch.randn(shape[0], dtype=dtype, requires_grad=True) if bias else None
    mean, var_t, q2 = torch.randn(in_channels), torch.rand(in_channels) + 0.5, torch.tensor(3.0)
    grad_w, grad_b = torch.randn(shape, dtype=dtype), torch.randn(shape[0], dtype=dtype) if bias else None
    want_w, want_b = _explicit_transform(grad_w.double(), grad_b.double() if bias else None, mean.double(),
                                         var_t.double(), 3.0, groups)
    with OpCounter(activation=weight) as counter:
        got = _transform_grads(weight, bias_param, mean, var_t, q2, groups, "triton", grad_w, grad_b)
    assert counter.ops.count("distnorm.bnp_precondition.default") == 1, counter.table()
    assert counter.passes == 2.0
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    assert got[0].dtype == dtype
    torch.testing.assert_close(got[0].double(), want_w, **tol)
    if bias:
        torch.testing.assert_close(got[1].double(), want_b, **tol)
    composite = _transform_grads(weight, bias_param, mean, var_t, q2, groups, None, grad_w, grad_b)
    for a, b in zip(got, composite):  # to one rounding of the gradient dtype
        torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


def test_the_cpu_kernel_refuses_what_does_not_match():
    """The C kernel reads raw pointers, so a mismatch raises before it runs, with the check
    (and the message) of ATen's calls (a guard for the operator's direct callers; mutant:
    bnp-kernel-shapes-unchecked)."""
    from distnorm._bnp_functions import bnp_precondition

    kernel = torch.ops.distnorm.bnp_precondition
    grad_w, grad_b, mean, var_t = torch.randn(6, 4, 3, 3), torch.randn(6), torch.randn(4), torch.rand(4) + 0.5
    q2 = torch.tensor(2.0)
    kernel(grad_w, grad_b, mean, var_t, q2, 1, "cpu")  # matches
    for bad in [(grad_w, grad_b, mean, var_t, q2, 2),  # 2 groups of 4 channels: 8 moments needed
                (grad_w, grad_b, torch.randn(5), torch.rand(5), q2, 1),
                (grad_w, torch.randn(5), mean, var_t, q2, 1),
                (grad_w, grad_b, mean, torch.rand(3), q2, 1)]:
        for way in (lambda *a: kernel(*a, "cpu"), lambda *a: bnp_precondition(*a[:5], groups=a[5])):
            with pytest.raises(ValueError, match="do not match"):
                way(*bad)
    half = (grad_w.half(), grad_b.half(), mean, var_t, q2, 1)  # not the C kernel's: the composite's values
    torch.testing.assert_close(kernel(*half, "cpu"), kernel(*half, "composite"), rtol=0, atol=0)


def test_dense_single_sample_uses_running_mean_for_variance():
    layer = nn.Linear(3, 2).double()
    distnorm.bnp.attach(layer, decay=RHO)
    x1 = torch.randn(8, 3, dtype=torch.float64)
    layer(x1).sum().backward()
    mu1 = layer.bnp_mean.clone()
    var1 = layer.bnp_var.clone()
    x2 = torch.randn(1, 3, dtype=torch.float64)
    layer(x2).sum().backward()
    torch.testing.assert_close(layer.bnp_mean, RHO * mu1 + (1 - RHO) * x2[0])
    torch.testing.assert_close(layer.bnp_var, RHO * var1 + (1 - RHO) * (x2[0] - mu1) ** 2)


def test_no_grad_and_eval_forwards_touch_nothing():
    plain = nn.Conv2d(3, 4, 3).double()
    layer = copy.deepcopy(plain)
    distnorm.bnp.attach(layer)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
    assert torch.equal(layer.bnp_mean, torch.zeros(3, dtype=torch.float64))
    layer.eval(), plain.eval()
    layer(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(layer.bnp_var, torch.ones(3, dtype=torch.float64))
    assert torch.equal(layer.weight.grad, plain.weight.grad)  # eval: plain gradient


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.ReLU(),
        nn.Conv2d(8, 8, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def test_detach_restores_bit_identical_behaviour():
    reference = _small_cnn()
    model = copy.deepcopy(reference)
    keys = list(model.state_dict())
    handle = distnorm.bnp.attach(model)
    x = torch.randn(4, 3, 6, 6)
    with torch.no_grad():  # attached and untrained: the forward value is unchanged
        assert torch.equal(model(x), reference(x))
    handle.detach()
    assert list(model.state_dict()) == keys
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not any(hasattr(m, "_distnorm_bnp") for m in model.modules())
    for m in (model, reference):
        m(x).square().sum().backward()
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), reference.named_parameters()):
        assert n1 == n2 and torch.equal(p1.grad, p2.grad), n1
    assert torch.equal(model(x), reference(x))


def test_detach_warns_about_trained_added_bias():
    model = nn.Sequential(nn.Linear(4, 3, bias=False))
    handle = distnorm.bnp.attach(model)
    with torch.no_grad():
        model[0].bias.fill_(0.5)
    with pytest.warns(UserWarning, match=r"\['0'\]"):
        handle.detach()
    assert model[0].bias is None


def test_handle_state_dict_round_trip_and_model_state_dict():
    model = _small_cnn()
    handle = distnorm.bnp.attach(model, exclude=["9"])
    assert set(handle.layers) == {"0", "3", "5"}
    model(torch.randn(4, 3, 6, 6)).sum().backward()
    assert "0.bnp_mean" in model.state_dict() and "9.bnp_mean" not in model.state_dict()
    saved = handle.state_dict()
    other = _small_cnn()
    other_handle = distnorm.bnp.attach(other, exclude=[nn.Linear])
    other_handle.load_state_dict(saved)
    for name in handle.layers:
        assert torch.equal(other_handle.layers[name].bnp_var, handle.layers[name].bnp_var)
    other2 = _small_cnn()
    distnorm.bnp.attach(other2, exclude=["9"])
    other2.load_state_dict(model.state_dict())  # the moments travel with the model's state_dict
    assert torch.equal(other2[0].bnp_mean, model[0].bnp_mean)
    with pytest.raises(ValueError, match="configuration"):
        distnorm.bnp.attach(_small_cnn(), decay=0.9, exclude=["9"]).load_state_dict(saved)
    assert distnorm.check_consistency(model) == 6


def test_moments_stay_float32_after_bfloat16():
    model = nn.Sequential(nn.Linear(4, 4))
    distnorm.bnp.attach(model)
    model.bfloat16()
    model(torch.randn(8, 4, dtype=torch.bfloat16)).float().sum().backward()
    assert model[0].bnp_mean.dtype == torch.float32
    assert model[0].weight.grad.dtype == torch.bfloat16


def test_bad_input():
    model = _small_cnn()
    distnorm.bnp.attach(model)
    with pytest.raises(ValueError, match="already attached"):
        distnorm.bnp.attach(model)
    with pytest.raises(TypeError, match="ConvTranspose2d"):
        distnorm.bnp.attach(_small_cnn(), layers=(nn.Conv2d, nn.ConvTranspose2d))
    with pytest.raises(ValueError, match="no layer"):
        distnorm.bnp.attach(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match="decay"):
        distnorm.bnp.attach(_small_cnn(), decay=1.0)
    with pytest.raises(ValueError, match="both be 0"):
        distnorm.bnp.attach(_small_cnn(), eps1=0, eps2=0)


# ---------------------------------------------------------------- 2 ranks under DDP
def _ddp_worker(rank, world, steps=3):
    torch.manual_seed(123)
    x_all = torch.randn(8, 3, 6, 6)
    y_all = torch.randint(0, 5, (8,))

    reference = _small_cnn()
    distnorm.bnp.attach(reference)
    model = _small_cnn()
    distnorm.bnp.attach(model)
    with pytest.raises(TypeError, match="already wrapped by torch DistributedDataParallel"):
        distnorm.bnp.attach(DDP(_small_cnn(), **distnorm.ddp_kwargs()))
    ddp = DDP(model, **distnorm.ddp_kwargs())

    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    half = x_all.shape[0] // world
    lo, hi = rank * half, (rank + 1) * half
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(steps):
        opt_ref.zero_grad()
        loss_fn(reference(x_all), y_all).backward()
        opt.zero_grad()
        loss_fn(ddp(x_all[lo:hi]), y_all[lo:hi]).backward()
        for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5, msg=name)
        for name, b in reference.named_buffers():
            torch.testing.assert_close(dict(model.named_buffers())[name], b, atol=1e-6, rtol=1e-5, msg=name)
        opt_ref.step()
        opt.step()
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p, p_ref, atol=1e-6, rtol=1e-5)
    assert distnorm.check_consistency(ddp) == 8
    # The group agreed on the C kernels at its first step: every preconditioned layer's
    # backward on this rank runs BNP's C kernel (its 4 layers: 3 convolutions, 1 linear).
    with OpCounter() as counter:
        loss_fn(ddp(x_all[lo:hi]), y_all[lo:hi]).backward()
    assert counter.ops.count("distnorm.bnp_precondition.default") == 4, counter.table()
    return {name: b.clone() for name, b in model.named_buffers()}


@pytest.mark.world_size(2)
def test_ddp_two_ranks_equal_one_process(tmp_path):
    b0, b1 = run_distributed(_ddp_worker, 2, tmp_path)
    for name in b0:
        assert torch.equal(b0[name], b1[name]), name


# ---------------------------------------------------------------- the paths GPU users take
class _StandardizedConv(nn.Conv2d):
    """A conv subclass with its own forward (weight standardization and 'same' padding,
    like timm's StdConv2dSame)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        pad = self.kernel_size[0] // 2
        return nn.functional.conv2d(nn.functional.pad(x, (pad, pad, pad, pad)), w, self.bias, self.stride)


def test_bnp_keeps_a_subclass_forward():
    """BNP keeps a subclass's own forward: an attached ``_StandardizedConv`` keeps its class
    and computes what it computed before, and BNP takes q² from its real output (5 x 5 here,
    where nn.Conv2d's formula without padding gives 4 x 4). Before, BNP replaced the layer's
    forward with nn.Conv2d's, silently changing a subclass's output (by 10.3 in the review)."""
    torch.manual_seed(0)
    plain = nn.Sequential(_StandardizedConv(3, 4, 3, stride=2))
    model = copy.deepcopy(plain)
    distnorm.bnp.attach(model)
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(model(x), plain(x))
    assert type(model[0]).__name__ == "_StandardizedConv" and isinstance(model[0], _StandardizedConv)
    y = model(x)
    y.square().sum().backward()
    # q² from the real output (5 x 5 here; nn.Conv2d's formula without padding gives 4 x 4)
    assert y.shape[-1] == 5


def test_bnp_refuses_layers_whose_forward_never_runs():
    """BNP refuses a layer whose forward never runs, naming it: ``nn.MultiheadAttention``'s
    ``out_proj`` when attaching (the attention uses its weight without its forward), and at the
    first forward a layer whose weight the model reads without calling it. Before,
    nn.MultiheadAttention.out_proj was attached but never preconditioned."""
    attention = nn.Sequential(nn.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match=r"0\.out_proj"):
        distnorm.bnp.attach(attention)

    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return nn.functional.linear(self.used(x), self.unused.weight)  # weight without the forward

    model = Skips()
    distnorm.bnp.attach(model)
    with pytest.raises(ValueError, match=r"\['unused'\]"):
        model(torch.randn(8, 4))


def test_bnp_q2_follows_the_output_size():
    torch.manual_seed(0)
    layer = nn.Sequential(_StandardizedConv(3, 4, 3, stride=2))
    distnorm.bnp.attach(layer, decay=0.0, eps1=0.0, eps2=1.0)
    x = torch.randn(2, 3, 9, 9)
    layer(x).sum().backward()
    conv = layer[0]
    fan_in = 3 * 3 * 3
    expected = max(fan_in / 2, math.sqrt(5 * 5))  # N = 2 samples, output 5 x 5
    assert expected == 13.5
    # bias gradient of a plain conv on the same input, transformed with q2 by hand
    plain = _StandardizedConv(3, 4, 3, stride=2)
    plain.load_state_dict({k: v for k, v in conv.state_dict().items() if not k.startswith("bnp_")})
    plain(x).sum().backward()
    mean = x.mean((0, 2, 3))
    var_t = x.var((0, 2, 3), unbiased=False) + 1.0
    gw = (plain.weight.grad - mean.view(1, 3, 1, 1) * plain.bias.grad.view(4, 1, 1, 1)) / (expected * var_t.view(1, 3, 1, 1))
    torch.testing.assert_close(conv.weight.grad, gw, atol=1e-5, rtol=1e-5)
