"""Ranks that disagree about collectives: a clear error, never a silent wrong value or a silent hang.

Every collective fshard issues passes through `begin` (called by ``_comm._issue``), which gives it a
record: its sequence number in its group (the ranks it runs over), the op, the axes, the shape, the
dtype and the call site (the first frame outside fshard and torch). Two parts use the records:

* **always on** (a dict update, a short walk up the stack and a few attribute writes per collective):
  the sequence counters, the last collective issued, finished and waited for (``_comm`` marks "in
  collective k since t" around every wait), and a daemon **watchdog** thread per rank. The thread
  answers requests posted on the rendezvous store (its rank's state and the Python stack of the
  thread that issues collectives) and, when this rank has waited longer than the hang-report
  threshold (``fs.init(hang_report=60)``), asks every rank of the group for its state and prints,
  once, which ranks have not arrived, where every rank is, and the stacks of the missing ones. When
  the process-group timeout ends the wait, the gloo error becomes a `CollectiveError` naming the
  ranks that did not arrive; it is recorded for the launcher, which names them (not the victim);
* **debug** (``fs.debug()`` / ``FSHARD_DEBUG=1``): before each collective, one small all-gather of a
  fixed-size fingerprint over the group; a mismatch raises the same `CollectiveError` on every rank
  (with each rank's collective and call site) before the collective is issued, so no mismatched
  result is returned and no collective of mismatched sizes reaches the backend.

Point-to-point transfers (``ppermute``) involve only some ranks of a group: they are marked while
waiting (for the hang report) but have no sequence number and no fingerprint.
"""

from __future__ import annotations

import json
import linecache
import math
import os
import sys
import threading
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _state as _jobs
from ._errors import CollectiveError, is_comm_error

_F = torch.ops._c10d_functional
# _comm.untracked, spelled here because _comm imports this module (the import graph stays acyclic)
_untracked = torch._C.DisableTorchFunction

__all__: list[str] = []

DEFAULT_HANG_REPORT = 60.0  # seconds a rank waits in one collective before it reports
_PREFIX = "fshard/hang/"  # the store keys of the hang report (a prefix of their own)
_ANSWER_WAIT = 2.5  # seconds a report waits for the other ranks' answers
_STACK_FRAMES = 8  # frames of a missing rank's stack shown
_DESC_BYTES = 512  # a collective's description, as exchanged on a fingerprint mismatch
_FSHARD_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_AUTOGRAD_DIR = os.path.join(_TORCH_DIR, "autograd") + os.sep


_TAG_LEVELS = {  # FSHARD_DESYNC_TAGS -> (all-reduce tags, all-gathered tags of the other collectives)
    "0": (False, False),
    "off": (False, False),
    "reduce": (True, False),
    "1": (True, True),
    "all": (True, True),
}


class _State:
    """This rank's collective state: written by the thread that issues collectives, read by the
    watchdog. A record is a tuple ``(seq, kind, names, ranks, shape, dtype, file, line, func, api,
    backward)``."""

    def __init__(self) -> None:
        self.seqs: dict[tuple[int, ...], int] = {}  # ranks of a group -> collectives issued over it
        self.issued: tuple | None = None  # the last collective issued
        self.current: tuple | None = None  # the collective being waited for, or None
        self.since = 0.0  # time.monotonic() when the wait began
        self.done: tuple | None = None  # the last collective waited for
        self.thread = threading.main_thread().ident  # the thread that issues collectives
        self.check = os.environ.get("FSHARD_DEBUG", "") not in ("", "0")  # the fingerprint all-gather
        # the tags sent with the data (see "always on" below). FSHARD_DESYNC_TAGS: "reduce" (the
        # default) tags the all-reduces, in their own buffer, at no measurable cost; "all" (or "1")
        # also all-gathers a tag after every other collective (one more tiny collective each, which
        # costs 5-20 % of an FSDP step on gloo, see benchmarks/RESULTS.md); "0" turns both off.
        level = os.environ.get("FSHARD_DESYNC_TAGS", "reduce").strip().lower()
        if level not in _TAG_LEVELS:
            raise ValueError(
                f"FSHARD_DESYNC_TAGS={level!r} is not one of {', '.join(sorted(_TAG_LEVELS))}: "
                "'reduce' (the default) tags the all-reduces, 'all' every collective, '0' none"
            )
        self.tags, self.gather_tags = _TAG_LEVELS[level]
        self.anonymous = 0  # > 0 inside fs.switch branches: call sites may differ by rank
        self.threshold: float | None = DEFAULT_HANG_REPORT
        self.started = False
        self.reported: tuple | None = None  # the wait already reported
        self.site: tuple | None = None  # the call site of collectives run later (fshard/_combine.py)
        self.epoch = 0  # jobs begun on this rank (`reset`): states of an earlier job are not read


