"""distnorm's configuration (``distnorm.DistNormConfig``): the command line, the environment,
YAML and a recipe override give the same specs, every spec field reachable from each; bad
values and unknown keys are refused by name."""

from __future__ import annotations

import pytest
import yaml

import distnorm
from distnorm.specs import BNPSpec, POPNormSpec


def test_config_sources_agree(tmp_path):
    import argparse

    parser = distnorm.add_arguments(argparse.ArgumentParser())
    from_args = distnorm.DistNormConfig.from_args(parser.parse_args(
        ["--distnorm", "popnorm", "--distnorm-popnorm-kappa", "3", "--distnorm-bnp", "--distnorm-bnp-exclude", "fc,head"]))
    from_env = distnorm.DistNormConfig.from_env({"DISTNORM_NORM": "popnorm", "DISTNORM_POPNORM_KAPPA": "3",
                                                 "DISTNORM_BNP": "true", "DISTNORM_BNP_EXCLUDE": "fc,head",
                                                 "DISTNORM_DEBUG": "1", "PATH": "/bin"})
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: resnet18\ndistnorm:\n  norm: popnorm\n  popnorm: {kappa: 3}\n  bnp: {exclude: [fc, head]}\n")
    from_yaml = distnorm.DistNormConfig.from_yaml(yaml_file)
    assert from_args == from_env == from_yaml
    assert from_args.norm_spec == POPNormSpec(kappa=3.0) and from_args.bnp == BNPSpec(exclude=("fc", "head"))


def _other_value(f):
    """A valid value of spec field ``f`` other than its default (text, as a user types it)."""
    overrides = {"eval_stats": "running", "exclude": "fc,head", "num_groups": "4", "group_size": "4", "decay": "0.9",
                 "r_max": "2.0", "momentum": "0.2", "eps": "0.001"}
    if f.name in overrides:
        return overrides[f.name]
    if str(f.type).startswith("bool"):
        return "false" if f.default else "true"
    return "2.5"


@pytest.mark.parametrize("section", ["cbn", "popnorm", "bn", "gn", "bnp"])
def test_every_spec_field_is_reachable_from_every_front_end(section, tmp_path):
    """One owner per hyper-parameter: each field of each spec can be set from the command line,
    the environment, YAML and a train-recipe override, and all four give the same spec.
    Before the specs, some layer parameters had no way in from one front end: r_max, eval_stats
    and sync had no flag, variable or YAML key."""
    import argparse
    import dataclasses

    from distnorm.config import SECTIONS
    from distnorm.train.config import apply_overrides, from_dict

    for f in dataclasses.fields(SECTIONS[section]):
        if section == "gn" and f.name == "group_size":
            continue  # exclusive with num_groups, set alone below
        text = _other_value(f)
        norm = section if section != "bnp" else "cbn"
        flag = f"--distnorm-{section}-{f.name.replace('_', '-')}"
        argv = ["--distnorm", norm, *(["--distnorm-bnp"] if section == "bnp" else [])]
        argv += [flag] if str(f.type).startswith("bool") and text == "true" else \
            [f"--no-{flag[2:]}"] if str(f.type).startswith("bool") else [flag, text]
        from_args = distnorm.DistNormConfig.from_args(distnorm.add_arguments(argparse.ArgumentParser()).parse_args(argv))
        env = {"DISTNORM_NORM": norm, f"DISTNORM_{section.upper()}_{f.name.upper()}": text,
               **({"DISTNORM_BNP": "1"} if section == "bnp" else {})}
        from_env = distnorm.DistNormConfig.from_env(env)
        from_yaml = distnorm.DistNormConfig.from_yaml({"norm": norm, section: {f.name: yaml.safe_load(text)}}, section=None)
        recipe = from_dict(apply_overrides({"model": {"name": "resnet20"}}, [f"distnorm.norm={norm}",
                                                                           f"distnorm.{section}.{f.name}={text}"])).distnorm
        got = {getattr(c, section) for c in (from_args, from_env, from_yaml, recipe)}
        assert len(got) == 1, (f.name, got)
        assert getattr(got.pop(), f.name) != f.default, f.name


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: distnorm.DistNormConfig(norm="batchnorm"), "norm must be one of"),
        (lambda: distnorm.DistNormConfig(cbn={"rho": 0}), "CBN: rho must be a positive"),
        (lambda: distnorm.DistNormConfig(cbn={"rhoo": 1}), r"unknown keyword\(s\) \['rhoo'\]"),
        (lambda: distnorm.DistNormConfig.from_env({"DISTNORM_RHOO": "2"}), "unknown environment variable DISTNORM_RHOO"),
        (lambda: distnorm.DistNormConfig.from_env({"DISTNORM_BNP": "maybe"}), "DISTNORM_BNP='maybe'"),
        (lambda: distnorm.DistNormConfig.from_env({"DISTNORM_BNP_DECAY": "0.9"}), "without switching BNP on"),
        (lambda: distnorm.DistNormConfig.from_yaml({"distnorm": {"nrom": "cbn"}}), r"unknown key\(s\) \['nrom'\]"),
        (lambda: distnorm.DistNormConfig(gn={"num_groups": 4, "group_size": 2}), "num_groups or group_size, not both"),
    ],
)
def test_bad_config(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cli_rejects_unknown_norm():
    import argparse

    parser = distnorm.add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--distnorm", "layernorm"])


def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_the_place(tmp_path):
    """A recipe that is not valid YAML: one line with the file, the line and column, and what
    YAML found there — not a parser traceback."""
    from distnorm.train.config import ConfigError, load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: resnet18\n optim: {lr: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert message.startswith(f"config {bad}, line 3, column ") and "not valid YAML" in message, message
    assert "\n" not in message


def test_extends_takes_a_shipped_recipes_name(tmp_path):
    """``extends:`` names a shipped recipe by its name as well as a file by its path: a user's
    file in any folder extends ``imagenet/resnet18_cbn``; a name that is neither says so."""
    from distnorm.train.config import ConfigError, load_config

    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: imagenet/resnet18_cbn\noptim: {lr: 0.05}\n")
    cfg = load_config(mine)
    assert cfg.model.name == "resnet18" and cfg.distnorm.norm == "cbn" and cfg.optim.lr == 0.05
    mine.write_text("extends: imagenet/resnet18_nope\n")
    with pytest.raises(ConfigError, match="neither a file .* nor a shipped recipe's name"):
        load_config(mine)
