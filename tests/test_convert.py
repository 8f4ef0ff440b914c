"""distnorm.convert / revert and the model zoo."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distnorm
from distnorm import _state, models
from distnorm.convert import ACTIVATION_MODULES, BATCH_NORMS, NORMS, PreNorm
from tests.distributed import run_distributed

INPUT = {"resnet18": 64, "resnet50": 64, "efficientnet_b0": 64, "resnet20": 32, "vgg16": 32}
NORM_TYPE = {"cbn": distnorm.CBN, "popnorm": distnorm.POPNorm, "bn": distnorm.SyncBatchNorm, "gn": distnorm.GroupNorm}


def _count(model: nn.Module, kind) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def _train_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float = 0.05) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        distnorm.set_lr(model, opt.param_groups[0]["lr"])
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("norm", ["cbn", "popnorm", "bn", "gn", "none"])
@pytest.mark.parametrize("name", models.available())
def test_zoo_model_converts_and_trains(name, norm):
    torch.manual_seed(0)
    bns = _count(models.create(name, num_classes=7, norm="keep"), BATCH_NORMS)
    model = models.create(name, num_classes=7, norm=norm)
    if norm in NORM_TYPE:
        assert _count(model, NORM_TYPE[norm]) == bns
    assert _count(model, nn.modules.batchnorm._BatchNorm) == 0
    if norm in ("cbn", "popnorm"):
        assert _count(model, distnorm.SyncBatchNorm) == 0
        _assert_pre_op(model, NORM_TYPE[norm])

    x = torch.randn(4, 3, INPUT[name], INPUT[name])
    y = torch.randint(0, 7, (4,))
    losses = _train_steps(model, x, y, 2, lr=1e-3)  # plumbing, not learning: un-normalized nets too
    assert all(torch.isfinite(torch.tensor(losses)))

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    twin = models.create(name, num_classes=7, norm=norm)
    twin.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    model.eval(), twin.eval()
    with torch.no_grad():
        out = model(x)
        assert torch.isfinite(out).all() and torch.equal(out, twin(x))


def _assert_pre_op(model: nn.Module, norm_type) -> None:
    """Forward hooks: each converted conv's input is exactly its pre-op norm's output,
    and that norm has the conv's input channel count."""
    seen: dict[str, tuple] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, PreNorm):
            assert isinstance(module.norm, norm_type)
            holder: dict = {}
            handles.append(module.norm.register_forward_hook(lambda m, a, out, h=holder: h.__setitem__("out", out)))
            handles.append(module.op.register_forward_pre_hook(
                lambda m, args, h=holder, n=name: seen.__setitem__(n, (args[0] is h.get("out"), m, h["norm"]))))
            holder["norm"] = module.norm
    assert handles, "no pre-op normalization found"
    model.eval()
    with torch.no_grad():
        size = 32 if isinstance(model, (models.ResNet20, models.VGG16)) else 64
        model(torch.randn(2, 3, size, size))
    model.train()
    for h in handles:
        h.remove()
    assert len(seen) == len(handles) // 2
    for name, (straight, op, norm) in seen.items():
        assert straight, f"{name}: conv input does not come straight from its pre-op norm"
        in_ch = op.in_features if isinstance(op, nn.Linear) else op.in_channels
        assert norm.num_features == in_ch, name


def test_foreign_torchvision_model_converts_and_trains():
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=5)
    bns = _count(model, BATCH_NORMS)
    gates = [n for n, m in model.named_modules() if n.endswith("scale_activation")]
    distnorm.convert(model, norm="cbn", activation="tanh", rho=2.0)
    assert _count(model, distnorm.CBN) == bns and all(m.rho == 2.0 for m in model.modules() if isinstance(m, distnorm.CBN))
    assert gates and all(isinstance(model.get_submodule(g), nn.Hardsigmoid) for g in gates)
    x, y = torch.randn(6, 3, 64, 64), torch.randint(0, 5, (6,))
    losses = _train_steps(model, x, y, 4)
    assert losses[-1] < losses[0]


