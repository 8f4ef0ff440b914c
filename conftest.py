"""Runs the Python code blocks of README.md and docs/**/*.md as tests (Sybil).

`make test` passes README.md and docs/ to pytest; every ```python block there runs, in page
order, with one namespace per page (a later block may use what an earlier one defined), in a
fresh temporary working directory, as `python page.py` would run it: one process, and none of
the variables a launcher sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... are removed
from the environment while the page runs, even where pytest itself was started with them), so
a block that needs one fails unless the page sets it. A block that shows how a page runs under
``torchrun`` is followed by

    <!-- torchrun: nproc=2 -->

which is a test of its own: the page's blocks that ran so far, written as one script, run
again under ``python -m torch.distributed.run --standalone --nproc_per_node=2`` in a fresh
directory (marked ``processes``: ``make test`` runs it, ``make check`` does not). A block
that cannot run here is preceded by

    <!-- skip: next "why it cannot run here" -->
    <!-- skip: next if(not torch.cuda.is_available(), reason="needs CUDA") -->

so it is reported as skipped with its reason (the second form runs where CUDA is present).
The shell commands of the same pages are checked by tests/test_docs.py.

Sybil is required (``pip install -e ".[docs]"``), except in the GPU tier: ``make test-gpu``
(bench/gpu_report.py) sets ``DISTNORM_TEST_TIER=gpu`` and runs only CUDA test files, on a
bare GPU image that has no Sybil. There, without Sybil, the pages' blocks are not collected
and the session says so once at its end; anywhere else a missing Sybil stops pytest before
it collects anything, naming the package.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

try:
    from sybil import Region, Sybil
    from sybil.evaluators.python import PythonEvaluator
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
    from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer
except ModuleNotFoundError as err:  # only the package itself: a broken install still raises
    if err.name != "sybil":
        raise
    Sybil = None

ROOT = Path(__file__).resolve().parent

# One intra-op thread in every test process and every process it starts (they inherit the
# environment), unless the caller chose a number: the tests check results, not speed, and two
# pytest workers, gloo ranks and launched runs share two cores. OpenMP threads that spin
# waiting for work burnt more CPU than the work itself: test_convert.py took 78 CPU-seconds
# with the default (2) and 29 with 1 (tests/cpu_seconds.py, 2026-11-26). Set before any
# test module imports torch, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Pages whose Python blocks start processes (DataLoader workers): left out of ``make check``.
PAGES_THAT_START_PROCESSES = {"docs/reference/data.md"}
#: What launchers set (torchrun / torch.distributed.elastic, Accelerate, Slurm, MPI): removed
#: from the environment while a page's blocks run, as a user's shell does not have them.
LAUNCHER_VARIABLES = re.compile(r"(MASTER_ADDR|MASTER_PORT|RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK"
                                r"|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_WORLD_SIZE|ROLE_NAME|CROSS_RANK|CROSS_SIZE"
                                r"|LOCAL_SIZE|TORCHELASTIC_\w+|ACCELERATE_\w+|SLURM_\w+|OMPI_\w+|PMI_\w+|PMIX_\w+"
                                r"|MV2_\w+)")
#: Seconds a page's blocks may take under torchrun (the README's and the DDP guide's: about 10 s on 2 cores).
TORCHRUN_TIMEOUT = 240


def pytest_configure(config: pytest.Config) -> None:
    """Every process the tests start finds this interpreter's tools first (``torchrun``,
    ``accelerate``, ``deepspeed``, ``ninja``), as in an activated virtualenv, whether or not
    pytest was started from one. Why it matters beyond finding the commands: DeepSpeed
    JIT-builds its CPU shared-memory op with the ``ninja`` on ``PATH``, and the venv's
    ``ninja`` (pip, 1.13) and Debian's (1.11) hash the same build command differently, so tests
    that alternated the two rebuilt the op each time (35-70 s a rebuild; two in one
    ``make test`` on 2026-11-24)."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + path
    # DeepSpeed builds that op in TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions, which
    # every venv of the user shares: two venvs rebuilt it for each other (two rebuilds of about
    # 2 min in one trial, 2026-11-26). One directory per venv *path as this interpreter sees
    # it*, inherited by every process the tests start; a value you set wins. The path matters:
    # the build command names the venv's include directories by it, so two checkouts reaching
    # one venv by two paths (a worktree's symlinked .venv) rebuilt the op for each other in a
    # shared directory every 30-60 s for as long as both suites ran (its .ninja_log, two
    # command hashes alternating, 2026-11-26 13:40-13:48), holding DeepSpeed launches past
    # their limits (tests/README.md, "Green under load").
    from distnorm.integrations.deepspeed import extensions_dir  # the one rule: what a user's DeepSpeed script gets

    if extensions_dir() is not None:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    if Sybil is None and not GPU_TIER:
        raise pytest.UsageError(
            f"Sybil is not installed for {sys.executable}: the tests run the Python blocks of README.md and "
            'docs/ through it. Install it (pip install -e ".[docs]", or make install); on a bare GPU '
            "machine run make test-gpu, whose CUDA tests do without it (DISTNORM_TEST_TIER=gpu).")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if Sybil is None:  # the GPU tier (anywhere else pytest_configure stopped the session)
        terminalreporter.write_line(f"note: {NO_SYBIL}")


