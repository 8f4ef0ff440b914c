"""distnorm's commands and launchers, started from an install: no clone needed.

    python -m distnorm.launch torchrun CONFIG [section.key=value ...]    # launch/torchrun.sh
    python -m distnorm.launch deepspeed CONFIG [section.key=value ...]   # launch/deepspeed.sh
    python -m distnorm.launch path accelerate/multi_gpu.yaml             # where a shipped file is
    python -m distnorm.launch list                                       # every shipped launcher file

(``distnorm-launch`` is the same command.) ``torchrun`` and ``deepspeed`` run the shell scripts
of the repository's ``launch/``, which ship in the package as ``distnorm.launch.scripts`` (in
a clone with an editable install they are the same files): one source of truth, the same
environment variables (``NPROC``, ``NNODES``, ``MASTER_ADDR``, ``HOSTFILE``, ...), the same
``distnorm-train --check`` before any worker starts. ``PYTHON`` defaults to this interpreter.
``CONFIG`` is a shipped recipe's name (``distnorm-train --list-configs``) or a path. For
``accelerate launch``, ``path`` names the shipped config file::

    accelerate launch --config_file "$(python -m distnorm.launch path accelerate/multi_gpu.yaml)" \\
        -m distnorm.train --config imagenet/resnet50_cbn

The console scripts ``distnorm-train`` and ``distnorm-shards`` start here too (:func:`train`,
:func:`shards`): their modules import the optional dependencies of an extra (PyYAML,
NumPy, Pillow) on the way in, and a missing one ends the command with one line naming the
extra to install instead of a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.resources
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

__all__ = ["main", "train", "shards", "shipped_files", "SCRIPTS_PACKAGE", "LAUNCHERS"]

#: The package the repository's launch/ installs as (pyproject.toml maps it onto launch/).
SCRIPTS_PACKAGE = "distnorm.launch.scripts"
#: ``python -m distnorm.launch NAME``: the shipped script it runs.
LAUNCHERS = {"torchrun": "torchrun.sh", "deepspeed": "deepspeed.sh"}


def _entry(module: str, extra: str, command: str) -> Callable[..., int]:
    """``module.main``, imported; a missing third-party module ends ``command`` with one line
    naming the pip extra that brings it."""
    try:
        return importlib.import_module(module).main
    except ModuleNotFoundError as err:
        if err.name is None or err.name.partition(".")[0] == "distnorm":
            raise  # a module of distnorm itself: a broken install, not a missing extra
        raise SystemExit(f"{command}: the optional dependency {err.name!r} is not installed; install the "
                         f'[{extra}] extra: pip install "distnorm[{extra}]" (from a clone: pip install -e ".[{extra}]")'
                         ) from None


def train() -> int:
    """The console script ``distnorm-train`` (:func:`distnorm.train.cli.main`); needs ``[train]``."""
    return _entry("distnorm.train.cli", "train", "distnorm-train")()


def shards() -> int:
    """The console script ``distnorm-shards`` (:func:`distnorm.data.shards.main`); needs ``[data]``."""
    return _entry("distnorm.data.shards", "data", "distnorm-shards")()


def _scripts_root() -> Path:
    root = importlib.resources.files(SCRIPTS_PACKAGE)
    if not isinstance(root, Path):  # a zipped install: bash needs the scripts on disk
        raise SystemExit(f"distnorm.launch: the shipped launchers are not files on disk ({root}); install "
                         "distnorm unzipped (pip install)")
    return root


def shipped_files() -> dict[str, Path]:
    """Every shipped launcher file by its path under ``launch/`` (``torchrun.sh``,
    ``accelerate/multi_gpu.yaml``, ...)."""
    root = _scripts_root()
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts}


def _shipped(name: str) -> Path:
    files = shipped_files()
    name = Path(name).as_posix().removeprefix("launch/")  # a clone's path names the same file
    if name in files:
        return files[name]
    close = difflib.get_close_matches(name, list(files), n=5)
    hint = f"; the closest: {', '.join(close)}" if close else ""
    raise SystemExit(f"distnorm.launch: no shipped launcher file {name!r}{hint} (python -m distnorm.launch list)")


def _run(launcher: str, args: list[str]) -> NoReturn:
    """Run the shipped ``launch/<script>`` with ``args``, as ``bash`` would from a clone."""
    _entry("distnorm.train.cli", "train", f"python -m distnorm.launch {launcher}")  # what every worker runs
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)  # the scripts' default is a clone's .venv, or `python`
    script = _shipped(LAUNCHERS[launcher])
    sys.stdout.flush()
    os.execvpe("bash", ["bash", str(script), *args], env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distnorm.launch",
        description="Run distnorm's launchers (the repository's launch/, shipped in the package) from an install.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, script in LAUNCHERS.items():
        sub = commands.add_parser(name, help=f"launch/{script}: distnorm-train --check, then {name}; "
                                             "without arguments it prints its environment variables")
        sub.add_argument("args", nargs=argparse.REMAINDER, metavar="CONFIG [section.key=value ...]",
                         help="a shipped recipe's name (distnorm-train --list-configs) or path, then overrides")
    path = commands.add_parser("path", help="print where a shipped launcher file is, e.g. accelerate/multi_gpu.yaml")
    path.add_argument("name", help="its path under launch/ (python -m distnorm.launch list)")
    commands.add_parser("list", help="list the shipped launcher files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in LAUNCHERS:
        _run(args.command, args.args)
    if args.command == "path":
        print(_shipped(args.name))
        return 0
    root = _scripts_root()
    print(f"Launcher files shipped with distnorm ({root}):")
    for name in shipped_files():
        print(f"  {name}")
    return 0