def test_sequential_linear_batchnorm1d():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
                          nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    distnorm.convert(model, norm="cbn")
    assert isinstance(model[0], PreNorm) and model[0].norm.num_features == 10
    assert isinstance(model[3], PreNorm) and model[3].norm.num_features == 32
    assert isinstance(model[1], nn.Identity) and not isinstance(model[6], PreNorm)
    assert model[0].in_features == 10 and model[0].weight is model[0].op.weight  # attribute forwarding
    x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
    losses = _train_steps(model, x, y, 15)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("norm", ["cbn", "popnorm", "bn", "gn", "none"])
def test_revert_restores_original_forward(norm):
    torch.manual_seed(0)
    original = torchvision.models.resnet18(num_classes=10)
    model = copy.deepcopy(original)
    classes = [type(m) for m in model.modules()]
    distnorm.convert(model, norm=norm, activation="selu")
    distnorm.revert(model)
    assert [type(m) for m in model.modules()] == classes
    assert not distnorm.conversion_summary(model)
    x = torch.randn(2, 3, 64, 64)
    for mode in ("eval", "train"):
        getattr(original, mode)(), getattr(model, mode)()
        with torch.no_grad():
            assert torch.equal(model(x), original(x)), mode


def test_bn_conversion_shares_parameters_and_state_dict():
    model = models.ResNet20()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the conversion
    distnorm.convert(model, norm="bn")
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is params[name], name
    assert isinstance(model.bn1, distnorm.SyncBatchNorm)
    nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    before = model.bn1.weight.clone()
    opt.step()
    assert not torch.equal(model.bn1.weight, before)  # the optimizer still owns the shared parameters
    distnorm.revert(model)
    assert isinstance(model.bn1, nn.BatchNorm2d) and torch.equal(model.bn1.weight.detach(), params["bn1.weight"].detach())


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", "selu", "swish"])
def test_activation_swap_changes_only_activations(activation):
    model = torchvision.models.efficientnet_b0(num_classes=3)
    before = dict(model.named_modules())
    gates = {n for n in before if n.endswith("scale_activation")}
    distnorm.convert(model, norm="keep", activation=activation)
    after = dict(model.named_modules())
    assert before.keys() == after.keys()
    new_cls = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "selu": nn.SELU, "swish": nn.SiLU}[activation]
    for name, module in before.items():
        if isinstance(module, ACTIVATION_MODULES) and name not in gates:
            assert type(after[name]) is new_cls, name
        else:
            assert after[name] is module, name  # everything else, gates included, untouched


def test_idempotent_and_keeps_mode_device_dtype():
    model = models.ResNet20().double().eval()
    distnorm.convert(model, norm="cbn", activation="tanh")
    summary = distnorm.conversion_summary(model)
    distnorm.convert(model, norm="cbn", activation="tanh")
    assert distnorm.conversion_summary(model) == summary
    for m in model.modules():
        assert not m.training
        for t in list(m.parameters(recurse=False)):
            assert t.dtype == torch.float64
    assert model.conv1.norm.running_mean.dtype == torch.float64
    with pytest.raises(ValueError, match="revert"):
        distnorm.convert(model, norm="bn")


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
            x = x * 2
        return self.bn2(self.conv2(x))


def test_untraceable_model_pairs_by_registration_order_with_warning():
    model = _Untraceable()
    with pytest.warns(UserWarning, match=r"registration order: conv -> bn, conv2 -> bn2"):
        distnorm.convert(model, norm="popnorm")
    assert isinstance(model.conv, PreNorm) and isinstance(model.conv2, PreNorm)
    model(torch.randn(2, 3, 8, 8)).sum().backward()


def test_bad_input():
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="unknown norm"):
        distnorm.convert(copy.deepcopy(model), norm="layernorm")
    with pytest.raises(ValueError, match="unknown activation"):
        distnorm.convert(copy.deepcopy(model), activation="gelu")
    with pytest.raises(ValueError, match=r"unknown keyword.*\['kappa'\]"):
        distnorm.convert(copy.deepcopy(model), norm="cbn", kappa=2)
    with pytest.raises(ValueError, match=r"BatchNorm layers \['0'\] do not follow"):
        distnorm.convert(copy.deepcopy(model), norm="cbn")
    with pytest.warns(UserWarning, match=r"\['0'\] follow no conv"):
        converted = distnorm.convert(copy.deepcopy(model), norm="cbn", unpaired="sync")
    assert isinstance(converted[0], distnorm.SyncBatchNorm) and isinstance(converted[1], PreNorm)
    with pytest.raises(ValueError, match="not converted"):
        distnorm.revert(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="unknown model"):
        models.create("resnet1000", num_classes=3)


