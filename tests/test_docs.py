"""Every shell command shown in README.md and docs/ is run or dry-run here.

The Python blocks of the same pages run through Sybil (conftest.py at the repository root);
`make docs` builds the site strictly. This file takes each command of every ```bash block,
one test per distinct command, and checks it the cheapest way that still fails when the
command is wrong:

* `distnorm-shards`: run for real on a small source of the same kind (an ImageFolder for a
  path, the bundled digits, fewer synthetic images); where a config reads the prefix, the
  shard names the command gives at the dataset's real size must be exactly the config's
  `data.*_shards` pattern, and its index the config's `data.*_index`;
* `distnorm-train` / `python -m distnorm.train`: `--check` (config keys, engine, every shard
  and index path, the batch split) in a copy of the repository layout whose `data/` holds
  empty stand-ins for the shards every config names;
* `launch/torchrun.sh`, `launch/deepspeed.sh`, `sbatch launch/slurm.sbatch`: the wrapper runs
  for real, its `--check` included, up to the point where it starts `torchrun` / the
  DeepSpeed runner, which is replaced by a stub that records the call (Slurm's `scontrol`
  and `srun` are stubs too);
* `accelerate launch`: its config file must exist; then `--check` as above, or the script's
  flags against its `--help`;
* `torchrun ... examples/ddp_train.py ... --max-steps N` on this CPU: run for real (two gloo
  processes); other example launches: the script's flags against its `--help`;
* `make TARGET`: `make -n TARGET`; `pip install -e ".[extras]"`: every extra exists;
* anything else with a CLI (`distnorm-report`, `bench/*.py`, `python -m distnorm.repro`):
  every `--flag` used appears in its `--help`.

Every path under configs/, launch/, examples/ or bench/ named in a command must exist. A
command no rule knows fails, naming this file. A block preceded by the line
`<!-- tests/test_docs.py: run whole -->` is not split into commands: one test runs it as a
bash script (the ImageNet guide's 3-class trial, on a small stand-in for ImageNet). The
ImageNet guide gets one more test: its shard commands on a small ImageFolder, then
`distnorm-train --check` on what they wrote. Every ```diff block that shows the plugin lines
of an example script must match that script. And the harness that runs the pages' Python
blocks (the root conftest.py) is tried here on small pages of its own: a block that needs a
variable its page does not set fails, and a `<!-- torchrun: nproc=N -->` marker runs the
page's blocks on N ranks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import math
import hashlib
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from distnorm.data import ShardIndex, expand_urls
from distnorm.data.index import ShardInfo

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PY = sys.executable
TIMEOUT = 240
#: Sizes of the datasets the docs shard but this machine does not have.
KNOWN_SIZES = {"imagenet/train": 1_281_167, "imagenet/val": 50_000, "CIFAR10/train": 50_000, "CIFAR10/val": 10_000}
PYTHONS = {"python", "python3", ".venv/bin/python", "$PY", "$(PY)"}
REPO_DIRS = ("configs/", "launch/", "examples/", "bench/")


# --- collecting the commands -------------------------------------------------------------

#: The line before a shell block that one test runs whole, as a script (not command by command).
RUN_WHOLE = "<!-- tests/test_docs.py: run whole -->"


def shell_blocks(page: Path, *, whole: bool = False) -> list[tuple[int, str]]:
    """(first line number, text) of every shell code block of a Markdown page: those marked
    RUN_WHOLE when `whole`, else the others."""
    blocks, lines, start, lang = [], page.read_text().splitlines(), None, None
    for number, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and start is None:
            start, lang, body = number, fence[1], []
            marked = number > 1 and lines[number - 2].strip() == RUN_WHOLE
        elif fence:
            if lang in SHELL_LANGS and marked == whole:
                blocks.append((start + 1, "\n".join(body)))
            start = None
        elif start is not None:
            body.append(line)
    return blocks


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """(where, tokens) of every command: continuation lines joined, comments dropped."""
    found = []
    for first, text in shell_blocks(page):
        joined = re.sub(r"\\\n", " ", text)
        for offset, line in enumerate(joined.splitlines()):
            tokens = shlex.split(line, comments=True)
            if tokens:
                found.append((f"{page.relative_to(ROOT)}:{first + offset}", tokens))
    return found


def distinct_commands() -> list[tuple[str, list[str]]]:
    seen: dict[str, tuple[str, list[str]]] = {}
    for page in PAGES:
        for where, tokens in commands(page):
            seen.setdefault(shlex.join(tokens), (where, tokens))
    return list(seen.values())


ALL = distinct_commands()


def test_the_pages_show_shell_commands():
    assert len(ALL) > 30, "the command collector found too few commands: is the fence parser broken?"


# --- the repository layout with stand-in data ------------------------------------------------

def data_locations() -> dict[str, tuple[str, str, int]]:
    """shards pattern -> (the split's index path, num_classes) for every config that names one
    (as loaded: a recipe states only what differs from its base and the defaults)."""
    from distnorm.train.config import load_config

    found = {}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        cfg = load_config(path)
        data = cfg.data
        for split in ("train", "val"):
            if getattr(data, f"{split}_shards"):
                found[getattr(data, f"{split}_shards")] = (getattr(data, f"{split}_index"), cfg.model.num_classes)
    return found


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    """The repository's configs/, launch/, examples/ and bench/ beside a data/ of empty shards
    (and real index files) at every path a config reads; stubs for torchrun, the DeepSpeed
    runner and Slurm's commands in bin/."""
    root = tmp_path_factory.mktemp("layout")
    for name in ("configs", "launch", "examples", "bench"):
        (root / name).symlink_to(ROOT / name)
    for pattern, (index, classes) in data_locations().items():
        shards = expand_urls(pattern)
        for shard in shards:
            (root / shard).parent.mkdir(parents=True, exist_ok=True)
            (root / shard).touch()
        ShardIndex(classes=[f"class{i}" for i in range(classes)],
                   shards=[ShardInfo(name=Path(s).name, count=1) for s in shards]).save(root / index)
    (root / "runs").mkdir()
    write_stubs(root / "bin")
    return root


def write_stubs(bin_dir: Path) -> None:
    """Stand-ins for the interpreter the launch/ wrappers run (their `--check` and the final
    torchrun recorded in $CHECK_LOG / $LAUNCH_LOG), the DeepSpeed runner and Slurm's commands."""
    bin_dir.mkdir()
    stubs = {
        # the interpreter the wrappers run: their `--check` and the final torchrun are recorded
        # (the test runs the check in its own process), anything else runs
        "python": ('for a in "$@"; do\n'
                   '  [[ "$a" == torch.distributed.run ]] && { echo "torchrun $*" >> "$LAUNCH_LOG"; exit 0; }\n'
                   '  [[ "$a" == --check ]] && { printf "%q " "$@" >> "$CHECK_LOG"; echo >> "$CHECK_LOG"; exit 0; }\n'
                   f'done\nexec {shlex.quote(PY)} "$@"'),
        "deepspeed": 'echo "deepspeed $*" >> "$LAUNCH_LOG"',
        # The first host, a pause, then the rest, as a long list comes in several writes: a
        # script that reads only the first line (`| head -n 1` under pipefail) dies of SIGPIPE.
        "scontrol": ('[[ "$1 $2" == "show hostnames" ]] || exit 0\n'
                     'printf "node%03d\\n" 1; sleep 0.3; printf "node%03d\\n" $(seq 2 "$SLURM_NNODES")'),
        "srun": 'while [[ "$1" == -* ]]; do shift; done\nexec "$@"',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\nset -euo pipefail\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: int = TIMEOUT) -> str:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(argv, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{shlex.join(argv)} exited {result.returncode}:\n{output[-4000:]}"
    return output


# --- the rules -----------------------------------------------------------------------------

def split_env(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, _, value = tokens[0].partition("=")
        env[key], tokens = value, tokens[1:]
    if tokens and tokens[0] == "sudo":
        tokens = tokens[1:]
    return env, tokens


def check_repo_paths(tokens: list[str]) -> None:
    for token in tokens:
        for part in (token, token.partition("=")[2]):
            if part.startswith(REPO_DIRS) and "{" not in part:
                assert (ROOT / part).exists(), f"{part} does not exist in the repository"


@contextlib.contextmanager
def inside(path: Path):
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    """`argv --help`: in this process for distnorm's own modules, else in a subprocess."""
    if argv[:2] == (PY, "-m") and argv[2].startswith("distnorm."):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            importlib.import_module(argv[2]).main(["--help"])
        return out.getvalue()
    return run([*argv, "--help"], cwd=ROOT)


def check_help_flags(argv: list[str], used: list[str]) -> None:
    """Every --flag in `used` is one the program's --help lists."""
    text = help_text(tuple(argv))
    for flag in (t.split("=")[0] for t in used if t.startswith("--")):
        assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", text), f"{shlex.join(argv)} has no option {flag}"


def train_check(args: list[str], layout: Path, world: int = 1) -> None:
    """distnorm-train ARGS as --check (dry-run options dropped)."""
    args = list(args)
    for option, has_value in (("--dry-run-batch", True), ("--dry-run", False)):
        while option in args:
            i = args.index(option)
            del args[i:i + 1 + has_value]
    if "--check" not in args:
        args.append("--check")
    if "--world-size" not in args:
        args += ["--world-size", str(world)]
    from distnorm.train import cli

    with inside(layout):
        assert cli.main(args) == 0, f"distnorm-train {shlex.join(args)} failed its check"


def wrapper(argv: list[str], env: dict[str, str], layout: Path, tmp_path: Path) -> list[str]:
    """Run a launch/ wrapper with the stubs, then the `distnorm-train --check` it ran (here,
    in this process); returns the launches it recorded."""
    log, checks = tmp_path / "launches.log", tmp_path / "checks.log"
    env = {"PYTHON": str(layout / "bin" / "python"), "LAUNCH_LOG": str(log), "CHECK_LOG": str(checks),
           "PATH": f"{layout / 'bin'}:{os.environ['PATH']}", **env}
    run(["bash", *argv], cwd=layout, env=env)
    recorded = [shlex.split(line) for line in checks.read_text().splitlines()] if checks.exists() else []
    assert len(recorded) == 1, f"{shlex.join(argv)} ran {len(recorded)} checks before launching"
    assert recorded[0][:2] == ["-m", "distnorm.train"], recorded
    train_check(recorded[0][2:], layout)
    launches = log.read_text().splitlines() if log.exists() else []
    assert launches, f"{shlex.join(argv)} started no launcher"
    return launches


def expected_shards(prefix: str, total: int, maxcount: int) -> list[str]:
    return [f"{prefix}-{i:06d}.tar" for i in range(math.ceil(total / maxcount))]


def make_image_folder(root: Path, classes: int = 3, per_class: int = 4) -> Path:
    from PIL import Image

    for c in range(classes):
        (root / f"n0000000{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (40, 30), (60 * c, 20 * i, 100)).save(root / f"n0000000{c}" / f"img_{i}.JPEG")
    return root


def write_shards_here(argv: list[str], cwd: Path) -> None:
    """distnorm-shards ARGV in this process (one writer: no worker processes)."""
    from distnorm.data import shards

    argv = list(argv)
    if "--workers" in argv:
        argv[argv.index("--workers") + 1] = "1"
    with inside(cwd), contextlib.redirect_stdout(io.StringIO()):
        assert shards.main([*argv, "--quiet"]) == 0, f"distnorm-shards {shlex.join(argv)} failed"


def check_shards(args: list[str], tmp_path: Path) -> None:
    """distnorm-shards SRC PREFIX ...: run on a small source of the same kind; where a config
    reads PREFIX, the shards at the real dataset size must be exactly the config's."""
    with_value = {"--maxcount", "--maxsize", "--workers", "--shuffle-seed", "--split", "--num-samples",
                  "--num-classes", "--image-size", "--seed"}
    positional, options, i = [], {}, 0
    while i < len(args):
        if args[i] in with_value:
            options[args[i]], i = args[i + 1], i + 2
        else:
            if not args[i].startswith("--"):
                positional.append(args[i])
            i += 1
    src, prefix = positional
    readers = {p: loc for p, loc in data_locations().items() if p.startswith(f"{prefix}-")}
    assert readers or src == "synthetic", (
        f"no config reads {prefix}-*.tar: write the shards where the configs read them (data/...) "
        "or show the data.*_shards / data.*_index overrides with the command")
    maxcount = int(options.get("--maxcount", 1000))
    split = options.get("--split", "train")
    argv, real_size = list(args), None
    if "--workers" in argv:  # the writer's processes change no name; here it writes in this process
        argv[argv.index("--workers") + 1] = "1"
    if src.startswith("/"):  # an ImageFolder tree
        argv[argv.index(src)] = str(make_image_folder(tmp_path / "folder"))
        real_size = KNOWN_SIZES.get("/".join(Path(src).parts[-2:]))
    elif src.startswith("torchvision:"):
        dataset = src.split(":")[1]
        import torchvision.datasets

        assert hasattr(torchvision.datasets, dataset), f"torchvision has no dataset {dataset}"
        real_size = KNOWN_SIZES.get(f"{dataset}/{split}")
        argv = None  # the dataset is not on this machine: names only
    elif src == "synthetic":
        i = argv.index("--num-samples")
        argv[i + 1] = "12"
    if argv is not None:
        write_shards_here(argv, tmp_path)
        written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob(f"{prefix}-*.tar"))
        index = ShardIndex.load(tmp_path / f"{prefix}-index.json")
        assert written == expected_shards(prefix, index.total, maxcount), written
        if real_size is None and src in ("digits", "synthetic"):
            real_size = index.total if src == "digits" else None
    for pattern, (index_path, _) in readers.items():
        assert real_size is not None, f"no known size for {src}"
        assert expand_urls(pattern) == expected_shards(prefix, real_size, maxcount), (
            f"the config reads {pattern}, the command writes {prefix}-000000.tar ... at the real size")
        assert index_path == f"{prefix}-index.json"


def _runs_in_this_process(tokens: list[str]) -> bool:
    """The commands test_shell_command checks inside pytest (the rest start a process)."""
    tokens = split_env(tokens)[1]
    program, args = tokens[0], tokens[1:]
    return program in ("pip", "distnorm-train", "distnorm-shards") or (
        program in PYTHONS and args[:2] in (["-m", "distnorm.train"], ["-m", "distnorm.data.shards"]))


@pytest.mark.parametrize("where, tokens", [
    pytest.param(where, tokens, id=where, marks=() if _runs_in_this_process(tokens) else pytest.mark.processes)
    for where, tokens in ALL])
def test_shell_command(where, tokens, layout, tmp_path):
    env, tokens = split_env(tokens)
    check_repo_paths(tokens)
    program, args = tokens[0], tokens[1:]
    if program in PYTHONS and args[:2] == ["-m", "distnorm.train"]:
        program, args = "distnorm-train", args[2:]
    if program in PYTHONS and args[:2] == ["-m", "distnorm.data.shards"]:
        program, args = "distnorm-shards", args[2:]

    if program == "make":
        targets = [a for a in args if "=" not in a]
        run(["make", "-n", *args], cwd=ROOT, env={"PY": PY})
        assert targets
    elif program == "pip":
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        assert args[:2] == ["install", "-e"], where
        target = args[2]
        named = re.match(r"^\.(?:\[([\w,-]+)\])?$", target)
        assert named, f"unexpected install target {target}"
        for extra in (named[1] or "").split(","):
            assert not extra or extra in extras, f"no extra [{extra}] in pyproject.toml"
    elif program == "distnorm-shards":
        check_shards(args, tmp_path)
    elif program == "distnorm-train":
        train_check(args, layout)
    elif program in ("launch/torchrun.sh", "launch/deepspeed.sh"):
        launches = wrapper([program, *args], env, layout, tmp_path)
        if program == "launch/torchrun.sh":
            nnodes = env.get("NNODES", "1")
            assert f"--nnodes={nnodes}" in launches[0]
    elif program == "sbatch":
        script = next(a for a in args if a.endswith(".sbatch"))
        nodes = next((a.split("=")[1] for a in args if a.startswith("--nodes=")), "2")
        slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": nodes, "SLURM_JOB_NODELIST": f"node[001-{int(nodes):03d}]",
                 "SLURM_SUBMIT_DIR": str(layout), "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "8"}
        launches = wrapper([script, *args[args.index(script) + 1:]], {**env, **slurm}, layout, tmp_path)
        assert f"--nnodes={nodes}" in launches[0] and "--rdzv_endpoint=node001:" in launches[0], launches
    elif program == "accelerate":
        assert args[0] == "launch"
        config = args[args.index("--config_file") + 1]
        assert (ROOT / config).is_file()
        if "-m" in args and args[args.index("-m") + 1] == "distnorm.train":
            processes = (yaml.safe_load((ROOT / config).read_text()) or {}).get("num_processes", 1)
            train_check(args[args.index("-m") + 2:], layout, world=processes)
        else:
            script = next(a for a in args if a.endswith(".py"))
            check_help_flags([PY, str(ROOT / script)], args[args.index(script) + 1:])
    elif program in ("torchrun", "deepspeed"):
        script = next(a for a in args if a.endswith(".py"))
        script_args = args[args.index(script) + 1:]
        nproc = next((args[i + 1] for i, a in enumerate(args) if a == "--nproc_per_node"), None)
        if script == "examples/ddp_train.py" and "--max-steps" in script_args and nproc == "2":
            # the README's two-process launch: run it
            out = run([PY, "-m", "torch.distributed.run", *args], cwd=ROOT, env=env, timeout=TIMEOUT)
            assert "done: " in out, out
        else:
            check_help_flags([PY, str(ROOT / script)], script_args)
    elif program in ("distnorm-report",):
        check_help_flags([PY, "-m", "distnorm.report"], args)
    elif program in PYTHONS and args and args[0] == "-m":
        check_help_flags([PY, "-m", args[1]], args[2:])
    elif program in PYTHONS and args and args[0].endswith(".py"):
        check_help_flags([PY, str(ROOT / args[0])], args[1:])
    else:
        pytest.fail(f"{where}: no rule checks `{shlex.join(tokens)}`; add one to tests/test_docs.py")


# --- the ImageNet guide on a small ImageFolder ----------------------------------------------

def test_imagenet_guide_writes_what_the_configs_read(tmp_path):
    """The guide's shard commands, on a small ImageFolder in place of /data/imagenet, write
    data/imagenet/{train,val}-NNNNNN.tar and -index.json: names inside the patterns
    configs/base/imagenet.yaml reads, and `distnorm-train --check` accepts them."""
    guide = ROOT / "docs" / "guides" / "imagenet.md"
    shard_commands = [t for _, t in commands(guide) if t[0] == "distnorm-shards"]
    assert len(shard_commands) == 2
    source = tmp_path / "imagenet"
    make_image_folder(source / "train", classes=3, per_class=5)
    make_image_folder(source / "val", classes=3, per_class=2)
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    for tokens in shard_commands:
        write_shards_here([a.replace("/data/imagenet", str(source)) for a in tokens[1:]], work)
    base = yaml.safe_load((ROOT / "configs" / "base" / "imagenet.yaml").read_text())["data"]
    written = {}
    for split in ("train", "val"):
        files = sorted(str(p.relative_to(work)) for p in (work / "data" / "imagenet").glob(f"{split}-*.tar"))
        assert files and set(files) <= set(expand_urls(base[f"{split}_shards"])), files
        assert (work / base[f"{split}_index"]).is_file()
        written[split] = files
    # the configs then find them: the same check the launchers run, over the shards written
    brace = {s: f"data/imagenet/{s}-{{000000..{len(f) - 1:06d}}}.tar" for s, f in written.items()}
    train_check(["--config", "configs/imagenet/resnet50_cbn.yaml", "--world-size", "8", f"data.train_shards={brace['train']}",
                 f"data.val_shards={brace['val']}", "model.num_classes=3"], work)


# --- the diffs against the example scripts ---------------------------------------------------

def diff_blocks() -> list[tuple[str, str, list[str]]]:
    """(where, diff text, example scripts named in the paragraph before it) of every ```diff block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        previous_end = 0
        for match in re.finditer(r"```diff\n(.*?)```", text, re.S):
            before = text[previous_end:match.start()].split("```")[-1]
            line = text[:match.start()].count("\n") + 2
            found.append((f"{page.relative_to(ROOT)}:{line}", match[1], re.findall(r"examples/\w+\.py", before)))
            previous_end = match.end()
    return found


DIFFS = [d for d in diff_blocks() if d[2]]


def test_every_diff_names_its_script_or_is_timms():
    unnamed = [where for where, text, scripts in diff_blocks() if not scripts and "timm" not in where]
    assert not unnamed, f"diff blocks without the example script they change: {unnamed}"


@pytest.mark.parametrize("where, diff, scripts", DIFFS, ids=[d[0] for d in DIFFS])
def test_diff_matches_its_example_script(where, diff, scripts):
    """The kept and added lines of a diff are the example script's lines, in its order (comments
    and spacing aside), so the plugin lines shown cannot drift from the script that runs."""
    def code(line: str) -> str:
        return re.sub(r"\s+", "", line.split("  #")[0])

    lines = [code(line[1:]) for line in diff.splitlines() if line[:1] in "+ " and line[1:].strip() not in ("", "...")]
    failures = {}
    for script in scripts:
        source = code("\n".join(l.split("  #")[0] for l in (ROOT / script).read_text().splitlines()))
        position, missing = 0, []
        for line in lines:
            found = source.find(line, position)
            if found < 0:
                missing.append(line)
            else:
                position = found + len(line)
        if not missing:
            return
        failures[script] = missing
    pytest.fail(f"{where}: lines not in the script (or out of its order): {failures}")


# --- the ImageNet guide's trial, run whole ---------------------------------------------------

def make_classes(root: Path, names: list[str], per_class: int) -> None:
    from PIL import Image

    for c, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (64, 48), (80 * c, 30 * i, 120)).save(root / name / f"{name}_{i}.JPEG")


@pytest.mark.processes
def test_imagenet_trial_runs_as_written(tmp_path):
    """The guide's "try it small first" block, as one bash script, with a small stand-in for
    /data/imagenet (the classes it links, a few JPEGs each): the folders, the links, the shards
    for real; `launch/torchrun.sh` for real up to torchrun (recorded, as in `layout`); then the
    `--check` it ran, here, on the shards the script wrote: the overrides find them, the index's
    3 classes match `model.num_classes`, 2 processes divide the batch.

    So the trial's overrides meet what its commands write: the shard and index names, the class
    count, a batch two processes can split, and keys spelt as the configuration spells them."""
    (block,) = [text for _, text in shell_blocks(ROOT / "docs" / "guides" / "imagenet.md", whole=True)]
    source, folder = tmp_path / "imagenet", tmp_path / "imagenet-3"
    for split, per_class in (("train", 6), ("val", 2)):
        names = sorted(set(re.findall(rf"/data/imagenet/{split}/(n\d{{8}})\b", block)))
        assert len(names) == 3, f"the trial links {names} from /data/imagenet/{split}"
        make_classes(source / split, names, per_class)
    script = block.replace("/data/imagenet", str(source)).replace("/tmp/imagenet-3", str(folder))
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs", "launch"):
        (work / name).symlink_to(ROOT / name)
    write_stubs(work / "bin")
    log, checks = tmp_path / "launches.log", tmp_path / "checks.log"
    run(["bash", "-euo", "pipefail", "-c", script], cwd=work,
        env={"PYTHON": str(work / "bin" / "python"), "LAUNCH_LOG": str(log), "CHECK_LOG": str(checks),
             "PATH": f"{work / 'bin'}:{os.environ['PATH']}"})
    (check,) = [shlex.split(line) for line in checks.read_text().splitlines()]
    assert check[:2] == ["-m", "distnorm.train"] and "--world-size" in check, check
    assert check[check.index("--world-size") + 1] == "2", check
    train_check(check[2:], work)
    (launch,) = log.read_text().splitlines()
    assert "--nproc_per_node=2" in launch, launch


# --- what the README says about installing ---------------------------------------------------

def test_the_extras_table_is_pyprojects():
    """The README's extras table names every extra pyproject.toml defines, and no other.

    An extra added, renamed or dropped in pyproject.toml and not in the README fails here (the
    table replaced ten `pip install -e ".[x]"` lines that this file checked one by one)."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| extra | adds | for |"):]
    table = table[:table.index("\n\n")]
    named = {m[1] for m in re.finditer(r"^\| `([\w-]+)` \|", table, re.M)}
    assert named == extras, f"README's table: {sorted(named)}; pyproject.toml: {sorted(extras)}"


