"""The recipe's command line.

    distnorm-train --config imagenet/resnet50_cbn [section.key=value ...]
    distnorm-train --config my_recipe.yaml ...         # a path works too (configs/... in a clone)
    distnorm-train --list-configs                      # the recipes shipped in the package
    distnorm-train --config ... --dry-run              # build everything, two synthetic steps
    distnorm-train --config ... --check --world-size 16   # validate before the queue wait
    distnorm-train --config ... --check --verify-checksums  # and every shard's SHA-256

Launch it under ``torchrun`` / SLURM / ``deepspeed`` / ``accelerate launch`` (see
``launch/``, or ``python -m distnorm.launch`` from an install): every process runs this same
command.

What the processes print when a run does not finish: an error every rank shares (a bad
command line, ranks whose setups differ) once: from one process of each node for a bad
command line (under torchrun the first to reach it), from rank 0 for ranks that disagree; a configuration or data error as one line, without a traceback; Ctrl-C
(SIGINT, which ``torchrun`` forwards to every process) one line from rank 0 naming the last
checkpoint and the command that resumes from it. Under ``torchrun`` the same message goes
to its error file, so the launcher's failure summary shows it as the root cause.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

# Nothing here imports torch: `--check`, `--help-config`, `--list-configs` and a refused
# configuration run without it (distnorm.train.checks); the training loop is imported to train.
from distnorm.data.specs import SKIP_HINT, DataError
from distnorm.errors import ConfigurationMismatchError
from distnorm.train.checkpoint import CheckpointManager
from distnorm.train.checks import SetupMismatchError, check_setup, local_world, missing_module, require_training_modules
from distnorm.train.config import ConfigError, TrainConfig, describe_config, describe_recipes, load_config

__all__ = ["main", "build_parser"]

#: Set by torchrun.sh (and any wrapper that knows it): the command as the user typed it, which
#: the Ctrl-C line gives as the command that resumes the run.
LAUNCH_COMMAND_ENV = "DISTNORM_LAUNCH_COMMAND"


def _local_rank() -> int:
    """This process's index on its node (``LOCAL_RANK``, which every launcher sets; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK") or 0)


def _says_it_for_the_node() -> bool:
    """Whether this process prints an error every process of its node shares (the command
    line, the config file, this node's files).

    Under torchrun with several processes on the node, the first to claim it: torchrun stops
    the others as soon as one exits, so the node's first process (``LOCAL_RANK`` 0) could be
    stopped before it printed, where a refused command takes a tenth of a second. The claim
    is a file created exclusively beside this attempt's error files (one directory per launch,
    node and restart). Elsewhere, the node's first process.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("LOCAL_WORLD_SIZE") or 1) > 1:
        claim = Path(error_file).parent.parent / "distnorm-said"
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:
            pass  # no claim possible here: the node's first process says it
    return _local_rank() == 0


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage error every process of a launch shares (the same argv): printed
    by one process of each node (:func:`_says_it_for_the_node`), and recorded for the
    launcher's summary."""

    def error(self, message: str):  # type: ignore[override]
        _record_for_launcher(f"{self.prog}: error: {message}")
        if not _says_it_for_the_node():
            self.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="distnorm-train",
        description="Train an ImageNet / CIFAR / demo recipe with synchronized CBN, POP-Norm, BN or BNP.",
    )
    parser.add_argument("--config", help="a shipped recipe's name, e.g. imagenet/resnet50_cbn (see --list-configs), "
                                         "or a recipe YAML's path")
    parser.add_argument("--list-configs", action="store_true",
                        help="list the recipes and DeepSpeed configs shipped in the package, then exit")
    parser.add_argument("--help-config", action="store_true",
                        help="print every key of a recipe with its type, default and help, then exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.epochs=2")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the model, engine and plugin, run two steps on a synthetic batch; no data needed")
    parser.add_argument("--dry-run-batch", type=int, default=None, help="per-rank batch of the dry run")
    parser.add_argument("--check", action="store_true",
                        help="validate the config, engine, data paths, shard sizes and batch split, then exit "
                             "(sizes, not contents: a shard damaged in place needs --verify-checksums)")
    parser.add_argument("--verify-checksums", action="store_true",
                        help="with --check: also compare every local shard's SHA-256 with its index "
                             "(reads every byte: minutes for ImageNet)")
    parser.add_argument("--world-size", type=int, default=None, help="with --check: the number of processes planned")
    parser.add_argument("--evaluate", metavar="PATH",
                        help="evaluate the frozen model a run wrote (its model-frozen.pt) on the recipe's evaluation "
                             "shards, print top-1, and exit; no training")
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


