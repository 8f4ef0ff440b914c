"""One owner and one spelling for every default, on the data side too.

A default is written once, in the section that declares it (``distnorm.specs``, the data
loaders' :class:`~distnorm.data.loaders.LoaderSpec`, the recipe's sections); every other
place takes it from there. A label has one spelling everywhere it is accepted.
"""

from __future__ import annotations

import argparse

import pytest
from torch import nn

import distnorm
from distnorm import models
from distnorm.specs import KEEP, NORM_LABELS, NORM_SPECS, REMOVE


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def test_every_norm_label_has_one_spelling_everywhere():
    """``convert``, ``models.create`` and the configuration (YAML, flags, environment) accept
    the same labels, taken from ``distnorm.specs``; "keep the BatchNorm" is ``"keep"`` in all
    of them and the configuration's default. Bugs caught: keep spelled ``None`` in
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