#: ``make check`` sets this: only tests that run in the pytest process itself are selected
#: (``-m "not processes and not world_size"``), and one that starts a process anyway fails,
#: naming the marker it needs -- so the quick tier stays quick without a list to maintain.
SINGLE_PROCESS = os.environ.get("DISTNORM_TEST_TIER") == "check"
#: ``make test-gpu`` sets this (bench/gpu_report.py): the CUDA tests, where Sybil may be missing.
GPU_TIER = os.environ.get("DISTNORM_TEST_TIER") == "gpu"
NO_SYBIL = ("the Python blocks of README.md and docs/ are not collected: Sybil is not installed for "
            f"{sys.executable} (DISTNORM_TEST_TIER=gpu, the bare GPU image)")


def _refusing_processes(item: pytest.Item):
    """Starting a process raises, naming the marker the test needs (``make check`` only)."""
    import contextlib
    import multiprocessing.process
    import subprocess

    if not SINGLE_PROCESS or item.get_closest_marker("processes") or item.get_closest_marker("world_size"):
        return contextlib.nullcontext()
    import torch  # noqa: F401 -- imported before the guard: its import runs ldconfig (ctypes.util.find_library)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{item.nodeid} starts a process (in the test or a fixture): mark it "
                           "@pytest.mark.processes, or list its page in PAGES_THAT_START_PROCESSES of "
                           "conftest.py (make check runs the tests that stay in one process)")

    stack = contextlib.ExitStack()
    patch = stack.enter_context(pytest.MonkeyPatch.context())
    patch.setattr(subprocess.Popen, "_execute_child", refuse)
    patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    return stack


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(ROOT).as_posix() in PAGES_THAT_START_PROCESSES:
            item.add_marker(pytest.mark.processes)
        elif getattr(item, "example", None) is not None and item.example.region.evaluator is _under_torchrun:
            item.add_marker(pytest.mark.processes)  # a Sybil item: the page's script on N torchrun ranks


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _refusing_processes(item):  # fixtures too: a module fixture that launches a run counts
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _refusing_processes(item):
        return (yield)


def _setup(namespace: dict) -> None:
    import torch

    namespace["torch"] = torch  # for `skip: next if(...)` conditions
    namespace["__saved__"] = (os.getcwd(), dict(os.environ))
    namespace["__script__"] = []  # the blocks that ran, for a torchrun marker
    for key in [k for k in os.environ if LAUNCHER_VARIABLES.fullmatch(k)]:
        del os.environ[key]  # a user's shell has none of them: a block that needs one fails
    namespace["__workdir__"] = tempfile.mkdtemp(prefix="distnorm-docs-")
    os.chdir(namespace["__workdir__"])
    torch.manual_seed(0)