S = _State()


@_jobs.job_state(order=0)
def reset() -> None:
    """Forget the sequence counters (a new job on a pool rank: every rank starts in step)."""
    S.seqs.clear()
    S.issued = S.current = S.done = S.reported = None
    S.epoch += 1


# -- call sites and records ------------------------------------------------------------------

_public: frozenset = frozenset()


def _site() -> tuple:
    """``(file, line, func, api, backward)`` of the first frame outside fshard and torch; ``api``
    is the outermost public fshard function on the way (``psum``), or ``""``."""
    global _public
    if not _public:
        import fshard

        _public = frozenset(fshard.__all__)
    f: Any = sys._getframe(2)
    api = ""
    backward = False
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if name.startswith(_FSHARD_DIR):
            if code.co_name in _public:
                api = code.co_name
        elif name.startswith(_TORCH_DIR):
            if name.startswith(_AUTOGRAD_DIR):
                backward = True
        else:
            return (name, f.f_lineno, code.co_name, api, backward)
        f = f.f_back
    return ("", 0, "", api, backward)


def begin(kind: str, g: Any, t: torch.Tensor, salt: Any = None, what=None) -> tuple:
    """Record the collective of ``t`` about to be issued over the `AxisGroup` ``g`` (and, in debug
    mode, check its fingerprint, with ``salt`` if given, against the other ranks'; ``what()``
    describes the collective's content in the error); returns its record."""
    if not S.started:
        ensure_started()
    ranks = g.global_ranks
    if kind == "ppermute":
        seq = 0
    else:
        seq = S.seqs.get(ranks, 0) + 1
        S.seqs[ranks] = seq
    rec = (seq, kind, g.names, ranks, t.shape, t.dtype, *(S.site or _site()))
    S.issued = rec
    S.thread = threading.get_ident()
    if S.check and seq:
        _fingerprint(rec, g.group, t.device, salt, what)
    return rec


class _World:
    """The world as an `AxisGroup` for `begin` (the default group; ``names`` empty)."""

    names: tuple = ()
    group = None
    backend: str | None = None  # the default group's backend, once asked (``_wire.backend``)

    def __init__(self, size: int):
        self.global_ranks = tuple(range(size))


_worlds: dict[int, _World] = {}


def world_group() -> _World:
    n = dist.get_world_size() if dist.is_initialized() else 1
    w = _worlds.get(n)
    if w is None:
        w = _worlds[n] = _World(n)
    return w


def describe(rec: tuple | None) -> str:
    """``#3 all_reduce (fs.psum) over dp of float32 (4, 2) at train.py:12``."""
    if rec is None:
        return "none"
    seq, kind, names, _, shape, dtype, file, line, _, api, backward = rec
    axes = ",".join(names) or "world"
    num = f"#{seq} " if seq else ""
    via = f" (fs.{api})" if api else ""
    where = f" at {os.path.basename(file)}:{line}" if file else ""
    back = " in the backward" if backward else ""
    dt = str(dtype).replace("torch.", "")
    return f"{num}{kind}{via} over {axes} of {dt} {tuple(shape)}{where}{back}"


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


# -- debug: the fingerprint all-gather ---------------------------------------------------------


def _crc(value: Any) -> int:
    return zlib.crc32(repr(value).encode())


