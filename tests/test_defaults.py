"""One owner and one spelling for every default, on the data side too.

A default is written once, in the section that declares it (``distnorm.specs``, the data
loaders' :class:`~distnorm.data.specs.LoaderSpec`, the recipe's sections); every other
place takes it from there. A label has one spelling everywhere it is accepted.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch import nn

import distnorm
from distnorm import models
from distnorm.specs import KEEP, NORM_LABELS, NORM_SPECS, REMOVE
PACKAGE = Path(distnorm.__file__).parent


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def test_every_norm_label_has_one_spelling_everywhere():
    """``convert``, ``models.create`` and the configuration (YAML, flags, environment) accept
    the same labels, taken from ``distnorm.specs``; "keep the BatchNorm" is ``"keep"`` in all
    of them and the configuration's default. Before, keep was spelled ``None`` in
    ``convert``, ``"off"`` in the configuration and ``"local_bn"`` in the model zoo, while
    ``"none"`` meant remove."""
    assert NORM_LABELS == (*NORM_SPECS, REMOVE, KEEP)
    assert distnorm.DistNormConfig().norm == KEEP and not distnorm.DistNormConfig().active
    assert distnorm.DistNormConfig.__dataclass_fields__["norm"].metadata["choices"] == NORM_LABELS
    parser = distnorm.add_arguments(argparse.ArgumentParser())
    for label in NORM_LABELS:
        from_flag = distnorm.DistNormConfig.from_args(parser.parse_args(["--distnorm", label]))
        assert from_flag == distnorm.DistNormConfig.from_env({"DISTNORM_NORM": label}) \
            == distnorm.DistNormConfig.from_yaml({"norm": label}, section=None)
        assert from_flag.norm == label
        models.create("resnet20", num_classes=3, norm=label)
        distnorm.convert(_net(), norm=label)
    kept = distnorm.convert(_net(), norm=KEEP, activation="tanh")
    assert isinstance(kept[1], nn.BatchNorm2d) and isinstance(kept[2], nn.Tanh)
    assert type(models.create("resnet20", num_classes=3, norm=KEEP).bn1) is nn.BatchNorm2d
    removed = distnorm.convert(_net(), norm=REMOVE)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in removed.modules())
    for other in ("off", "local_bn"):
        with pytest.raises(ValueError, match="must be one of"):
            distnorm.DistNormConfig(norm=other)
        with pytest.raises(ValueError, match="unknown norm"):
            models.create("resnet20", num_classes=3, norm=other)
        with pytest.raises(ValueError, match="unknown norm"):
            distnorm.convert(_net(), norm=other)
    with pytest.raises(ValueError, match="norm='keep' leaves the BatchNorm"):
        distnorm.convert(_net(), norm=None)


# ------------------------------------------------------------------ the data side
#: The sections that own the data side's defaults.
def _owners() -> dict[str, type]:
    from distnorm.data.specs import LoaderSpec
    from distnorm.data.specs import ImageSpec
    from distnorm.train.config import DataConfig

    return {"ImageSpec": ImageSpec, "LoaderSpec": LoaderSpec, "DataConfig": DataConfig}


#: Same name, another setting: ``name -> {where: why}``.
OTHER_SETTINGS = {
    "image_size": {"SyntheticSource": "the side of the images a synthetic source generates, not the crop"},
}


def _literal_defaults(path: Path) -> list[tuple[str, str, int]]:
    """``(where, name, line)`` of every parameter, dataclass field or ``--flag`` in ``path``
    whose default is written as a literal (not taken from an owner, e.g. ``ImageSpec.decoder``)."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str, int]] = []
    literal = (ast.Constant, ast.List, ast.Tuple, ast.Dict)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(node.name, a.arg, d.lineno) for a, d in pairs if isinstance(d, literal)]
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    value = item.value
                    if isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("param", "field"):
                        value = value.args[0] if value.args else next(
                            (k.value for k in value.keywords if k.arg == "default"), None)
                    if isinstance(value, literal):
                        found.append((node.name, item.target.id, item.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if flags and isinstance(default, literal):
                found.append(("command line", flags[0][2:].replace("-", "_"), node.lineno))
    return found


def test_every_data_default_has_one_owner():
    """Each data setting's default is written once, in the section that owns it
    (``ImageSpec``: the image pipeline; ``LoaderSpec``: the loaders; ``DataConfig``: what
    only a recipe decides); the loaders, ``build_transform``, ``ImageTransform``, the
    recipe and the command lines take it from there. Before, the recipe said 8 training
    workers and ``TrainLoader`` 4, evaluation workers were 4 in one place and 2 in another,
    ``decoder="pil"`` was written five times and ``image_size=224`` four."""
    owners = _owners()
    owned = {f.name: name for name, cls in owners.items() for f in dataclasses.fields(cls)}
    owned_here = {name: {f.name for f in dataclasses.fields(cls) if f.name in vars(cls).get("__annotations__", {})}
                  for name, cls in owners.items()}
    seconds = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for where, name, line in _literal_defaults(path):
            if name not in owned or name in owned_here.get(where, ()) or where in OTHER_SETTINGS.get(name, {}):
                continue
            seconds.append(f"{path.relative_to(PACKAGE.parent)}:{line} {where}: {name} (owned by {owned[name]})")
    assert not seconds, "a second owner of a data default:\n" + "\n".join(seconds)
    # The loaders take every setting from the spec: nothing but the spec's keywords.
    from distnorm.data import EvalLoader, TrainLoader
    from distnorm.data.specs import LoaderSpec

    for loader in (TrainLoader, EvalLoader):
        assert not set(inspect.signature(loader).parameters) & set(owned), loader
        with pytest.raises(ValueError, match=r"unknown key\(s\).*num_worker"):
            loader("x-000000.tar", num_samples=1, index=None, batch_size=1, num_worker=2)
    from distnorm.train.config import DataConfig

    assert DataConfig().loader_options() == LoaderSpec().loader_options()


def _flat(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    return {key: value for k, v in tree.items() for key, value in _flat(v, (*prefix, k)).items()}


#: The recipes as written in this tree (what ships as distnorm.recipes).
RECIPES = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", sorted(p.relative_to(RECIPES).with_suffix("").as_posix()
                                        for p in RECIPES.rglob("*.yaml")))
def test_a_recipe_states_only_what_differs_from_what_it_extends(name):
    """A recipe sets a key only to change it: from its base recipe (``extends:``), and a base
    from the sections' defaults. Before, ``configs/base/imagenet.yaml`` restated 24
    defaults (lr 0.1, 8 workers, ``decoder: pil``, ...), every CBN recipe restated
    ``rho: 1.0`` and every POP-Norm recipe ``kappa: 4.0``."""
    from distnorm.train.config import TrainConfig, _merge, _read

    path = RECIPES / f"{name}.yaml"
    own = yaml.safe_load(path.read_text()) or {}
    parent = own.pop("extends", None)
    under = TrainConfig().to_dict()
    if parent is not None:
        under = _merge(under, _read(path.parent / parent))
    flat_under = _flat(under)
    restated = [".".join(key) for key, value in _flat(own).items()
                if key in flat_under and flat_under[key] == value and key != ("model", "name")]  # a recipe names its model
    assert not restated, f"{name} restates what it inherits: {restated}"
