"""distnorm.freeze: a trained model as plain torch.nn, equal to it in eval mode, loadable and
exportable without distnorm. Each test says the behaviour it holds; tests/README.md and
tests/mutants.py name the bugs they catch."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import distnorm
from distnorm import models

ZOO = ["resnet20", "resnet18", "resnet50", "efficientnet_b0", "vgg16"]
#: The training batch of each zoo model: EfficientNet-B0 reduces 32 px to 1 x 1, where a batch
#: of 4 gives each BatchNorm 4 values a channel, statistics so noisy that the evaluation output
#: grows to 1e8; at 64 px and 8 images it stays near 10.
SHAPES = {"efficientnet_b0": (8, 3, 64, 64)}
#: (norm, BNP attached): every conversion, BNP with the two norms it is used with.
NORMS = [("cbn", False), ("popnorm", False), ("bn", False), ("bn", True), ("gn", True)]


def _trained(model: nn.Module, dtype: torch.dtype, shape=(4, 3, 32, 32), steps: int = 2, bnp: bool = False):
    """``model`` after ``steps`` SGD steps on random data (learning rates that move AMAT's eta
    across its phases), in ``dtype``; its buffers hold trained statistics."""
    torch.manual_seed(0)
    model = model.to(dtype)
    if bnp:
        distnorm.bnp.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
    for step in range(steps):
        distnorm.set_lr(model, [0.05, 0.01, 0.002][step % 3])
        x = torch.randn(*shape, dtype=dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.no_grad():
        # Ten more batches' statistics (no update of the weights): after two steps alone the
        # running and AMAT statistics are far from the batches', and a deep network's
        # evaluation output grows without bound (EfficientNet-B0's reached 1e50).
        for _ in range(10):
            distnorm.set_lr(model, 0.002)
            model(torch.randn(*shape, dtype=dtype))
        for module in model.modules():  # biases BNP added moved by training, as a long run moves them
            state = module.__dict__.get("_distnorm_bnp")
            if state is not None and state.added_bias:
                module.bias.add_(0.01)
    return model.eval()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, float32: float = 1e-6) -> None:
    """Equal to ``want`` within 1e-12 (float64) or ``float32`` (1e-6) of its largest value."""
    tol = (1e-12 if dtype == torch.float64 else float32) * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def _torch_only(model: nn.Module) -> None:
    """Nothing of distnorm in ``model`` but an architecture of its zoo (``distnorm.models``):
    every norm a torch.nn module, no distnorm attribute or BNP buffer left; eval mode."""
    classes = {f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}
    ours = sorted(c for c in classes if c.startswith("distnorm.") and not c.startswith("distnorm.models."))
    assert not ours, ours
    norms = {type(m) for m in model.modules() if isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm))}
    assert all(cls.__module__.startswith(("torch.nn.", "timm.")) for cls in norms), norms  # timm: its BatchNormAct2d
    assert not [k for m in model.modules() for k in m.__dict__ if k.startswith("_distnorm")]
    assert not any(name.endswith(("bnp_mean", "bnp_var")) for name, _ in model.named_buffers())
    assert not model.training and not any(m.training for m in model.modules())


@pytest.mark.parametrize("norm,bnp", NORMS, ids=[f"{n}{'+bnp' if b else ''}" for n, b in NORMS])
@pytest.mark.parametrize("name", ZOO)
def test_the_frozen_zoo_model_computes_what_the_trained_one_does(name, norm, bnp):
    """Every zoo model under every conversion, trained for two steps in float64: its frozen
    copy is plain torch.nn in eval mode and gives the distnorm model's evaluation output to
    1e-12; the trained model is left as it was."""
    shape = SHAPES.get(name, (4, 3, 32, 32))
    model = _trained(models.create(name, num_classes=10, norm=norm), torch.float64, shape, bnp=bnp)
    before = copy.deepcopy(model.state_dict())
    frozen = distnorm.freeze(model)
    _torch_only(frozen)
    x = torch.randn(3, *shape[1:], dtype=torch.float64)
    with torch.no_grad():
        _close(frozen(x), model(x), torch.float64)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert type(model.__dict__.get("_distnorm_conversion")).__module__ == "distnorm.convert"


@pytest.mark.parametrize("eval_stats", ["amat", "running", "auto"])
def test_the_frozen_cbn_uses_the_statistics_eval_stats_names(eval_stats):
    """A CBN ResNet in float32 (the training dtype), each ``eval_stats``: the frozen affine
    holds the statistics that setting picks, to float32 rounding."""
    model = _trained(models.create("resnet20", num_classes=10, norm="cbn", norm_kwargs={"eval_stats": eval_stats}),
                     torch.float32, steps=3)
    frozen = distnorm.freeze(model)
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        _close(frozen(x), model(x), torch.float32)


@pytest.mark.parametrize("norm", ["cbn", "bn", "gn"])
def test_timm_models_freeze(norm):
    """timm's EfficientNet-B0 (its fused ``BatchNormAct2d``) converted to each norm: frozen,
    plain torch.nn, equal in eval mode."""
    timm = pytest.importorskip("timm")
    model = _trained(distnorm.convert(timm.create_model("efficientnet_b0", num_classes=10), norm=norm),
                     torch.float64, bnp=norm == "gn")
    frozen = distnorm.freeze(model)
    _torch_only(frozen)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        _close(frozen(x), model(x), torch.float64)


@pytest.mark.parametrize("bnp", [False, True])
def test_a_bn_model_loads_into_the_stock_torchvision_model(bnp):
    """A torchvision ResNet-18 trained with ``norm="bn"`` (BNP on or off): the frozen model's
    state_dict loads into a stock ``torchvision.models.resnet18`` with ``strict=True`` (BNP's
    added convolution biases moved into the BatchNorms after them), which then computes the
    same outputs."""
    torchvision = pytest.importorskip("torchvision")
    model = _trained(distnorm.convert(torchvision.models.resnet18(num_classes=10), norm="bn"), torch.float64,
                     bnp=bnp)
    frozen = distnorm.freeze(model)
    stock = torchvision.models.resnet18(num_classes=10).double().eval()
    stock.load_state_dict(frozen.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        _close(stock(x), model(x), torch.float64)


def test_a_bn_model_loads_into_the_stock_timm_model():
    """timm's EfficientNet-B0 trained with ``norm="bn"``: its frozen state_dict loads into
    ``timm.create_model("efficientnet_b0")`` with ``strict=True``."""
    timm = pytest.importorskip("timm")
    model = _trained(distnorm.convert(timm.create_model("efficientnet_b0", num_classes=10), norm="bn"),
                     torch.float64)
    stock = timm.create_model("efficientnet_b0", num_classes=10).double().eval()
    stock.load_state_dict(distnorm.freeze(model).state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        _close(stock(x), model(x), torch.float64)


@pytest.mark.parametrize("norm", ["cbn", "bn"])
def test_fold_merges_affines_where_exact(norm):
    """``fold=True``: CBN's affine folded into each convolution without padding (the 1x1
    shortcuts) and into the classifier, BatchNorms after convolutions fused into them; the
    padded 3x3 convolutions keep their affine; the output stays equal."""
    torchvision = pytest.importorskip("torchvision")
    model = _trained(distnorm.convert(torchvision.models.resnet18(num_classes=10), norm=norm), torch.float64)
    plain, folded = distnorm.freeze(model), distnorm.freeze(model, fold=True)
    count = lambda m: sum(isinstance(x, nn.BatchNorm2d) for x in m.modules())  # noqa: E731
    assert count(folded) < count(plain)
    if norm == "cbn":
        assert isinstance(folded.fc, nn.Linear) and isinstance(folded.layer2[0].downsample[0], nn.Conv2d)
        assert isinstance(folded.layer1[0].conv1, nn.Sequential)  # padded: the affine stays in front
    else:
        assert count(folded) == 0
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        _close(folded(x), model(x), torch.float64)


def test_a_wrapped_model_freezes_its_module():
    model = _trained(models.create("resnet20", num_classes=10, norm="cbn"), torch.float64)
    frozen = distnorm.freeze(nn.DataParallel(model))
    _torch_only(frozen)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        _close(frozen(x), model(x), torch.float64)


def _exported(name: str, norm: str, bnp: bool = False) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A zoo model trained in float32, with its frozen copy and an input."""
    shape = SHAPES.get(name, (4, 3, 32, 32))
    model = _trained(models.create(name, num_classes=10, norm=norm), torch.float32, shape, bnp=bnp)
    x = torch.randn(2, *shape[1:])
    return model, distnorm.freeze(model), x