def test_deepspeeds_op_is_built_inside_the_venv():
    """README: the tests build DeepSpeed's CPU op in `.venv/torch_extensions/<hash of the
    venv's path>` (the root conftest.py sets TORCH_EXTENSIONS_DIR, which every process the
    tests start inherits): one directory per venv, and per path it is reached by.

    Without the setting the venvs of one user share ~/.cache/torch_extensions and rebuild the
    op for each other (two rebuilds of about 2 min each in a trial, 2026-11-26); with one
    directory for two paths to one venv (a worktree's symlinked .venv), whose build commands
    differ, the two suites rebuilt it every 30-60 s (tests/README.md)."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("pytest runs outside a virtualenv: the default directory is kept")
    seen_as = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    assert os.environ.get("TORCH_EXTENSIONS_DIR") == str(Path(sys.prefix) / "torch_extensions" / seen_as)


# --- the harness of the pages' Python blocks (the root conftest.py) ---------------------------

def run_page(tmp_path: Path, text: str) -> None:
    """A Markdown page through the harness that runs README.md's and docs/'s blocks: setup,
    every example in order, teardown."""
    import conftest as harness  # the root one (tests/conftest.py is tests.conftest)

    assert Path(harness.__file__).resolve() == ROOT / "conftest.py", harness.__file__
    page = tmp_path / "page.md"
    page.write_text(text)
    document = harness.DOCS.parse(page)
    harness.DOCS.setup(document.namespace)
    try:
        for example in document.examples():
            example.evaluate()
    finally:
        harness.DOCS.teardown(document.namespace)


INIT_GROUP = """```python
import os
import torch.distributed as dist

if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
```
"""


def test_a_block_that_needs_a_launcher_variable_fails(tmp_path, monkeypatch):
    """A block runs as `python page.py` would: `init_process_group("gloo")` without the
    variables torchrun sets fails, as it does for a user, even where pytest itself runs with
    them; the teardown gives them back.

    Before 2026-11-26 the harness set RANK, WORLD_SIZE, MASTER_ADDR, ... for every block: the
    README's DDP block passed its test and failed for a user with "environment variable RANK
    expected, but not set". Nor does a block see the ones pytest inherited."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launched = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for key, value in launched.items():
        monkeypatch.setenv(key, value)
    needs_rank = '```python\nimport torch.distributed as dist\n\ndist.init_process_group("gloo")\n```\n'
    with pytest.raises(ValueError, match="environment variable RANK expected"):
        run_page(tmp_path, needs_rank)
    assert {key: os.environ.get(key) for key in launched} == launched
    run_page(tmp_path, INIT_GROUP + '\n```python\nassert dist.get_world_size() == 1\n```\n')


@pytest.mark.processes
def test_a_torchrun_marker_runs_the_pages_blocks_on_n_ranks(tmp_path):
    """`<!-- torchrun: nproc=2 -->` after a block: the page's blocks so far (two here, the
    second using the first's names) run once in the page's process and again as one script
    under torchrun on 2 ranks; a script that fails there fails the marker.

    So the marker runs every rank, not one, and all the page's blocks so far, not only its own
    block, and it does not pass whatever the ranks return."""
    out = tmp_path / "out"
    out.mkdir()
    page = INIT_GROUP + f"""
```python
open(os.path.join({str(out)!r}, f"rank{{dist.get_rank()}}-of-{{dist.get_world_size()}}"), "w").close()
dist.destroy_process_group()
```
<!-- torchrun: nproc=2 -->
"""
    run_page(tmp_path, page)
    assert sorted(p.name for p in out.iterdir()) == ["rank0-of-1", "rank0-of-2", "rank1-of-2"]

    from sybil.example import SybilFailure

    fails_when_launched = '```python\nimport os\n\nassert "RANK" not in os.environ\n```\n<!-- torchrun: nproc=2 -->\n'
    with pytest.raises(SybilFailure, match="exited 1"):
        run_page(tmp_path, fails_when_launched)