def _gather_rows(row: list[int], group: Any, device, rec: tuple) -> list[list[int]]:
    """Every rank's ``row`` (one all-gather over ``group``, marked as a wait on ``rec``)."""
    with _untracked(), torch.no_grad():
        pg = group if group is not None else dist.group.WORLD
        n = dist.get_world_size(pg)
        t = torch.tensor(row, dtype=torch.int64, device=device)
        out = _F.all_gather_into_tensor.default(t, n, pg.group_name)  # type: ignore[union-attr]
        return wait(_F.wait_tensor.default, rec, out).view(n, len(row)).tolist()


def _each_rank(rec: tuple, group: Any, device, what=None) -> tuple[list[int], str]:
    """Every rank of the group's description of its collective (one all-gather of fixed-size rows):
    the ranks, and one bullet per distinct description, naming the ranks that gave it."""
    text = (describe(rec) + (f", {what()}" if what is not None else "")).encode()[: _DESC_BYTES - 1]
    rows = _gather_rows([dist.get_rank(), *text.ljust(_DESC_BYTES, b"\0")], group, device, rec)
    by: dict[str, list[int]] = {}
    for row in rows:
        by.setdefault(bytes(row[1:]).rstrip(b"\0").decode(errors="replace"), []).append(row[0])
    bullets = "\n".join(
        f"  - {_ranks_text(sorted(r))}: {d}" for d, r in sorted(by.items(), key=lambda kv: min(kv[1]))
    )
    return sorted(row[0] for row in rows), bullets


_ORDER_FIX = (
    "Every rank must issue the same collectives over a group in the same order (op, axes, shape, dtype, "
    "call site): look for a collective in a branch on the rank or on per-rank data (if rank == 0, a loop "
    "whose length differs by rank) and make every rank reach it"
)


def _fingerprint(rec: tuple, group: Any, device, salt: Any = None, what=None) -> None:
    seq, kind, names, ranks, shape, dtype, file, line, *_ = rec
    site = 0 if S.anonymous else _crc((file, line))
    row = [seq, _crc(kind), _crc(names), _crc(str(dtype)), _crc(tuple(shape)), site, _crc(salt)]
    rows = _gather_rows(row, group, device, rec)
    if all(r == rows[0] for r in rows):
        return
    members, bullets = _each_rank(rec, group, device, what)
    raise CollectiveError(
        f"fshard [debug]: the ranks of the group over {','.join(names) or 'world'} ({_ranks_text(members)}) "
        f"disagree about their next collective:\n{bullets}\n"
        f"Nothing was sent: every rank of the group raised this error before the collective. {_ORDER_FIX}"
    )


# -- always on: tags sent with the data ----------------------------------------------------------
#
# A collective's tag ``h`` (a number from its sequence number, op and call site) travels with its
# data, so that ranks that paired different collectives (one rank skipped one: its next psum met
# the others' psum) see it when the collective ends, before its result is returned. An all-reduce
# carries the tag in two more elements of its own buffer (no extra collective): ``h`` and ``h * h``
# (for a sum; ``h`` and ``b - h`` for max and min), whose reductions are ``n * h`` and ``n * h * h``
# only if every rank sent the same ``h`` (the variance of the ``h`` sent is 0), with ``h`` small
# enough that the sums are exact in the buffer's dtype (several digits when it is small, as for
# bfloat16). This part is on by default. Under FSHARD_DESYNC_TAGS=all the other collectives also
# all-gather the tag in a tiny int64 buffer launched right after the data and compare the tags; that
# is one more collective each (5-20 % of a gloo FSDP step), so it is opt-in, and ``fs.debug`` checks
# them all before anything is sent. Tags are read on the host, so only CPU tensors carry them
# (reading a CUDA tag would wait for the device); ``fs.debug`` checks any device.

_EXACT = {  # the integers a sum of this dtype represents exactly
    torch.float64: 2**53,
    torch.float32: 2**24,
    torch.float16: 2**11,
    torch.bfloat16: 2**8,
    torch.int64: 2**62,
    torch.int32: 2**31 - 1,
    torch.int16: 2**15 - 1,
    torch.int8: 2**7 - 1,
    torch.uint8: 2**8 - 1,
}
_TAG_BITS = 20  # a tag tells about a million collectives apart
_bases: dict[tuple, tuple[int, int] | None] = {}


