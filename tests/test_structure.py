"""The package's structure and names: no import circle, one owner per default, one name per
value."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import distnorm
from distnorm import functional
from distnorm.specs import BNPSpec, CBNSpec, GNSpec, POPNormSpec, SyncBNSpec

PACKAGE = Path(distnorm.__file__).parent
#: distnorm modules that exist to import an optional package; imported lazily.
OPTIONAL_BACKENDS = ("distnorm.integrations.", "distnorm._triton")
#: Modules on the command line's check path (``distnorm-train --check``, a refused
#: configuration), which imports no torch: each imports what needs torch where it is first
#: used. The circle check sees those imports as module-level ones.
TORCH_FREE_LAZY = ("distnorm.models", "distnorm.train.cli")
#: Where the check path starts: the command's module (``distnorm-train``).
CHECK_PATH_ENTRY = "distnorm.train.cli"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, ast.AST, bool]]:
    """Every import of ``path`` that runs: ``(target, node, in_a_function)``, where ``from a
    import b`` targets ``a.b`` when that is one of ``modules``, else ``a``; imports under ``if
    TYPE_CHECKING`` (never executed) left out."""
    tree = ast.parse(path.read_text())
    inside = lambda kinds: {id(inner) for f in ast.walk(tree) if kinds(f) for inner in ast.walk(f) if inner is not f}  # noqa: E731
    in_function = inside(lambda f: isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    type_checking = inside(lambda f: isinstance(f, ast.If) and ast.unparse(f.test) in ("TYPE_CHECKING", "_TYPE_CHECKING"))
    found = []
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node, id(node) in in_function) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module, node,
                       id(node) in in_function) for a in node.names]
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """distnorm's import graph: what each module imports when imported (and, for the
    ``TORCH_FREE_LAZY`` modules, inside their functions too), and every other distnorm import
    made inside a function."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    inside_functions: list[str] = []
    for path in paths:
        module = _module_name(path)
        graph[module] = set()
        for target, node, in_function in _imports(path, modules):
            if not target.startswith("distnorm") or target == module:
                continue
            if not in_function or module in TORCH_FREE_LAZY:
                graph[module].add(target)
            elif not target.startswith(OPTIONAL_BACKENDS):
                # The integrations import their optional engine (DeepSpeed, Accelerate) when
                # imported, and distnorm._triton imports Triton (loaded on the first CUDA step,
                # never on a CPU run): importing them lazily is a lazy import of that package.
                inside_functions.append(f"{module}:{node.lineno} imports {target}")
    return graph, inside_functions


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_and_no_distnorm_import_inside_a_function():
    """distnorm's modules import one another in no circle, and never inside a function, where
    an import hid a circle before (specs.build() importing layers, the operators importing
    bnp)."""
    graph, inside_functions = _graph()
    # (Integrations are loaded by name through importlib where an engine is met: a plugin
    # mechanism, not an import this walk sees. Docstring examples are not code.)
    assert inside_functions == []
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    graph["distnorm.specs"].add("distnorm.layers")  # the checker finds the circle this would close
    assert _cycle(graph) is not None


