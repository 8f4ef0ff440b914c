"""``torch.compile`` of the layers, the functional API and a model with the plugin equals eager
(one process and two ranks); CUDA graphs never capture the layers' host decisions.

Each test says the behaviour it holds; tests/README.md and tests/mutants.py name the bugs they catch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import distnorm
from distnorm import _kernel_choice
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
    """A model compiled whole (``fullgraph=True``) trains as the eager one: outputs, gradients
    and buffers equal at every step, CBN with AMAT included. Before, compiled CBN with AMAT
    (eta = 0.5) gave gradients 18-47 % off from the second step on: the Function updated
    buffers its compiled backward re-read."""
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
    """``torch.compile`` of the functional API equals eager: the operators rebuild each call's
    state from the configuration the graph holds. Before, it raised "no layer is registered
    under key -1": its per-call states were never registered, and a registry could not hold
    them for the graph."""
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


@pytest.mark.parametrize("group", ["local", "one-rank group"])
def test_a_compiled_model_with_dynamic_batch_sizes_equals_eager(group):
    """Batch sizes that change (the last batch of an epoch; ``torch.compile``'s automatic
    dynamic shapes after a second size, or ``dynamic=True``) make a layer's count a symbol:
    every layer kind and BNP still equals eager across AMAT's phases, locally and with the
    collectives traced. The count's comparison leaves no symbolic bool where the step needs to
    know the batch is valid (that failed with "where() received an invalid combination of
    arguments - got (SymBool, ...)"), and no symbolic channel count reaches the frames'
    trace-time constants (that failed with "assume_constant_result argument conversion
    failed")."""
    dist, previous = _one_rank_group() if group != "local" else (None, False)
    try:
        torch._dynamo.reset()
        eager = mixed_model()
        compiled = copy.deepcopy(eager)
        fn = torch.compile(compiled, fullgraph=True, backend="aot_eager", dynamic=True)
        for step, lr in enumerate(STEPS):
            x = torch.randn(4 + 2 * (step % 2), 3, 6, 6, generator=torch.Generator().manual_seed(step)) + 0.5
            for model in (eager, compiled):
                distnorm.set_lr(model, lr)
                model.zero_grad()
            fn(x).square().mean().backward()
            eager(x).square().mean().backward()
            assert_states_close(train_state(eager), train_state(compiled), 1e-5)
    finally:
        if dist is not None:
            _end_one_rank_group(dist, previous)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.processes)])  # Inductor: compile workers
def test_two_compiled_functional_call_sites_keep_their_own_amat_state(backend):
    """Two compiled ``functional.cbn`` call sites of the same configuration, each with its own
    buffers, equal eager in float64 (eta = 0.5, 3 steps), traced whole (``fullgraph=True``)
    and through Inductor's own kernels. Before, the compiled operators found a functional
    call's state in a cache keyed by its configuration, so the second call site shared the
    first one's "AMAT initialised" and skipped its own initialisation (its output off by 1.13
    at the first step; ``../shared/evidence/compiled-functional-call-sites.py``)."""
    from distnorm import functional as F

    def run(compiled: bool):
        torch._dynamo.reset()
        f = torch.compile(F.cbn, backend=backend, fullgraph=True) if compiled else F.cbn
        fresh = lambda: F.CBNBuffers(*[t.double() if t.is_floating_point() else t  # noqa: E731
                                        for t in F.CBNBuffers.fresh(3)])
        buffers, w, b = (fresh(), fresh()), torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        g = torch.Generator().manual_seed(1)
        outs = []
        for _ in range(3):
            xs = (torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64),
                  torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64) * 3 + 1)
            outs += [f(x, w, b, bufs, eta=0.5) for x, bufs in zip(xs, buffers)]
        return outs + [t for bufs in buffers for t in bufs]

    for got, want in zip(run(True), run(False)):  # Inductor may reorder float64 sums: 1e-10
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_compiled_model_with_the_plugin_does_not_recompile_when_the_lr_changes():
    """A compiled model with the plugin does not recompile when the learning rate changes (at
    most 2 frames compiled for 7 learning rates), and its buffers equal the eager model's.
    Before, the layer's forward read the Python float ``lr`` (and the plugin's hook set it
    inside the traced region), so dynamo guarded on its value and recompiled the model at
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
    ATen ops it decomposes; opaque stay only the all-reduces, as functional collectives, and
    the copies of the buffers a step updates in place (``distnorm::snapshot``, one per AMAT
    or BNP layer: ``distnorm._traced.cbn_statistics`` says why).
    The model trains across AMAT's phases -- the buffers initialise at the first step, the
    learning rate changes at every step, ``eta`` crosses 0 twice -- in ONE graph: no
    recompilation, no graph break. And nothing in it is unsafe for CUDA graphs by Inductor's
    own check. Before, the statistics step and the backward were opaque custom operators
    (Inductor could not fuse them, and they were tagged ``cudagraph_unsafe``), and a host read
    (``state.amat_ready``) guarded and recompiled."""
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
    # forward + backward, compiled once (fullgraph=True: a graph break would have raised)
    assert counter.frame_count == 1 and len(graphs) == 2, (counter.frame_count, len(graphs))
    targets = {phase: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
               for phase, gm in zip(("forward", "backward"), graphs)}
    for phase, ops in targets.items():
        opaque = [op for op in ops if not op.startswith(("aten.", "_c10d_functional.", "<built-in function getitem>"))]
        # and the copies of the buffers the step updates in place (distnorm._traced.cbn_statistics): CBN's, BNP's two
        expected = {"forward": ["distnorm.snapshot.default"] * 3, "backward": []}[phase]
        assert opaque == expected, (phase, opaque)
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
    layer. Compiled collectives that pair different layers do not pass silently."""
    messages = run_distributed(_mismatch_worker, 2, tmp_path, timeout=240)
    for message in messages:
        assert message is not None
        assert "CBN 'a'|forward" in message and "CBN 'b'|forward" in message, message


def test_the_constant_marker_is_the_one_torch_compile_reads():
    """``distnorm._frames`` marks its trace-time constants without importing ``torch._dynamo``
    (2 s at ``import distnorm``), by the attribute ``torch.compiler.assume_constant_result``
    sets, and that is what this torch's decorator sets. A torch whose decorator marked
    functions otherwise would have the frames' fingerprints traced, which fails."""
    from distnorm import _frames

    def probe():
        return 1

    marked = torch.compiler.assume_constant_result(probe)
    assert {k: v for k, v in vars(marked).items()} == vars(_frames._marked_constant(lambda: 1))