def _base(dtype: torch.dtype, n: int, op: str) -> tuple[int, int] | None:
    """``(base, digits)`` of the tags an all-reduce ``op`` of ``dtype`` over ``n`` ranks carries."""
    key = (dtype, n, op)
    if key not in _bases:
        limit = _EXACT.get(dtype, 0)
        if op == "sum":
            base = math.isqrt(limit // n) if limit else 0
        elif op in ("max", "min"):
            base = limit
        else:  # product, average, bitwise: no tag
            base = 0
        base = min(base, 2**_TAG_BITS)
        if base < 3:
            _bases[key] = None
        else:
            digits = min(8, math.ceil(_TAG_BITS / math.log2(base - 1)))
            _bases[key] = (base, digits)
    return _bases[key]


def tag(rec: tuple) -> int:
    """The tag of collective ``rec``: its sequence number, op and call site (not inside fs.switch)."""
    seq, kind, *_ = rec
    site = () if S.anonymous else rec[6:8]
    return zlib.crc32(repr((seq, kind, site)).encode())


def reduce_tags(rec: tuple, dtype: torch.dtype, n: int, op: str, salt: Any = None) -> list[int] | None:
    """The elements an all-reduce ``op`` of ``dtype`` over ``n`` ranks appends to its buffer for
    ``rec`` (None: this one carries no tag). ``salt`` (a repr-able value every rank must agree on,
    such as what a gradient bucket holds) is mixed into the tag."""
    if not S.tags:
        return None
    bd = _base(dtype, n, op)
    if bd is None:
        return None
    base, digits = bd
    h = tag(rec) if salt is None else zlib.crc32(repr((tag(rec), salt)).encode())
    out: list[int] = []
    for _ in range(digits):
        d = 1 + h % (base - 1)  # 1 .. base - 1
        h //= base - 1
        out += (d, d * d) if op == "sum" else (d, base - d)
    return out


def reduced_tags_agree(got: list, sent: list[int], n: int, op: str) -> bool:
    """Whether the reduced tags ``got`` are what ``n`` ranks sending ``sent`` give."""
    want = [n * v for v in sent] if op == "sum" else sent
    return [int(v) for v in got] == want


def check_reduced_tags(
    got: list, sent: list[int], n: int, op: str, rec: tuple, g: Any, device, what=None
) -> None:
    """After the all-reduce of ``rec``: raise on every rank of the group if the tags disagree
    (``what()``: the collective's content, in each rank's description)."""
    if not reduced_tags_agree(got, sent, n, op):
        _disagreed(rec, g, device, what)


def check_gathered_tags(got: list, rec: tuple, g: Any, device) -> None:
    """After the collective of ``rec`` whose tag was all-gathered: raise if the tags differ."""
    if any(v != got[0] for v in got):
        _disagreed(rec, g, device)


def agree(rec: tuple, g: Any, device, salt: Any, what=None) -> None:
    """Before the data of collective ``rec`` over ``g`` is sent: one all-reduce of its tags (those an
    all-reduce of its own carries, `reduce_tags`, with ``salt``: what the collective holds, such as
    each member of a combined bucket) in a buffer of a fixed size, the same on every rank whatever
    the collective; raises the same `CollectiveError` on every rank of the group if they disagree,
    so that a collective whose sizes differ between ranks is never issued (``what()``: the
    collective's content, in each rank's description)."""
    sent = reduce_tags(rec, torch.int64, len(g.global_ranks), "sum", salt)
    if sent is None:
        return
    pg = g.group if g.group is not None else dist.group.WORLD
    with _untracked(), torch.no_grad():
        t = torch.tensor(sent, dtype=torch.int64, device=device)
        out = _F.all_reduce.default(t, "sum", pg.group_name)  # type: ignore[union-attr]
        got = wait(_F.wait_tensor.default, rec, out).tolist()
    if not reduced_tags_agree(got, sent, len(g.global_ranks), "sum"):
        _disagreed(rec, g, device, what, sent=False)


def _disagreed(rec: tuple, g: Any, device, what=None, sent: bool = True) -> None:
    members, bullets = _each_rank(rec, g.group, device, what)
    when = (
        "Its result was not returned: every rank of the group raised this error when the collective "
        "ended (its tag disagreed)"
        if sent
        else "Nothing was sent: every rank of the group raised this error before the collective (the tags "
        "exchanged before it disagreed)"
    )
    raise CollectiveError(
        f"fshard: the ranks of the group over {','.join(rec[2]) or 'world'} ({_ranks_text(members)}) ran "
        f"different collectives together:\n{bullets}\n"
        f"{when}. {_ORDER_FIX}. fs.debug() (or FSHARD_DEBUG=1) checks each collective "
        f"before it is sent"
    )


# -- waiting ---------------------------------------------------------------------------------


def wait(fn, rec: tuple | None, *args, **kwargs):
    """``fn(*args, **kwargs)``, marked as waiting in collective ``rec``; a timeout becomes a
    `CollectiveError` naming the ranks that did not arrive."""
    S.current, S.since = rec, time.monotonic()
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        err = timed_out(exc, rec)
        if err is None:
            raise
        raise err from exc
    finally:
        S.current, S.done = None, rec


def timed_out(exc: BaseException, rec: tuple | None) -> CollectiveError | None:
    """The error to raise instead of ``exc`` when ``exc`` is the process-group timeout ending the
    wait in ``rec`` (None otherwise): which ranks of the group did not arrive, and where they are."""
    if rec is None or not rec[0] or not _world():
        return None
    waited = time.monotonic() - S.since
    closed = "timed out" not in str(exc).lower()
    if closed and not _closed_by_a_timeout(exc, waited):
        return None
    try:
        states = _collect(_main_store(), rec[3], reached=rec)
    except Exception:  # the store is gone (its host rank has already ended): gloo's error stands
        return None
    missing = _missing(rec, states)
    me = dist.get_rank()
    over = f"{describe(rec)} (over {_ranks_text(rec[3])})"
    head = f"rank {me} timed out after {waited:.0f} s waiting in {over}"
    gave_up = f"timed out waiting for it after {waited:.0f} s"
    if closed:  # a peer timed out first
        head = f"rank {me} stopped waiting after {waited:.0f} s in {over} when a rank that timed out there closed its connection"
        gave_up = f"stopped waiting for it after {waited:.0f} s (a peer that timed out closed the connection)"
    if not missing:
        err = CollectiveError(
            f"{head}; every rank of the group had issued it or a later one, so they disagree about it:\n"
            f"{_states_text(rec, states, [])}\nTurn on fs.debug() (or FSHARD_DEBUG=1) to have each collective "
            f"checked across the ranks before it is issued"
        )
        return err
    where = "; ".join(f"rank {r} {_whereabouts(states.get(r))}" for r in missing)
    text = f"did not arrive at {describe(rec)}, where rank {me} {gave_up}"
    err = CollectiveError(
        f"{head}: {_ranks_text(missing)} did not arrive ({where}). Every rank of a group must reach each of "
        f"its collectives within the timeout (fs.init(timeout=...)): look for work the missing rank does alone "
        f"(data loading, evaluation or saving on one rank), or a collective it skipped"
    )
    # read by the exit hook (fshard._env.write_error_file): the launcher names these ranks
    err.fshard_blame = (missing, text)  # type: ignore[attr-defined]
    return err


def collective_timeout() -> timedelta | None:
    """The timeout of the default process group (whoever made it), or None when unknown.

    fshard gives every group it creates this timeout, so that ``fs.init(timeout=...)`` (or the
    ``timeout`` of ``torch.distributed.init_process_group``) bounds collectives on mesh axes too.
    """
    try:
        pg = dist.distributed_c10d._get_default_group()
        for device in (torch.device("cpu"), torch.device("cuda")):
            if device in pg._device_types:
                timeout = pg._get_backend(device).options._timeout
                if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
                    return timeout
    except Exception:
        pass
    return None


def _closed_by_a_timeout(exc: BaseException, waited: float) -> bool:
    """Whether ``exc`` is a connection that a peer closed when its own wait in the same collective
    timed out: ranks that wait for the same missing rank time out within moments of each other, and
    the first to give up closes its pairs, so the others see a closed connection, not a timeout.
    They must name the missing rank all the same (and do so while the store still serves them)."""
    timeout = collective_timeout()
    return timeout is not None and is_comm_error(exc) and waited >= 0.5 * timeout.total_seconds()


def _whereabouts(state: dict | None) -> str:
    if state is None:
        return "did not answer: its process may have died, or its watchdog is not running"
    if state.get("stale"):
        return f"last answered that it {_whereabouts({**state, 'stale': False})}"
    if state["current"]:
        return f"is waiting in {state['current']} for {state['waited']:.0f} s"
    if state["done"] == "none":
        return f"has finished no fshard collective and is at {state['where']}"
    return f"last finished {state['done']} and is at {state['where']}"


def _missing(rec: tuple, states: dict) -> list[int]:
    """Ranks of ``rec``'s group that have not issued it (no answer counts as missing; a stale answer
    counts as what it says, since a rank's sequence numbers only grow)."""
    return [r for r in rec[3] if r not in states or not _reached(rec, states[r])]


def _reached(rec: tuple, state: dict) -> bool:
    """Whether the rank whose state this is had issued ``rec`` (or a later collective of its group)."""
    return state["seqs"].get(json.dumps(list(rec[3])), 0) >= rec[0]


def _states_text(rec: tuple, states: dict, missing: list[int]) -> str:
    lines = []
    for r in rec[3]:
        state = states.get(r)
        lines.append(f"  rank {r}: {_whereabouts(state)}")
        if r in missing and state is not None and state["stack"]:
            lines += [f"      {frame}" for frame in state["stack"]]
    return "\n".join(lines)


# -- the watchdog ----------------------------------------------------------------------------


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_stores: dict[str, Any] = {}


def _store(which: str):
    """A connection of its own to the rendezvous store, per thread (``which``)."""
    store = _stores.get(which)
    if store is None:
        store = _stores[which] = dist.distributed_c10d._get_default_store().clone()  # type: ignore[attr-defined]
    return store


def _main_store():
    return _store("main")


def configure(hang_report: float | None) -> None:
    """Set the hang-report threshold (None: no report) and start the watchdog."""
    S.threshold = hang_report
    ensure_started()


def ensure_started() -> None:
    """Start this rank's watchdog thread (once per process; only in a world of several ranks)."""
    if S.started or not _world():
        return
    S.started = True
    _stores.clear()
    _stop.clear()
    thread = threading.Thread(target=_watch, args=(dist.get_rank(),), daemon=True, name="fshard-watchdog")
    thread.start()
    _thread[0] = thread
    if not _stop_hooked:
        import atexit

        atexit.register(stop)  # fs.init's exit hook also stops it, before tearing the groups down
        globals()["_stop_hooked"] = True


_stop = threading.Event()
_stop_hooked = False
_thread: list[threading.Thread | None] = [None]


def stop(timeout: float = 2.0) -> None:
    """Stop the watchdog thread and close its store connections (at exit: before the process
    groups are torn down and the interpreter shuts down). Idempotent."""
    _stop.set()
    thread, _thread[0] = _thread[0], None
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=timeout)
    _stores.clear()
    S.started = False


