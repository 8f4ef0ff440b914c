"""The recipe's command line.

    distnorm-train --config configs/imagenet/resnet50_cbn.yaml [section.key=value ...]
    distnorm-train --config ... --dry-run              # build everything, two synthetic steps
    distnorm-train --config ... --check --world-size 16   # validate before the queue wait

Launch it under ``torchrun`` / SLURM / ``deepspeed`` / ``accelerate launch`` (see
``launch/``): every process runs this same command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

import torch.distributed as dist

from distnorm.train.config import ConfigError, describe_config, load_config
from distnorm.train.engines import local_world
from distnorm.train.loop import check_setup, train

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distnorm-train",
        description="Train an ImageNet / CIFAR / demo recipe with synchronized CBN, POP-Norm, BN or BNP.",
    )
    parser.add_argument("--config", help="recipe YAML (see configs/)")
    parser.add_argument("--help-config", action="store_true",
                        help="print every key of a recipe with its type, default and help, then exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.epochs=2")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the model, engine and plugin, run two steps on a synthetic batch; no data needed")
    parser.add_argument("--dry-run-batch", type=int, default=None, help="per-rank batch of the dry run")
    parser.add_argument("--check", action="store_true",
                        help="validate the config, engine, data paths and batch split, then exit")
    parser.add_argument("--world-size", type=int, default=None, help="with --check: the number of processes planned")
    # The DeepSpeed launcher (and torch.distributed.launch) pass --local_rank=N to every
    # worker; LOCAL_RANK in the environment says the same and wins when both are present.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def set_log_level(level: str) -> None:
    """Every logger at ``level`` (``output.log_level``): the root, which distnorm's and
    Accelerate's loggers inherit, and the libraries that keep a level of their own."""
    value = getattr(logging, level.upper())
    logging.getLogger().setLevel(value)
    for name in ("DeepSpeed", "accelerate", "torch.distributed"):
        logging.getLogger(name).setLevel(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help_config:
        print(describe_config())
        return 0
    if args.config is None:
        parser.error("the following arguments are required: --config")
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        set_log_level(cfg.output.log_level)
        if args.check:
            world = args.world_size or local_world()[1]
            check_setup(cfg, world)
            print(f"{args.config}: OK for {world} process(es), {cfg.per_rank_batch(world)} samples each per step")
            return 0
        result = train(cfg, dry_run=args.dry_run, dry_run_batch=args.dry_run_batch)
    except ConfigError as err:
        print(f"distnorm-train: configuration error: {err}", file=sys.stderr)
        return 2
    finally:
        # Leave no communication thread running at interpreter exit.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if local_world()[0] == 0:
        evaluation = result["eval"]
        if args.dry_run:
            print(f"dry run OK: {result['global_step']} steps, evaluation forward OK ({evaluation.get('count', 0)} samples)")
        else:
            top1 = f"{evaluation['top1']:.2f}%" if evaluation else "not evaluated"
            print(f"final top-1 {top1}; metrics: {result['run_dir']}/metrics.jsonl; "
                  f"checkpoint: {result['checkpoint']}")
    return 0