def test_debug_mode_refuses_compilation_naming_what_works():
    """Debug mode reads each collective's fingerprint and the statistics on the host, which a
    compiled graph cannot: one error says so and names what works. Debug checks are never
    silently absent from a compiled model."""
    torch._dynamo.reset()
    layer = distnorm.CBN(3)
    previous = distnorm.debug(True)
    try:
        with pytest.raises(Exception, match=r"(?s)distnorm.debug\(\) reads.*without torch.compile"):
            torch.compile(layer, backend="aot_eager", fullgraph=True)(torch.randn(8, 3, 6))
    finally:
        distnorm.debug(previous)


# ------------------------------------------------------------------ CUDA graphs
def _step_ops(model: nn.Module, x: torch.Tensor) -> list[tuple]:
    """Every op a training step dispatches, with what a CUDA graph bakes into its kernels:
    the non-tensor arguments and the length of each list of tensors (``distnorm::cbn_plan``'s
    ``params`` hold ``eta`` on the history path; its ``amat_ready`` skips the device's check)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def baked(arg):
        if isinstance(arg, torch.Tensor):
            return "tensor"
        if isinstance(arg, (list, tuple)):
            return tuple(baked(a) for a in arg)
        return arg

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append((str(func), baked(args), baked(sorted((kwargs or {}).items()))))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        model(x).square().mean().backward()
    return recorder.ops


def test_a_captured_step_dispatches_the_same_ops_whatever_the_values(monkeypatch):
    """A CUDA graph replays the kernels its capture recorded, so a captured step must issue
    the same kernels at every step: before and after the AMAT buffers initialise, with
    ``eta`` 0 or not. Here the layers take the decisions they take while captured
    (``_capture.capturing`` answers True, as ``torch.cuda.is_current_stream_capturing``
    would), and every step of AMAT's phases dispatches the same ops, with outputs, gradients
    and buffers equal to the eager steps' (the history path at ``eta = 0`` gives the batch
    statistics). Neither ``history`` nor ``amat_ready`` on the host chooses the kernels or their
    arguments: a graph captured at one step would then replay the wrong branch at another."""
    from distnorm import _capture

    torch.manual_seed(0)
    replayed, eager = mixed_model(), mixed_model()
    for model in (replayed, eager):  # the warm-up step before capture (the kernels' probe runs here)
        distnorm.set_lr(model, STEPS[0])
        model(batch(0)).sum().backward()
    fresh = mixed_model()  # and a model whose capture would come before the AMAT buffers' first update
    monkeypatch.setattr(_capture, "capturing", lambda device: True)
    op_lists = []
    for step, lr in enumerate(STEPS):
        for model in (replayed, eager, fresh):
            distnorm.set_lr(model, lr)
            model.zero_grad()
        op_lists.append(_step_ops(fresh, batch(step)))
        op_lists.append(_step_ops(replayed, batch(step)))
        monkeypatch.setattr(_capture, "capturing", lambda device: False)
        eager(batch(step)).square().mean().backward()
        monkeypatch.setattr(_capture, "capturing", lambda device: True)
        assert_states_close(train_state(replayed), train_state(eager), 1e-5)
    assert all(ops == op_lists[0] for ops in op_lists), [len(ops) for ops in op_lists]


def test_what_cannot_be_captured_is_refused_naming_what_works(monkeypatch):
    """Capturing a group's first step (its kernel vote is read on the host), a gloo
    collective, or a step in debug mode cannot work: each raises one error that says why and
    what to do, from the layer's own call, instead of a CUDA error from inside the capture or
    a silently wrong replay."""
    from distnorm import _capture

    capture = lambda on: monkeypatch.setattr(_capture, "capturing", lambda device: on)  # noqa: E731
    dist, previous = _one_rank_group()
    try:
        layer = distnorm.CBN(8)
        distnorm.set_lr(layer, 0.05)
        capture(True)
        with pytest.raises(RuntimeError, match=r"(?s)first synchronized step \(its vote on the kernels\) "
                                               r"reads the device on the host.*Run one training step before "
                                               r"capturing"):
            layer(torch.randn(6, 8))
        capture(False)
        layer(torch.randn(6, 8)).sum().backward()  # the first step, eager: the group agrees
        capture(True)
        with pytest.raises(RuntimeError, match=r"(?s)being captured into a CUDA graph.*runs on gloo.*Use the nccl "
                                               r"backend"):
            layer(torch.randn(6, 8))
    finally:
        _end_one_rank_group(dist, previous)
    local = distnorm.CBN(8, sync=False)
    distnorm.set_lr(local, 0.05)
    local(torch.randn(6, 8))  # warmed up
    previous_debug = distnorm.debug(True)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)distnorm.debug\(\) reads.*without CUDA-graph capture"):
            local(torch.randn(6, 8))
    finally:
        distnorm.debug(previous_debug)


def _cuda_graph_training(one_rank_group: bool) -> None:
    """MLPerf's way: warm up on a side stream, capture a whole training step (forward,
    backward, SGD step) with ``torch.cuda.graph``, replay it across AMAT's phases (``eta``
    crossing 0 both ways, set outside the graph by ``set_lr``), against the same steps run
    eagerly."""
    from distnorm import _collectives

    if one_rank_group:
        _collectives.keep_one_rank_groups(True)
    torch.manual_seed(0)
    model = mixed_model().cuda()
    twin = copy.deepcopy(model)
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (model, twin)}

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        optimizers[id(m)].zero_grad(set_to_none=False)
        loss = m(x).square().mean()
        loss.backward()
        optimizers[id(m)].step()
        return loss

    static_x = batch(0, device="cuda").clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            for m in (model, twin):
                distnorm.set_lr(m, STEPS[i])
            static_x.copy_(batch(i, device="cuda"))
            step(model, static_x)
            step(twin, batch(i, device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, static_x)
    for i, lr in enumerate(STEPS + STEPS[::-1]):
        for m in (model, twin):
            distnorm.set_lr(m, lr)
        x = batch(i + 3, device="cuda")
        static_x.copy_(x)
        graph.replay()
        loss = step(twin, x)
        torch.testing.assert_close(static_loss, loss, atol=1e-5, rtol=1e-5, msg=f"replay {i}")
        assert_states_close(train_state(model), train_state(twin), 1e-4)
    _collectives.check_frames()
    if one_rank_group:
        assert _kernel_choice.triton_state(torch.distributed.group.WORLD, "cuda").used


def _reduce_overhead_training(one_rank_group: bool) -> None:
    """``torch.compile(mode="reduce-overhead")`` of the whole model, trained across AMAT's
    phases against eager: Inductor's CUDA graphs skip nothing."""
    from torch._dynamo.utils import counters

    from distnorm import _collectives

    if one_rank_group:
        _collectives.keep_one_rank_groups(True)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = mixed_model().cuda()
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for i, lr in enumerate(STEPS + STEPS[::-1]):
        x = batch(i, device="cuda")
        for m in (model, twin):
            distnorm.set_lr(m, lr)
            m.zero_grad()
        y = compiled(x)
        y.square().mean().backward()
        y = y.clone()  # a CUDA graph's output is overwritten by its next replay
        y_twin = twin(x)
        y_twin.square().mean().backward()
        torch.testing.assert_close(y, y_twin, atol=1e-4, rtol=1e-4, msg=f"step {i}")
        assert_states_close(train_state(model), train_state(twin), 1e-4)
    _collectives.check_frames()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def _cuda_graph_worker(rank, world, how):
    {"capture": _cuda_graph_training, "reduce-overhead": _reduce_overhead_training}[how](one_rank_group=True)


_needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@_needs_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["capture", "reduce-overhead"])
def test_cuda_graphs_of_a_training_step_equal_eager(how):
    """A whole training step captured with ``torch.cuda.graph``, and
    ``torch.compile(mode="reduce-overhead")``, on one GPU without a group: every layer kind
    and BNP replayed across AMAT's phases equals eager."""
    {"capture": _cuda_graph_training, "reduce-overhead": _reduce_overhead_training}[how](one_rank_group=False)


@pytest.mark.cuda
@_needs_gpu
@pytest.mark.world_size(1)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["capture", "reduce-overhead"])
def test_cuda_graphs_with_the_nccl_all_reduce_inside(how, tmp_path):
    """The same on an NCCL world of one rank that keeps its collectives
    (``DISTNORM_SYNC_ONE_RANK``): the statistics and gradient all-reduces are captured into
    the CUDA graphs (the functional collectives, the frames compared on the device), and the
    frames' logs hold no mismatch."""
    if not torch.distributed.is_nccl_available():
        pytest.skip("needs NCCL: this torch build has none")
    run_distributed(_cuda_graph_worker, 1, tmp_path, how, backend="nccl", timeout=540)