def _watch(rank: int) -> None:
    try:
        store = _store("watchdog")
    except Exception:
        S.started = False
        return
    seen = -1
    failures = 0
    while True:
        threshold = S.threshold
        if _stop.wait(0.5 if threshold is None else min(0.5, max(0.05, threshold / 4))):
            _stores.pop("watchdog", None)
            return
        try:
            req = int(store.add(_PREFIX + "req", 0))
            if req != seen:
                _answer(store, rank, req)
                seen = req
            rec, since = S.current, S.since
            if (
                rec is not None
                and threshold is not None
                and rec is not S.reported
                and time.monotonic() - since >= threshold
            ):
                S.reported = rec
                states = _collect(store, rec[3])
                _print_report(rank, rec, since, states)
            failures = 0
        except Exception:  # the store is gone (the job is ending): stop after a few tries
            failures += 1
            if failures >= 5:
                S.started = False
                return


def _state(rank: int, req: int) -> dict:
    rec, since, done = S.current, S.since, S.done
    frames = sys._current_frames().get(S.thread or 0)
    stack: list[str] = []
    where = "an unknown place"
    if frames is not None:
        import traceback

        summary = traceback.extract_stack(frames)
        stack = [
            f'File "{fr.filename}", line {fr.lineno}, in {fr.name}: {fr.line}'
            for fr in summary[-_STACK_FRAMES:]
        ]
        user = [fr for fr in summary if not fr.filename.startswith((_FSHARD_DIR, _TORCH_DIR))]
        if user:
            fr = user[-1]
            code = fr.line or linecache.getline(fr.filename, fr.lineno or 0).strip()
            where = f"{os.path.basename(fr.filename)}:{fr.lineno} in {fr.name}: {code}"
    return {
        "rank": rank,
        "req": req,
        "epoch": S.epoch,
        "seqs": {json.dumps(list(k)): v for k, v in S.seqs.items()},
        "current": describe(rec) if rec is not None else None,
        "waited": time.monotonic() - since if rec is not None else 0.0,
        "done": describe(done),
        "where": where,
        "stack": stack,
    }


