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


def _one_rank_group():
    """A gloo world of one rank in this process, whose group keeps its collectives (the test
    switch ``DISTNORM_SYNC_ONE_RANK``): the synchronized path without a second process."""
    import tempfile

    import torch.distributed as dist

    from distnorm import _collectives

    store = dist.FileStore(tempfile.mktemp(prefix="distnorm-one-rank-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist, _collectives.keep_one_rank_groups(True)


def _end_one_rank_group(dist, previous: bool) -> None:
    from distnorm import _collectives

    _collectives.keep_one_rank_groups(previous)
    dist.destroy_process_group()


def _record_graphs(graphs: list):
    """An aot_autograd backend that keeps the forward and backward FX graphs it compiles and
    runs them as they are, with Dynamo's compile counter around it."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.testing import CompileCounterWithBackend

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition,
                           keep_inference_input_mutations=True)  # aot_eager's partitioner: the one Inductor uses
    return CompileCounterWithBackend(backend)


def test_a_compiled_step_is_one_graph_of_aten_ops_and_collectives():
    """Compiled means fused: the statistics, the AMAT blend and buffer updates, the
    normalization and the backward's sums of every layer kind and BNP reach the compiler as
    ATen ops it decomposes, and only the all-reduces stay opaque, as functional collectives.
    The model trains across AMAT's phases -- the buffers initialise at the first step, the
    learning rate changes at every step, ``eta`` crosses 0 twice -- in ONE graph: no
    recompilation, no graph break. And nothing in it is unsafe for CUDA graphs by Inductor's
    own check. Bugs caught: the statistics step and the backward as opaque custom operators
    (Inductor could not fuse them, and they were tagged ``cudagraph_unsafe``); a host read
    (``state.history``, ``state.amat_ready``) that guards and recompiles."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    dist, previous = _one_rank_group()
    try:
        torch._dynamo.reset()
        counters.clear()
        graphs: list = []
        counter = _record_graphs(graphs)
        model = mixed_model()
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        for step, lr in enumerate(STEPS):
            distnorm.set_lr(model, lr)
            compiled(batch(step)).square().mean().backward()
        distnorm._collectives.check_frames()  # the logs of the traced frames: nothing mismatched
    finally:
        _end_one_rank_group(dist, previous)
    assert counter.frame_count == 1 and len(graphs) == 2, (counter.frame_count, len(graphs))  # forward + backward, once
    assert not counters["graph_break"], dict(counters["graph_break"])
    targets = {phase: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
               for phase, gm in zip(("forward", "backward"), graphs)}
    for phase, ops in targets.items():
        opaque = [op for op in ops if not op.startswith(("aten.", "_c10d_functional.", "<built-in function getitem>"))]
        assert not opaque, (phase, opaque)
    collectives = {phase: sum(op == "_c10d_functional.all_reduce.default" for op in ops)
                   for phase, ops in targets.items()}
    # CBN, SyncBatchNorm, POP-Norm and the two BNP layers' statistics; the three layers' input gradients
    assert collectives == {"forward": 5, "backward": 3}, collectives
    for gm in graphs:
        assert get_first_incompatible_cudagraph_node(gm) is None, gm


def _mismatch_worker(rank, world):
    """Rank 0 runs layer ``a``, rank 1 layer ``b`` (same width): compiled, their statistics
    all-reduces pair up silently unless the frames' fingerprints say so."""
    import torch.distributed as dist

    from distnorm.errors import CollectiveMismatchError

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": distnorm.CBN(4), "b": distnorm.CBN(4)})
    distnorm.name_layers(model)

    def step(x, which: str):
        return model[which](x).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.randn(6, 4)
    compiled(x, "a").backward()  # every rank runs a: matched
    distnorm._collectives.check_frames()
    compiled(x, "a" if rank == 0 else "b").backward()
    dist.barrier()
    try:
        distnorm._collectives.check_frames()
    except CollectiveMismatchError as err:
        return str(err)
    return None


@pytest.mark.world_size(2)
@pytest.mark.timeout(300)
def test_a_compiled_mismatch_is_named_at_the_next_frame_check(tmp_path):
    """A compiled graph cannot stop on the host at a mismatched collective: it compares the
    frame's fingerprints on the device and logs the first mismatch, and the next
    ``check_frames`` (the plugin's periodic check) raises on every rank, naming each rank's
    layer. Bug caught: compiled collectives that paired different layers silently."""
    messages = run_distributed(_mismatch_worker, 2, tmp_path, timeout=240)
    for message in messages:
        assert message is not None
        assert "CBN 'a'|forward" in message and "CBN 'b'|forward" in message, message


def test_the_constant_marker_is_the_one_torch_compile_reads():
    """``distnorm._frames`` marks its trace-time constants without importing ``torch._dynamo``
    (2 s at ``import distnorm``), by the attribute ``torch.compiler.assume_constant_result``
    sets. Bug caught: a torch whose decorator marks functions otherwise (the frames'
    fingerprints would then be traced, and fail)."""
    from distnorm import _frames

    def probe():
        return 1

    marked = torch.compiler.assume_constant_result(probe)
    assert {k: v for k, v in vars(marked).items()} == vars(_frames._marked_constant(lambda: 1))


def test_debug_mode_refuses_compilation_naming_what_works():
    """Debug mode reads each collective's fingerprint and the statistics on the host, which a
    compiled graph cannot: one error says so and names what works. Bug caught: debug checks
    silently absent from a compiled model."""
    torch._dynamo.reset()
    layer = distnorm.CBN(3)
    previous = distnorm.debug(True)
    try:
        with pytest.raises(Exception, match=r"(?s)distnorm.debug\(\) reads.*without torch.compile"):
            torch.compile(layer, backend="aot_eager", fullgraph=True)(torch.randn(8, 3, 6))
    finally:
        distnorm.debug(previous)
