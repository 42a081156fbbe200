"""Test-session setup.

Multi-process tests start their ranks with ``forkserver`` (tests/support/multiproc.py's START_METHOD, and
``PACIStrategy(start_method="forkserver")``): the server imports these once and every rank is forked
from it, instead of each spawned rank importing torch and Lightning afresh (about 13 s of CPU per rank
on these machines, most of a multi-process test's time). Set here, before any server starts, with no
import of Lightning: importing it before pytest's log capture is installed would turn off the
propagation of Lightning's log records that tests read through ``caplog``.

The suite runs on two pytest-xdist workers (pyproject's ``-n auto --dist loadgroup``; ``-n 0`` runs it serially),
arranged at the end of this file: which tests may run beside which.
"""

import multiprocessing

multiprocessing.set_forkserver_preload(
    ["torch", "lightning.pytorch", "lit_efficient.strategy", "lit_efficient.cli.app"]
)


import os  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# One torch thread per test process when two workers share the two cores (set here, before any test imports torch;
# xdist names the worker count before it reads this file). With torch's default of a thread per core, an in-process
# test's OpenMP threads spun waiting for a core the other worker's ranks held: a 0.7 s test took 28 s beside them.
# The forkserver and the subprocesses a test starts inherit it; a test that needs more threads sets its own.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One thread here and in every rank (``pytestmark = pytest.mark.usefixtures("one_thread")``): one device,
    one process and S processes then agree bit for bit under 1F1B-flush (a matmul's reduction order depends
    on the thread count). The ranks read OMP_NUM_THREADS (PACIStrategy's forkserver launcher applies it);
    without it they keep the thread count of the forkserver, which depends on which test started it. Both are
    put back after the module by `_environment_as_found_by_the_module`."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _environment_as_found_by_the_module():
    """`_environment_as_found` for a module's fixtures (a module-scoped fit writes MASTER_PORT before any test)."""
    yield from _environment_restored()


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves this process's environment, thread count and loggers as it found them. Lightning's launchers
    write MASTER_PORT (and LOCAL_RANK, WORLD_SIZE, ...) here and never take them out: every later fit in the worker then
    bound that same port number, which the other worker's gloo may have taken meanwhile ("address already in use").
    A test that set OMP_NUM_THREADS or torch's threads changed the numbers of whichever tests came after it."""
    yield from _environment_restored()


def _environment_restored():
    import logging

    import torch

    environ, threads = dict(os.environ), torch.get_num_threads()
    # A run in this process that quiets Lightning (`setLevel(ERROR)` in a helper that also runs as a rank) kept it
    # quiet for every later test of the worker: a test reading its INFO records through caplog found none.
    existing = [logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    loggers = {logger: (logger.level, logger.propagate, logger.disabled) for logger in [logging.root, *existing]}
    yield
    for logger, (level, propagate, disabled) in loggers.items():
        if logger.level != level:
            logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """examples/own_hf_model.py's stand-in for a downloaded model: a small Qwen2 and its BPE tokenizer in one
    save_pretrained folder (a 300-token vocabulary trained on 300 kB of the embedded corpus here)."""
    pytest.importorskip("transformers")
    from tests.support.examples import own_hf_model

    return own_hf_model().make_demo_folder(tmp_path_factory.mktemp("my_model"), vocab_size=300, text_bytes=300_000)


# -- two tests at a time (pyproject's addopts: ``-n auto --dist loadgroup``) ------------------------------------------


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """Two workers: these machines have two cores, and the multi-process tests run serially left one of them idle
    37% of the suite's time, waiting on timeouts by design or on a one-thread rank. More would put several
    computing multi-process tests on two cores; one core gets one worker. PYTEST_XDIST_AUTO_NUM_WORKERS wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(2, cores)


# Multi-process tests that mostly wait by design (a peer's timeout, a grace period, a kill): 73% of the hung-rank
# test's time has a core idle. Their group runs beside the other multi-process tests' group, and so do the tests
# marked ``command``: a user's command (the console script, an example, torchrun) in fresh interpreters, most of
# whose time is their start-up (importing torch and Lightning), not ranks computing in step.
_WAITING_FILES = {Path(__file__).parent / "strategy" / "test_reliability.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Two groups of ``multiproc`` tests, each on one worker, one test after another (xdist's ``loadgroup``; its
    own hook reads the mark after this one): "beside", the tests that wait on failures, start commands or run alone, and
    "processes", the others. At most one test whose ranks compute in step runs at a time; a worker takes in-process
    tests when its group is done. The serial "processes" group is the suite's longest path: what leaves it shortens
    the suite."""
    for item in items:
        if item.get_closest_marker("multiproc"):
            beside = Path(item.path) in _WAITING_FILES or item.get_closest_marker("command") is not None
            # An ``alone`` test waits, idle, for the other worker's test to end: there the wait is for a short test
            # of "processes", not for a long one of "beside" (up to 37 s) on the suite's longest path.
            beside = beside or item.get_closest_marker("alone") is not None
            item.add_marker(pytest.mark.xdist_group("beside" if beside else "processes"))
        elif item.get_closest_marker("gpu"):  # one device, and a CUDA clock checked against sleeps: one at a time
            item.add_marker(pytest.mark.xdist_group("gpu"))


_running: list = [None]  # the test item running in this process


def _ranks_only_in_multiproc_tests() -> None:
    """A test that starts ranks (a forkserver's or spawned process) without the ``multiproc`` mark would run them
    outside its group, beside another test's ranks, and in the quick subset: it fails, saying so."""
    import multiprocessing.context
    import multiprocessing.process

    start = multiprocessing.process.BaseProcess.start
    kinds = (multiprocessing.context.ForkServerProcess, multiprocessing.context.SpawnProcess)

    def checked_start(self):
        item = _running[0]
        loader = getattr(getattr(self, "_target", None), "__module__", "").startswith("torch.utils.data")
        if isinstance(self, kinds) and not loader and item is not None and not item.get_closest_marker("multiproc"):
            raise RuntimeError(f"{item.nodeid} starts processes: mark it @pytest.mark.multiproc (tests/conftest.py)")
        return start(self)

    multiprocessing.process.BaseProcess.start = checked_start


_ranks_only_in_multiproc_tests()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, setup to teardown: known to the rank check above, and sharing the machine as it may."""
    _running[0] = item
    try:
        yield from _sharing_the_machine(item)
    finally:
        _running[0] = None


def _sharing_the_machine(item):
    """A test marked ``alone`` runs with no other test beside it: a timing it checks against a model would read the
    other worker's load. The other tests share the machine. A readers-writer lock on files of this run (in the
    folder of its workers' temporary folders), with a turnstile so that a waiting ``alone`` test is not starved by
    the other worker's stream of short tests. POSIX record locks (``lockf``): a DataLoader worker forked during a
    test does not inherit them, so it cannot hold the machine after its test. A lock not had in 15 minutes is
    given up with a warning (the test then runs beside the other worker): a wedged peer must not hang the suite."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # not under xdist: every test runs alone anyway
        yield
        return
    import fcntl

    folder = item.config._tmp_path_factory.getbasetemp().parent  # one per run, shared by its workers
    alone = item.get_closest_marker("alone") is not None
    with open(folder / "tests.turnstile", "a+") as turnstile, open(folder / "tests.machine", "a+") as machine:
        held = _lock(turnstile, fcntl.LOCK_EX, item)
        held = _lock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, item) and held
        if held and not alone:
            fcntl.lockf(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.lockf(machine, fcntl.LOCK_UN)
            fcntl.lockf(turnstile, fcntl.LOCK_UN)


def _lock(file, kind: int, item, patience: float = 900.0) -> bool:
    import fcntl
    import time
    import warnings

    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.lockf(file, kind | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() > deadline:
                message = f"{item.nodeid}: no test lock after {patience:.0f} s; running beside the other worker"
                warnings.warn(message, stacklevel=2)
                return False
            time.sleep(0.05)
