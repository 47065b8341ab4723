import contextlib
import faulthandler
import functools
import gc
import inspect
import os
import signal
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(__file__))  # `import harness`

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

# A forked rank inherits this handler: SIGUSR1 makes it print every thread's Python stack (what a hung rank
# was waiting on), which the reaper below asks for before it ends a rank a test left behind.
faulthandler.register(signal.SIGUSR1, all_threads=True)


def _descendants(root: int) -> list:
    """Every live process below ``root`` (from /proc: children, their children, ...), zombies left out."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ...: after the parenthesized name
        if fields[0] != "Z":
            parent_of[int(entry)] = int(fields[1])
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier}
        found.extend(sorted(frontier))
    return found


def _where(pid: int) -> str:
    """What each thread of ``pid`` waits in, as the kernel tells it (state and wait channel per thread)."""
    lines = []
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                wchan = f.read()
            lines.append(f"  thread {tid}: {stat[stat.index('(') + 1:stat.rindex(')')]} "
                         f"state {stat[stat.rindex(')') + 2]} waits in {wchan or '-'}")
    except OSError:
        return f"process {pid}: gone\n"
    return f"process {pid} ({cmd}):\n" + "\n".join(lines) + "\n"


def _end(pids: list, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """No rank a test started outlives it. A hung test (pytest-timeout ends only the test, in this process)
    used to leave its forked ranks waiting, and multiprocessing's exit handler then joined them forever, so
    the session never ended after its summary. Left-over ranks print their stacks (SIGUSR1, above), then get
    SIGTERM, then SIGKILL."""
    me = os.getpid()
    before = set(_descendants(me))
    yield
    left = [pid for pid in _descendants(me) if pid not in before]
    if not left:
        return
    sys.stderr.write("".join(_where(pid) for pid in left))
    _end(left, signal.SIGUSR1)
    time.sleep(1.0)
    _end(left, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    alive = left
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in left if pid in set(_descendants(me))]
    _end(alive, signal.SIGKILL)
    for pid in left:  # reap our own children; a grandchild is its parent's to reap
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    sys.stderr.write(f"conftest: ended {len(left)} process(es) this test left behind: {left}\n")


@pytest.fixture(autouse=True)
def _native_crash_stacks():
    """A process that dies of a native fault (SIGSEGV, SIGABRT from glibc's heap checks, ...) prints every thread's
    Python stack into the test's captured output, where the failure report shows it: the forked ranks inherit the
    handler and the descriptor. (pytest's own faulthandler writes to the session's stderr, which xdist does not
    report: a rank's ``double free or corruption`` once came with no stack at all.)"""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    yield
    faulthandler.enable(file=sys.__stderr__, all_threads=True)


@pytest.fixture(autouse=True)
def _no_patch_left():
    """No test leaves a patch of lightning_par.patches installed in this process (DTensor's sharding tables are
    process-global): it would be in every later test of this worker and every rank it forks, and fail the one
    that checks teardown's state, far from its cause. The leak is taken out, and the test that left it fails."""
    from lightning_par import patches
    from lightning_par.tensor.rules import restore_rules

    yield
    left = patches.pending()
    if left:
        restore_rules()  # as the strategies' teardown: DTensor's cached decisions go with the rules
        patches.undo()
        pytest.fail(f"the test left patches installed in the pytest process: {left}")


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache(tmp_path_factory):
    """One inductor cache directory for the test session: kernels compiled by one test (or rank) are reused by the
    next, so the few inductor tests pay each compile once."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "inductor-cache")
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test sees the environment the session started with, whatever an earlier test's launch set
    (harness.LAUNCH_VARIABLES says what a launch leaves and what it does to a later subprocess)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


# [Note: the longest tests first]
# Under ``-n 2 --dist worksteal`` a worker that runs out of tests steals half of the other's queue from its end, and
# the session ends when the last test does: a long test near the end of a queue (a recipe, a torchft run, ~15-80 s)
# leaves the other core idle meanwhile. The slow tests go first, then the other process-launch tests, then the
# distributed ones, and the unit tests (mostly under a second) last, where they fill both workers to the end (the
# longest-processing-time-first rule). Within a group the order is pytest's.
_ORDER = ("slow", "e2e")


def pytest_collection_modifyitems(config, items):
    def group(item) -> int:
        for i, marker in enumerate(_ORDER):
            if item.get_closest_marker(marker):
                return i
        return len(_ORDER) + ("dist" not in item.path.parts)

    items.sort(key=group)  # stable


# [Note: the session's objects are frozen]
# Every fork launch collects this process's garbage first ([Note: collect before fork] in
# lightning_par/strategies/_materialize.py), and every rank's collections walk what it inherited: with torch,
# Lightning and transformers imported that is ~0.5 M objects, ~0.4 s a collection, paid in the caller before
# each launch and again in each rank. What the session holds when its tests begin is collected once and frozen
# (``gc.freeze()``); before each distributed test what earlier tests left is collected and frozen too, so a
# launch collects only what its test made and its ranks skip the rest. Frozen objects are still freed by their
# reference counts; only cycles among them stay (this process's lifetime).
def pytest_collection_finish(session):
    # what every DDP / tensor-parallel rank imports at setup, imported once here rather than in each rank
    import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook  # noqa: F401
    import lightning_par.tensor.probe  # noqa: F401

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _heap_frozen(request):
    if "dist" in request.node.path.parts:
        gc.collect()
        gc.freeze()
    yield


# [Note: a test runs on one frame-stack chunk]
# CPython 3.11 keeps its Python frames on a per-thread stack of chunks (16 KiB each, mapped and unmapped whole):
# a call that does not fit in the top chunk maps a new one, and its return unmaps it. A hot call whose frame sits
# across a chunk's end (a dispatch loop of DTensor, autograd or Lightning at that depth) therefore maps, faults in
# and unmaps 16 KiB every time: ~4-6.5 us a call against ~0.03 us, and 35% of the page faults of
# test_tensor_parallel.py's ranks. The chunk for a frame larger than 16 KiB is the next power of two above it, so
# each test body, and each fixture that returns its value (a module's one-process reference fit), is called through
# a frame of a 512 KiB value stack: its chunk is 1 MiB, and every frame above it (the test's, and those of the ranks
# it forks, which inherit the chunk) fits in the other half. The value stack's slots are never touched (its pages
# are not faulted in; a frame object made of it for a traceback is one untouched allocation of that size), and on
# a CPython without chunks it is one more frame.
def _on_one_chunk(fn, *args, **kwargs):
    return fn(*args, **kwargs)


_on_one_chunk.__code__ = _on_one_chunk.__code__.replace(co_stacksize=1 << 16)


@contextlib.contextmanager
def _swapped(owner, attr, fn):
    """owner.attr is fn called on one chunk inside the with block, and fn again after it."""
    setattr(owner, attr, functools.wraps(fn)(functools.partial(_on_one_chunk, fn)))
    try:
        yield
    finally:
        setattr(owner, attr, fn)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    test = getattr(item, "obj", None)
    if not callable(test):
        return (yield)
    with _swapped(item, "obj", test):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    # A generator fixture's body runs where pytest calls next() on it, and a fixture of a test class is bound to
    # its instance: both are left as they are (the suite's fixtures that fit a model return their value).
    fn = fixturedef.func
    if inspect.isgeneratorfunction(fn) or request.instance is not None:
        return (yield)
    with _swapped(fixturedef, "func", fn):
        return (yield)
