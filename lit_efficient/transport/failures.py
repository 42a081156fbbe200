"""Failures of a pipeline's communication, named: the error type, and the first failure of a run published
for every rank (so a peer that times out names the real culprit, not itself)."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from datetime import timedelta

import torch.distributed as dist


class PipelineCommError(RuntimeError):
    """A peer stage failed, died or went silent; the message names it."""


_ABORT_KEY = "lit_efficient/abort"
_STOP_KEY = "lit_efficient/stopped"  # the first rank stopped from outside (`report_stop`), apart from the failures


# gloo says "Timed out waiting 5000ms for recv operation"; NCCL's watchdog "Watchdog caught collective
# operation timeout: WorkNCCL(SeqNum=7, OpType=RECV, ..., Timeout(ms)=600000) ran for 600043 milliseconds
# before timing out" (no "timed out" in it: reported as a dead peer before this matched both).
_TIMEOUT_TEXT = re.compile(r"timed out|timing out|operation timeout", re.IGNORECASE)


def is_timeout(err: BaseException) -> bool:
    """Whether a communication error is a timeout (gloo's or NCCL's watchdog), not a lost peer."""
    return bool(_TIMEOUT_TEXT.search(str(err)))


# What a rank sees when a peer's failure reaches it through a collective or a transfer, not a failure of its own.
_LOST_PEER_TEXT = re.compile(
    r"connection closed|connection reset|broken pipe|remote process exited|network error|timed out|timing out"
    r"|operation timeout",
    re.IGNORECASE,
)


# Where such an error comes from: torch.distributed's own errors, or gloo's and NCCL's (a plain RuntimeError whose
# text names its source file: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer").
_COMM_SOURCE_TEXT = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)


def is_raw_comm_error(err: BaseException) -> bool:
    """Whether ``err`` is gloo's or NCCL's own error of a lost or silent peer (from a collective or a send no
    `PipelineCommError` names): a failure seen here, not one that started here, which a rank must not publish as
    the run's cause (a `PipelineCommError` names the peer itself and is published). Another library's timeout
    (a DataLoader's) is a failure of this rank's own."""
    if isinstance(err, PipelineCommError) or not isinstance(err, RuntimeError):
        return False
    text = str(err)
    from_comm = isinstance(err, dist.DistError) or bool(_COMM_SOURCE_TEXT.search(text))
    return from_comm and bool(_LOST_PEER_TEXT.search(text))


_printed_failure = False

# The store whose host was found gone (rank 0 died): each further access would only fail again, and torch prints
# each failure as a warning with a 30-line C++ stack (three of them buried the one line that names the cause). Only
# that store: a later group's (a script that initializes again) is asked as any other.
_gone_store: object | None = None


def _store():
    store = dist.distributed_c10d._get_default_store()
    if store is _gone_store:
        raise ConnectionError("the rendezvous store's host is gone")
    return store


def _store_failed(err: BaseException) -> None:
    global _gone_store
    if isinstance(err, dist.DistError):  # the store's host unreachable; another error leaves the store asked
        with contextlib.suppress(Exception):
            _gone_store = dist.distributed_c10d._get_default_store()


def report_failure(message: str) -> None:
    """Publish the first failure of the run in the rendezvous store, so peers can name the cause, and
    print this process's first one to stderr at once, as a "pipeline failure": a launcher that sees a rank die may kill
    the others (Lightning's does, within seconds) before their exception's traceback is printed.

    Best effort: the store may be gone with the rank that hosted it.
    """
    _say_and_publish(_ABORT_KEY, "pipeline failure", message)


def report_stop(message: str) -> None:
    """A rank stopped from outside (SIGTERM, Ctrl-C): printed here at once under "stopped", and published apart from
    the failures. torchrun stops a node's other ranks with SIGTERM when one of them dies, and a killed rank publishes
    nothing: published as a failure, the stop was named as the run's cause on every rank, over the death that led to
    it. A peer names a stop where nothing else explains what it saw (`explain_link_failure`, `report_lost_peers`)."""
    _say_and_publish(_STOP_KEY, "stopped", message)


def _say_and_publish(key: str, heading: str, message: str) -> None:
    """This process's first report of the run to stderr under ``heading``; ``message`` into the store's ``key``
    unless a rank published there first."""
    global _printed_failure
    if not _printed_failure:
        _printed_failure = True
        print(f"lit-efficient: {heading}: {message}", file=sys.stderr, flush=True)
    try:
        _store().compare_set(key, "", message)
    except Exception as err:  # noqa: BLE001 - reporting must never hide the original error
        _store_failed(err)


def read_stop() -> str | None:
    """The first stop published by any rank (`report_stop`), if one was and the store is still reachable."""
    try:
        return _published(_STOP_KEY)
    except Exception as err:  # noqa: BLE001 - the store is gone with its host
        _store_failed(err)
        return None


def begin_run() -> None:
    """A run starts in this process: its first failure is printed afresh (a process that runs again, a notebook or a
    script that fits twice, printed only its first run's)."""
    global _printed_failure
    _printed_failure = False


def clear_published_failure() -> None:
    """Empty the published cause for a run every rank has entered (one rank calls it, after a collective that every
    rank reaches only once done with its earlier run): kept, an earlier run's cause explained every failure of the
    later run, on every rank."""
    try:
        _store().set(_ABORT_KEY, "")  # `_published` reads "" as none; compare_set publishes over it
        _store().set(_STOP_KEY, "")
    except Exception as err:  # noqa: BLE001 - the store gone with its host: the run's first transfer says so
        _store_failed(err)


def check_peers_alive(timeout: timedelta) -> None:
    """Before a later run in a process that keeps its default group (a notebook, a script that fits again): every
    rank must still be there. Without this, a rank that exited or was killed since the earlier run left the new
    run's first group waiting out its whole timeout (``p2p_timeout``, 600 s by default) with a store error that
    names no rank; gloo's connections report a lost peer in milliseconds. Collective. gloo only: NCCL has no
    monitored barrier, and its barrier would wait out the watchdog all the same."""
    if dist.get_backend() != "gloo":
        return
    start = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        text = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        me = f"rank {dist.get_rank()}"
        # gloo says "Rank 1 failed to pass monitoredBarrier in 40000 ms" for a closed connection too, at once.
        if time.monotonic() - start >= 0.9 * timeout.total_seconds():
            raise PipelineCommError(
                f"{me}: not every rank started this run within {timeout.total_seconds():g} s ({text}). Every rank "
                "of the process group this process's earlier run used must call fit, validate, test and predict in "
                "the same order; raise PACIStrategy(p2p_timeout=...) if one is only slow to get there"
            ) from err
        raise PipelineCommError(
            f"{me}: a rank of this process's earlier run is gone (gloo, at once: {text}): a pipeline needs every "
            "rank, and a rank that exited or was killed cannot join the group again. Start every process again "
            "(torchrun --max-restarts restarts them all, and a fit resumes from its last checkpoint)"
        ) from err


def read_failure() -> str | None:
    """The first failure published by any rank, if one was and the store is still reachable."""
    return await_failure(grace=0.0)


def _published(key: str = _ABORT_KEY) -> str | None:
    """The first failure (or, with `_STOP_KEY`, stop) published, or None; raises when the store cannot be read (gone
    with its host)."""
    store = _store()
    if store.check([key]):
        return store.get(key).decode() or None
    return None


def release_peers_keeping_the_store() -> object | None:
    """For the exit of a failed process that hosts the rendezvous store (rank 0 of a ``start_method="popen"``
    launch): close its default group's connections, so that a rank waiting on it (a barrier: a save's, a
    callback's) fails as this process begins its exit, not after its wait for the ranks, and return the store,
    which the caller keeps alive while that rank reads the failure published there. gloo only: an NCCL group with
    work in flight may block its destruction (and its peers would not see it close before their own timeout)."""
    try:
        if not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        backends = {name.rsplit(":", 1)[-1] for name in str(dist.get_backend()).split(",")}  # "cpu:gloo,cuda:nccl"
        if backends == {"gloo"}:
            dist.destroy_process_group()
        return store
    except Exception:  # noqa: BLE001 - an exit's courtesy to the peers: never an error of its own
        return None


PUBLISH_GRACE_S = 2.0  # how long a rank that lost a peer waits for that peer's own report of what it raised


def await_failure(grace: float = PUBLISH_GRACE_S) -> str | None:
    """`read_failure`, waiting up to ``grace`` seconds for one: a peer that raised publishes its error while the
    exception unwinds, and its connections may close a moment before (a group torn down on the way), so the
    first read can come too early. A peer that was killed never publishes: None after the grace."""
    deadline = time.monotonic() + grace
    while True:
        try:
            cause = _published()
        except Exception as err:  # noqa: BLE001 - the store is gone with its host: nothing more will be published
            _store_failed(err)
            return None
        if cause is not None or time.monotonic() >= deadline:
            return cause
        time.sleep(0.05)


def explain_link_failure(
    err: BaseException, timed_out: tuple[str, str], lost: tuple[str, str], peer: str | None = None
) -> str:
    """The message of a transfer that failed with ``err``, for a stage link and the tied-weight exchange alike:
    ``head: the pipeline stopped because <the cause a rank published>``, else ``head: fallback``, with ``(head,
    fallback)`` from ``timed_out`` or ``lost``. A timeout reads what is published now (a stage further up may have
    timed out on the real culprit first) and is not published itself: it may be an innocent rank waiting on a chain
    that ends at the hung one. A lost peer awaits the peer's own report (it may publish a moment after its
    connections close) and, confirmed, is published as the run's cause; a ``peer`` (``stage s (rank r)``) that was
    itself stopped from outside (`report_stop`) is named so, and that is not published as a failure."""
    is_late = is_timeout(err)
    head, fallback = timed_out if is_late else lost
    cause = read_failure() if is_late else await_failure()
    stop = None if cause or peer is None else read_stop()
    if stop is not None and stop.startswith(f"{peer} "):
        return f"{head}: the pipeline stopped because {stop}"
    message = f"{head}: " + (f"the pipeline stopped because {cause}" if cause else fallback)
    if not is_late:
        report_failure(message)
    return message


def lost_peers(here: str, err: BaseException) -> str:
    """What ``here`` (``stage s (rank r)``) saw: a raw communication error (`is_raw_comm_error`), with the cause a
    peer published (awaited, unless it timed out: a timeout's cause may never be published) and, for a timeout, the
    option that bounds it."""
    timed_out = is_timeout(err)
    cause = read_failure() if timed_out else await_failure()
    stop = None if cause else read_stop()
    text = str(err).strip()
    first_line = text.splitlines()[0][:300] if text else ""
    message = (
        f"{here} lost its peers ({type(err).__name__}: {first_line}); "
        + (f"the pipeline stopped because {cause}" if cause else "no rank reported a failure of its own "
           "(one died, was killed, or is hung or slower than the timeout)")
        + (f"; meanwhile {stop}" if stop else "")
        + (". If a rank is only slow (a long validation or save on one rank), raise PACIStrategy(timeout="
           "timedelta(...)), which bounds every collective" if timed_out else "")
    )  # fmt: skip
    return message


def report_lost_peers(here: str, err: BaseException, account: str | None = None) -> None:
    """Print `lost_peers`' account (``account`` where it was taken already: the wait for a peer's cause is not
    repeated). Not published: it is not this rank's failure."""
    print(f"lit-efficient: {account or lost_peers(here, err)}", file=sys.stderr, flush=True)


class LostPeersError(PipelineCommError):
    """A collective's raw communication error as a rank raises it (`lost_peers_error`): what it saw, and the cause a
    peer published; its ``__cause__`` is the raw error. Not this rank's failure: never published as the run's."""


def lost_peers_error(here: str, err: BaseException) -> LostPeersError | None:
    """The error a rank raises for a raw communication error of a collective (a callback's, a metric share's):
    `lost_peers`' account, the cause a peer published last in the traceback (gloo's "Connection closed by peer"
    named neither; the transfers between stages say it already, `explain_link_failure`). None for another error:
    raise ``err`` itself."""
    return LostPeersError(lost_peers(here, err)) if is_raw_comm_error(err) else None