EXPORTED = [("cbn", False), ("bn", True), ("gn", True)]


@pytest.mark.parametrize("norm,bnp", EXPORTED, ids=[f"{n}{'+bnp' if b else ''}" for n, b in EXPORTED])
@pytest.mark.parametrize("name", ZOO)
def test_the_frozen_model_exports_and_scripts(name, norm, bnp):
    """``torch.export.export`` and ``torch.jit.script`` take every frozen zoo model (CBN; BN and
    GN with BNP); both compute its outputs, in float32 to 1e-6 of the largest output — 1e-5 for
    BN with BNP, whose convolution biases moved into the BatchNorms: one subtraction per
    channel rounded otherwise (``running_mean - bias`` once, not ``conv + bias - running_mean``
    each time), which a deep network's evaluation amplifies (ResNet-50: 2.4e-6 measured)."""
    model, frozen, x = _exported(name, norm, bnp)
    tol = 1e-5 if norm == "bn" and bnp else 1e-6
    with torch.no_grad():
        want = model(x)
        _close(frozen(x), want, torch.float32, tol)
        _close(torch.export.export(frozen, (x,)).module()(x), want, torch.float32, tol)
        _close(torch.jit.script(frozen)(x), want, torch.float32, tol)


ONNX_CASES = [(name, True) for name in ZOO] + [("resnet20", False)]


