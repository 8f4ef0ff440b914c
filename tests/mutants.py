"""Mutation check: deliberate one-line bugs, each against one claim, each caught by its tests.

    make mutants                        # every mutant (a baseline run first)
    make mutants MUTANTS_ARGS="--only eta-formula sha256-skipped"
    .venv/bin/python tests/mutants.py --list

tests/README.md asks that every claim's test be tried once against the bug it exists to
catch. This script keeps those tries: each :class:`Mutant` is data — the claim (a row of
tests/README.md's table or a README sentence), a file, the exact text to break and its
replacement (one changed line; unchanged lines around it may be given to make the text
unique), and the one or two tests that must fail.

For each mutant the tracked and untracked-but-not-ignored files of the working tree
(``git ls-files``) are copied to a fresh temporary directory, the patch is applied there, and
the tests run with that copy as the working directory and first on ``PYTHONPATH`` — which
gloo ranks, ``torchrun`` children and ``subprocess`` launches inherit — so every process
imports the mutated ``distnorm``, not the checkout the virtualenv's editable install points
at (checked for each mutant before its tests run: the mutated module must be imported from
the copy and hold the replacement). No file of the checkout is changed.

Outcomes: ``caught`` (the tests failed), ``MISSED`` (they passed: the test does not test the
claim — strengthen it), ``BROKEN`` (the mutant does not import, or pytest could not collect or
run the tests: the mutant proves nothing), ``SKIPPED`` (every test was skipped on this
machine), ``TIMEOUT``. Before the mutants, the union of their selections runs once on an
unmutated copy; a mutant whose selection fails (or is skipped) there is reported as
``BASELINE``. A crash of the test process (a signal, ``Fatal Python error``) counts as caught.
A mutant whose text is not found exactly once stops the run before anything runs, so the
list cannot rot silently when the code changes. The copies and logs are removed unless
``--keep`` is given or a mutant was not caught. Exit status 0 only when every mutant was
caught.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    """One deliberate bug.

    Attributes:
        id: short name (``--only``).
        claim: the claim it breaks (a row of tests/README.md's table or a README sentence).
        path: file to patch, relative to the repository root.
        original: exact text, found exactly once in ``path``.
        replacement: ``original`` with one line changed.
        tests: pytest node ids that must fail (one or two, so the whole run stays short).
    """

    id: str
    claim: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]


LD = "tests/test_layers_distributed.py"
KC = "tests/test_kernel_contracts.py"
REL = "tests/test_reliability.py"
DB = "tests/test_ddp_buffers.py"

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- collectives
    Mutant(
        "extra-broadcast",
        "one all-reduce forward, one backward, nothing else",
        "distnorm/_moments.py",
        '    all_reduce_sum(packed, group, slot=f"{layer}|forward|C={channels}|{x.dtype}", shape=(channels, x.dtype))\n',
        '    all_reduce_sum(packed, group, slot=f"{layer}|forward|C={channels}|{x.dtype}", shape=(channels, x.dtype)); '
        "__import__('distnorm')._collectives.broadcast_from_first([packed], group)\n",
        (f"{LD}::test_one_collective_forward_one_backward",),
    ),
    Mutant(
        "backward-reduce-without-input-grad",
        "one all-reduce backward, skipped when the input needs no gradient",
        "distnorm/_functions.py",
        "    if not need_input_grad:\n        return torch.empty(0, dtype=x.dtype, device=x.device),",
        "    if False:\n        return torch.empty(0, dtype=x.dtype, device=x.device),",
        (f"{LD}::test_one_collective_forward_one_backward",),
    ),
    Mutant(
        "empty-rank-statistics",
        "a rank with an empty batch joins the collectives and contributes nothing (no hang, no NaN)",
        "distnorm/_moments.py",
        "    packed = _packed(local_moments(x, cpu_kernel) if local_count > 0 else None, local_count, channels, x.device)\n",
        "    packed = _packed(local_moments(x, cpu_kernel), local_count, channels, x.device)\n",
        (f"{LD}::test_empty_rank_joins_and_contributes_nothing[cbn]",
         f"{KC}::test_cuda_kernel_contract_when_synchronized"),
    ),
    Mutant(
        "all-empty-guard",
        "a rank with an empty batch joins the collectives and contributes nothing (no NaN): every rank empty",
        "distnorm/_moments.py",
        "    ratios = packed / (count if local_count > 1 else count.clamp_min(1.0))  # [mean, E[x^2], 1]\n",
        "    ratios = packed / count  # [mean, E[x^2], 1]\n",
        (f"{LD}::test_every_rank_empty_changes_nothing",),
    ),
    Mutant(
        "agreement-skipped",
        "start-up agreement on configuration, world size, index and model structure, every rank raises",
        "distnorm/_collectives.py",
        "    value = torch.tensor([stable_hash(text)], dtype=torch.int64, device=device)\n"
        "    if bool(all_agree(value, group).all()):\n",
        "    value = torch.tensor([stable_hash(text)], dtype=torch.int64, device=device)\n"
        "    if True:\n",
        (f"{REL}::test_setup_mismatches_raise_on_every_rank[model-the model structure differs]",),
    ),
    # ------------------------------------------------------------ layer mathematics
    Mutant(
        "cbn-backward-count",
        "CBN matches the float64 reference, 2 ranks equal 1 process (a wrong count in the backward)",
        "distnorm/_composite.py",
        "    return torch.stack([r_mu, q, w, to_dtype(count, q.dtype)]).view(2, 2, -1)\n",
        "    return torch.stack([r_mu, q, w, to_dtype(count, q.dtype) - 1.0]).view(2, 2, -1)\n",
        (f"{LD}::test_two_ranks_equal_one_process[NC-cbn]",),
    ),
    Mutant(
        "amat-blend-reversed",
        "CBN matches the float64 reference (AMAT's eta weighs the history)",
        "distnorm/_composite.py",
        "    var_u = torch.lerp(var_b, var_a, eta)\n",
        "    var_u = torch.lerp(var_a, var_b, eta)\n",
        ("tests/test_layers.py::test_cbn_matches_reference[shape0]",),
    ),
    Mutant(
        "ratio-guard-dropped",
        "CBN matches the float64 reference (mu_U / mu_B used only where meaningful)",
        "distnorm/_composite.py",
        "    meaningful = (ratio > 0) & (torch.addcmul(var_x, mu_b, mu_b, value=-100.0) < -eps)\n",
        "    meaningful = ratio > 0\n",
        ("tests/test_layers.py::test_cbn_ratio_guard_and_clamp_only_change_gradients",),
    ),
    Mutant(
        "triton-ratio-guard-dropped",
        "The fused operators' CUDA (Triton) kernels equal the ATen composite",
        "distnorm/_triton.py",
        "            meaningful = (ratio > 0) & ((var_x - 100.0 * mu_b * mu_b) < -eps)\n",
        "            meaningful = ratio > 0\n",
        ("tests/test_fused.py::test_triton_plan_kernel_equals_composite[history]",),
    ),
    Mutant(
        "triton-masked-step-writes",
        "The fused operators' CUDA (Triton) kernels equal the ATen composite (an all-empty step changes nothing)",
        "distnorm/_triton.py",
        "        tl.store(amat_mean_ptr + offs, tl.where(valid, mu_u, amat_mean), mask=m)\n",
        "        tl.store(amat_mean_ptr + offs, mu_u, mask=m)\n",
        ("tests/test_fused.py::test_triton_plan_kernel_equals_composite[device_count_masked]",),
    ),
    Mutant(
        "triton-takes-other-devices",
        "The fused operators' CUDA (Triton) kernels get only tensors on their device (a CPU eta stays with the composite)",
        "distnorm/_kernels.py",
        "    return all(t is None or t.device == first.device for t in others)\n",
        "    return True\n",
        ("tests/test_fused.py::test_triton_takes_only_tensors_on_the_statistics_device",),
    ),
    Mutant(
        "triton-failure-falls-back",
        "A Triton that cannot run here is an error, not a fallback to the composite",
        "distnorm/_kernel_choice.py",
        '        return _FAILED, f"{type(err).__name__}: {err}"\n',
        '        return _OFF, f"{type(err).__name__}: {err}"\n',
        ("tests/test_fused.py::test_a_triton_that_cannot_run_is_an_error_not_a_fallback",),
    ),
    Mutant(
        "triton-probe-compares-nothing",
        "A Triton whose kernels compute something else here is refused like one that cannot build",
        "distnorm/_kernel_choice.py",
        "        if not torch.allclose(g.double(), w.double(), rtol=1e-5, atol=1e-6):\n",
        "        if False:\n",
        ("tests/test_fused.py::test_kernels_that_compute_something_else_here_are_refused",),
    ),
    Mutant(
        "triton-mode-unchecked",
        "triton_state says which kernels run and why (an unknown DISTNORM_TRITON is an error)",
        "distnorm/_kernel_choice.py",
        "    if mode not in _kernels.MODES:\n",
        "    if False:\n",
        ("tests/test_fused.py::test_triton_state_says_which_kernels_run_and_why",),
    ),
    Mutant(
        "triton-arguments-swapped",
        "The layers through the Triton kernels equal the composite (the operator hands the kernel its arguments)",
        "distnorm/_triton.py",
        "    weight, bias = weight.contiguous(), bias.contiguous()\n",
        "    weight, bias = bias.contiguous(), weight.contiguous()\n",
        ("tests/test_fused.py::test_layers_through_the_interpreted_kernels_equal_the_composite",),
    ),
    Mutant(
        "monitored-rank-takes-composite",
        "every rank takes the same arithmetic path: a rank with theory monitors too",
        "distnorm/_functions.py",
        "                                   state.amat_ready and not replayed, plan_kernel))\n",
        "                                   state.amat_ready and not replayed, plan_kernel if state.stats_sink is None else \"composite\"))\n",
        (f"{LD}::test_a_monitored_rank_runs_the_arithmetic_of_the_others",),
    ),
    Mutant(
        "triton-chosen-per-process",
        "every rank takes the same arithmetic path: whether Triton runs is agreed by the group",
        "distnorm/_kernel_choice.py",
        "    if triton_decision(group, device):\n",
        "    if triton_decision(group, device) or triton_decision(None, device):\n",
        (f"{LD}::test_ranks_that_differ_on_triton_agree_on_the_composite",),
    ),
    Mutant(
        "triton-failure-raised-on-one-rank",
        "a rank whose Triton fails makes every rank raise (no rank left waiting in a collective)",
        "distnorm/_kernel_choice.py",
        "    if failed:\n",
        "    if verdict == _FAILED:\n",
        (f"{LD}::test_a_rank_whose_triton_fails_makes_every_rank_raise",),
    ),
    Mutant(
        "monitor-sigma-without-shift",
        "the theory monitors record the batch's sigma_B = sqrt(mean((x - mu_U + beta)^2) + eps)",
        "distnorm/monitors.py",
        '            "sigma": torch.sqrt(var + d * d + sink["eps"])}\n',
        '            "sigma": torch.sqrt(var + sink["eps"])}\n',
        ("tests/test_report.py::test_monitored_statistics_are_the_batch_statistics[0.2]",),
    ),
    Mutant(
        "jpeg-rows-one-short",
        "decoding down to the crop gives the pixels of a full decode (every row the crop needs)",
        "distnorm/data/transforms.py",
        "        image = self._loaded_to_row(image, data, top + height)\n",
        "        image = self._loaded_to_row(image, data, top + height - 1)\n",
        ("tests/test_data.py::test_decoding_down_to_the_crop_gives_the_pixels_of_a_full_decode",),
    ),
    Mutant(
        "jpeg-rows-truncated-file-accepted",
        "decoding down to the crop: a truncated JPEG still fails as a full decode fails",
        "distnorm/data/transforms.py",
        "            or not data.endswith(b\"\\xff\\xd9\")):\n",
        "            ):\n",
        ("tests/test_data.py::test_decoding_down_to_the_crop_gives_the_pixels_of_a_full_decode",),
    ),
    Mutant(
        "tar-prefix-dropped",
        "the shards' tar reader reads what WebDataset reads (long names: the ustar prefix)",
        "distnorm/data/tars.py",
        "        if magic == _POSIX and block[345] != 0:\n",
        "        if False:\n",
        ("tests/test_data.py::test_tar_reader_reads_what_webdataset_reads",),
    ),
    Mutant(
        "fusion-bypassed",
        "CBN's per-channel step is one operator (launch cost: CBN <= 20 ops per layer-step)",
        "distnorm/_functions.py",
        "    plan = NormPlan(*_ops.cbn_plan(mean, var, device_count, device_valid, weight, bias, eta if state.amat else None,\n",
        "    plan = NormPlan(*_ops._kernels.cbn_plan(mean, var, device_count, device_valid, weight, bias, eta if state.amat else None,\n",
        ("tests/test_step_cost.py::test_dispatched_ops_and_host_syncs_per_step",),
    ),
    Mutant(
        "eta-formula",
        "AMAT's eta = clip(1 - omega * lr, 0, 1)",
        "distnorm/functional.py",
        "    return min(max(1.0 - omega * lr, 0.0), 1.0)\n",
        "    return min(max(1.0 - lr / omega, 0.0), 1.0)\n",
        ("tests/test_layers.py::test_amat_eta_follows_learning_rate",),
    ),
    Mutant(
        "bnp-local-moments",
        "BNP moments from all-reduced statistics: 2 ranks equal 1 process",
        "distnorm/_bnp_functions.py",
        "    moments = _kernel_choice.synced_moments(h, state.group(), f\"BNP '{state.name}'\", state)  # the group's first step: its vote\n",
        "    moments = _kernel_choice.synced_moments(h, None, f\"BNP '{state.name}'\", state)  # the group's first step: its vote\n",
        ("tests/test_bnp.py::test_ddp_two_ranks_equal_one_process",),
    ),
    # ------------------------------------------------------------ kernel contracts, host syncs
    Mutant(
        "empty-eval-batch-kernel",
        "every call meets the CUDA kernels' contracts (an empty batch)",
        "distnorm/_functions.py",
        "    if x.numel() == 0:\n        # Kernel contract (Normalization.cuh, batch_norm_elemt_cuda_template)",
        "    if False:\n        # Kernel contract (Normalization.cuh, batch_norm_elemt_cuda_template)",
        (f"{KC}::test_an_empty_batch_calls_no_kernel_that_cuda_rejects[cbn]",),
    ),
    Mutant(
        "empty-rank-forward-kernel",
        "every call meets the CUDA kernels' contracts (an empty rank synchronized)",
        "distnorm/_functions.py",
        "    if x.numel() == 0:  # a rank without samples (kernel contract: no empty input, see channel_affine)\n",
        "    if False:  # a rank without samples (kernel contract: no empty input, see channel_affine)\n",
        (f"{KC}::test_cuda_kernel_contract_when_synchronized",),
    ),
    Mutant(
        "backward-save-mean-undefined",
        "every call meets the CUDA kernels' contracts (defined save_mean / save_invstd)",
        "distnorm/_functions.py",
        "            grad_out, x, invstd, None, None, center, invstd, True, state.eps, [False, True, True])\n",
        "            grad_out, x, invstd, None, None, None, None, True, state.eps, [False, True, True])\n",
        (f"{KC}::test_every_call_meets_the_cuda_kernel_contract[dtype0-cbn]",),
    ),
    Mutant(
        "host-sync-eta",
        "no path synchronizes with the host (torch.tensor(eta, device=...) in functional.cbn)",
        "distnorm/functional.py",
        "    return torch.full((), float(eta), dtype=buffers[0].dtype, device=x.device)\n",
        "    return torch.tensor(float(eta), dtype=buffers[0].dtype, device=x.device)\n",
        ("tests/test_step_cost.py::test_no_host_sync_on_any_per_step_path",),
    ),
    Mutant(
        "checkpoint-recompute-updates",
        "activation checkpointing: buffers updated once per step",
        "distnorm/_functions.py",
        "    if in_backward():\n        return stash.pop(x.shape, state.name)\n",
        "    if False:\n        return stash.pop(x.shape, state.name)\n",
        ("tests/test_checkpointing.py::test_checkpointing_equals_plain_and_updates_buffers_once[False]",),
    ),
    Mutant(
        "second-derivative-unrefused",
        "the hand-written backward is differentiable once: a second derivative is refused by name",
        "distnorm/_functions.py",
        "        return refusing(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)\n",
        "        return backward(ctx, *grads)\n",
        ("tests/test_layers.py::test_a_second_derivative_is_refused_by_name",),
    ),
    Mutant(
        "checkpoint-plain-plans-kept",
        "activation checkpointing: a checkpointed step after plain ones recomputes with its own statistics",
        "distnorm/_functions.py",
        "    grad_enabled = torch.is_grad_enabled()  # the caller's: the statistics ran under no_grad\n",
        "    grad_enabled = False  # the caller's: the statistics ran under no_grad\n",
        ("tests/test_checkpointing.py::test_a_checkpointed_step_after_plain_steps_recomputes_with_its_own_statistics",),
    ),
    Mutant(
        "stash-keeps-dead-references",
        "activation checkpointing: the stash keeps nothing of steps whose graphs are gone",
        "distnorm/_recompute.py",
        "            live = (e for e in self._entries if isinstance(e, weakref.ref) and e() is not None)\n",
        "            live = (e for e in self._entries if isinstance(e, weakref.ref))\n",
        ("tests/test_checkpointing.py::test_a_checkpointed_step_after_plain_steps_recomputes_with_its_own_statistics",),
    ),
    Mutant(
        "layer-hands-a-closure",
        "a layer step walks down: module -> functional -> the operator module -> collectives (no closure)",
        "distnorm/layers.py",
        "        buffers = (self.running_mean, self.running_var, self.num_batches_tracked)\n",
        "        buffers = (lambda: (self.running_mean, self.running_var, self.num_batches_tracked))()\n",
        ("tests/test_structure.py::test_a_layer_step_walks_down_module_functional_operators_collectives",),
    ),
    Mutant(
        "compile-reads-lr",
        "a changing learning rate does not recompile (the plugin's hook runs outside the graph)",
        "distnorm/plugin.py",
        "model.register_forward_pre_hook(torch.compiler.disable(self._before_forward))",
        "model.register_forward_pre_hook(self._before_forward)  # was torch.compiler.disable(...)",
        ("tests/test_compile.py::test_compiled_model_with_the_plugin_does_not_recompile_when_the_lr_changes",),
    ),
    Mutant(
        "compiled-reads-updated-buffers",
        "compiled CBN equals eager (the backward never reads buffers the step updated)",
        "distnorm/_traced.py",
        "    amat_before = _ops.snapshot(list(buffers[:3])) if state.amat else None\n",
        "    amat_before = None\n",
        ("tests/test_compile.py::test_compile_equals_eager",),
    ),
    Mutant(
        "lr-tensor-read-on-host",
        "a tensor learning rate (capturable / fused optimizers) costs no host synchronisation",
        "distnorm/layers.py",
        "        if not _debug.is_debug():\n            return lr\n",
        "        if False:\n            return lr\n",
        ("tests/test_step_cost.py::test_a_tensor_learning_rate_is_never_read_on_the_host",),
    ),
    Mutant(
        "captured-init-from-the-host",
        "a captured CUDA graph replays the right branch at every step (the AMAT initialisation checked on the device)",
        "distnorm/_functions.py",
        "    replayed = _capture.capturing(x.device)\n",
        "    replayed = False\n",
        ("tests/test_compile.py::test_a_captured_step_dispatches_the_same_ops_whatever_the_values",),
    ),
    Mutant(
        "compiled-frame-mismatch-not-logged",
        "a compiled collective that paired different layers is named at the next frame check",
        "distnorm/_frames.py",
        "    log.copy_(torch.where(first, torch.cat([received.new_ones(1), received]), log))\n",
        "    log.copy_(log)\n",
        ("tests/test_compile.py::test_a_compiled_mismatch_is_named_at_the_next_frame_check",),
    ),
    # ------------------------------------------------------------------- plugin, config
    Mutant(
        "plugin-config-disagreement",
        "the plugin compares its configuration across ranks (a ValueError on every rank)",
        "distnorm/plugin.py",
        "        if self._config_checked or not _collectives.is_distributed():\n",
        "        if True:\n",
        ("tests/test_plugin.py::test_ranks_with_different_configurations_are_refused",),
    ),
    Mutant(
        "amat-lr-wrong-group",
        "follow(optimizer): AMAT reads the learning rate of the parameter group holding each layer",
        "distnorm/plugin.py",
        "            index = [where.get(id(m.weight), 0) for m in self.amat_layers]\n",
        "            index = [0 for m in self.amat_layers]\n",
        ("tests/test_plugin.py::test_each_amat_layer_follows_the_group_holding_its_weight",),
    ),
    Mutant(
        "consistency-skips-a-buffer",
        "check_consistency compares every buffer of a distnorm layer",
        "distnorm/consistency.py",
        "        for name in names:\n            buf = module._buffers.get(name)\n",
        "        for name in names[:-1]:\n            buf = module._buffers.get(name)\n",
        ("tests/test_consistency.py::test_check_consistency_local_is_a_count",),
    ),
    Mutant(
        "consistency-skips-parameters",
        "ranks whose weights drift apart stop with a named error (parameters fingerprinted)",
        "distnorm/consistency.py",
        "        found.extend(replicated)\n",
        "        found.extend(replicated[:0])\n",
        ("tests/test_consistency.py::test_drifted_parameter_and_optimizer_state_are_named_on_every_rank",),
    ),
    Mutant(
        "world-size-resume-keeps-position",
        "a checkpoint of another world size resumes at the next epoch (not its old mid-epoch position)",
        "distnorm/train/loop.py",
        "        if position.step_in_epoch:\n            position = Position(position.epoch + 1, 0, position.global_step)\n",
        "        if False:\n            position = Position(position.epoch + 1, 0, position.global_step)\n",
        ("tests/test_resume_world_size.py::test_resume_on_another_world_size_when_allowed_both_ways",),
    ),
    Mutant(
        "host-cost-replay-skips-operators",
        "bench/host_cost.py --replay times a step's dispatched operators called again, every one of them",
        "bench/host_cost.py",
        "        for func, args, kwargs in calls:\n",
        "        for func, args, kwargs in calls[:1]:\n",
        ("tests/test_bench.py::test_profile_step_and_host_cost_name_what_runs",),
    ),
    Mutant(
        "gpu-report-runs-benchmarks-without-cuda",
        "make test-gpu runs on a machine without CUDA: the GPU benchmarks skipped with the reason, the report written",
        "bench/gpu_report.py",
        '        elif not cuda["device_count"]:\n',
        "        elif False:\n",
        ("tests/test_bench.py::test_gpu_report_without_cuda",),
    ),
    Mutant(
        "spec-field-without-flag",
        "every spec field is reachable from the CLI, the environment, YAML and recipe overrides",
        "distnorm/config.py",
        "            for sf in fields(SECTIONS[f.name]):\n",
        '            for sf in [s for s in fields(SECTIONS[f.name]) if s.name != "r_max"]:\n',
        ("tests/test_config.py::test_every_spec_field_is_reachable_from_every_front_end[cbn]",),
    ),
    Mutant(
        "key-given-twice",
        "a key given twice on the command line is refused",
        "distnorm/train/config.py",
        "        given.setdefault(dotted.strip(), []).append(raw)\n",
        "        given[dotted.strip()] = [raw]\n",
        ("tests/test_train.py::test_a_key_given_twice_is_refused_naming_the_shell_expansion",),
    ),
    # ------------------------------------------- what a step costs: no buffer broadcast, counts
    Mutant(
        "ddp-kwargs-broadcast-on",
        "DistributedDataParallel(model, **distnorm.ddp_kwargs()): no buffer broadcast",
        "distnorm/plugin.py",
        '        return {"forward_sync_buffers": False}\n',
        "        return {}\n",
        (f"{DB}::test_ddp_kwargs_step_broadcasts_no_buffers",),
    ),
    Mutant(
        "plugin-checks-every-forward",
        "the plugin checks consistency every check_every training forwards",
        "distnorm/plugin.py",
        "        if every and self.training_forwards % every == 0:\n",
        "        if every:\n",
        (f"{DB}::test_plugin_step_broadcasts_no_buffers_and_checks_every_n_forwards",),
    ),
    Mutant(
        "plugin-resyncs-every-forward",
        "the buffers are broadcast and verified at the first training forward after a load (not at every one)",
        "distnorm/plugin.py",
        "        if self._resync:  # first training forward after a checkpoint load: a safe point\n",
        "        if True:  # first training forward after a checkpoint load: a safe point\n",
        (f"{DB}::test_plugin_step_broadcasts_no_buffers_and_checks_every_n_forwards",),
    ),
    Mutant(
        "consistency-gathers-every-tensor",
        "check_consistency: one collective for the structure, one for the fingerprints; tensors gathered only on a mismatch",
        "distnorm/consistency.py",
        "    agree = _collectives.all_agree(sums, group)\n",
        "    agree = torch.zeros_like(sums, dtype=torch.bool)\n",
        (f"{DB}::test_consistency_check_costs_two_all_reduces",),
    ),
    Mutant(
        "sync-group-not-given-to-layers",
        "sync_group_size=k synchronizes within groups of k consecutive ranks (the layers)",
        "distnorm/plugin.py",
        "activation=cfg.activation, process_group=self.group)\n",
        "activation=cfg.activation, process_group=None)\n",
        (f"{DB}::test_sync_group_size_keeps_the_statistics_inside_the_group",),
    ),
    Mutant(
        "sync-group-not-given-to-bnp",
        "sync_group_size=k synchronizes within groups of k consecutive ranks (BNP)",
        "distnorm/plugin.py",
        "        self.bnp_handle = cfg.bnp.attach(model, process_group=self.group) if cfg.bnp is not None else None\n",
        "        self.bnp_handle = cfg.bnp.attach(model, process_group=None) if cfg.bnp is not None else None\n",
        (f"{DB}::test_sync_group_size_keeps_the_statistics_inside_the_group",),
    ),
    Mutant(
        "accelerate-broadcast-on",
        "Accelerate: prepare() makes Accelerate build DDP without the buffer broadcast (no handler given)",
        "distnorm/integrations/accelerate.py",
        "        accelerator.ddp_handler = accelerate.utils.DistributedDataParallelKwargs(broadcast_buffers=False)\n",
        "        accelerator.ddp_handler = accelerate.utils.DistributedDataParallelKwargs(broadcast_buffers=True)\n",
        ("tests/test_integrations.py::test_two_ranks_match_one_process[accelerate]",),
    ),
    Mutant(
        "accelerate-handler-broadcast-kept",
        "Accelerate: prepare() turns the buffer broadcast off on the script's own DDP handler",
        "distnorm/integrations/accelerate.py",
        "        handler.broadcast_buffers = False\n",
        "        pass\n",
        ("tests/test_integrations.py::test_two_ranks_match_one_process[accelerate]",),
    ),
    Mutant(
        "lightning-broadcast-on",
        "Lightning: on_fit_start turns the DDP wrapper's buffer broadcast off",
        "distnorm/integrations/lightning.py",
        "                wrapper.broadcast_buffers = False\n",
        "                wrapper.broadcast_buffers = True\n",
        ("tests/test_lightning.py::test_two_lightning_ranks_match_one_process[cbn-flags0]",),
    ),
    Mutant(
        "lightning-hook-per-call",
        "Lightning: the plugin's per-step work (learning rate, check every check_every) once per training batch",
        "distnorm/integrations/lightning.py",
        "        plugin.remove()\n",
        "        pass\n",
        ("tests/test_lightning.py::test_two_lightning_ranks_match_one_process[cbn-flags0]",),
    ),
    # ------------------------------------------------------------------- data, evaluation
    Mutant(
        "eval-sample-dropped-silently",
        "an unreadable sample raises (on_error='raise') or is skipped and counted (on_error='skip')",
        "distnorm/data/loaders.py",
        '        log.failure(f"shard {url} sample {key}", err)\n',
        "        pass\n",
        ("tests/test_data.py::test_undecodable_image_and_bad_label",),
    ),
    Mutant(
        "masked-samples-counted",
        "evaluation counts each real sample once, padding nowhere",
        "distnorm/data/evaluation.py",
        "            m = mask.double()\n",
        "            m = torch.ones_like(mask, dtype=torch.float64)\n",
        ("tests/test_data.py::test_undecodable_image_and_bad_label",),
    ),
    Mutant(
        "normalize-rounding-changed",
        "the presets' tensors equal torchvision's Compose(..., ToTensor(), Normalize()) bit for bit",
        "distnorm/data/transforms.py",
        "        out.div_(255).sub_(self._mean).div_(self._std)  # on the CPU (workers; batch())\n",
        "        out.mul_(1 / 255).sub_(self._mean).div_(self._std)  # on the CPU (workers; batch())\n",
        ("tests/test_data.py::test_preset_transforms_equal_torchvision_compose_bit_for_bit",),
    ),
    Mutant(
        "deferred-flip-inverted",
        "decode_device: the same crops and flips as decoding in the workers",
        "distnorm/data/transforms.py",
        "                if torch.rand(1) < step.p:\n",
        "                if torch.rand(1) > step.p:\n",
        ("tests/test_data.py::test_torchvision_decoder_in_workers_and_deferred_to_the_main_process_agree",),
    ),
    Mutant(
        "eval-shard-shortfall-unreported",
        "evaluation reports a shard cut inside a tar header (samples against the index)",
        "distnorm/data/loaders.py",
        "            if seen.get(url, 0) < self.counts[url] and url not in log.failed_shards:\n",
        "            if seen.get(url, 0) < 0:\n",
        ("tests/test_data.py::test_truncated_webdataset_shard_is_reported_in_evaluation",),
    ),
    Mutant(
        "batch-buffer-given-back-while-held",
        "a worker reuses a batch buffer only once nothing in the main process refers to it",
        "distnorm/data/batches.py",
        "            if ref.expired():  # no tensor, view or array in this process refers to it\n",
        "            if True:  # no tensor, view or array in this process refers to it\n",
        ("tests/test_data.py::test_batch_buffers_reused_only_once_nothing_refers_to_them",),
    ),
    Mutant(
        "batch-buffers-never-reused",
        "workers reuse their shared batch buffers (no fresh 19 MB buffer per ImageNet batch)",
        "distnorm/data/batches.py",
        "                self._give_back(held)\n",
        "                pass\n",
        ("tests/test_data.py::test_batch_buffers_reused_only_once_nothing_refers_to_them",),
    ),
    Mutant(
        "fork-shares-given-back",
        "a batch a forked process inherited keeps its buffer (never given back to its worker)",
        "distnorm/data/batches.py",
        "os.register_at_fork(before=_before_fork)\n",
        "pass  # os.register_at_fork(before=_before_fork)\n",
        ("tests/test_data.py::test_batches_a_forked_process_inherits_keep_their_buffers",),
    ),
    Mutant(
        "pax-headers-back",
        "distnorm-shards writes one header per member (no PAX header)",
        "distnorm/data/shards.py",
        "FIXED_MTIME = 0  # reproducible tar headers; an int: a float mtime costs a PAX header per member\n",
        "FIXED_MTIME = 0.0  # reproducible tar headers; an int: a float mtime costs a PAX header per member\n",
        ("tests/test_data.py::test_shards_have_no_pax_headers",),
    ),
    Mutant(
        "shuffle-reads-ahead",
        "a worker reads no sample its epoch does not use",
        "distnorm/data/loaders.py",
        "        target = min(bufsize, demand.outstanding())\n",
        "        target = bufsize\n",
        ("tests/test_data.py::test_shuffle_buffer_reads_no_sample_the_epoch_does_not_use",),
    ),
    # ------------------------------------------------------------ recipe: faults, checkpoints
    Mutant(
        "config-disagreement-accepted",
        "ranks whose training configurations differ stop before the first training collective",
        "distnorm/train/loop.py",
        '        "the training configuration": ("\\n".join(keyed_lines(config)),\n',
        '        "the training configuration": ("",\n',
        (f"{REL}::test_mismatch_is_detected_before_the_first_training_collective[config]",),
    ),
    # ------------------------------------------------- recipe: what a run says when it ends (issue 38)
    Mutant(
        "mismatch-dumped-whole",
        "ranks whose setups differ are told the keys that differ and each rank's value, once",
        "distnorm/_collectives.py",
        "    keyed = _describe_keys(groups)\n",
        "    keyed = None\n",
        (f"{REL}::test_mismatch_is_detected_before_the_first_training_collective[config]",),
    ),
    Mutant(
        "config-error-said-by-every-process",
        "an error every process shares is printed once",
        "distnorm/train/cli.py",
        "        if says_it:\n",
        "        if True:\n",
        ("tests/test_train.py::test_a_bad_command_under_torchrun_is_said_once_and_named_as_the_root_cause",
         f"{REL}::test_mismatch_is_detected_before_the_first_training_collective[config]"),
    ),
    Mutant(
        "usage-error-said-by-every-process",
        "an error every process shares is printed once",
        "distnorm/train/cli.py",
        "        if not _says_it_for_the_node():\n            self.exit(2)\n",
        "        if False:\n            self.exit(2)\n",
        ("tests/test_train.py::test_a_bad_command_under_torchrun_is_said_once_and_named_as_the_root_cause",),
    ),
    Mutant(
        "node-error-said-by-local-rank-0-only",
        "under torchrun, the first process of a node to reach an error every process shares prints it "
        "(torchrun stops the others once one exits)",
        "distnorm/train/cli.py",
        '    if error_file and os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("LOCAL_WORLD_SIZE") or 1) > 1:\n',
        "    if False:\n",
        ("tests/test_train.py::test_the_first_process_of_a_node_to_claim_a_shared_error_says_it",),
    ),
    Mutant(
        "launcher-root-cause-unrecorded",
        "torchrun's failure summary names distnorm-train's error as the root cause",
        "distnorm/train/cli.py",
        '    path = os.environ.get("TORCHELASTIC_ERROR_FILE")\n',
        "    path = None\n",
        ("tests/test_train.py::test_a_bad_command_under_torchrun_is_said_once_and_named_as_the_root_cause",),
    ),
    Mutant(
        "max-steps-stop-unsaved",
        "a run stopped by train.max_steps writes a checkpoint there",
        "distnorm/train/loop.py",
        "        if outputs and position.global_step and checkpoints.latest_step() != position.global_step:\n",
        "        if False:\n",
        ("tests/test_train.py::test_a_max_steps_stop_writes_a_checkpoint_there",),
    ),
    Mutant(
        "ctrl-c-tracebacks",
        "Ctrl-C under torchrun: one line (the last checkpoint, the command to resume), no traceback",
        "distnorm/train/cli.py",
        "    if interrupted or isinstance(err, KeyboardInterrupt):\n",
        "    if False:\n",
        ("tests/test_train.py::test_ctrl_c_under_torchrun_says_where_to_resume_in_one_line",),
    ),
    Mutant(
        "torchrun-signal-traceback",
        "Ctrl-C under torchrun: one line (the last checkpoint, the command to resume), no traceback",
        "distnorm/train/torchrun.py",
        "        except SignalException as err:\n",
        "        except ImportError as err:\n",
        ("tests/test_train.py::test_ctrl_c_under_torchrun_says_where_to_resume_in_one_line",),
    ),
    Mutant(
        "resume-command-without-nproc",
        "Ctrl-C under torchrun: one line (the last checkpoint, the command to resume), no traceback",
        "launch/torchrun.sh",
        '  if [[ -n "${!var:-}" ]]; then LAUNCH_COMMAND+="$var=$(printf \'%q\' "${!var}") "; fi\n',
        '  if false; then LAUNCH_COMMAND+="$var=$(printf \'%q\' "${!var}") "; fi\n',
        ("tests/test_train.py::test_ctrl_c_under_torchrun_says_where_to_resume_in_one_line",),
    ),
    Mutant(
        "data-error-names-library-keyword",
        "a data error under the recipe names the override to type (data.on_error=skip)",
        "distnorm/train/cli.py",
        '    text = text.replace(SKIP_HINT, "set data.on_error=skip to skip bad data (counted and reported each epoch), or "\n',
        '    text = text.replace("(nowhere)", "set data.on_error=skip to skip bad data (counted and reported each epoch), or "\n',
        (f"{REL}::test_corrupt_shard_fails_all_ranks_or_is_skipped",),
    ),
    # ------------------------------------------------------------ shards on shared storage (issue 38)
    Mutant(
        "index-created-0600",
        "the shard index gets the mode of the shards (0666 less the umask)",
        "distnorm/data/index.py",
        "        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the kernel applies the umask\n",
        "        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the kernel applies the umask\n",
        ("tests/test_data.py::test_index_gets_the_mode_of_the_shards",),
    ),
    Mutant(
        "empty-class-folders-accepted",
        "an ImageFolder with an empty class folder is refused, naming it",
        "distnorm/data/shards.py",
        "    if isinstance(source, ImageFolderSource):\n        _refuse_empty_classes(source)\n",
        "    if False:\n        _refuse_empty_classes(source)\n",
        ("tests/test_data.py::test_empty_class_folders_are_refused_naming_them",),
    ),
    Mutant(
        "shard-size-not-compared",
        "--check (run by the launchers before any worker) compares every shard's size with its index",
        "distnorm/data/index.py",
        "        if self.size is not None and size != self.size:\n",
        "        if False:\n",
        ("tests/test_train.py::test_check_compares_shard_sizes_and_on_request_checksums",
         "tests/test_train.py::test_launcher_refuses_a_truncated_shard_before_starting_workers"),
    ),
    Mutant(
        "shard-checksum-not-compared",
        "--check --verify-checksums compares every shard's SHA-256 with its index",
        "distnorm/data/index.py",
        "        if checksum and self.sha256 is not None:\n",
        "        if False:\n",
        ("tests/test_data.py::test_index_records_each_shards_size_and_sha256",
         "tests/test_train.py::test_check_compares_shard_sizes_and_on_request_checksums"),
    ),
    Mutant(
        "nan-loss-unchecked",
        "a NaN loss stops every rank before the backward",
        "distnorm/train/loop.py",
        "            finite = _all_finite(loss_value, world, loss.device)\n",
        "            finite = True\n",
        (f"{REL}::test_non_finite_loss_stops_every_rank_naming_the_step_and_layer",),
    ),
    Mutant(
        "sha256-skipped",
        "a corrupt checkpoint is detected and skipped",
        "distnorm/train/checkpoint.py",
        '        if _sha256(path) != meta["sha256"]:\n',
        "        if False:\n",
        (f"{REL}::test_corrupt_latest_checkpoint_falls_back_to_the_previous[flipped byte]",),
    ),
    Mutant(
        "full-disk-swallowed",
        "a full disk (or any failed write) while checkpointing stops every rank cleanly, naming the free space",
        "distnorm/train/checkpoint.py",
        "safetensors report a full disk in their own types\n            failure = _describe_write_failure(err, tmp)\n",
        'safetensors report a full disk in their own types\n            failure = ""\n',
        # The tmpfs test (test_full_disk_while_checkpointing_stops_every_rank_cleanly) passes with
        # this bug: there the manifest's own write hits the full disk and reports it.
        (f"{REL}::test_a_failed_checkpoint_write_stops_every_rank_and_leaves_the_previous_latest[0-iostream]",
         f"{REL}::test_a_failed_checkpoint_write_stops_every_rank_and_leaves_the_previous_latest[1-iostream]"),
    ),
    Mutant(
        "console-at-info",
        "the console shows the epoch summaries, no library INFO lines",
        "distnorm/train/cli.py",
        "    logging.getLogger().setLevel(value)\n",
        "    logging.getLogger().setLevel(logging.INFO)\n",
        ("tests/test_train.py::test_demo_path_end_to_end",),
    ),
    Mutant(
        "slurm-job-not-requeued",
        "a failed Slurm node requeues the job, which resumes",
        "launch/slurm.sbatch",
        "#SBATCH --requeue\n",
        "#SBATCH --no-requeue\n",
        ("tests/test_cluster.py::test_slurm_node_failure_requeues_and_resumes",),  # make test-cluster's test
    ),
    Mutant(
        "resume-ignores-position",
        "kill -9 and restart resumes exactly (mid-epoch)",
        "distnorm/train/loop.py",
        "    loader.set_epoch(epoch, skip_batches=position.step_in_epoch)\n",
        "    loader.set_epoch(epoch, skip_batches=0)\n",
        ("tests/test_train.py::test_kill_mid_epoch_and_resume_continues_exactly",),
    ),
    # ------------------------------------------------------- make test-gpu on the bare image
    Mutant(
        "sybil-import-unguarded",
        "make test-gpu collects its tests on the bare GPU image (no Sybil, DeepSpeed, WebDataset, Lightning)",
        "conftest.py",
        '    if err.name != "sybil":\n',
        "    if True:\n",
        ("tests/test_gpu_image.py::test_gpu_tests_are_collected_where_sybil_deepspeed_webdataset_lightning_are_absent",),
    ),
    Mutant(
        "sybil-optional-everywhere",
        "make test stops, naming Sybil, where it is missing (the docs' examples are never dropped silently)",
        "conftest.py",
        "    if Sybil is None and not GPU_TIER:\n",
        "    if False:\n",
        ("tests/test_gpu_image.py::test_without_sybil_make_test_stops_naming_it",),
    ),
    Mutant(
        "gpu-report-runs-cpu-tests",
        "make test-gpu runs the CUDA tests only",
        "bench/gpu_report.py",
        '    return [sys.executable, "-m", "pytest", "-q", "-rs", "-m", TEST_MARKER, *args.tests, *shlex.split(args.pytest_args),\n',
        '    return [sys.executable, "-m", "pytest", "-q", "-rs", *args.tests, *shlex.split(args.pytest_args),\n',
        ("tests/test_bench.py::test_gpu_report_without_cuda",),
    ),
    Mutant(
        "gpu-report-part-grandchildren-survive",
        "make test-gpu stops a part at its time limit with every process it started",
        "bench/gpu_report.py",
        "        os.killpg(proc.pid, signal.SIGKILL)\n",
        "        proc.kill()\n",
        ("tests/test_bench.py::test_gpu_report_stops_a_part_and_everything_it_started_at_its_limit",),
    ),
    Mutant(
        "gpu-report-written-only-after-parts",
        "make test-gpu: a run killed from outside keeps its report and shows where it stopped",
        "bench/gpu_report.py",
        '                                                            "still says so was stopped from outside"}\n'
        "    save()\n",
        '                                                            "still says so was stopped from outside"}\n'
        "    pass\n",
        ("tests/test_bench.py::test_gpu_report_stopped_from_outside_keeps_its_report",),
    ),
    Mutant(
        "step-gpu-compiled-first",
        "make test-gpu: eager before compiled (a run cut short keeps the cheap figures)",
        "bench/step_gpu.py",
        "    args.modes = [m for m in MODES if m in args.modes]  # eager first\n",
        "    args.modes = list(dict.fromkeys(args.modes))\n",
        ("tests/test_bench.py::test_bench_step_gpu_smoke",),
    ),
    Mutant(
        "gpu-report-untimed-builds-dropped",
        "make test-gpu: a step part stopped at its limit reports what it built but did not time",
        "bench/gpu_report.py",
        '    if untimed and not result.get("complete", True):\n',
        "    if False:\n",
        ("tests/test_bench.py::test_gpu_report_tables_and_failures",),
    ),
    Mutant(
        "empty-rank-backward-sums-not-zero",
        "a rank with an empty batch joins the collectives and contributes nothing: on one device, two ranks",
        "distnorm/_functions.py",
        "        t_local, s1_local = torch.zeros(2, channels, dtype=center.dtype, device=center.device).unbind()\n",
        "        t_local, s1_local = torch.ones(2, channels, dtype=center.dtype, device=center.device).unbind()\n",
        ("tests/test_cuda.py::test_empty_rank_on_one_device[cpu-splits0]",),
    ),
    # ------------------------------------------------------------ the package is the product (issue 38)
    Mutant(
        "wheel-without-deepspeed-json",
        "the wheel ships the recipes, their DeepSpeed JSON and the launchers; its commands run them outside a clone",
        "pyproject.toml",
        '"distnorm.recipes" = ["**/*.yaml", "**/*.json"]\n',
        '"distnorm.recipes" = ["**/*.yaml"]\n',
        ("tests/test_packaging.py::test_the_wheel_holds_the_package_its_recipes_and_its_launchers",
         "tests/test_packaging.py::test_the_installed_commands_run_shipped_recipes_outside_the_clone"),
    ),
    Mutant(
        "wheel-without-launch-scripts",
        "python -m distnorm.launch torchrun runs the shipped launch/torchrun.sh from an install",
        "pyproject.toml",
        '"distnorm.launch.scripts" = ["*.sh", "*.sbatch",',
        '"distnorm.launch.scripts" = ["*.sbatch",',
        ("tests/test_packaging.py::test_the_installed_launcher_runs_torchrun_sh_from_the_package",),
    ),
    Mutant(
        "recipe-clone-path-outside-clone",
        "a recipe by name, or by a clone's configs/ path, from any directory (its DeepSpeed JSON too)",
        "distnorm/train/config.py",
        "    return Path(value).as_posix().removeprefix(_CLONE_PREFIX)\n",
        "    return Path(value).as_posix()\n",
        ("tests/test_train.py::test_a_shipped_recipe_by_name_from_any_directory",),
    ),
    Mutant(
        "recipe-close-names-dropped",
        "a recipe name that matches nothing lists the closest names",
        "distnorm/train/config.py",
        "    close = list(dict.fromkeys(close))[:5]\n",
        "    close = []\n",
        ("tests/test_train.py::test_an_unknown_recipe_name_lists_the_closest_and_list_configs_lists_every_one",),
    ),
    Mutant(
        "missing-extra-traceback",
        "a missing optional dependency names the extra to install, never a bare ModuleNotFoundError",
        "distnorm/launch/__init__.py",
        '    return _entry("distnorm.train.cli", "train", "distnorm-train")()\n',
        '    return importlib.import_module("distnorm.train.cli").main()\n',
        ("tests/test_packaging.py::test_a_missing_optional_dependency_names_the_extra_to_install[train-help]",),
    ),
    # ------------------------------------------------- the docs run as a user runs them
    Mutant(
        "docs-blocks-keep-launcher-variables",
        "every code block of README and docs runs in the environment a user has (no variable the page does not set)",
        "conftest.py",
        "    for key in [k for k in os.environ if LAUNCHER_VARIABLES.fullmatch(k)]:\n",
        "    for key in []:\n",
        ("tests/test_docs.py::test_a_block_that_needs_a_launcher_variable_fails",),
    ),
    Mutant(
        "torchrun-marker-one-rank",
        "a block marked for torchrun runs (with the page's blocks before it) on the ranks the marker names",
        "conftest.py",
        '    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",\n',
        '    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",\n',
        ("tests/test_docs.py::test_a_torchrun_marker_runs_the_pages_blocks_on_n_ranks",),
    ),
    Mutant(
        "torchrun-marker-exit-ignored",
        "a page's blocks that fail under torchrun fail their test",
        "conftest.py",
        "    if done.returncode != 0:\n",
        "    if False:\n",
        ("tests/test_docs.py::test_a_torchrun_marker_runs_the_pages_blocks_on_n_ranks",),
    ),
    Mutant(
        "torch-extensions-shared-by-venvs",
        "DeepSpeed's CPU op is built in the venv (TORCH_EXTENSIONS_DIR), not in the cache every venv shares: the "
        "tests', the examples', distnorm-train's",
        "distnorm/integrations/deepspeed.py",
        "    if sys.prefix == sys.base_prefix:\n        return None\n",
        "    if True:\n        return None\n",
        ("tests/test_docs.py::test_deepspeeds_op_is_built_inside_the_venv",
         "tests/test_integrations.py::test_the_deepspeed_integration_builds_deepspeeds_ops_in_its_venv"),
    ),
    Mutant(
        "extras-table-drifts",
        "README's extras table names every extra of pyproject.toml",
        "README.md",
        "| `report` | matplotlib | `distnorm-report`'s plots |\n",
        "| `reports` | matplotlib | `distnorm-report`'s plots |\n",
        ("tests/test_docs.py::test_the_extras_table_is_pyprojects",),
    ),
    Mutant(
        "imagenet-trial-class-count-wrong",
        "the ImageNet guide's 3-class trial runs as written",
        "docs/guides/imagenet.md",
        "NPROC=2 launch/torchrun.sh configs/imagenet/resnet50_cbn.yaml model.num_classes=3 \\\n",
        "NPROC=2 launch/torchrun.sh configs/imagenet/resnet50_cbn.yaml model.num_classes=4 \\\n",
        ("tests/test_docs.py::test_imagenet_trial_runs_as_written",),
    ),
    # ----------------------------------------------- issue 39: one owner per default, one spelling
    Mutant(
        "data-default-second-owner",
        "every data default has one owner (ImageSpec / LoaderSpec / the recipe's DataConfig)",
        "distnorm/data/transforms.py",
        "                 reduced_decode: bool = ImageSpec.reduced_decode, decoder: str = ImageSpec.decoder,\n",
        '                 reduced_decode: bool = ImageSpec.reduced_decode, decoder: str = "pil",\n',
        ("tests/test_defaults.py::test_every_data_default_has_one_owner",),
    ),
    Mutant(
        "loader-keyword-of-its-own",
        "the loaders take every setting from LoaderSpec, an unknown keyword refused by name",
        "distnorm/data/loaders.py",
        "                 world_size: int = 1, **options: Any):\n        super().__init__(LoaderSpec.of(\"EvalLoader\"",
        "                 world_size: int = 1, num_workers: int = 2, **options: Any):\n"
        "        super().__init__(LoaderSpec.of(\"EvalLoader\"",
        ("tests/test_defaults.py::test_every_data_default_has_one_owner",),
    ),
    Mutant(
        "recipe-restates-a-default",
        "a recipe states only what differs from what it extends",
        "configs/base/imagenet.yaml",
        "  checkpoint_every_steps: 1000\n",
        "  keep_last: 3\n",
        ("tests/test_defaults.py::test_a_recipe_states_only_what_differs_from_what_it_extends[base/imagenet]",),
    ),
    Mutant(
        "config-keeps-off-spelling",
        "one spelling per norm label: keep the BatchNorm is \"keep\" in convert, the configuration and the zoo",
        "distnorm/config.py",
        '"they are; none: remove them)", one_of(*NORM_LABELS), choices=NORM_LABELS)\n',
        '"they are; none: remove them)", one_of(*NORM_LABELS, "off"), choices=NORM_LABELS)\n',
        ("tests/test_defaults.py::test_every_norm_label_has_one_spelling_everywhere",),
    ),
    # ------------------------------------------- issue 39 (3): converted models pickle whole
    Mutant(
        "norm-act-class-made-at-run-time",
        "converted models save whole: torch.save / pickle / deepcopy, every norm, BNP off and on",
        "distnorm/convert.py",
        "    fused = NORM_ACT_CLASSES.get(type(norm))\n",
        "    fused = type(f\"{type(norm).__name__}Act\", (_NormAct, type(norm)), {\"__module__\": __name__})\n",
        ("tests/test_convert.py::test_converted_models_save_pickle_and_deepcopy_whole[timm:efficientnet_b0]",),
    ),
    Mutant(
        "preconditioned-class-pickled-by-name",
        "converted models save whole: torch.save / pickle / deepcopy, every norm, BNP off and on",
        "distnorm/bnp.py",
        "            \"__reduce_ex__\": _reduce_preconditioned, \"__setstate__\": _setstate_preconditioned,\n",
        "            \"__setstate__\": _setstate_preconditioned,\n",
        ("tests/test_convert.py::test_converted_models_save_pickle_and_deepcopy_whole[zoo:resnet20]",),
    ),
    Mutant(
        "bnp-state-pickles-its-stash",
        "converted models save whole: torch.save / pickle / deepcopy, every norm, BNP off and on",
        "distnorm/_bnp_functions.py",
        "        state.update(dict.fromkeys(self.RUNTIME_FIELDS), stash=None, key=-1)\n",
        "        state.update(dict.fromkeys(self.RUNTIME_FIELDS), key=-1)\n",
        ("tests/test_convert.py::test_converted_models_save_pickle_and_deepcopy_whole[zoo:resnet20]",),
    ),
    Mutant(
        "loaded-bnp-state-unregistered",
        "converted models save whole: torch.save / pickle / deepcopy, every norm, BNP off and on",
        "distnorm/bnp.py",
        "    if bnp_state is not None:\n        _state.register(bnp_state, channels=module.bnp_mean.numel())",
        "    if bnp_state is None:\n        _state.register(bnp_state, channels=module.bnp_mean.numel())",
        ("tests/test_convert.py::test_converted_models_save_pickle_and_deepcopy_whole[zoo:resnet20]",),
    ),
    # ----------------------------------------------- issue 39 (2): one object per engine
    Mutant(
        "core-names-an-engine",
        "the core (plugin, consistency, wrappers, the registry) names no engine",
        "distnorm/plugin.py",
        '            "created (init_process_group(), or the engine\'s own initialisation)"\n',
        '            "created (Accelerator(), deepspeed.init_distributed() or init_process_group())"\n',
        ("tests/test_engines.py::test_the_core_names_no_engine",),
    ),
    Mutant(
        "registry-follow-ignored",
        "one registration is all an engine needs: follow() reads the learning rate its Engine says",
        "distnorm/plugin.py",
        "        if engine is not None and engine.follow is not None:  # its integration knows how to read it\n",
        "        if False:  # its integration knows how to read it\n",
        ("tests/test_engines.py::test_one_registration_is_all_a_new_engine_needs",),
    ),
    Mutant(
        "registry-partition-ignored",
        "one registration is all an engine needs: its partitioned parameters are left out of the check",
        "distnorm/_engines.py",
        "    return [e.partitioned for e in _ENGINES.values() if e.partitioned is not None]\n",
        "    return []\n",
        ("tests/test_engines.py::test_one_registration_is_all_a_new_engine_needs",),
    ),
    Mutant(
        "registry-loads-every-integration",
        "import distnorm and a plugin's check import no engine; an integration loads when its library is met",
        "distnorm/_engines.py",
        "    for library in _INTEGRATIONS & sys.modules.keys():\n",
        "    for library in _INTEGRATIONS:\n",
        ("tests/test_engines.py::test_import_distnorm_imports_no_engine_and_an_engine_met_loads_its_integration",),
    ),
    Mutant(
        "check-path-imports-the-loaders",
        "distnorm-train --check and a refused configuration import no torch: the recipe reads the loaders' settings, "
        "not the loaders",
        "distnorm/train/config.py",
        "from distnorm.data.specs import LoaderSpec\n",
        "from distnorm.data.loaders import LoaderSpec\n",
        ("tests/test_structure.py::test_the_command_lines_check_path_imports_no_torch",
         "tests/test_train.py::test_check_and_a_refused_configuration_run_without_torch"),
    ),
    Mutant(
        "package-convert-becomes-the-module",
        "distnorm.convert stays the function once the submodule distnorm.convert is imported (lazy import distnorm)",
        "distnorm/__init__.py",
        "_sys.modules[__name__].__class__ = _Package\n",
        "pass\n",
        ("tests/test_structure.py::test_import_distnorm_loads_no_torch_and_every_public_name_resolves",),
    ),
    Mutant(
        "check-skips-the-training-modules",
        "--check looks up the modules the training imports (a missing Pillow said before the queue wait)",
        "distnorm/train/cli.py",
        "            require_training_modules()  # what the workers import, looked up here (a run imports them)\n",
        "            pass\n",
        ("tests/test_packaging.py::test_a_missing_optional_dependency_names_the_extra_to_install[train-check]",),
    ),
    Mutant(
        "check-imports-the-engine",
        "the check looks the engine's library up without importing it (DeepSpeed imports torch and more)",
        "distnorm/train/checks.py",
        "    if importlib.util.find_spec(module) is None:\n",
        "    if __import__(module) is None:\n",
        ("tests/test_train.py::test_check_and_a_refused_configuration_run_without_torch",),
    ),
    Mutant(
        "deepspeed-state-not-in-client-state",
        "DeepSpeed: the plugin's state rides in client_state (resume: the count goes on, another configuration refused)",
        "distnorm/integrations/deepspeed.py",
        "    state[STATE_KEY] = plugin.state_dict()\n",
        "    pass\n",
        ("tests/test_integrations.py::test_resume_in_fresh_processes_equals_uninterrupted[deepspeed-zero1-zero3]",),
    ),
    Mutant(
        "accelerate-state-not-registered",
        "Accelerate: the plugin's state rides in save_state (register_for_checkpointing)",
        "distnorm/integrations/accelerate.py",
        "    accelerator.register_for_checkpointing(plugin)\n",
        "    pass\n",
        ("tests/test_integrations.py::test_resume_in_fresh_processes_equals_uninterrupted[accelerate]",),
    ),
    Mutant(
        "lightning-state-not-saved",
        "Lightning: the plugin's state rides in the callback's checkpoint state",
        "distnorm/integrations/lightning.py",
        '        return {"plugin": self.plugin.state_dict()}\n',
        "        return {}\n",
        ("tests/test_lightning.py::test_lightning_resume_from_checkpoint_equals_uninterrupted",),
    ),
    # ------------------------------------------------------- ranks that branch differently
    Mutant(
        "frame-header-unchecked",
        "ranks running different layers raise CollectiveMismatchError on every rank, debug off",
        "distnorm/_frames.py",
        "        if not torch.equal(frame.header, header.expected):\n",
        "        if False:\n",
        ("tests/test_branches.py::test_every_rank_names_both_layers[debug_off]",),
    ),
    Mutant(
        "frame-not-padded",
        "a skipped layer or another channel count still pairs well-formed collectives (no gloo abort)",
        "distnorm/_frames.py",
        "    return _WIDTH[0]\n",
        "    return payload\n",
        ("tests/test_branches.py::test_every_rank_names_both_layers[debug_off]",),
    ),
    Mutant(
        "pending-frames-never-compared",
        "frames compared late (a GPU's path) are compared at the next consistency check",
        "distnorm/_frames.py",
        "    _PENDING.check(wait=True)\n",
        "    pass\n",
        ("tests/test_branches.py::test_the_plugin_check_names_both_layers_when_frames_are_compared_late",),
    ),
    Mutant(
        "cpu-kernel-setting-not-voted",
        "every rank runs the same backward arithmetic: DISTNORM_CPU_KERNEL is agreed in the group's first step",
        "distnorm/_kernel_choice.py",
        "    off = device.type == \"cpu\" and cpu == _OFF\n",
        "    off = False\n",
        ("tests/test_fused.py::test_ranks_with_different_cpu_kernel_settings_raise_on_every_rank",),
    ),
    Mutant(
        "cpu-plan-kernel-formula",
        "the CPU's C kernel of CBN's per-channel step computes the composite's values",
        "distnorm/csrc/kernels.c",
        "            d = beta - delta * eta;\n",
        "            d = beta + delta * eta;\n",
        ("tests/test_fused.py::test_cpu_plan_kernel_equals_composite",),
    ),
    Mutant(
        "cpu-param-grads-kernel-formula",
        "the CPU's C kernels of the backward's per-channel operators compute the composite's values",
        "distnorm/csrc/kernels.c",
        "        grad_bias[c] = (s1[c] + (-1.0f * beta_coef[c]) * t[c]) * a[c];\n",
        "        grad_bias[c] = (s1[c] + beta_coef[c] * t[c]) * a[c];\n",
        ("tests/test_fused.py::test_cpu_backward_kernel_equals_composite",),
    ),
    Mutant(
        "cpu-output-kernel-formula",
        "the CPU's C kernel of the forward's output computes CUDA's batch_norm_elemt",
        "distnorm/csrc/kernels.c",
        "        k[c] = weight ? invstd[c] * weight[c] : invstd[c];                                            \\\n",
        "        k[c] = weight ? weight[c] : invstd[c];                                                        \\\n",
        ("tests/test_fused.py::test_cpu_output_kernel_is_cudas_formula",),
    ),
    Mutant(
        "cpu-sums-kernel-uncentered",
        "the CPU's C kernel of the backward's local sums computes CUDA's batch_norm_backward_reduce",
        "distnorm/csrc/kernels.c",
        "                    ACC gv = LOAD(gr[k]), d = LOAD(xr[k]) - mean[c0 + k];                            \\\n",
        "                    ACC gv = LOAD(gr[k]), d = LOAD(xr[k]);                                           \\\n",
        ("tests/test_fused.py::test_cpu_sums_kernel_is_cudas_reduce",),
    ),
    Mutant(
        "bnp-kernel-unused",
        "BNP's backward on the CPU runs the C kernel: one pass over the weight gradient",
        "distnorm/_bnp_functions.py",
        "        if ctx.kernel in (None, \"composite\"):\n",
        "        if True:\n",
        ("tests/test_bnp.py::test_the_cpu_kernel_preconditions_in_one_pass_over_the_weight_gradient",),
    ),
    Mutant(
        "bnp-kernel-only-without-a-group",
        "BNP's backward on the CPU runs the C kernel once the layer's group agreed on it",
        "distnorm/bnp.py",
        "                  else _kernel_choice.kernels_of(state, state.group(), weight.device).per_channel)\n",
        "                  else _kernel_choice.kernels_of(state, None, weight.device).per_channel if state.group() is None else None)\n",
        ("tests/test_bnp.py::test_ddp_two_ranks_equal_one_process",),
    ),
    Mutant(
        "bnp-kernel-group-rows",
        "BNP's C kernel computes the transform of the explicit matrices (grouped convolutions)",
        "distnorm/csrc/kernels.c",
        "        const T* m = mu_k + (d / rows_per_group) * row_len;                                           \\\n",
        "        const T* m = mu_k;                                                                            \\\n",
        ("tests/test_bnp.py::test_transform_equals_explicit_matrices",),
    ),
    Mutant(
        "bnp-kernel-bias-sum",
        "BNP's C kernel computes the transform of the explicit matrices (the bias's row sum)",
        "distnorm/csrc/kernels.c",
        "        out_b[d] = (T)((double)(g / q2) - fold(acc));                                                 \\\n",
        "        out_b[d] = (T)((double)(g / q2) + fold(acc));                                                 \\\n",
        ("tests/test_bnp.py::test_the_cpu_kernel_preconditions_in_one_pass_over_the_weight_gradient",),
    ),
    Mutant(
        "bnp-triton-kernel-group-rows",
        "BNP's Triton kernel reads each group's statistics for its rows (grouped convolutions)",
        "distnorm/_triton.py",
        "    first = (d // rows_per_group) * per_group\n",
        "    first = d * 0\n",
        ("tests/test_bnp.py::test_the_triton_kernel_preconditions_in_one_pass",),
    ),
    Mutant(
        "bnp-kernel-shapes-unchecked",
        "BNP's C kernel refuses arguments that do not match before it reads them",
        "distnorm/csrc/cpu_ops.cpp",
        "      grad_weight.dim() >= 2 && groups >= 1 && grad_weight.size(0) % groups == 0 &&\n",
        "      true || grad_weight.dim() >= 2 && groups >= 1 && grad_weight.size(0) % groups == 0 &&\n",
        ("tests/test_bnp.py::test_the_cpu_kernel_refuses_what_does_not_match",),
    ),
    Mutant(
        "cpu-kernel-strided-pointers",
        "the CPU's C kernels read strided arguments as the composite does",
        "distnorm/csrc/cpu_ops.cpp",
        "  backward_sums_f32(ptr<float>(s1_), ptr<float>(t_), ptr<float>(beta_), ptr<float>(a_), ptr<float>(coef_),\n",
        "  backward_sums_f32(ptr<float>(s1), ptr<float>(t), ptr<float>(beta_coef), ptr<float>(grad_scale), ptr<float>(grad_coef),\n",
        ("tests/test_fused.py::test_cpu_kernels_read_strided_arguments",),
    ),
    Mutant(
        "backward-sums-unscaled",
        "CBN matches the float64 reference, 2 ranks equal 1 process (the backward's sums scaled by r_mu and q before the all-reduce)",
        "distnorm/_composite.py",
        "    sums = grad_coef[0] * torch.stack([s1, t])\n",
        "    sums = torch.stack([s1, t])\n",
        ("tests/test_layers.py::test_cbn_matches_reference[shape0]",),
    ),
    Mutant(
        "triton-backward-sums-unscaled",
        "The fused operators' CUDA (Triton) kernels equal the ATen composite (the backward's scaled sums)",
        "distnorm/_triton.py",
        "        tl.store(sums_ptr + C + offs, q * t, mask=m)\n",
        "        tl.store(sums_ptr + C + offs, t, mask=m)\n",
        ("tests/test_fused.py::test_triton_backward_kernel_equals_composite",),
    ),
    Mutant(
        "worker-prints-dropped-handoffs",
        "Ctrl-C leaves one line: a DataLoader worker prints no traceback when the main process drops a batch handoff",
        "distnorm/data/loaders.py",
        "    sys.excepthook = hook\n",
        "    pass\n",
        ("tests/test_data.py::test_a_worker_prints_no_traceback_when_the_main_process_drops_a_batch_handoff",),
    ),
    Mutant(
        "worker-hides-every-error",
        "a DataLoader worker's hook drops only the resource sharer's connection errors",
        "distnorm/data/loaders.py",
        "        if issubclass(kind, (ConnectionError, EOFError)) and tb is not None and tb.tb_frame.f_code is serving_loop:\n",
        "        if True:\n",
        ("tests/test_data.py::test_a_worker_prints_no_traceback_when_the_main_process_drops_a_batch_handoff",),
    ),
    Mutant(
        "checkpoint-commit-interruptible",
        "an interrupted run's last checkpoint is the one on disk: Ctrl-C is held while a checkpoint is committed",
        "distnorm/train/checkpoint.py",
        "        with _sigint_held():\n",
        "        with contextlib.nullcontext():\n",
        ("tests/test_reliability.py::test_ctrl_c_during_the_commit_waits_until_latest_names_the_checkpoint",),
    ),
    Mutant(
        "cpu-kernel-built-at-first-use",
        "no rank is left waiting: a rank whose C kernels cannot be built is named by every rank at the group's first step",
        "distnorm/_kernel_choice.py",
        "        _cpu_kernels.library()\n",
        "        pass\n",
        ("tests/test_fused.py::test_a_rank_without_a_c_compiler_is_named_by_every_rank_at_the_first_step",),
    ),
    Mutant(
        "cpu-kernel-agreement-not-kept",
        "synchronized CPU layers run the C kernels once their group agreed on them",
        "distnorm/_kernel_choice.py",
        "        _CPU_KERNEL_AGREED[group] = cpu_kernel_off == 0\n",
        "        _CPU_KERNEL_AGREED[group] = False\n",
        ("tests/test_fused.py::test_synchronized_layers_run_the_c_kernels_once_the_group_agreed",),
    ),
    # ------------------------------------------------------------------------ exit
    Mutant(
        "kernels-hold-their-group",
        "a distnorm script exits cleanly after destroy_process_group: a layer's kept kernels hold its group weakly",
        "distnorm/_kernel_choice.py",
        "        state.kernels = (weakref.ref(group) if group is not None else None, device, chosen)\n",
        "        state.kernels = ((lambda: group) if group is not None else None, device, chosen)\n",
        ("tests/test_exit.py::test_no_distnorm_cache_keeps_a_destroyed_group_alive",),
    ),
    Mutant(
        "collective-returns-before-gloo-lets-go",
        "a distnorm script exits cleanly after destroy_process_group: a CPU collective returns after gloo let go of its tensors",
        "distnorm/_release.py",
        "        while sys.getrefcount(cpu[i]) > before[i]:\n",
        "        while False:\n",
        ("tests/test_exit.py::test_released_waits_for_the_last_other_holder_and_no_longer",
         "tests/test_exit.py::test_a_cpu_collective_returns_after_gloo_let_go_of_its_tensors"),
    ),
    Mutant(
        "kernel-vote-holds-its-groups",
        "a distnorm script exits cleanly after destroy_process_group: no distnorm cache keeps a destroyed group alive",
        "distnorm/_kernel_choice.py",
        '_AGREED: "weakref.WeakKeyDictionary[ProcessGroup, dict[str, TritonState]]" = weakref.WeakKeyDictionary()\n',
        '_AGREED: "weakref.WeakKeyDictionary[ProcessGroup, dict[str, TritonState]]" = {}\n',
        ("tests/test_exit.py::test_no_distnorm_cache_keeps_a_destroyed_group_alive",),
    ),
    Mutant(
        "fold-drops-beta-statistics-path",
        "a CBN before the stem is folded into its convolution: the float64 reference's values and gradients, without the stem's input gradient",
        "distnorm/_functions.py",
        "                grad_shift, grad_scale, beta_coef, a, grad_coef, 1.0 / state.rho,\n",
        "                grad_shift, grad_scale, torch.zeros_like(beta_coef), a, grad_coef, 1.0 / state.rho,\n",
        ("tests/test_folding.py::test_folded_stem_equals_the_float64_reference",),
    ),
    Mutant(
        "fold-padding-as-interior",
        "a CBN before the stem is folded into its convolution: the float64 reference's values and gradients, without the stem's input gradient",
        "distnorm/_folding.py",
        "        bias_image = op._conv_forward(image, weight.detach(), None)\n",
        "        bias_image = weight.detach().sum(dim=tuple(range(2, weight.dim()))).mv(shift.to(weight.dtype)).view((1, -1) + (1,) * (weight.dim() - 2))\n",
        ("tests/test_folding.py::test_folded_stem_equals_the_float64_reference",),
    ),
    Mutant(
        "fold-plan-kept-by-nothing",
        "a CBN before the stem is folded into its convolution: compiled and checkpointed as eager",
        "distnorm/_functions.py",
        "            ctx.stashed = state.pending  # keeps the stashed plan alive as long as this node (NormalizeFunction)\n",
        "            ctx.stashed = None  # keeps the stashed plan alive as long as this node (NormalizeFunction)\n",
        ("tests/test_folding.py::test_the_folded_stem_compiles_and_checkpoints_as_eager",),
    ),
    Mutant(
        "fold-skips-hooks",
        "a CBN before the stem is folded into its convolution only where the result is the layers': no hooks or replaced forward on either module, no groups, no subclass, no eval or no_grad",
        "distnorm/_folding.py",
        "            and not _hooked(op) and not _hooked(norm))\n",
        "            and not _hooked(norm))\n",
        ("tests/test_folding.py::test_it_folds_only_where_the_result_is_the_layers",),
    ),
    Mutant(
        "fold-skips-norm-hooks",
        "a CBN before the stem is folded into its convolution only where the result is the layers': no hooks or replaced forward on either module, no groups, no subclass, no eval or no_grad",
        "distnorm/_folding.py",
        "            and not _hooked(op) and not _hooked(norm))\n",
        "            and not _hooked(op))\n",
        ("tests/test_folding.py::test_it_folds_only_where_the_result_is_the_layers",),
    ),
    Mutant(
        "fold-skips-instance-forward",
        "a CBN before the stem is folded into its convolution only where the result is the layers': no hooks or replaced forward on either module, no groups, no subclass, no eval or no_grad",
        "distnorm/_folding.py",
        '    return bool("forward" in module.__dict__ or module._forward_pre_hooks or module._forward_hooks\n',
        "    return bool(module._forward_pre_hooks or module._forward_hooks\n",
        ("tests/test_folding.py::test_it_folds_only_where_the_result_is_the_layers",),
    ),
    Mutant(
        "fold-never-taken",
        "a CBN before the stem is folded into its convolution: the float64 reference's values and gradients, without the stem's input gradient",
        "distnorm/convert.py",
        "        if _folding.folds(self.norm, self.op, x):  # the stem: no input gradient to pay for\n",
        "        if False:  # the stem: no input gradient to pay for\n",
        ("tests/test_folding.py::test_the_folded_stem_computes_no_input_gradient",),
    ),
    Mutant(
        "prefetch-takes-after-the-step",
        "to_device takes (and copies) the next batch before the step reads the current one",
        "distnorm/data/prefetch.py",
        "        take()  # the next batch's copy goes out before this one's step starts\n        yield batch\n",
        "        yield batch\n        take()  # the next batch's copy goes out before this one's step starts\n",
        ("tests/test_prefetch.py::test_batches_are_taken_depth_ahead_of_the_step",),
    ),
    Mutant(
        "freeze-ignores-eval-stats",
        "the frozen CBN holds the statistics eval_stats names (AMAT's or the running ones)",
        "distnorm/serving.py",
        "        scale, shift = functional.cbn_eval_affine(weight, layer.bias, layer._statistics(), layer.amat_eta,\n",
        "        scale, shift = functional.cbn_eval_affine(weight, layer.bias, layer._statistics(), layer.amat_eta * 0,\n",
        ("tests/test_serving.py::test_the_frozen_cbn_uses_the_statistics_eval_stats_names",),
    ),
    Mutant(
        "freeze-bias-moved-with-its-sign",
        "a bias BNP added to a norm='bn' convolution moves into the BatchNorm after it: the stock torchvision model computes the same outputs",
        "distnorm/serving.py",
        "            bn.running_mean.sub_(op.bias.to(bn.running_mean.dtype))\n",
        "            bn.running_mean.add_(op.bias.to(bn.running_mean.dtype))\n",
        ("tests/test_serving.py::test_a_bn_model_loads_into_the_stock_torchvision_model",),
    ),
    Mutant(
        "revert-leaves-moved-buffers",
        "revert of a norm='bn' model gives back BatchNorms holding the trained statistics, also after model.to()",
        "distnorm/convert.py",
        "            _carry_over(current, change.original)\n",
        "            pass\n",
        ("tests/test_serving.py::test_revert_of_a_bn_model_keeps_what_it_trained_after_a_move",),
    ),
    Mutant(
        "gn-triton-slices-merged-without-spread",
        "distnorm's GroupNorm on CUDA (Triton) equals float64's across tiles and slices",
        "distnorm/_triton.py",
        "        acc += tl.where(m, tl.load(at + C, mask=m, other=0.0) + cnt * d * d, 0.0)\n",
        "        acc += tl.where(m, tl.load(at + C, mask=m, other=0.0), 0.0)\n",
        ("tests/test_group_norm.py::test_triton_kernels_merge_tiles_and_slices[nchw-affine-torch.float32]",),
    ),
    Mutant(
        "gn-triton-backward-without-mean-term",
        "distnorm's GroupNorm on CUDA (Triton): the input gradient equals float64's",
        "distnorm/_triton.py",
        "    tl.store(coef_ptr + N * G + p, -rstd * tl.reduce(s2, 0, _add) * inv_m)\n",
        "    tl.store(coef_ptr + N * G + p, 0.0 * rstd)\n",
        ("tests/test_group_norm.py::test_triton_kernels_are_float64_group_norm[nchw-torch.float32]",),
    ),
    Mutant(
        "gn-composite-in-input-dtype",
        "distnorm's GroupNorm keeps float32 parameters and arithmetic for a bf16 input",
        "distnorm/_gn_kernels.py",
        "    acc = _acc(x)\n    y, mean, rstd = torch.native_group_norm(",
        "    acc = x.dtype\n    y, mean, rstd = torch.native_group_norm(",
        ("tests/test_group_norm.py::test_group_norm_is_float64_group_norm[nchw-torch.bfloat16-affine]",),
    ),
]


# ------------------------------------------------------------------------ mechanics
def _module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def _changed_lines(m: Mutant) -> tuple[str, str]:
    """The line of ``m.original`` that ``m.replacement`` changes, and what it becomes (stripped)."""
    diff = list(difflib.ndiff(m.original.splitlines(), m.replacement.splitlines()))
    old = next((line[2:].strip() for line in diff if line[:1] == "-"), "")
    new = next((line[2:].strip() for line in diff if line[:1] == "+"), "")
    return old, new


def check_mutants(mutants: list[Mutant], root: Path) -> list[str]:
    """Problems with the list against the tree at ``root``: text not found exactly once, or a
    replacement that changes other than exactly one line."""
    problems = []
    ids = [m.id for m in mutants]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"{dup}: id used twice")
    for m in mutants:
        path = root / m.path
        if not path.is_file():
            problems.append(f"{m.id}: {m.path} does not exist")
            continue
        found = path.read_text().count(m.original)
        if found != 1:
            problems.append(f"{m.id}: the original text is found {found} times in {m.path} (must be exactly once):\n"
                            + "".join(f"      {line}\n" for line in m.original.splitlines()))
        old, new = m.original.splitlines(), m.replacement.splitlines()
        changed = [line for line in difflib.ndiff(old, new) if line[:1] in "+-"]
        if len(old) != len(new) or len(changed) != 2:
            problems.append(f"{m.id}: the replacement must change exactly one line")
        if not m.tests:
            problems.append(f"{m.id}: no tests")
    return problems


def tree_files(root: Path) -> list[str]:
    """Tracked files and untracked files git does not ignore, as they are in the working tree."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p and (root / p).is_file()]


def make_copy(files: list[str], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)


def env_for(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no stale bytecode can outlive a patch
    env.pop("PYTEST_ADDOPTS", None)
    return env


def imported_from_copy(copy: Path, module: str, expect: str | None) -> str | None:
    """``None`` if, in a process started elsewhere with the copy's environment, ``distnorm``
    and ``module`` are imported from ``copy`` (and ``module``'s source holds ``expect``);
    else what went wrong."""
    code = ("import importlib, inspect, sys, distnorm\n"
            f"m = importlib.import_module({module!r})\n"
            "print(distnorm.__file__); print(m.__file__)\n"
            f"expect = {expect!r}\n"
            "sys.exit(0 if expect is None or expect in inspect.getsource(m) else 3)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", env=env_for(copy), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 3:
        return f"{module} imported without the replacement"
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return f"import {module} failed: {last}"
    paths = proc.stdout.split()
    outside = [p for p in paths if not Path(p).resolve().is_relative_to(copy.resolve())]
    return f"imported from outside the copy: {outside}" if outside else None


@dataclass
class Result:
    status: str  # caught | MISSED | BROKEN | SKIPPED | TIMEOUT | BASELINE
    seconds: float
    detail: str = ""


def run_pytest(copy: Path, tests: tuple[str, ...], report: Path, *, stop_first: bool, timeout: float,
               log: Path) -> tuple[int | None, dict[str, str]]:
    """Run ``tests`` in ``copy``; return pytest's exit code (``None`` on timeout) and the
    outcome of each test case that did not pass (``failure``, ``error`` or ``skipped``, from
    the JUnit report). On a timeout or an interrupt the whole process group goes (ranks and
    launchers the tests started included)."""
    # --basetemp beside the copy: this run's tmp_path trees go with it, apart from other sessions'.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "-rfEs",
           f"--basetemp={copy}.tmp", *(["-x"] if stop_first else []), *tests]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=copy, env=env_for(copy), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        except BaseException:
            _kill_group(proc)
            raise
        _kill_group(proc)  # whatever the tests left running in their session
    outcomes: dict[str, str] = {}
    if report.is_file():
        for case in ET.parse(report).iter("testcase"):
            for kind in ("failure", "error", "skipped"):
                if case.find(kind) is not None:
                    outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind
    return code, outcomes


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _ran(report: Path) -> int:
    """How many test cases the JUnit report lists."""
    return sum(1 for _ in ET.parse(report).iter("testcase")) if report.is_file() else 0


def _tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return "\n".join("      " + line for line in text[-lines:])


def run_mutant(m: Mutant, files: list[str], work: Path, timeout: float) -> Result:
    started = time.monotonic()
    copy = work / m.id
    make_copy(files, copy)
    target = copy / m.path
    target.write_text(target.read_text().replace(m.original, m.replacement, 1))
    if m.path.startswith("distnorm/") and m.path.endswith(".py"):
        problem = imported_from_copy(copy, _module_name(m.path), _changed_lines(m)[1])
    elif m.path.startswith("distnorm/"):  # a source the package builds (csrc): the package from the copy
        problem = imported_from_copy(copy, "distnorm", None)
    else:
        problem = None
        try:
            if m.path.endswith(".py"):
                compile(target.read_text(), str(target), "exec")
        except SyntaxError as err:
            problem = f"syntax error: {err}"
    if problem is not None:
        return Result("BROKEN", time.monotonic() - started, problem)
    log = work / f"{m.id}.log"
    code, outcomes = run_pytest(copy, m.tests, work / f"{m.id}.xml", stop_first=True, timeout=timeout, log=log)
    seconds = time.monotonic() - started
    if code is None:
        return Result("TIMEOUT", seconds, f"no result in {timeout:.0f} s; log: {log}")
    failed = {name: kind for name, kind in outcomes.items() if kind != "skipped"}
    if code == 0:
        if outcomes and len(outcomes) == _ran(work / f"{m.id}.xml"):
            return Result("SKIPPED", seconds, f"every test was skipped; log: {log}")
        return Result("MISSED", seconds, f"{len(m.tests)} test(s) passed with the bug in place")
    if code == 1 and failed:
        first = next(iter(failed))
        return Result("caught", seconds, f"{first.rsplit('.', 1)[-1]} ({failed[first]})")
    fatal = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("Fatal Python error")]
    if code < 0 or fatal:  # the bug took the test process down: the selection failed, without a report
        return Result("caught", seconds, f"the test process crashed ({fatal[0] if fatal else f'signal {-code}'})")
    return Result("BROKEN", seconds, f"pytest exit {code} (collection or usage error); log: {log}\n{_tail(log)}")


def baseline(mutants: list[Mutant], files: list[str], work: Path, timeout: float) -> tuple[set[str], float, str]:
    """Run the union of the selections once on an unmutated copy; the failing node ids."""
    started = time.monotonic()
    copy = work / "_baseline"
    make_copy(files, copy)
    problem = imported_from_copy(copy, "distnorm", None)
    if problem is not None:
        raise SystemExit(f"mutants: the copy is not what the tests import ({problem}); nothing would be tested")
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    log = work / "_baseline.log"
    code, outcomes = run_pytest(copy, tests, work / "_baseline.xml", stop_first=False, timeout=timeout * len(tests),
                                log=log)
    seconds = time.monotonic() - started
    if code is None:
        raise SystemExit(f"mutants: the baseline run did not finish; log: {log}")
    if code not in (0, 1):
        raise SystemExit(f"mutants: the baseline run could not collect or run the tests (pytest exit {code}):\n"
                         f"{_tail(log, 40)}")
    failing = {t for t in tests if any(_same_test(t, o) for o, kind in outcomes.items() if kind != "skipped")}
    skipped = {t for t in tests if any(_same_test(t, o) for o, kind in outcomes.items() if kind == "skipped")}
    failing |= skipped  # a skipped test cannot catch anything here
    if code == 1 and not failing:
        failing = set(tests)  # failed, but the report names nothing we can match: trust no test
    return failing, seconds, str(log)


def _same_test(node: str, junit_name: str) -> bool:
    """Whether pytest node id ``tests/test_x.py::test_y[p]`` is JUnit's ``tests.test_x::test_y[p]``."""
    path, _, name = node.partition("::")
    return junit_name == f"{_module_name(path)}::{name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/mutants.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant (default 900)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies and logs")
    args = parser.parse_args(argv)

    problems = check_mutants(MUTANTS, REPO)
    if problems:
        print("mutants: the list no longer matches the code; fix these entries in tests/mutants.py:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 2
    mutants = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in MUTANTS})
        if unknown:
            print(f"mutants: unknown id(s) {unknown}; see --list", file=sys.stderr)
            return 2
        mutants = [m for m in MUTANTS if m.id in args.only]
    if args.list:
        for m in mutants:
            before, after = _changed_lines(m)
            print(f"{m.id}\n    claim: {m.claim}\n    {m.path}:\n      - {before}\n      + {after}")
            for t in m.tests:
                print(f"    must fail: {t}")
        return 0

    files = tree_files(REPO)
    work = Path(tempfile.mkdtemp(prefix="distnorm-mutants-"))
    started = time.monotonic()
    print(f"mutants: {len(mutants)} mutant(s); copies of {len(files)} files under {work}", flush=True)
    failing: set[str] = set()
    results: dict[str, Result] = {}
    try:
        if not args.no_baseline:
            failing, seconds, log = baseline(mutants, files, work, args.timeout)
            note = f"failing or skipped without any mutant: {sorted(failing)} (log: {log})" if failing else "all pass"
            print(f"baseline ({seconds:.0f} s): {note}", flush=True)
        for m in mutants:
            if failing & set(m.tests):
                results[m.id] = Result("BASELINE", 0.0, "its tests fail (or are skipped) without the mutant")
            else:
                results[m.id] = run_mutant(m, files, work, args.timeout)
            r = results[m.id]
            print(f"  {m.id:<36} {r.status:<8} {r.seconds:6.0f} s  {r.detail}", flush=True)
    finally:
        if args.keep or len(results) < len(mutants) or any(r.status != "caught" for r in results.values()):
            print(f"copies and logs kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)

    total = time.monotonic() - started
    width = max(len(m.id) for m in mutants)
    print()
    print(f"| {'mutant':<{width}} | result   | s    | claim |")
    print(f"|{'-' * (width + 2)}|----------|------|-------|")
    for m in mutants:
        r = results[m.id]
        print(f"| {m.id:<{width}} | {r.status:<8} | {r.seconds:4.0f} | {m.claim} |")
    caught = sum(r.status == "caught" for r in results.values())
    print(f"\n{caught} of {len(mutants)} caught in {total / 60:.1f} min"
          + ("" if caught == len(mutants) else
             f"; not caught: {', '.join(f'{i} ({r.status})' for i, r in results.items() if r.status != 'caught')}"))
    return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
