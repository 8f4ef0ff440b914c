"""The fused per-channel operators (``distnorm::cbn_plan``, ``cbn_param_grads``,
``shift_slope``; :mod:`distnorm._fused`): their Triton kernels (the CUDA path) equal the
ATen composite (the CPU path, itself checked against float64 references in
``test_layers.py``), and the operators are well-formed for ``torch.compile``.

The Triton kernels run here through Triton's interpreter on CPU tensors (a second copy of
``distnorm/_triton.py`` loaded with ``TRITON_INTERPRET=1``); on a GPU, the same comparison
runs compiled (``make test-gpu``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from distnorm import _fused

C = 70  # not a power of two: the last block is partial

CASES = {  # name: keyword arguments of _plan_args
    "history": dict(history=True),
    "no_history": dict(history=False),
    "device_count": dict(history=True, device_count=True),
    "device_count_masked": dict(history=True, device_count=True, masked=True),
    "amat_uninitialized": dict(history=True, initialized=False),
    "cumulative_momentum": dict(history=True, device_count=True, momentum=None),
    "popnorm": dict(history=False, device_count=True, rho=1.0, r_max=1.0),
    "bf16_parameters": dict(history=True, param_dtype=torch.bfloat16),
    # more channels than one block (1024): ResNet-50's 2048 and a partial third block
    "many_channels": dict(history=True, device_count=True, channels=2100),
}


def _plan_args(*, history, device_count=False, masked=False, initialized=True, momentum=0.1, rho=1.5, r_max=2.0,
               param_dtype=torch.float32, device="cpu", seed=0, channels=C) -> tuple:
    """Arguments of ``distnorm::cbn_plan``: batch statistics with means near zero and far
    from it (both branches of ``r_mu``), every buffer, a count on the host or the device."""
    g, c = torch.Generator().manual_seed(seed), channels
    mean = torch.randn(c, generator=g) * torch.tensor([0.01, 3.0]).repeat(c // 2)
    var = torch.rand(c, generator=g) + 0.1
    weight, bias = (torch.rand(c, generator=g) + 0.5).to(param_dtype), (torch.randn(c, generator=g) * 0.3).to(param_dtype)
    buffers = [torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5, torch.tensor(initialized),
               torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5, torch.tensor(3)]
    count = torch.full((c,), 1.0 if masked else 512.0) if device_count else None
    args = (mean, var, count, -1 if device_count else 512, device_count and not masked, weight, bias,
            torch.tensor(0.6), *buffers, 1e-5, momentum, rho, r_max, history, False)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        if w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=f"output {i}")
        else:
            assert torch.equal(g, w), i


@pytest.fixture(scope="module")
def interpreted():
    """``distnorm/_triton.py`` loaded again with ``TRITON_INTERPRET=1``: the same kernels,
    run by Triton's interpreter on CPU tensors."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (installed with torch on Linux)")
    path = Path(_fused.__file__).with_name("_triton.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location("distnorm_triton_interpreted", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _run_plan_kernel(triton_module, args: tuple) -> tuple:
    (mean, var, count, host_count, _valid_known, weight, bias, eta, *buffers, eps, momentum, rho, r_max,
     history, _ready) = args
    return triton_module.cbn_plan(mean, var, count, host_count, weight, bias, eta, *buffers, eps, momentum, rho,
                                  r_max, history, kernels=triton_module.KERNELS)


# numpy's warnings about the masked step's n / (n - 1) = inf, which the kernel discards
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("case", CASES)
def test_triton_plan_kernel_equals_composite(interpreted, case):
    """Bugs caught: a formula of the kernel that differs from the composite (outputs or
    buffer updates), a masked step that still writes, a counter or flag not updated."""
    args = _plan_args(**CASES[case])
    composite_args, kernel_args = _clone(args), _clone(args)
    want = _fused.cbn_plan_composite(*composite_args)
    got = _run_plan_kernel(interpreted, kernel_args)
    _assert_close(list(got) + list(kernel_args[8:14]), list(want) + list(composite_args[8:14]))
    if CASES[case].get("masked"):  # an all-empty global batch changes no buffer
        _assert_close(list(kernel_args[8:14]), list(args[8:14]))


def test_triton_backward_kernels_equal_composite(interpreted):
    g = torch.Generator().manual_seed(1)
    s1, t, beta_coef, a = (torch.randn(C, generator=g) for _ in range(4))
    _assert_close(interpreted.cbn_param_grads(s1, t, beta_coef, a, 1 / 1.5, kernels=interpreted.KERNELS),
                  torch.ops.distnorm.cbn_param_grads(s1, t, beta_coef, a, 1 / 1.5))
    coef, sums = torch.randn(2, 2, C, generator=g), torch.randn(2, C, generator=g)
    _assert_close(interpreted.shift_slope(coef, sums, kernels=interpreted.KERNELS),
                  torch.ops.distnorm.shift_slope(coef, sums))


def test_a_triton_launch_failure_falls_back_to_the_composite_once_and_for_all(monkeypatch):
    """Bug caught: a Triton that imports but cannot build its launcher or compile here (no C
    compiler, no libcuda for it, an unsupported GPU) crashing the first training step."""
    monkeypatch.setattr(_fused, "_TRITON_FAILED", [])

    def launch():
        raise RuntimeError("Failed to find C compiler")

    with pytest.warns(RuntimeWarning, match="distnorm::cbn_plan failed to launch .*Failed to find C compiler"):
        assert _fused._triton_or_composite("cbn_plan", launch, lambda: ("composite",)) == ("composite",)
    assert not _fused.triton_enabled()  # from now on: the composite, without trying again


def test_triton_takes_only_tensors_on_the_statistics_device():
    """Bug caught: a CPU 0-dim ``eta`` (the functional API passes a user's through) handed to
    the CUDA kernel as a pointer. (``meta`` stands in for the CUDA device.)"""
    mean, buffers = torch.empty(C, device="meta"), tuple(torch.empty(C, device="meta") for _ in range(4))
    on_meta = (torch.empty(C, device="meta"), torch.empty((), device="meta"))
    assert _fused._on_one_device(mean, None, *buffers, *on_meta)
    assert not _fused._on_one_device(mean, None, *buffers, torch.tensor(0.5))
    assert not _fused._triton_takes_plan(mean, None, 512, buffers, (torch.tensor(0.5),))


def test_operators_are_well_formed_for_torch_compile():
    """``torch.library.opcheck``: schema and declared mutations, fake kernels (shapes for
    ``torch.compile``), no autograd registration needed (they run under no_grad)."""
    for case in ("history", "device_count"):
        torch.library.opcheck(torch.ops.distnorm.cbn_plan.default, _plan_args(**CASES[case]))
    s1, t = torch.randn(C), torch.randn(C)
    torch.library.opcheck(torch.ops.distnorm.cbn_param_grads.default, (s1, t, torch.randn(C), torch.rand(C), 0.5))
    torch.library.opcheck(torch.ops.distnorm.shift_slope.default, (torch.randn(2, 2, C), torch.randn(2, C)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES)
def test_cuda_fused_operators_equal_composite(case):
    """On a GPU: the compiled Triton kernels (the operators' CUDA path) against the composite
    on the same CUDA tensors."""
    if not _fused.triton_enabled():
        pytest.skip("Triton kernels not enabled on this machine (no triton, or DISTNORM_TRITON=0)")
    args = _plan_args(**CASES[case], device="cuda")
    composite_args, op_args = _clone(args), _clone(args)
    want = _fused.cbn_plan_composite(*composite_args)
    got = torch.ops.distnorm.cbn_plan(*op_args)
    _assert_close([x.cpu() for x in list(got) + list(op_args[8:14])],
                  [x.cpu() for x in list(want) + list(composite_args[8:14])])
    s1, t, beta_coef, a = (torch.randn(C, device="cuda") for _ in range(4))
    _assert_close(torch.ops.distnorm.cbn_param_grads(s1, t, beta_coef, a, 0.5),
                  _fused._cbn_param_grads_composite(s1, t, beta_coef, a, 0.5))
    coef, sums = torch.randn(2, 2, C, device="cuda"), torch.randn(2, C, device="cuda")
    _assert_close(torch.ops.distnorm.shift_slope(coef, sums), _fused._shift_slope_composite(coef, sums))