def _teardown(namespace: dict) -> None:
    import torch.distributed as dist

    if "accelerate" in sys.modules:  # a page that made an Accelerator leaves no singleton state behind
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    cwd, env = namespace["__saved__"]
    os.chdir(cwd)
    shutil.rmtree(namespace["__workdir__"], ignore_errors=True)
    os.environ.clear()  # what the blocks set goes, what the setup removed comes back
    os.environ.update(env)


class _KeptBlock:
    """Runs a ```python block in the page's namespace, then keeps its text for a torchrun marker."""

    def __init__(self, evaluator: object) -> None:
        self.evaluator = evaluator

    def __call__(self, example: object) -> None:
        __tracebackhide__ = True
        self.evaluator(example)
        example.namespace["__script__"].append(str(example.parsed))


def _under_torchrun(example: object) -> str | None:
    """A ``<!-- torchrun: nproc=N -->`` marker: the page's blocks that ran so far, as one script,
    under ``torchrun --standalone --nproc_per_node=N`` in a fresh directory, as a user who saved
    them to a file would launch it. The failure text is the command and its output's end."""
    nproc = example.parsed
    blocks = example.namespace["__script__"]
    if not blocks:
        return "a torchrun marker with no block run before it on the page"
    workdir = tempfile.mkdtemp(prefix="torchrun-", dir=example.namespace["__workdir__"])
    script = Path(workdir, "page.py")
    script.write_text("\n\n".join(blocks))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script)]
    try:
        done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"{' '.join(command)} did not finish in {TORCHRUN_TIMEOUT} s"
    if done.returncode != 0:
        return f"{' '.join(command)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    return None


def _torchrun_markers(document: object):
    for lexed in DirectiveInHTMLCommentLexer(directive="torchrun", arguments=".*?")(document):
        argument = lexed.lexemes["arguments"].strip()
        matched = re.fullmatch(r"nproc=([1-9][0-9]*)", argument)
        if matched is None:
            raise ValueError(f"{document.path}: a torchrun marker reads <!-- torchrun: nproc=N -->, not {argument!r}")
        yield Region(lexed.start, lexed.end, int(matched[1]), _under_torchrun)


def _python_blocks(document: object):
    for region in _PYTHON(document):
        if isinstance(region.evaluator, PythonEvaluator):  # not a >>> block, which nothing here has
            region.evaluator = _KeptBlock(region.evaluator)
        yield region


if Sybil is not None:
    _PYTHON = PythonCodeBlockParser()
    #: The pages' harness; ``tests/test_docs.py`` runs its own small pages through it too.
    DOCS = Sybil(
        parsers=[_python_blocks, SkipParser(), _torchrun_markers],
        patterns=["README.md", "docs/*.md", "docs/*/*.md"],
        excludes=["tests/*", "launch/*", "bench/*", "examples/*", "configs/*", "distnorm/*"],
        setup=_setup,
        teardown=_teardown,
    )
    pytest_collect_file = DOCS.pytest()


@pytest.fixture(autouse=True)
def _doctest_shards(request: pytest.FixtureRequest) -> None:
    """Docstring examples that read shards get the demo digits' shards (written once per
    session): ``digits_shards`` in their namespace."""
    if isinstance(request.node, pytest.DoctestItem) and "digits_shards" in request.node.dtest.docstring:
        request.getfixturevalue("doctest_namespace")["digits_shards"] = request.getfixturevalue("_digits_shards")


@pytest.fixture(scope="session")
def _digits_shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.helpers import write_digits_shards

    return str(write_digits_shards(tmp_path_factory.mktemp("doctest-digits"), size=32))  # the demo's, as the docs show it
