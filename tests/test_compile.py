"""``torch.compile`` of the layers, the functional API and a model with the plugin equals eager
(one process and two ranks); CUDA graphs never capture the layers' host decisions.

Each test names the bug it exists to catch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import distnorm
from tests.distributed import run_distributed
from tests.mixed import STEPS, assert_states_close, batch, mixed_model, train_state


def _compile_run(rank: int = 0, world: int = 1, device: str = "cpu") -> list[dict]:
    eager = mixed_model().to(device)
    compiled = copy.deepcopy(eager)
    fn = torch.compile(compiled, fullgraph=True)
    results = []
    for step, lr in enumerate(STEPS):
        x = batch(step, rank, world, device)
        for model in (eager, compiled):
            distnorm.set_lr(model, lr)
            model.zero_grad()
        y_c = fn(x)
        y_c.square().mean().backward()
        y_e = eager(x)
        y_e.square().mean().backward()
        results.append(dict(y=(y_e.detach(), y_c.detach()), eager=train_state(eager), compiled=train_state(compiled)))
    return results


def _check_compile(results: list[dict]) -> None:
    for step, r in enumerate(results):
        torch.testing.assert_close(r["y"][1], r["y"][0], atol=1e-5, rtol=1e-5, msg=f"step {step}")
        assert_states_close(r["eager"], r["compiled"], 1e-5)


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_compile_equals_eager():
    """Bug caught: compiled CBN with AMAT (eta = 0.5) gave gradients 18-47 % off from the
    second step on: the Function updated buffers its compiled backward re-read."""
    _check_compile(_compile_run())


def _compile_worker(rank, world):
    results = _compile_run(rank, world)
    _check_compile(results)
    return {n: b for n, b in results[-1]["compiled"].items() if n.startswith("buffer.")}


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_compile_equals_eager_on_two_ranks(tmp_path):
    b0, b1 = run_distributed(_compile_worker, 2, tmp_path, timeout=800)
    for name in b0:
        assert torch.equal(b0[name], b1[name]), name


def _functional_compile_run(rank: int = 0, world: int = 1, process_group=None) -> list[dict]:
    """The functional API (``cbn`` with a float and with a tensor ``eta``, ``pop_norm``,
    ``sync_batch_norm``) compiled with ``fullgraph=True`` and eager, side by side over AMAT's
    phases: outputs, gradients and buffers after each step."""
    from distnorm import functional as F
    from distnorm.specs import CBNSpec

    def net(x, w, b, bufs, bufs_t, pop, bn, eta):
        y = F.cbn(x, w, b, bufs, eta=eta, spec=CBNSpec(rho=1.5), process_group=process_group, layer="f.cbn")
        y = F.cbn(y.tanh(), w, b, bufs_t, eta=torch.full((), eta), process_group=process_group)
        y = F.pop_norm(y, w, b, *pop, process_group=process_group)
        return F.sync_batch_norm(y, bn[0], bn[1], w, b, bn[2], process_group=process_group)

    torch.manual_seed(0)
    w, b = torch.rand(6) + 0.5, torch.randn(6) * 0.1
    fresh = F.CBNBuffers.fresh
    runs = {mode: dict(w=w.clone().requires_grad_(), b=b.clone().requires_grad_(), bufs=fresh(6), bufs_t=fresh(6),
                       pop=fresh(6)[3:], bn=(torch.zeros(6), torch.ones(6), torch.zeros((), dtype=torch.long)))
            for mode in ("eager", "compiled")}
    fn = {"eager": net, "compiled": torch.compile(net, fullgraph=True, backend="aot_eager")}
    results = []
    for step, eta in enumerate([0.0, 0.5, 0.9, 0.0, 0.9]):
        x = torch.randn(8 * world, 6, 5, generator=torch.Generator().manual_seed(step))[8 * rank:8 * (rank + 1)] + 1
        out = {}
        for mode, r in runs.items():
            xm = x.clone().requires_grad_()
            y = fn[mode](xm, r["w"], r["b"], r["bufs"], r["bufs_t"], r["pop"], r["bn"], eta)
            y.square().mean().backward()
            out[mode] = [y.detach(), xm.grad, r["w"].grad.clone(), r["b"].grad.clone(), *r["bufs"], *r["bufs_t"],
                         *r["pop"], *r["bn"]]
            r["w"].grad = r["b"].grad = None
        results.append(out)
    return results


def _check_functional_compile(results: list[dict]) -> None:
    for step, out in enumerate(results):
        for i, (got, want) in enumerate(zip(out["compiled"], out["eager"])):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=f"step {step}, tensor {i}")


def test_compiled_functional_api_equals_eager():
    """Bug caught: ``torch.compile`` of the functional API raised "no layer is registered
    under key -1" — its per-call states were never registered, and a registry could not hold
    them for the graph; the operators now rebuild them from the configuration the graph holds."""
    torch._dynamo.reset()
    _check_functional_compile(_functional_compile_run())


def _functional_compile_worker(rank, world):
    import torch.distributed as dist

    results = _functional_compile_run(rank, world, process_group=dist.group.WORLD)
    _check_functional_compile(results)
    return results[-1]["compiled"][4:]  # the buffers


@pytest.mark.world_size(2)
@pytest.mark.timeout(300)
def test_compiled_functional_api_on_two_ranks(tmp_path):
    """The functional API compiled, synchronized over an explicit group (which the compiled
    graph names, and the operators find again): equal to eager, buffers identical on both
    ranks."""
    b0, b1 = run_distributed(_functional_compile_worker, 2, tmp_path, timeout=240)
    for a, b in zip(b0, b1):
        assert torch.equal(a, b)


def test_compiled_model_with_the_plugin_does_not_recompile_when_the_lr_changes():
    """Bug caught: the layer's forward read the Python float ``lr`` (and the plugin's hook set
    it inside the traced region), so dynamo guarded on its value and recompiled the model at
    every learning-rate change — every step of a warm-up or cosine schedule."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 3))
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn"))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    plugin.follow(opt)
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    lrs = [0.2, 0.05, 0.04, 0.03, 0.01, 0.009, 0.008]
    for step, lr in enumerate(lrs):
        opt.param_groups[0]["lr"] = lr
        distnorm.set_lr(eager, lr)
        x = batch(step)
        compiled(x).square().mean().backward()
        eager(x).square().mean().backward()
    assert counter.frame_count <= 2, counter.frame_count  # not one per learning rate
    for (name, a), b in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