def _answer(store, rank: int, req: int) -> None:
    store.set(f"{_PREFIX}state/{rank}", json.dumps(_state(rank, req)))


def _collect(store, ranks: tuple, reached: tuple | None = None) -> dict[int, dict]:
    """Ask every rank for its state; wait (up to `_ANSWER_WAIT` s) for the answers of ``ranks``.

    Requests other ranks post meanwhile are answered too (they may be collecting at the same time).
    A rank that does not answer is given the state it last posted in this job, marked ``stale``: a
    rank whose collective just failed (its connection closed by a peer that timed out) may have
    ended already, and the sequence numbers it posted earlier still tell that it had reached the
    collective (they only grow), so that it is not named as a rank that did not arrive. With
    ``reached`` (a record), the wait ends once every rank not known to have reached it answered."""
    me = dist.get_rank()
    req = answered = int(store.add(_PREFIX + "req", 1))
    _answer(store, me, req)
    states: dict[int, dict] = {}
    deadline = time.monotonic() + _ANSWER_WAIT
    while True:
        latest = int(store.add(_PREFIX + "req", 0))
        if latest > answered:
            _answer(store, me, latest)
            answered = latest
        stale: dict[int, dict] = {}
        for r in ranks:
            if r in states:
                continue
            key = f"{_PREFIX}state/{r}"
            if store.check([key]):
                state = json.loads(store.get(key))
                if state["req"] >= req:
                    states[r] = state
                elif state.get("epoch") == S.epoch:
                    stale[r] = {**state, "stale": True}
        waiting = [r for r in ranks if r not in states]
        if reached is not None:
            waiting = [r for r in waiting if r not in stale or not _reached(reached, stale[r])]
        if not waiting or time.monotonic() >= deadline:
            return {**stale, **states}
        time.sleep(0.05)


def _print_report(rank: int, rec: tuple, since: float, states: dict) -> None:
    """The hang report: in full from the lowest rank of the group that is waiting (the others print
    one line pointing to it, so that a job prints one report per group, not one per waiting rank)."""
    missing = _missing(rec, states)
    if missing:
        verdict = f"{_ranks_text(missing)} of the group {'have' if len(missing) > 1 else 'has'} not arrived"
    else:
        verdict = "every rank of the group has issued it or a later one: they disagree about it"
    head = (
        f"fshard: rank {rank} has waited {time.monotonic() - since:.0f} s in {describe(rec)} "
        f"(over {_ranks_text(rec[3])}); {verdict}"
    )
    lead = min(
        [rank, *(r for r in rec[3] if r in states and states[r]["current"] and not states[r].get("stale"))]
    )
    if lead == rank:
        text = f"{head}:\n{_states_text(rec, states, missing)}\n"
    else:
        text = f"{head} (rank {lead} prints where every rank is)\n"
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:
        pass


class anonymous_sites:
    """Inside ``fs.switch`` branches each rank runs its own code: call sites are not compared."""

    def __enter__(self) -> None:
        S.anonymous += 1

    def __exit__(self, *exc) -> None:
        S.anonymous -= 1