def test_the_command_lines_check_path_imports_no_torch():
    """Every module ``distnorm-train`` imports before it trains -- the package, the recipe's
    configuration, the data settings, the checks -- imports no torch, so ``--check`` and a
    refused configuration cost a tenth of a second, not ``import torch``'s second or more in
    every process of a launch (tests/test_train.py runs them with torch made unimportable).
    The check path imports neither the loaders, the zoo's networks nor the engines."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    path, todo, torch_imports = set(), [CHECK_PATH_ENTRY], {}
    while todo:
        module = todo.pop()
        if module in path:
            continue
        path.add(module)
        parts = module.split(".")  # importing a module imports its packages first
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for target, node, in_function in _imports(_module_path(module), modules):
            if in_function:
                continue
            if target.split(".")[0] in ("torch", "torchvision"):
                torch_imports.setdefault(module, []).append(node.lineno)
            elif target.startswith("distnorm"):
                todo.append(target)
    assert {"distnorm", "distnorm.train.config", "distnorm.train.checks", "distnorm.data.specs", "distnorm.config",
            "distnorm.models"} <= path
    assert torch_imports == {}


def _module_path(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    if (PACKAGE / relative).is_dir():
        return PACKAGE / relative / "__init__.py"
    return PACKAGE / relative.with_suffix(".py")


def test_the_core_layers_sit_below_specs_builders_and_bnp():
    """The core layers sit below the specs' builders and BNP: ``distnorm.specs`` imports only
    ``distnorm.settings``, which imports nothing of distnorm, so the specs import no layer
    again; and BNP's statistics stay below the operators (``_bnp_functions`` imports no
    ``_functions``, ``_functions`` no ``distnorm.bnp``)."""
    graph, _ = _graph()
    assert graph["distnorm.specs"] == {"distnorm.settings"} and graph["distnorm.settings"] == set()
    assert "distnorm.bnp" not in graph["distnorm._functions"]
    assert "distnorm._functions" not in graph["distnorm._bnp_functions"]


#: The rooms under the layers, from the ground up: each imports only rooms listed before it
#: (and the package's leaves: errors, _release, _debug, _recompute, specs, settings).
BASEMENT = ("_torch_floor", "_capture", "_constants", "_cpu_kernels", "_composite", "_kernels", "_gn_kernels", "_ops",
            "_gn_function", "_frames", "_collectives", "_moments", "_kernel_choice", "_state", "_bnp_functions", "_traced", "_functions")
LEAVES = {"distnorm.errors", "distnorm._release", "distnorm._debug", "distnorm._recompute", "distnorm.specs",
          "distnorm.settings", "distnorm._triton"}


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_room_imports_one_above_it_and_none_is_too_large():
    """The basement under the layers in one direction: every room imports only the rooms below
    it (``BASEMENT``), none imports the package back (its names load the layers, which sit
    above: the package's lazy names are arrows here), and no module passes 600 lines. Before,
    ``_functions`` imported ``distnorm`` for its torch check (an arrow back up to the package,
    8 upward edges in all), the statistics' module called an operator declared above it, and
    ``_functions.py`` had 898 lines with five concerns."""
    graph, _ = _graph()
    exports = {f"distnorm.{module or name}" for name, module in distnorm._EXPORTS.items()}
    graph["distnorm"] |= exports  # the lazy names: what `distnorm.X` imports at first use
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    for i, room in enumerate(BASEMENT):
        below = {f"distnorm.{r}" for r in BASEMENT[:i]} | LEAVES
        assert graph[f"distnorm.{room}"] <= below, (room, graph[f"distnorm.{room}"] - below)
    long = {path.relative_to(PACKAGE).as_posix(): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}


def test_operators_are_called_only_through_the_room_that_declares_them():
    """``distnorm._ops`` alone declares operators (one ``torch.library.Library``) and names
    their overloads; every other room calls ``_ops.<name>``, so a room that calls an operator
    imports the room that declares it and sits above it. Before, ``_collectives`` and
    ``_bnp_functions`` called ``torch.ops.distnorm.*`` declared above them (they worked only
    because ``distnorm/__init__`` had imported the declaring module first)."""
    graph, _ = _graph()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = _module_name(path)
        raw = [node.lineno for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and ast.unparse(node) == "torch.ops.distnorm"]
        calls = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "_ops"]
        if module == "distnorm._ops":
            continue
        assert raw == [], (module, raw)
        if calls:
            assert "distnorm._ops" in graph[module], module


def test_a_layer_step_walks_down_module_functional_operators_collectives():
    """The path of a training step, in one direction: the layers call ``functional`` (never
    the operators, no closure), ``functional`` the step (``_functions``), which calls the
    collectives, the group's kernel choice and the one operator module, ``_ops``, which alone
    declares operators (one ``torch.library.Library``). Before, the layers handed
    ``functional`` a closure over the operators (layer -> functional -> back up into the
    layer's lambda -> _ops -> _functions); operators were declared in two modules (``_ops``
    with ``custom_op``, the kernels' module with a ``Library``); an operator signature had 21
    names; and a list's length said what it held (``moments`` as ``[mean, var]``, ``[mean,
    var, count]`` or ``[mean, var, count, valid]``)."""
    import inspect

    from distnorm import layers

    graph, _ = _graph()
    assert "distnorm.functional" in graph["distnorm.layers"]
    assert not {"distnorm._functions", "distnorm._ops", "distnorm._kernels"} & graph["distnorm.layers"]
    assert "distnorm._functions" in graph["distnorm.functional"]
    assert {"distnorm._collectives", "distnorm._kernel_choice", "distnorm._ops"} <= graph["distnorm._functions"]
    assert not {"distnorm.functional", "distnorm.layers"} & graph["distnorm._functions"]
    assert "distnorm._functions" not in _reaches(graph, "distnorm._ops")
    for path in sorted(PACKAGE.rglob("*.py")):
        declares = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
                    and node.attr in ("Library", "custom_op") and ast.unparse(node.value) == "torch.library"]
        assert len(declares) == (1 if path == PACKAGE / "_ops.py" else 0), path
    tree = ast.parse(inspect.getsource(layers))
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Lambda)]  # no closure handed down
    # the compiled path: traced below the step's module, never back up into it
    assert "distnorm._traced" in graph["distnorm._functions"]
    assert not {"distnorm._functions", "distnorm.functional", "distnorm.layers"} & graph["distnorm._traced"]
    # No length-coded list: what may be absent is a named optional tensor, and the one list of
    # tensors is the layer's buffers (one meaning per position, CBNBuffers' order).
    for name in ("cbn_plan", "backward_sums"):
        schema = getattr(torch.ops.distnorm, name).default._schema
        lists = [arg.name for arg in schema.arguments if str(arg.type).startswith("List[Tensor]")]
        assert lists == (["buffers"] if name == "cbn_plan" else []), schema
    optional = {arg.name for arg in torch.ops.distnorm.cbn_plan.default._schema.arguments
                if str(arg.type) == "Optional[Tensor]"}
    assert optional == {"count", "valid", "eta"}


def test_specs_build_every_layer_and_convert_goes_through_them():
    """The specs build every layer with the package's defaults (``EPS``, ``MOMENTUM``,
    GroupNorm's 32 groups as ``GNSpec.default_groups``), and what convert builds goes through
    them: a replaced BatchNorm's eps, momentum and Parameters are kept unless the spec sets
    them. Convert builds no SyncBatchNorm / GroupNorm itself with defaults of its own, and
    GroupNorm's 32 groups are not hidden in code."""
    assert isinstance(CBNSpec(rho=2.0).build(8), distnorm.CBN)
    assert distnorm.POPNorm(8).kappa == POPNormSpec.kappa == POPNormSpec().build(8).kappa
    new_bn = SyncBNSpec().build(8)
    assert (new_bn.eps, new_bn.momentum) == (distnorm.specs.EPS, distnorm.specs.MOMENTUM)
    assert GNSpec().build(64).num_groups == GNSpec.default_groups == 32
    bn = nn.BatchNorm2d(8, eps=1e-3, momentum=0.3)
    kept = SyncBNSpec().build(8, replacing=bn)
    assert (kept.eps, kept.momentum, kept.weight) == (1e-3, 0.3, bn.weight)  # shares the Parameter
    assert SyncBNSpec(eps=1e-4).build(8, replacing=bn).eps == 1e-4
    assert GNSpec(num_groups=4).build(8, replacing=bn).eps == 1e-3
    with pytest.raises(TypeError, match="not a layer"):
        BNPSpec().build(8)


