"""distnorm's GroupNorm (:class:`distnorm.GroupNorm`, :func:`distnorm.functional.group_norm`):
the values of ``torch.nn.GroupNorm`` in float64, the input's layout and dtype kept (under
autocast too), the Triton kernels of its CUDA path (run here in Triton's interpreter) equal to
a float64 reference on every layout and across many tiles and slices, the launches a GPU pays,
and the paths users take: ``torch.compile``, activation checkpointing, ``convert(norm="gn")``
and :func:`distnorm.freeze` back to ``nn.GroupNorm``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import distnorm
from distnorm import _gn_kernels, _kernels
from tests.test_fused import triton_launches

#: Largest error against float64, in units of the dtype's epsilon times the output's scale.
ULPS = {torch.float64: 64, torch.float32: 64, torch.bfloat16: 2, torch.float16: 2}

LAYOUTS = {  # name: (shape, groups, make the input's layout)
    "nchw": ((3, 8, 5, 7), 4, lambda t: t),
    "channels_last": ((3, 8, 5, 7), 2, lambda t: t.to(memory_format=torch.channels_last)),
    "channels_last_3d": ((2, 6, 3, 4, 5), 3, lambda t: t.to(memory_format=torch.channels_last_3d)),
    "sequence": ((2, 6, 9), 3, lambda t: t),
    "flat": ((4, 12), 4, lambda t: t),
    "strided": ((3, 8, 5, 14), 4, lambda t: t[..., ::2]),  # neither layout: copied to NCHW first
    "one_group_per_channel": ((2, 4, 3, 3), 4, lambda t: t.to(memory_format=torch.channels_last)),
}


def _inputs(name: str, dtype: torch.dtype, affine: bool = True, seed: int = 0):
    shape, groups, layout = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    full = list(shape)
    x = layout((torch.randn(*full, generator=g) * 3 + 5).to(dtype))  # a mean far from 0: cancellation shows
    channels = shape[1]
    weight = torch.rand(channels, generator=g) + 0.5 if affine else None
    bias = torch.randn(channels, generator=g) if affine else None
    grad = layout(torch.randn(*full, generator=g).to(dtype))
    return x, groups, weight, bias, grad


def _reference(x, groups, weight, bias, grad):
    """``F.group_norm`` in float64, and its gradients."""
    xd = x.detach().double().requires_grad_()
    params = [p.detach().double().requires_grad_() if p is not None else None for p in (weight, bias)]
    y = F.group_norm(xd, groups, *params, eps=1e-5)
    y.backward(grad.double())
    return y, xd.grad, *(p.grad if p is not None else None for p in params)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = expected.abs().max().item() + 1.0
    limit = ULPS[dtype] * torch.finfo(dtype).eps * scale
    err = (actual.double() - expected).abs().max().item()
    assert err <= limit, f"{what}: max error {err:.3g} > {limit:.3g} ({dtype})"


def _check_against_reference(run, name: str, dtype: torch.dtype, affine: bool, device: str = "cpu") -> None:
    x, groups, weight, bias, grad = _inputs(name, dtype, affine)
    y_ref, gx_ref, gw_ref, gb_ref = _reference(x, groups, weight, bias, grad)
    on = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731 (to() keeps the layout)
    y, gx, gw, gb = (t.cpu() if t is not None else None for t in run(*map(on, (x, groups, weight, bias, grad))))
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    assert y.stride() == torch.empty_like(x).stride() and gx.stride() == torch.empty_like(x).stride()
    _assert_close(y, y_ref, dtype, "output")
    _assert_close(gx, gx_ref, dtype, "input gradient")
    if affine:
        assert gw.dtype == weight.dtype and gb.dtype == bias.dtype
        # sums over the batch, in the parameters' dtype (float32)
        _assert_close(gw, gw_ref, weight.dtype, "weight gradient")
        _assert_close(gb, gb_ref, bias.dtype, "bias gradient")


def _through_autograd(x, groups, weight, bias, grad):
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() if p is not None else None for p in (weight, bias)]
    y = distnorm.functional.group_norm(x, groups, *params, eps=1e-5)
    y.backward(grad)
    return y, x.grad, *(p.grad if p is not None else None for p in params)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_group_norm_is_float64_group_norm(layout: str, dtype: torch.dtype, affine: bool) -> None:
    """The operator's CPU path (ATen's kernel in the accumulation dtype): output and gradients
    within a few units of the dtype of float64's, in the input's dtype and layout, the
    parameters' gradients in theirs."""
    _check_against_reference(_through_autograd, layout, dtype, affine)