def _compiled_graphs(model: nn.Module, x: torch.Tensor) -> list:
    """The forward and backward FX graphs ``torch.compile`` hands its backend for ``model``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    fn(x).square().mean().backward()
    return graphs


def test_cuda_graphs_never_capture_the_layers_host_decisions():
    """``torch.compile(mode="reduce-overhead")`` replays captured kernels without running the
    host code of distnorm's operators (AMAT's history branch and initialisation, the
    checkpoint stash, host counts, the group's Triton agreement): a schedule crossing
    ``eta = 0`` would replay the wrong branch. Every operator is tagged
    ``torch.Tag.cudagraph_unsafe`` (torch >= 2.8), and Inductor's own check finds them in the
    forward and the backward graph of a compiled model: it runs them outside the captured
    graphs (graph partitions), or captures none. Bug caught: an operator left untagged."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    from distnorm import _functions

    if not _functions._UNSAFE_FOR_CUDA_GRAPHS:
        pytest.skip(f"torch {torch.__version__} has no cudagraph_unsafe tag: the refusal below guards instead")
    model = mixed_model()
    distnorm.set_lr(model, 0.05)
    found = {}
    for gm in _compiled_graphs(model, batch(0)):
        for node in gm.graph.nodes:
            # A mutating operator is wrapped in auto_functionalized until Inductor's post-grad
            # passes put it back, before they look for unsafe nodes.
            op = node.args[0] if "auto_functionalized" in str(node.target) else node.target
            if getattr(op, "namespace", None) == "distnorm":
                found[str(op)] = torch.Tag.cudagraph_unsafe in op.tags
        with inductor_config.patch(graph_partition=False):  # without partitions: the whole graph is refused
            first = get_first_incompatible_cudagraph_node(gm)
        if any(getattr(n.target, "namespace", None) == "distnorm" for n in gm.graph.nodes):
            assert first is not None and first.target.namespace == "distnorm", first
    assert found == {"distnorm.cbn_statistics.default": True, "distnorm.bn_statistics.default": True,
                     "distnorm.bnp_statistics.default": True, "distnorm.normalize_backward.default": True}, found


def test_without_the_tag_reduce_overhead_is_refused(monkeypatch):
    """A torch without ``torch.Tag.cudagraph_unsafe`` (2.4 to 2.7) cannot be told; there a
    compilation that would capture CUDA graphs raises, naming the modes that work, instead
    of replaying the first step's decisions. (This torch has the tag: the operators'
    tagging is switched off to run the older torch's path.) Bug caught: the mode accepted."""
    from distnorm import _functions

    monkeypatch.setattr(_functions, "_UNSAFE_FOR_CUDA_GRAPHS", ())
    torch._dynamo.reset()
    layer = distnorm.CBN(3)
    distnorm.set_lr(layer, 0.05)
    with pytest.raises(Exception, match=r"(?s)reduce-overhead.{0,4} captures CUDA graphs.*cannot mark distnorm.{1,3}s "
                                        r"operators unsafe for CUDA graphs.*max-autotune-no-cudagraphs"):
        torch.compile(layer, mode="reduce-overhead")(torch.randn(8, 3, 6))
    torch._dynamo.reset()
    assert torch.compile(layer, backend="aot_eager")(torch.randn(8, 3, 6)).shape == (8, 3, 6)