def test_functional_cbn_evaluates_like_the_module():
    """``functional.cbn(spec=CBNSpec())`` evaluates like the CBN module, bit for bit: its
    ``eval_stats=None`` means "auto" in both. Before, it meant "auto" in CBN() but "amat" in
    functional.cbn(spec=CBNSpec()), and the module and the functional form evaluated
    differently."""
    layer = distnorm.CBN(4)
    distnorm.set_lr(layer, 0.2)  # eta = 0: "auto" evaluates with the running statistics
    for _ in range(3):
        layer(torch.randn(16, 4) * 3 + 1)
    layer.eval()
    x = torch.randn(8, 4)
    buffers = functional.CBNBuffers(layer.amat_mean, layer.amat_var, layer.amat_initialized, layer.running_mean,
                                    layer.running_var, layer.num_batches_tracked)
    y = functional.cbn(x, layer.weight, layer.bias, buffers, training=False, eta=layer.amat_eta, spec=CBNSpec())
    torch.testing.assert_close(y, layer(x), rtol=0, atol=0)
    assert CBNSpec().resolved_eval_stats == "auto" and CBNSpec(amat=False).resolved_eval_stats == "running"
    assert POPNormSpec(kappa=2.0).as_cbn().rho == 2.0


def test_bnp_history_weight_is_called_decay_everywhere():
    """BNP's history weight is called ``decay`` everywhere (``attach``, the handle's config,
    its saved state, ``BNPSpec``; ``momentum`` is refused), and ``BNPHandle.config.exclude``
    holds the excluded names. Before, the weight had four names and ``config.exclude`` was
    always ``()``."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    handle = distnorm.bnp.attach(model, decay=0.9, exclude=["2", nn.ReLU])
    assert handle.config.decay == 0.9 and handle.config.exclude == ("2",)
    assert handle.exclude == ("2", nn.ReLU) and list(handle.layers) == ["0"]
    saved = handle.state_dict()
    assert saved["config"]["decay"] == 0.9
    handle.detach()
    with pytest.raises(TypeError, match="momentum"):
        distnorm.bnp.attach(model, momentum=0.9)
    assert BNPSpec(decay=0.5).attach(model).config.decay == 0.5


def test_sync_group_size_is_the_ranks_per_group():
    """The ranks per synchronization group are ``sync_group_size`` in the configuration (dict
    and environment), which refuses ``group_size``: that is GroupNorm's channels per group in
    GNSpec. Before, ``group_size`` meant ranks per group in the config and channels per group
    in GNSpec."""
    assert distnorm.DistNormConfig.from_dict({"norm": "cbn", "sync_group_size": 2}).sync_group_size == 2
    assert distnorm.DistNormConfig.from_env({"DISTNORM_SYNC_GROUP_SIZE": "4"}).sync_group_size == 4
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['group_size'\]"):
        distnorm.DistNormConfig.from_dict({"group_size": 2})
    with pytest.raises(ValueError, match="unknown environment variable DISTNORM_GROUP_SIZE"):
        distnorm.DistNormConfig.from_env({"DISTNORM_GROUP_SIZE": "4"})


def test_one_way_to_declare_and_read_every_setting():
    """Every setting is declared in a frozen Section with a help text, and the generated help
    (``distnorm-train --help-config``) lists every key. A configuration value declared outside
    a Section would have no check and no help."""
    import dataclasses

    from distnorm.settings import Section
    from distnorm.train.cli import main
    from distnorm.train.config import TrainConfig, describe_config

    sections = [type(f.default_factory()) for f in dataclasses.fields(TrainConfig)]
    sections += [distnorm.specs.BNPSpec, *distnorm.specs.NORM_SPECS.values()]
    for cls in sections:
        assert issubclass(cls, Section) and cls.__dataclass_params__.frozen, cls
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), (cls.__name__, f.name)
    listing = describe_config()
    for section in ("model", "data", "optim", "train", "output"):
        for f in dataclasses.fields(type(getattr(TrainConfig(), section))):
            assert f"  {section}.{f.name} (" in listing
    assert "distnorm.cbn.r_max (" in listing and "distnorm.bnp.decay (" in listing
    assert main(["--help-config"]) == 0


#: A fresh process: ``import distnorm`` loads no torch; then every public name, the public
#: submodules and ``distnorm.convert`` (the function, though the submodule of that name was
#: imported) resolve.
_FRESH_IMPORT = """
import sys
import distnorm
assert "torch" not in sys.modules, "import distnorm imported torch"
from distnorm.convert import ACTIVATIONS  # the submodule named like the function, imported
assert callable(distnorm.convert) and not isinstance(distnorm.convert, type(sys))
assert distnorm.specs.NORMS and distnorm.layers.CBN is distnorm.CBN
missing = [name for name in distnorm.__all__ if getattr(distnorm, name, None) is None]
assert not missing, missing
assert hasattr(__import__("torch").ops.distnorm, "cbn_plan")  # a layer used: its operators declared
print("ok")
"""


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_import_distnorm_loads_no_torch_and_every_public_name_resolves():
    """``import distnorm`` is lazy (PEP 562): the command line's check pays no torch, and a
    user's ``distnorm.X`` still finds every name of ``__all__`` and every submodule. Where
    torch cannot be imported at all (``sys.modules["torch"] = None``), ``import distnorm`` works.
    ``distnorm.convert`` stays the function once another module imported the submodule, and
    ``distnorm.specs`` resolves after ``import distnorm``."""
    import subprocess
    import sys

    run = [sys.executable, "-c"]
    done = subprocess.run([*run, _FRESH_IMPORT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    blocked = subprocess.run([*run, "import sys; sys.modules['torch'] = None; import distnorm; print(distnorm.__version__)"],
                             capture_output=True, text=True, timeout=60)
    assert blocked.returncode == 0, blocked.stderr[-3000:]


#: The modules a training process runs beyond the check path: their third-party imports are
#: what ``distnorm-train --check`` looks up (``distnorm.train.checks.TRAINING_MODULES``).
TRAINING_PATH = ("train/loop.py", "train/engines.py", "train/metrics.py", "train/checkpoint.py", "data/loaders.py",
                 "data/transforms.py", "data/batches.py", "data/tars.py", "data/evaluation.py", "data/index.py",
                 "data/specs.py", "models/__init__.py", "models/cifar.py")


def test_the_check_looks_up_every_module_a_training_imports():
    """Every third-party module the training's own modules import (inside functions too) is
    looked up by ``--check``, or is an engine (``require_engine``) or PyYAML (which the check
    itself imports, said by ``distnorm.launch``). A module added to the training and not to
    the list fails here: ``--check`` would pass where every worker fails after the queue."""
    import sys

    from distnorm.train.checks import TRAINING_MODULES

    imported = {target.split(".")[0] for relative in TRAINING_PATH for target, _, _ in _imports(PACKAGE / relative, set())}
    third_party = imported - set(sys.stdlib_module_names) - {"distnorm", "__future__"}
    assert third_party - {"accelerate", "deepspeed", "yaml"} == set(TRAINING_MODULES)