def _wrapped_worker(rank, world):
    with pytest.raises(TypeError, match="already wrapped by torch DistributedDataParallel"):
        distnorm.convert(DDP(models.ResNet20()), norm="cbn")
    return True


@pytest.mark.world_size(2)
def test_refuses_ddp_wrapped_model(tmp_path):
    assert run_distributed(_wrapped_worker, 2, tmp_path) == [True, True]


def test_bnp_with_group_norm_resnet():
    """BNP + GN (paper 004 §5): GroupNorm ResNet with BNP preconditioning trains."""
    torch.manual_seed(0)
    model = models.create("resnet20", num_classes=4, norm="gn", norm_kwargs={"group_size": 4})
    assert all(m.num_groups == m.num_channels // 4 for m in model.modules() if isinstance(m, nn.GroupNorm))
    handle = distnorm.bnp.attach(model)
    assert len(handle.layers) == 20  # 19 convs + the classifier
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    losses = _train_steps(model, x, y, 6)
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------- timm
#: timm models and their activation-module counts (the README quotes them).
TIMM_MODELS = {"efficientnet_b0": 65, "mobilenetv3_large_100": 48, "resnet50d": 51}


def _activation_count(model: nn.Module) -> int:
    from distnorm.convert import ACTIVATION_MODULES

    return sum(isinstance(m, ACTIVATION_MODULES) for m in model.modules())


@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_batchnorm_act_keeps_its_activation(name):
    """Converting a timm model keeps the activation of each BatchNormAct2d (norm + activation in
    one module), for every norm: the converted model has the original's number of activations
    (the README's figure); ``norm='bn'`` evaluates identically, with the same state_dict keys;
    ``activation=`` swaps every activation but the SE gates; ``revert`` gives the original
    back. Before, BatchNormAct2d was replaced as a plain BatchNorm and its activation dropped:
    efficientnet_b0 with norm='bn' kept 32 of its 65 activations — silently a different
    network."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    reference = model(x)
    count = _activation_count(model)
    assert count == TIMM_MODELS[name]  # the README's figure
    keys = set(model.state_dict())
    for norm in ("bn", "cbn", "popnorm", "gn", "none"):
        converted = distnorm.convert(copy.deepcopy(model), norm=norm)
        assert _activation_count(converted) == count, norm
        if norm == "bn":  # same network, same weights: identical evaluation, same state_dict keys
            assert torch.equal(converted.eval()(x), reference)
            assert set(converted.state_dict()) == keys
        converted.train()(torch.randn(4, 3, 32, 32)).sum().backward()
    swapped = distnorm.convert(copy.deepcopy(model), norm="cbn", activation="tanh")
    tanh = sum(isinstance(m, nn.Tanh) for m in swapped.modules())
    gates = sum(isinstance(m, (nn.Sigmoid, nn.Hardsigmoid)) for m in swapped.modules())
    assert tanh + gates == count and tanh > 0  # every activation swapped except SE gates
    assert distnorm.revert(swapped) is swapped and torch.equal(swapped.eval()(x), reference)


def test_resnet50_conversion_summary_is_the_readmes():
    """The README's conversion example, verbatim: torchvision ResNet-50 to pre-op CBN + tanh."""
    import torchvision

    model = torchvision.models.resnet50(num_classes=1000)
    distnorm.convert(model, norm="cbn", activation="tanh", rho=2.0)
    assert distnorm.conversion_summary(model) == {
        "BatchNorm2d -> removed (pre-op CBN)": 53, "Conv2d -> CBN + Conv2d": 53, "ReLU -> Tanh": 17}
    assert all(m.rho == 2.0 for m in model.modules() if isinstance(m, distnorm.CBN))
    assert distnorm.revert(model) is model


# --------------------------------------------------------- saving a converted model whole
#: One model per source: every zoo model, and the timm model the README converts.
WHOLE_MODELS = [*(f"zoo:{name}" for name in models.available()), "timm:efficientnet_b0"]


def _base_model(source: str) -> tuple[nn.Module, torch.Tensor]:
    """``source`` ("zoo:<name>" or "timm:<name>") with its own BatchNorm and activations, and
    a small input (the CIFAR models pool five times; the others reach 1 x 1 from 16 x 16)."""
    kind, _, name = source.partition(":")
    x = torch.randn(2, 3, 32, 32) if name in ("resnet20", "vgg16") else torch.randn(2, 3, 16, 16)
    if kind == "zoo":  # built through convert (the zoo's one path), then given its modules back
        return distnorm.revert(models.create(name, num_classes=5, norm="bn")), x
    timm = pytest.importorskip("timm")
    return timm.create_model(name, num_classes=5), x


def _round_trips(model: nn.Module) -> dict[str, nn.Module]:
    """``model`` through ``torch.save`` / ``torch.load``, ``pickle`` and ``copy.deepcopy``."""
    buf = io.BytesIO()
    torch.save(model, buf)
    return {
        "torch.save": torch.load(io.BytesIO(buf.getvalue()), weights_only=False),
        "pickle": pickle.loads(pickle.dumps(model)),
        "deepcopy": copy.deepcopy(model),
    }


def _behaviour(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ``model`` computes: its evaluation output, then one training step's output and
    gradients (BNP's preconditioned ones, when attached: its hooks must work in a loaded
    model) and the buffers that step leaves. Seeded: stochastic depth and dropout draw."""
    with torch.no_grad():
        seen = {"eval": model.eval()(x)}
    torch.manual_seed(1)
    model.train().zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    seen["train"] = out.detach()
    seen.update((f"grad {n}", p.grad) for n, p in model.named_parameters() if p.grad is not None)
    seen.update((f"buffer {n}", b) for n, b in model.named_buffers())
    return seen


def _assert_own_state(model: nn.Module, twin: nn.Module, how: str) -> None:
    """``twin`` has ``model``'s classes and state_dict keys, and each layer's state (a norm
    layer's, BNP's) of its own: not the original's, registered where the operators find it,
    with no stashed plan carried over."""
    assert [type(m) for m in twin.modules()] == [type(m) for m in model.modules()], how
    assert list(twin.state_dict()) == list(model.state_dict()), how
    for (name, a), b in zip(model.named_modules(), twin.modules()):
        for attr in ("_state", "_distnorm_bnp"):
            state, twin_state = a.__dict__.get(attr), b.__dict__.get(attr)
            if state is None:
                continue
            assert twin_state is not state and _state._STATES.get(twin_state.key) is twin_state, (how, name)
            assert not twin_state.stash._entries and twin_state.pending is None, (how, name)


@pytest.mark.parametrize("source", WHOLE_MODELS)
def test_converted_models_save_pickle_and_deepcopy_whole(source):
    """``torch.save(model)`` / ``pickle`` / ``copy.deepcopy`` of a converted model, for every
    norm, with BNP off and on, taken after a training forward whose graph is still alive:
    the copy loads, computes what the original computes (BNP's hooks included) and carries
    none of the original's per-forward state. Before, timm's fused norm + activation class
    was made with ``type()`` at conversion, so ``norm="bn"`` / ``"gn"`` could not be
    pickled, and BNP's preconditioned class (made per layer class) not at all."""
    torch.manual_seed(0)
    model, x = _base_model(source)
    for norm in NORMS:
        distnorm.convert(model, norm=norm)
        for bnp in (False, True):
            handle = distnorm.bnp.attach(model) if bnp else None
            distnorm.set_lr(model, 0.1)
            pending = model.train()(x)  # stashes hold this forward's plans
            twins = _round_trips(model)
            pending.mean().backward()
            del pending
            expected = _behaviour(model, x)
            for how, twin in twins.items():
                how = f"{source} norm={norm} bnp={bnp} {how}"
                _assert_own_state(model, twin, how)
                seen = _behaviour(twin, x)
                assert seen.keys() == expected.keys(), how
                assert all(torch.equal(seen[k], v) for k, v in expected.items()), how
            if handle is not None:
                handle.detach()
        with warnings.catch_warnings():  # trained: revert says the originals come back untrained (test_serving.py)
            warnings.simplefilter("ignore", UserWarning)
            distnorm.revert(model)