@pytest.mark.parametrize("name,dynamo", ONNX_CASES, ids=[f"{n}-{'dynamo' if d else 'torchscript'}" for n, d in ONNX_CASES])
def test_onnx_runtime_runs_the_frozen_model(tmp_path, name, dynamo):
    """torch.export's ONNX exporter writes every frozen zoo model (CBN), the TorchScript one the
    CIFAR ResNet; ONNX Runtime's output equals PyTorch's within float32 rounding: 1e-4 of the
    largest output (its convolutions sum in another order; ResNet-50 9e-5 measured, the CIFAR
    ResNet and VGG-16 1e-6)."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript" if dynamo else "onnx")
    model, frozen, x = _exported(name, "cbn")
    path = tmp_path / "model.onnx"
    torch.onnx.export(frozen, (x,), str(path), dynamo=dynamo, input_names=["x"], **({"verbose": False} if dynamo else {}))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = model(x)
    _close(torch.from_numpy(got), want, torch.float32, 1e-4)


@pytest.mark.processes
def test_the_frozen_model_loads_where_distnorm_cannot_be_imported(tmp_path):
    """A pickled frozen model (torchvision's ResNet-18 trained with CBN) loads and runs in a
    process where ``import distnorm`` fails. (An architecture of distnorm's own zoo needs its
    class to unpickle: TorchScript, torch.export and ONNX carry it instead.)"""
    torchvision = pytest.importorskip("torchvision")
    model = _trained(distnorm.convert(torchvision.models.resnet18(num_classes=10), norm="cbn"), torch.float32)
    frozen, x = distnorm.freeze(model), torch.randn(2, 3, 32, 32)
    torch.save(frozen, tmp_path / "frozen.pt")
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.save(model(x), tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["distnorm"] = None  # import distnorm raises
        import torch
        model = torch.load({str(tmp_path / 'frozen.pt')!r}, weights_only=False)
        x, want = torch.load({str(tmp_path / 'x.pt')!r}), torch.load({str(tmp_path / 'want.pt')!r})
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, rtol=0, atol=1e-6 * float(want.abs().max()))
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_sharded_or_opaque_wrapper_is_refused_with_what_to_do():
    class Opaque(nn.Module):  # not a registered engine: frozen as any module
        def __init__(self):
            super().__init__()
            self.inner = models.create("resnet20", num_classes=10, norm="cbn")

        def forward(self, x):
            return self.inner(x)

    _torch_only(distnorm.freeze(Opaque()).inner)
    with pytest.raises(TypeError, match="wrap it in a container"):
        distnorm.freeze(distnorm.CBN(4))


@pytest.mark.parametrize("norm", ["cbn", "popnorm", "gn"])
def test_revert_after_training_warns_and_names_freeze(norm):
    """``revert`` brings back the BatchNorms a trained CBN / POP-Norm / GN model replaced, as
    they were before training: it says so and names ``freeze``; before training it is silent."""
    torchvision = pytest.importorskip("torchvision")
    fresh = distnorm.convert(torchvision.models.resnet18(num_classes=10), norm=norm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distnorm.revert(fresh)
    model = _trained(distnorm.convert(torchvision.models.resnet18(num_classes=10), norm=norm), torch.float32)
    with pytest.warns(UserWarning, match=r"revert: \d+ trained distnorm layer.*distnorm.freeze\(model\)"):
        distnorm.revert(model)


def test_revert_of_a_bn_model_keeps_what_it_trained_after_a_move():
    """``revert`` of a ``norm="bn"`` model gives back BatchNorms holding the trained parameters
    and statistics, also after ``model.to(dtype)`` (which gives the synchronized layers new
    buffers, not shared with the originals any more)."""
    torchvision = pytest.importorskip("torchvision")
    model = _trained(distnorm.convert(torchvision.models.resnet18(num_classes=10), norm="bn"), torch.float64)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
        reverted = distnorm.revert(model).eval()
        assert type(reverted.bn1) is nn.BatchNorm2d and reverted.bn1.running_mean.dtype == torch.float64
        _close(reverted(x), want, torch.float64)