@pytest.fixture(scope="module")
def interpreted():
    """``distnorm/_triton.py`` in Triton's interpreter (CPU tensors)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (installed with torch on Linux)")
    return _kernels.interpreted_kernels()


@pytest.fixture
def small_tiles(interpreted, monkeypatch):
    """Tiles of 16 values and slices of 32 (GPU-sized ones would cover these inputs in one
    tile): the merges across tiles and slices run."""
    monkeypatch.setattr(interpreted, "_GN_TILE", 16)
    monkeypatch.setattr(interpreted, "_GN_SLICE", 32)
    return interpreted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_kernels_are_float64_group_norm(interpreted, monkeypatch, layout: str, dtype: torch.dtype) -> None:
    """CUDA's path: the operator with the Triton kernels (``DISTNORM_TRITON=interpret`` puts them
    on the CPU) against float64, in the input's dtype and layout."""
    monkeypatch.setenv("DISTNORM_TRITON", "interpret")
    _check_against_reference(_through_autograd, layout, dtype, affine=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_triton_kernels_merge_tiles_and_slices(small_tiles, monkeypatch, layout: str, affine: bool,
                                               dtype: torch.dtype) -> None:
    """The same at 16-value tiles and 32-value slices: every sample's moments and sums are
    merged across tiles and slices (with and without parameters)."""
    monkeypatch.setenv("DISTNORM_TRITON", "interpret")
    x = _inputs(layout, torch.float32)[0]
    assert small_tiles._gn_plan(x)["slices"] > 1
    _check_against_reference(_through_autograd, layout, dtype, affine)


def test_triton_kernels_slice_a_channels_last_sample(small_tiles) -> None:
    """A channels_last ``(2, 160, 3, 3)`` input at 16-value tiles is read in many slices and
    two channel blocks (128 channels each), which its 8 groups of 20 channels straddle: the
    statistics equal float64's."""
    x = (torch.randn(2, 160, 3, 3) * 2 + 3).to(memory_format=torch.channels_last)
    plan = small_tiles._gn_plan(x)
    assert plan["slices"] > 1 and plan["grid"][2] > 1
    y, mean, rstd = small_tiles.group_norm(x, None, None, 8, 1e-5, kernels=small_tiles.KERNELS)
    view = x.double().reshape(2, 8, -1)
    assert torch.allclose(mean.double(), view.mean(-1), rtol=0, atol=1e-5)
    assert torch.allclose(rstd.double(), (view.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-5, atol=0)


def test_a_layer_step_launches_three_kernels_forward_and_four_backward(interpreted, monkeypatch) -> None:
    """What a GPU pays per GroupNorm step through the operators: three launches forward (the
    slices' moments, the groups' statistics, the output) and four backward; three backward when
    the parameters need no gradient, or the input none."""
    monkeypatch.setenv("DISTNORM_TRITON", "interpret")
    layer = distnorm.GroupNorm(2, 8)
    x = torch.randn(2, 8, 4, 4, requires_grad=True).to(memory_format=torch.channels_last)
    layer(x)  # the first step on a device also checks the kernels (their own test: below)
    with triton_launches("cpu") as counts:
        y = layer(x)
        assert sum(counts.values()) == 3
        y.sum().backward()
    assert sum(counts.values()) == 7 and set(counts.values()) == {1}
    layer.requires_grad_(False)
    with triton_launches("cpu") as counts:
        layer(x).sum().backward()
    assert sum(counts.values()) == 6 and "group_norm_param_grads" not in counts
    layer.requires_grad_(True)
    with triton_launches("cpu") as counts:
        layer(x.detach()).sum().backward()  # the input needs no gradient: its kernel is skipped
    assert sum(counts.values()) == 6 and "group_norm_backward_input" not in counts


def test_triton_kernels_that_compute_something_else_are_refused(interpreted, monkeypatch) -> None:
    """Before its first Triton step on a device, GroupNorm runs the kernels on a small input
    against ATen's: kernels 1 % off raise an error naming ``DISTNORM_TRITON=0``, at every call,
    not a quiet fallback; the real kernels pass and run."""
    monkeypatch.setenv("DISTNORM_TRITON", "interpret")
    real = interpreted.KERNELS["group_norm_stats"]

    class OnePercentOff:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                real[grid](*args, **kwargs)
                args[2].mul_(1.01)  # rstd
            return launch

    layer, x = distnorm.GroupNorm(4, 32), torch.randn(2, 32, 3, 3)
    _gn_kernels._verified.cache_clear()
    monkeypatch.setitem(interpreted.KERNELS, "group_norm_stats", OnePercentOff())
    for _ in range(2):
        with pytest.raises(RuntimeError, match="differ from ATen's GroupNorm.*DISTNORM_TRITON=0"):
            layer(x)
    monkeypatch.setitem(interpreted.KERNELS, "group_norm_stats", real)
    torch.testing.assert_close(layer(x), nn.GroupNorm.forward(layer, x), rtol=1e-5, atol=1e-5)


def test_layer_is_torchs_group_norm_in_float32() -> None:
    """On the CPU, in float32, the layer is ``nn.GroupNorm`` to the bit (the same ATen kernel),
    with the same ``state_dict``; an ``nn.GroupNorm`` checkpoint loads into it."""
    torch.manual_seed(0)
    ours, theirs = distnorm.GroupNorm(4, 8), nn.GroupNorm(4, 8)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(3, 8, 6, 6)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [m(t) for m, t in zip((ours, theirs), xs)]
    assert torch.equal(outs[0], outs[1])
    grad = torch.randn_like(x)
    for out in outs:
        out.backward(grad)
    assert torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(ours.weight.grad, theirs.weight.grad) and torch.equal(ours.bias.grad, theirs.bias.grad)


def test_autocast_keeps_the_input_dtype_and_layout() -> None:
    """Under bf16 autocast a bf16 channels_last input gives a bf16 channels_last output, float32
    parameters keep float32 gradients (``nn.GroupNorm`` on CUDA would give float32 NCHW)."""
    layer = distnorm.GroupNorm(4, 8)
    x = torch.randn(2, 8, 5, 5).to(torch.bfloat16, memory_format=torch.channels_last).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_empty_batch() -> None:
    """A rank's empty batch: an empty output, zero parameter gradients."""
    layer = distnorm.GroupNorm(2, 4)
    x = torch.randn(0, 4, 3, 3, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros(4)) and x.grad.shape == x.shape


@pytest.mark.parametrize("call, message", [
    (lambda: distnorm.functional.group_norm(torch.randn(2, 6, 3), 4), "not divisible by num_groups=4"),
    (lambda: distnorm.functional.group_norm(torch.randn(2, 6, 3), 0), "positive int"),
    (lambda: distnorm.functional.group_norm(torch.randn(6), 2), r"shape \(N, C, \*\)"),
    (lambda: distnorm.functional.group_norm(torch.ones(2, 6, dtype=torch.long), 2), "floating-point input"),
    (lambda: distnorm.functional.group_norm(torch.randn(2, 6, 3), 2, torch.ones(4)), r"weight of shape \(6,\)"),
])
def test_bad_arguments_are_named(call, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_numpy_group_counts_and_a_second_derivative() -> None:
    """``num_groups`` may be any integer type ``F.group_norm`` takes (numpy's); a second
    derivative is refused by name (``once_differentiable``), not computed wrong."""
    import numpy as np

    x = torch.randn(2, 6, 3, requires_grad=True)
    y = distnorm.functional.group_norm(x, np.int64(3))
    assert torch.equal(y, distnorm.functional.group_norm(x, 3))
    (grad,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        grad.sum().backward()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    """``torch.compile(fullgraph=True)`` runs the operators as they are: output and gradients
    equal eager's to the bit."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = distnorm.GroupNorm(4, 8)
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    grads = []
    for fn in (layer, torch.compile(layer, backend=backend, fullgraph=True)):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(torch.ones_like(y))
        grads.append((y.detach(), xi.grad, layer.weight.grad.clone()))
    for eager, compiled in zip(*grads):
        assert torch.equal(eager, compiled)


def test_checkpointed_equals_plain() -> None:
    layer = distnorm.GroupNorm(2, 6)
    x = torch.randn(2, 6, 4, 4)
    results = []
    for wrap in (lambda t: layer(t), lambda t: checkpoint(layer, t, use_reentrant=False)):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        wrap(xi).square().sum().backward()
        results.append((xi.grad, layer.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_convert_builds_it_and_freeze_returns_torchs() -> None:
    """``convert(norm="gn")`` builds distnorm's GroupNorm; :func:`distnorm.freeze` gives back
    ``nn.GroupNorm`` with the same values."""
    model = distnorm.models.create("resnet20", num_classes=10, norm="gn", activation=None)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.GroupNorm)}
    assert kinds == {distnorm.GroupNorm}
    model.eval()
    frozen = distnorm.freeze(model)
    assert {type(m) for m in frozen.modules() if isinstance(m, nn.GroupNorm)} == {nn.GroupNorm}
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(frozen(x), model(x))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: none visible")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_group_norm_is_float64_group_norm(layout: str, dtype: torch.dtype) -> None:
    """The compiled Triton kernels on the GPU against float64, in the input's dtype and layout."""
    _check_against_reference(_through_autograd, layout, dtype, affine=True, device="cuda")


@pytest.mark.cuda
@needs_gpu
def test_cuda_resnet50_sized_group_norm_keeps_channels_last_under_autocast() -> None:
    """ResNet-50's first GroupNorm at batch 32 under bf16 autocast: a bf16 channels_last output
    (``nn.GroupNorm`` gives float32 NCHW), within two bf16 units of float64 (the statistics
    merged over hundreds of programs)."""
    layer = distnorm.GroupNorm(32, 64).cuda()
    x = (torch.randn(32, 64, 56, 56, device="cuda") * 2 + 1).to(torch.bfloat16, memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
        assert nn.GroupNorm.forward(layer, x).dtype == torch.float32
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    expected = F.group_norm(x.double(), 32, layer.weight.double(), layer.bias.double())
    _assert_close(y, expected, torch.bfloat16, "output")
