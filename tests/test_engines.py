"""One object per engine (``distnorm._engines``): an engine's wrapper types, how the plugin
follows it, which parameters it partitions and how its checkpoints carry the plugin's state
are one registration in its integration module; the core names no engine, and ``import
distnorm`` imports none. (That each engine's own checkpoint hook carries the plugin's state
through a resume: ``test_integrations.py::test_resume_in_fresh_processes_equals_uninterrupted``
for Accelerate and DeepSpeed, ``test_lightning.py::test_lightning_resume_from_checkpoint_equals_uninterrupted``.)"""

from __future__ import annotations

import ast
import importlib
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch
from torch import nn

import distnorm
from distnorm import _engines
from distnorm._engines import Engine, register_engine
from distnorm._wrappers import wrapper_name

PACKAGE = Path(distnorm.__file__).parent
REPO = PACKAGE.parent
#: The modules every engine passes through: they may know the registry, never an engine.
CORE = ("plugin.py", "consistency.py", "_wrappers.py", "_engines.py")
#: One integration module per engine library, named after it.
LIBRARIES = sorted(p.stem for p in (PACKAGE / "integrations").glob("*.py") if not p.stem.startswith("_"))


def _words(path: Path) -> set[str]:
    """Every word of ``path``: names, strings (docstrings and messages included) and comments."""
    words: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING, tokenize.COMMENT):
            words.update(w.lower() for w in tok.string.replace(".", " ").replace("_", " ").split())
    return {w.strip("`'\"()[]{},:;*!?<>=/") for w in words}


def test_the_core_names_no_engine():
    """The plugin, the consistency check and the wrapper registry read what an engine
    registered and never name one: not in code, messages, docstrings or comments (every
    library of ``distnorm/integrations/``, ZeRO's names too). Before, the core's
    partitioned-parameter rule imported ``distnorm.integrations.deepspeed`` by name; no error
    message names an engine's call either."""
    assert {"accelerate", "deepspeed", "lightning"} <= set(LIBRARIES)
    banned = {*LIBRARIES, "zero", "zero-3", "zero3", "accelerator", "pytorch-lightning"}
    for name in CORE:
        named = banned & _words(PACKAGE / name)
        assert not named, f"distnorm/{name} names {sorted(named)}: move it into the engine's Engine registration"
        tree = ast.parse((PACKAGE / name).read_text())
        imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in imports if m.startswith("distnorm.integrations")], (name, imports)


@pytest.mark.parametrize("library", LIBRARIES)
def test_each_integration_registers_one_engine_named_after_its_library(library):
    """Each integration registers one engine, named after its library, with one
    ``register_engine`` call and no monkeypatched ``save_checkpoint`` / ``load_checkpoint``.
    Before, an engine's facts were spread over several registries (``register_wrapper``,
    ``register_engine`` and ``register_partitioned``: three doors)."""
    pytest.importorskip(library)
    module = importlib.import_module(f"distnorm.integrations.{library}")
    assert module.ENGINE.library == library
    assert [e for e in _engines.engines() if e.library == library] == [module.ENGINE]
    source = (PACKAGE / "integrations" / f"{library}.py").read_text()
    assert source.count("register_engine(") == 1
    assert "engine.save_checkpoint =" not in source and "engine.load_checkpoint =" not in source  # no monkeypatch


class _Toy(nn.Module):
    """An engine of a library distnorm has never heard of: a wrapper with its own learning rate."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.lr = 0.05

    def forward(self, x):
        return self.module(x)


def _toy_follow(plugin, engine):
    return lambda: [engine.lr] * len(plugin.amat_layers)


def _toy_partitioned(param: torch.Tensor) -> bool:
    return getattr(param, "toy_shard", False)


@pytest.fixture
def toy_engine(monkeypatch):
    """``_Toy`` registered as one Engine, the registry restored afterwards."""
    monkeypatch.setattr(_engines, "_ENGINES", dict(_engines._ENGINES))
    return register_engine(Engine("Toy engine", __name__.partition(".")[0], (_Toy,), follow=_toy_follow,
                                  partitioned=_toy_partitioned))


def test_one_registration_is_all_a_new_engine_needs(toy_engine):
    """The core honours a registered engine in each of its places: surgery refuses its
    wrapper (naming it), ``follow`` reads its learning rate, and the consistency check leaves
    its partitioned parameters out. Neither the registration's ``follow`` nor its
    ``partitioned`` is ignored (mutants registry-follow-ignored, registry-partition-ignored)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn"))
    engine = _Toy(model)
    assert wrapper_name(engine) == "Toy engine"
    with pytest.raises(TypeError, match="already wrapped by Toy engine"):
        distnorm.convert(engine, norm="cbn")
    plugin.follow(engine)
    for lr in (0.05, 0.02):
        engine.lr = lr
        engine(torch.randn(2, 3, 5, 5))
        assert plugin.amat_layers[0].lr == lr
    replicated = len(distnorm.consistency.consistent_tensors(model, parameters=True))
    model[0].weight.toy_shard = True
    assert len(distnorm.consistency.consistent_tensors(model, parameters=True)) == replicated - 1
    assert wrapper_name(type("DistributedDataParallel", (nn.Module,), {})()) is None  # a name is no wrapper


_FRESH_PROCESS = """
import sys, torch
import distnorm
engines = ("deepspeed", "accelerate", "lightning", "pytorch_lightning")
print("loaded:", sorted(m for m in (*engines, "torch._dynamo", "torch.distributed.fsdp") if m in sys.modules))
from distnorm.train.config import load_config
load_config("configs/demo/digits.yaml", [])  # what `distnorm-train --check` and a refused configuration pay
print("config:", sorted(m for m in ("torchvision", "torch._dynamo") if m in sys.modules))
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig(norm="cbn", bnp=True))
plugin.follow(torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.randn(2, 3, 5, 5))
distnorm.check_consistency(model, parameters=True)
print("loaded:", sorted(m for m in engines if m in sys.modules))
print("integrations:", sorted(m for m in sys.modules if m.startswith("distnorm.integrations.")))
import deepspeed
from distnorm._wrappers import wrapper_name
engine = deepspeed.DeepSpeedEngine.__new__(deepspeed.DeepSpeedEngine)
torch.nn.Module.__init__(engine)
print("wrapper:", wrapper_name(engine))
print("integrations:", sorted(m for m in sys.modules if m.startswith("distnorm.integrations.")))
"""


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_import_distnorm_imports_no_engine_and_an_engine_met_loads_its_integration():
    """In a fresh process: ``import distnorm`` imports no engine library, neither
    ``torch._dynamo`` nor torch's FSDP; loading a recipe's configuration (what a ``--check``
    needs of torch) imports neither torchvision nor, through it, ``torch._dynamo`` (paid by
    every ``--check`` a launcher runs: config-check-builds-geometry); a plugin,
    a training forward and a consistency check import no engine library (the plugin's hook
    imports ``torch._dynamo``); then a
    DeepSpeed engine met by ``wrapper_name`` loads DeepSpeed's integration by its library's
    name (the script never imported it) and is named. The registry imports the integrations
    of the libraries the script imported, not every integration (mutant
    registry-loads-every-integration), and an engine is not recognised by its class name."""
    pytest.importorskip("deepspeed")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines()
             if line.split(":")[0] in ("loaded", "config", "integrations", "wrapper")]
    assert lines == ["loaded: []", "config: []", "loaded: []", "integrations: []", "wrapper: DeepSpeed",
                     "integrations: ['distnorm.integrations.deepspeed']"], proc.stdout[-3000:]