def _record_for_launcher(message: str) -> None:
    """Write ``message`` where torchrun's failure summary reads a process's root cause
    (``TORCHELASTIC_ERROR_FILE``, the format of torch.distributed.elastic's ``@record``), so the
    summary shows it instead of "To enable traceback see: ..."; nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    # The summary shows "py_callstack" as the failure's traceback: here, the message alone.
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:
        pass  # the summary then says less; the message was printed anyway


class _Interrupt:
    """Records SIGINT (Ctrl-C; torchrun forwards it to every process), then raises
    KeyboardInterrupt as Python's own handler does. Whatever a process raises after it —
    the KeyboardInterrupt, or a collective that failed because a peer stopped first — is the
    interruption, reported once."""

    def __init__(self) -> None:
        self.seen, self.previous = False, None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
            self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _interrupted_line(cfg: TrainConfig | None, argv: Sequence[str]) -> str:
    """The one line a Ctrl-C leaves: where the last checkpoint is, and how to resume from it."""
    command = os.environ.get(LAUNCH_COMMAND_ENV) or \
        f"distnorm-train {shlex.join(a for a in argv if not a.startswith('--local'))}, under the same launcher"
    if cfg is None:
        return f"distnorm-train: interrupted before the run started; to start it: {command}"
    latest = CheckpointManager(Path(cfg.output.dir) / "checkpoints", 1, False, lambda: None).latest()
    if latest is None:
        return (f"distnorm-train: interrupted before the first checkpoint (none in {cfg.output.dir}); "
                f"the same command starts the run again: {command}")
    step = int(latest.name.removeprefix("step_"))
    return (f"distnorm-train: interrupted; the last checkpoint is {latest} (step {step}); "
            f"to resume from it, run the same command again: {command}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help_config:
        print(describe_config())
        return 0
    if args.list_configs:
        try:
            print(describe_recipes())
        except ConfigError as err:
            print(f"distnorm-train: {err}", file=sys.stderr)
            return 2
        return 0
    if args.config is None:
        parser.error("the following arguments are required: --config")
    if args.verify_checksums and not args.check:
        parser.error("--verify-checksums goes with --check (training itself compares sizes only)")
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg, interrupt = None, None
    try:
        cfg = load_config(args.config, args.overrides)
        set_log_level(cfg.output.log_level)
        if args.check:
            world = args.world_size or local_world()[1]
            require_training_modules()  # what the workers import, looked up here (a run imports them)
            check_setup(cfg, world, checksums=args.verify_checksums)
            checked = "shards, sizes and checksums" if args.verify_checksums else "shards and sizes"
            print(f"{args.config}: OK for {world} process(es), {cfg.per_rank_batch(world)} samples each per step "
                  f"({checked} checked)")
            return 0
        interrupt = _Interrupt()
        try:
            from distnorm.train.loop import evaluate_only, train
        except ModuleNotFoundError as err:  # one the check did not look up: said as the check says it
            if err.name is None or err.name.partition(".")[0] == "distnorm":
                raise  # a module of distnorm itself: a broken install
            raise missing_module(err.name) from None

        if args.evaluate:
            if not Path(args.evaluate).is_file():
                raise ConfigError(f"--evaluate {args.evaluate}: no such file (relative to {Path.cwd()}); a run "
                                  "writes <output.dir>/model-frozen.pt at its end")
            metrics = evaluate_only(cfg, args.evaluate)
            if local_world()[0] == 0:
                print(f"{args.evaluate}: top-1 {metrics['top1']:.2f}%, top-5 {metrics['top5']:.2f}%, "
                      f"loss {metrics['loss']:.4f} over {metrics['count']} samples")
            return 0
        result = train(cfg, dry_run=args.dry_run, dry_run_batch=args.dry_run_batch)
    except BaseException as err:  # noqa: BLE001 - each kind is reported below or re-raised
        code = _report(err, cfg, argv, interrupted=interrupt is not None and interrupt.seen)
        if code is None:
            raise
        return code
    finally:
        if interrupt is not None:
            interrupt.restore()
        # Leave no communication thread running at interpreter exit (only a run that trained
        # imported torch.distributed).
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if local_world()[0] == 0:
        evaluation = result["eval"]
        if args.dry_run:
            print(f"dry run OK: {result['global_step']} steps, evaluation forward OK ({evaluation.get('count', 0)} samples)")
        else:
            top1 = f"{evaluation['top1']:.2f}%" if evaluation else "not evaluated"
            saved = f"checkpoint: {result['checkpoint']}" if result["checkpoint"] else "no checkpoint written"
            frozen = f"; frozen model: {', '.join(result['frozen'])}" if result["frozen"] else ""
            print(f"final top-1 {top1}; metrics: {result['run_dir']}/metrics.jsonl; {saved}{frozen}")
    return 0


def data_error_message(err: DataError) -> str:
    """A loader's :class:`DataError` as the recipe's user reads it: the loader's own message
    (without the worker traceback a DataLoader wraps it in), with the setting to change named
    as the override they would type (``data.on_error=skip``) rather than the loader's keyword."""
    text = str(err)
    if "Original Traceback" in text:  # raised in a DataLoader worker: the last line is the error
        text = text.rstrip().rsplit("DataError: ", 1)[-1]
    text = text.replace(SKIP_HINT, "set data.on_error=skip to skip bad data (counted and reported each epoch), or "
                                   "find the damaged shards with distnorm-train --check --verify-checksums")
    return " ".join([text, *getattr(err, "__notes__", [])])


def _report(err: BaseException, cfg: TrainConfig | None, argv: Sequence[str], *, interrupted: bool) -> int | None:
    """Print what ``err`` means for the user, once; the exit code, or ``None`` to re-raise."""
    rank = local_world()[0]
    if interrupted or isinstance(err, KeyboardInterrupt):
        line = _interrupted_line(cfg, argv)
        _record_for_launcher(line)
        if rank == 0:
            print(line, file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT, as a shell reports a process Ctrl-C stopped
    if isinstance(err, (ConfigError, ConfigurationMismatchError)):  # the latter: a checkpoint of another distnorm config
        message = f"distnorm-train: configuration error: {err}"
        _record_for_launcher(message)
        # Said once: ranks that disagree all raise the same error (rank 0 says it); any other
        # configuration error comes from the command line, the config file or this node's
        # files, the same for every process of a node (its first says it).
        says_it = rank == 0 if isinstance(err, SetupMismatchError) else _says_it_for_the_node()
        if says_it:
            print(message, file=sys.stderr, flush=True)
        return 2
    if isinstance(err, DataError):
        message = f"distnorm-train: data error on rank {rank}: {data_error_message(err)}"
        _record_for_launcher(message)
        print(message, file=sys.stderr, flush=True)
        return 1
    if isinstance(err, Exception) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)  # torchrun's summary shows this traceback as the root cause
    return None
