"""Ranks that disagree about collectives get a clear error, never a silent wrong value or hang.

* debug mode (``fs.debug()``): a rank that skips a collective, or issues another one (an
  all_gather where its peers psum, of the same or of another size; ``async_op=True`` too), makes
  every rank of the group raise the same `CollectiveError` before anything is sent (no wrong value,
  no gloo abort), on 1- and 2-axis meshes; values are checked against plain torch;
* always: a rank stuck outside a collective is named, with its stack line, by a hang report once
  the others have waited ``hang_report`` seconds, then by the error that ends the wait at the
  timeout, and by the launcher's last line (``python -m fshard.run``; ``fs.RankPool``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fshard as fs
from fshard._errors import RankError
from fshard._launch import RankPool
from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parent.parent
HERE = os.path.basename(__file__)
BOUND = 30.0  # seconds: each hang below (timeout 6 s) must end well within this


def _line(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, text in enumerate(lines) if text.endswith(f"# {marker}"))


FIX = (
    "Nothing was sent: every rank of the group raised this error before the collective. Every rank must "
    "issue the same collectives over a group in the same order (op, axes, shape, dtype, call site): look "
    "for a collective in a branch on the rank or on per-rank data (if rank == 0, a loop whose length "
    "differs by rank) and make every rank reach it"
)


def _desync_message(axes, ranks, groups):
    bullets = "\n".join(f"  - {who}: {what}" for who, what in groups)
    return (
        f"fshard [debug]: the ranks of the group over {axes} ({ranks}) disagree about their next "
        f"collective:\n{bullets}\n{FIX}"
    )


# -- debug mode: a mismatch raises on every rank of the group, before anything is sent -------------


def _rank_disagreements(X):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}

    def attempt(name, mesh, spec, f):
        def debugged(x):
            with fs.debug():
                return f(x)

        try:
            out[name] = ("value", fs.shard_map(debugged, mesh=mesh, in_specs=spec, out_specs=spec)(X).local)
        except fs.CollectiveError as err:
            out[name] = ("error", str(err))

    dp = fs.Mesh(dp=4)

    def skip(x):
        a = fs.psum(x, "dp") if rank != 2 else x  # skip-first
        return fs.psum(a, "dp") * 1.0  # skip-second

    def other_op(x):
        return fs.all_gather(x, "dp", dim=0, tiled=True)[:4] if rank == 2 else fs.psum(x, "dp")  # other-op

    def other_size(x):
        return fs.all_gather(x[:1], "dp", dim=0, tiled=True) if rank == 2 else fs.psum(x, "dp")  # other-size

    def other_async(x):
        if rank == 2:
            pending = fs.psum_scatter(x, "dp", dim=0, tiled=True, async_op=True)  # async-scatter
            return pending.wait().repeat(4)
        return fs.all_gather(x, "dp", dim=0, tiled=True, async_op=True).wait()[:4]  # async-gather

    for name, f in (
        ("skip", skip),
        ("other_op", other_op),
        ("other_size", other_size),
        ("async", other_async),
    ):
        attempt(name, dp, "(dp b)", f)

    mesh2 = fs.Mesh(dp=2, tp=2)

    def skip_tp(x):
        a = fs.psum(x, "tp") if rank != 2 else x  # tp-first
        return fs.psum(a * 2.0, "tp")  # tp-second

    attempt("skip_tp", mesh2, "(dp tp b)", skip_tp)

    def agree(x):  # the same collectives on every rank, different values: no false alarm
        return fs.all_gather(fs.psum(x, "dp"), "dp", dim=0, tiled=True, async_op=True).wait()[:4]

    attempt("agree", dp, "(dp b)", agree)
    return out


def test_disagreeing_collectives_raise_on_every_rank_of_the_group_before_sending():
    X = torch.arange(16.0)
    start = time.monotonic()
    got = run_ranks(4, _rank_disagreements, X)
    assert time.monotonic() - start < BOUND
    f32 = "float32 (4,)"
    world = "ranks 0, 1, 2, 3"

    def at(marker):
        return f"at {HERE}:{_line(marker)}"

    expected = {
        "skip": _desync_message(
            "dp",
            world,
            [
                ("ranks 0, 1, 3", f"#1 all_reduce (fs.psum) over dp of {f32} {at('skip-first')}"),
                ("rank 2", f"#1 all_reduce (fs.psum) over dp of {f32} {at('skip-second')}"),
            ],
        ),
        "other_op": _desync_message(
            "dp",
            world,
            [
                ("ranks 0, 1, 3", f"#2 all_reduce (fs.psum) over dp of {f32} {at('other-op')}"),
                ("rank 2", f"#2 all_gather (fs.all_gather) over dp of {f32} {at('other-op')}"),
            ],
        ),
        "other_size": _desync_message(
            "dp",
            world,
            [
                ("ranks 0, 1, 3", f"#3 all_reduce (fs.psum) over dp of {f32} {at('other-size')}"),
                ("rank 2", f"#3 all_gather (fs.all_gather) over dp of float32 (1,) {at('other-size')}"),
            ],
        ),
        "async": _desync_message(
            "dp",
            world,
            [
                ("ranks 0, 1, 3", f"#4 all_gather (fs.all_gather) over dp of {f32} {at('async-gather')}"),
                # the shape handed to the collective: x split into one block per rank
                (
                    "rank 2",
                    f"#4 reduce_scatter (fs.psum_scatter) over dp of float32 (4, 1) {at('async-scatter')}",
                ),
            ],
        ),
    }
    for name, message in expected.items():
        assert got[0][name] == ("error", message), name
        assert all(got[r][name] == ("error", message) for r in range(4)), name  # the same on every rank
    # 2-axis mesh: only rank 2's tp group (ranks 2, 3) disagrees; ranks 0, 1 get the right value.
    tp_message = _desync_message(
        "tp",
        "ranks 2, 3",
        [
            ("rank 2", f"#1 all_reduce (fs.psum) over tp of {f32} {at('tp-second')}"),
            ("rank 3", f"#1 all_reduce (fs.psum) over tp of {f32} {at('tp-first')}"),
        ],
    )
    assert [g["skip_tp"][0] for g in got] == ["value", "value", "error", "error"]
    assert got[2]["skip_tp"][1] == got[3]["skip_tp"][1] == tp_message
    blocks = X.reshape(2, 2, 4)  # [dp, tp, b]: each dp row's tp blocks summed, twice (times 2)
    want = (blocks.sum(1, keepdim=True) * 2 * 2).expand(2, 2, 4)  # psum(psum(x) * 2) = 2 * 2 * sum
    for r in (0, 1):  # rank r is at dp=0, tp=r
        torch.testing.assert_close(got[r]["skip_tp"][1], want[0, r])
    # Agreeing ranks pass the check: the all-gathered psum is the global sum of every block, 4 times.
    total = X.reshape(4, 4).sum(0)
    for r in range(4):
        assert got[r]["agree"][0] == "value"
        torch.testing.assert_close(got[r]["agree"][1], total)


# -- always on: a skipped collective is caught when it ends, by the tags sent with the data ----------

TAG_FIX = (
    "Its result was not returned: every rank of the group raised this error when the collective ended (its "
    "tag disagreed). Every rank must issue the same collectives over a group in the same order (op, axes, "
    "shape, dtype, call site): look for a collective in a branch on the rank or on per-rank data (if rank "
    "== 0, a loop whose length differs by rank) and make every rank reach it. fs.debug() (or "
    "FSHARD_DEBUG=1) checks each collective before it is sent"
)


def _tag_message(axes, ranks, groups):
    bullets = "\n".join(f"  - {who}: {what}" for who, what in groups)
    return f"fshard: the ranks of the group over {axes} ({ranks}) ran different collectives together:\n{bullets}\n{TAG_FIX}"


def _rank_skips_without_debug(X):
    from fshard import _watchdog as _wd
    from tests.helpers import env_vars

    assert (_wd.S.tags, _wd.S.gather_tags) == (True, False)  # the default: all-reduces carry tags
    # the tags sent with each uncombined collective; combined ones are checked before they are sent,
    # whatever they hold (tests/test_combine_agreement.py)
    with env_vars(FSHARD_COMBINE="0"):
        saved, _wd.S.gather_tags = _wd.S.gather_tags, True  # opt-in for the rest (FSHARD_DESYNC_TAGS=all)
        try:
            out = _rank_skips_body(X)
        finally:
            _wd.S.gather_tags = saved
        # the all-reduce cases again with the defaults: caught without debug mode and without the opt-in
        again = _rank_skips_body(X, kinds=("psum", "pmax", "psum_bf16", "skip_tp", "agree"))
    return out, again


def _rank_skips_body(X, kinds=None):
    import torch.distributed as dist

    from fshard import _watchdog

    rank = dist.get_rank()
    out = {}

    def attempt(name, mesh, spec, f, x=X):
        if kinds is not None and name not in kinds:
            return
        _watchdog.reset()  # every case starts at collective #1 on every rank
        try:
            out[name] = ("value", fs.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)(x).local)
        except fs.CollectiveError as err:
            out[name] = ("error", str(err))

    dp = fs.Mesh(dp=4)

    def skip_psum(x):
        a = fs.psum(x, "dp") if rank != 2 else x  # tag-psum-first
        return fs.psum(a, "dp") * 1.0  # tag-psum-second

    def skip_pmax(x):
        a = fs.pmax(x, "dp") if rank != 0 else x  # tag-pmax-first
        return fs.pmax(a + 1.0, "dp")  # tag-pmax-second

    def skip_gather(x):
        a = fs.all_gather(x, "dp", dim=0, tiled=True)[4:8] if rank != 3 else x  # tag-gather-first
        return fs.all_gather(a, "dp", dim=0, tiled=True)[:4]  # tag-gather-second

    def skip_scatter(x):
        a = fs.psum_scatter(x, "dp", dim=0, tiled=True).repeat(4) if rank != 1 else x  # tag-scatter-first
        pending = fs.psum_scatter(a, "dp", dim=0, tiled=True, async_op=True)  # tag-scatter-second
        return pending.wait().repeat(4)

    for name, f in (
        ("psum", skip_psum),
        ("pmax", skip_pmax),
        ("gather", skip_gather),
        ("scatter", skip_scatter),
    ):
        attempt(name, dp, "(dp b)", f)
    attempt("psum_bf16", dp, "(dp b)", skip_psum, X.to(torch.bfloat16))

    mesh2 = fs.Mesh(dp=2, tp=2)

    def skip_tp(x):
        a = fs.psum(x, "tp") if rank != 3 else x  # tag-tp-first
        return fs.psum(a * 2.0, "tp")  # tag-tp-second

    attempt("skip_tp", mesh2, "(dp tp b)", skip_tp)

    def agree(x):  # every collective on every rank, per-rank values: no false alarm, values intact
        s = fs.psum(x, "dp") + fs.pmax(x, "dp") + fs.psum(x.to(torch.bfloat16), "dp").float()
        g = fs.all_gather(x, "dp", dim=0, tiled=True)[:4]
        return s + g + fs.psum_scatter(x.repeat(4), "dp", dim=0, tiled=True) + fs.all_to_all(x, "dp", 0, 0)

    attempt("agree", dp, "(dp b)", agree)
    return out


def test_a_skipped_collective_raises_on_every_rank_without_debug_mode():
    X = torch.arange(16.0)
    start = time.monotonic()
    results = run_ranks(4, _rank_skips_without_debug, X)
    assert time.monotonic() - start < BOUND
    got = [r[0] for r in results]
    for r, (first, again) in enumerate(results):  # the all-reduces: the same with the default tags only
        assert sorted(again) == ["agree", "pmax", "psum", "psum_bf16", "skip_tp"], r
        for k, (kind, v) in again.items():
            assert kind == first[k][0], (r, k)
            if kind == "error":
                assert v == first[k][1], (r, k)
            else:
                torch.testing.assert_close(v, first[k][1])
    world = "ranks 0, 1, 2, 3"

    def at(marker):
        return f"at {HERE}:{_line(marker)}"

    def pair(op, api, dtype, marker):
        return f"#1 {op} (fs.{api}) over dp of {dtype} (4,) {at(marker)}"

    expected = {
        "psum": [
            ("ranks 0, 1, 3", pair("all_reduce", "psum", "float32", "tag-psum-first")),
            ("rank 2", pair("all_reduce", "psum", "float32", "tag-psum-second")),
        ],
        "pmax": [
            ("rank 0", pair("all_reduce", "pmax", "float32", "tag-pmax-second")),
            ("ranks 1, 2, 3", pair("all_reduce", "pmax", "float32", "tag-pmax-first")),
        ],
        "gather": [
            ("ranks 0, 1, 2", pair("all_gather", "all_gather", "float32", "tag-gather-first")),
            ("rank 3", pair("all_gather", "all_gather", "float32", "tag-gather-second")),
        ],
        "scatter": [
            (
                "ranks 0, 2, 3",
                f"#1 reduce_scatter (fs.psum_scatter) over dp of float32 (4, 1) {at('tag-scatter-first')}",
            ),
            (
                "rank 1",
                f"#1 reduce_scatter (fs.psum_scatter) over dp of float32 (4, 1) {at('tag-scatter-second')}",
            ),
        ],
        "psum_bf16": [
            ("ranks 0, 1, 3", pair("all_reduce", "psum", "bfloat16", "tag-psum-first")),
            ("rank 2", pair("all_reduce", "psum", "bfloat16", "tag-psum-second")),
        ],
    }
    for name, groups in expected.items():
        message = _tag_message("dp", world, groups)
        assert [g[name] for g in got] == [("error", message)] * 4, name  # the same on every rank
    # 2-axis mesh: only rank 3's tp group (ranks 2, 3) disagrees; ranks 0, 1 get the right value.
    tp_message = _tag_message(
        "tp",
        "ranks 2, 3",
        [
            ("rank 2", f"#1 all_reduce (fs.psum) over tp of float32 (4,) {at('tag-tp-first')}"),
            ("rank 3", f"#1 all_reduce (fs.psum) over tp of float32 (4,) {at('tag-tp-second')}"),
        ],
    )
    assert [g["skip_tp"][0] for g in got] == ["value", "value", "error", "error"]
    assert got[2]["skip_tp"][1] == got[3]["skip_tp"][1] == tp_message
    blocks = X.reshape(2, 2, 4)  # [dp, tp, b]
    want = blocks.sum(1, keepdim=True) * 2 * 2  # psum(psum(x) * 2)
    for r in (0, 1):
        torch.testing.assert_close(got[r]["skip_tp"][1], want[0, 0])
    # Agreeing ranks: the values of plain torch on the global tensor.
    B = X.reshape(4, 4)  # row r: rank r's block
    for r in range(4):
        assert got[r]["agree"][0] == "value"
        scatter = B.sum(0)  # psum_scatter of x.repeat(4): block r of the sum, the sum of the blocks
        a2a = B[:, r]  # all_to_all(split 0, concat 0): element r of every rank's block
        want = B.sum(0) + B.max(0).values + B.sum(0) + B[0] + scatter + a2a  # psum in bf16: exact integers
        torch.testing.assert_close(got[r]["agree"][1], want)


# -- a rank stuck outside a collective: hang report, timeout error, launcher -------------------------

STUCK_SCRIPT = """
import time, torch
import torch.distributed as dist
import fshard as fs

fs.init(timeout=6, hang_report=2)
mesh = fs.Mesh(dp=2, tp=2)

@fs.shard_map(mesh=mesh, in_specs="(dp tp b)", out_specs="b")
def total(x):
    return fs.psum(x, ("dp", "tp"))

x = torch.arange(8.0)
print(total(x).tolist(), flush=True)
if dist.get_rank() == 2:
    print(f"sleeping at t={time.time():.3f}", flush=True)
    time.sleep(60)  # stuck in its own data loading
print(total(x).tolist(), flush=True)
"""


def _clean_env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


# -- gradient buckets: an input f uses on some ranks only ----------------------------------------------

BUCKET_SHAPES = {"a": (6, 20), "b": (6, 20), "c": (6, 20), "d": (6, 20), "e": (6, 30)}


def _rank_bucket_plans(X):
    import contextlib

    import torch.distributed as dist

    from fshard import _watchdog

    rank = dist.get_rank()
    mesh = fs.Mesh(dp=dist.get_world_size())
    gen = torch.Generator().manual_seed(5)
    init = {k: torch.randn(*s, generator=gen, dtype=torch.float64) / 3 for k, s in BUCKET_SHAPES.items()}
    out = {}

    def attempt(name, used, bucket_mb, debug=False, skew=False):
        params = {k: v.clone().requires_grad_(True) for k, v in init.items()}

        def f(p, x):
            total = 0
            for k in used[rank]:  # which inputs f uses depends on the rank
                total = total + (x @ p[k]).sin().sum()  # bucket-term
            return fs.psum(total, "dp")

        step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
        _watchdog.reset()  # every case starts at collective #1 on every rank
        try:
            with fs.debug() if debug else contextlib.nullcontext():
                loss = step(params, X)
                if skew and rank == 1:  # as if rank 1 had issued one more collective over dp
                    ranks = mesh.axis_group("dp").global_ranks
                    _watchdog.S.seqs[ranks] += 1
                loss.backward()  # bucket-backward
            out[name] = ("grads", {k: p.grad for k, p in params.items()})
        except fs.CollectiveError as err:
            out[name] = ("error", str(err))

    one = 1500 / 2**20  # one bucket per parameter
    # same sizes: every rank sends three buckets, the first holds c on rank 0 and d on the others
    swapped = {r: ("a", "b", "c") if r == 0 else ("a", "b", "d") for r in range(4)}
    attempt("swapped", swapped, one)
    attempt("swapped_one_bucket", swapped, 25.0)
    attempt("swapped_unbucketed", swapped, None)  # one all-reduce per input: its key path in the tags
    # debug mode: checked before sending, also where the sizes differ (e used by rank 0 only)
    attempt("debug_extra", {r: ("a", "e") if r == 0 else ("a",) for r in range(4)}, 25.0, debug=True)
    attempt("agree", {r: ("a", "b", "e") for r in range(4)}, one)  # no false alarm
    attempt("agree_unbucketed", {r: ("a", "b", "e") for r in range(4)}, None)
    # the same buckets, but the ranks count their collectives differently: the other message
    attempt("skew", {r: ("a", "b") for r in range(4)}, 25.0, skew=True)
    return out


def test_an_input_used_on_some_ranks_only_raises_instead_of_summing_misaligned_buckets():
    world = 2
    X = torch.randn(8, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    start = time.monotonic()
    got = run_ranks(world, _rank_bucket_plans, X)
    assert time.monotonic() - start < BOUND
    f = "_rank_bucket_plans.<locals>.attempt.<locals>.f"
    where = f"at {HERE}:{_line('bucket-backward')} in the backward"

    def mismatch(held):
        return (
            f"fshard: the ranks of the group over dp (ranks 0, 1) reduced different gradients together in one "
            f"bucket: this rank's bucket held the gradients of {held} (inputs of {f}), another rank's bucket "
            "held other inputs (the tags sent with it disagreed); its result was not returned. Each rank "
            "buckets the gradients of the inputs f used with values varying over dp in that backward, so an "
            "input that f uses on some ranks only (a Python branch on the rank or on per-rank data: `if rank "
            "== 0: loss = loss + g(w)`) is reduced by those ranks alone. Use every input on every rank alike: "
            "select with torch.where, or scale the term by a 0/1 tensor"
        )

    for name in ("swapped", "swapped_one_bucket"):
        held = (
            ["args[0]['c']", "args[0]['d']"]
            if name == "swapped"
            else [
                "args[0]['c'], args[0]['b'], args[0]['a']",
                "args[0]['d'], args[0]['b'], args[0]['a']",
            ]
        )
        for r in range(world):
            assert got[r][name] == ("error", mismatch(held[r])), (name, r)
    # (#4: fs.debug's checks of the two inputs, then f's psum, come first)
    debug = _desync_message(
        "dp",
        "ranks 0, 1",
        [
            (
                "rank 0",
                f"#4 all_reduce over dp of float64 (300,) {where}, a bucket of the gradients of "
                f"args[0]['e'], args[0]['a'] (inputs of {f})",
            ),
            (
                "rank 1",
                f"#4 all_reduce over dp of float64 (120,) {where}, a bucket of the gradients of "
                f"args[0]['a'] (inputs of {f})",
            ),
        ],
    )
    assert [g["debug_extra"] for g in got] == [("error", debug)] * world
    unbucketed = _tag_message(
        "dp",
        "ranks 0, 1",
        [
            (f"rank {r}", f"#2 all_reduce over dp of float64 (6, 20) {where}, the gradient of args[0]['{k}']")
            for r, k in ((0, "c"), (1, "d"))
        ],
    )
    assert [g["swapped_unbucketed"] for g in got] == [("error", unbucketed)] * world
    for r in range(world):
        seq = 2 + r  # f's psum was #1; rank 1 counted one more
        assert got[r]["skew"] == (
            "error",
            f"fshard: the ranks of the group over dp (ranks 0, 1) ran different collectives together: this rank's "
            f"#{seq} all_reduce over dp of float64 (240,) {where}, a bucket of the gradients of "
            f"args[0]['b'], args[0]['a'] (inputs of {f}), met another collective on another rank (the tags sent "
            f"with it disagreed); its result was not returned. {FIX.split('. ', 1)[1]}. fs.debug() (or FSHARD_DEBUG=1) "
            "checks each collective before it is sent",
        ), r
    # agreeing ranks: the gradients of one process on the whole batch
    p = {k: v.clone().requires_grad_(True) for k, v in _bucket_init().items()}
    sum((X @ p[k]).sin().sum() for k in ("a", "b", "e")).backward()
    for r in range(world):
        for case in ("agree", "agree_unbucketed"):
            kind, grads = got[r][case]
            assert kind == "grads", (case, grads)
            for k in ("a", "b", "e"):
                torch.testing.assert_close(grads[k], p[k].grad, msg=f"rank {r} {case} {k}")
            assert grads["c"] is None and grads["d"] is None


def _bucket_init():
    gen = torch.Generator().manual_seed(5)
    return {k: torch.randn(*s, generator=gen, dtype=torch.float64) / 3 for k, s in BUCKET_SHAPES.items()}


def test_fshard_run_names_the_rank_that_did_not_arrive(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "-n", "4", str(script)],
        env=_clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=110,
    )
    slept = float(re.search(r"sleeping at t=([0-9.]+)", out.stdout).group(1))
    assert time.time() - slept < BOUND, out.stderr  # the 6 s timeout, not the 60 s sleep
    assert out.returncode == 1, out.stderr
    assert out.stdout.count("[12.0, 16.0]") == 4  # the first psum, on every rank
    src = STUCK_SCRIPT.splitlines()
    at_psum, at_sleep = (
        next(i + 1 for i, t in enumerate(src) if t.lstrip().startswith(s)) for s in ("return", "time")
    )
    psum = f"#2 all_reduce (fs.psum) over dp,tp of float32 (2,) at stuck.py:{at_psum}"
    # The hang report of a waiting rank (every waiting rank prints one; rank 0 is among them).
    report = re.search(r"fshard: rank 0 has waited \d+ s in (.*)\n((?:  .*\n)+)", out.stderr)
    assert report is not None, out.stderr
    assert report.group(1) == f"{psum} (over ranks 0, 1, 2, 3); rank 2 of the group has not arrived:"
    lines = report.group(2).splitlines()
    waiting = f"is waiting in {psum} for"
    assert [line.split(" for ")[0] for line in lines[:2]] == [
        f"  rank 0: {waiting[:-4]}",
        f"  rank 1: {waiting[:-4]}",
    ]
    assert lines[2] == (
        f"  rank 2: last finished #1 all_reduce (fs.psum) over dp,tp of float32 (2,) at stuck.py:{at_psum} and is at "
        f"stuck.py:{at_sleep} in <module>: time.sleep(60)  # stuck in its own data loading"
    )
    assert lines[3] == (
        f'      File "{script}", line {at_sleep}, in <module>: time.sleep(60)  # stuck in its own data loading'
    )
    assert lines[4].startswith(f"  rank 3: {waiting} ")
    # One full report: the other waiting ranks point to rank 0's.
    assert len(re.findall(r"^fshard: rank \d has waited .*:$", out.stderr, re.M)) == 1, out.stderr
    pointers = re.findall(r"^fshard: rank (\d) has waited \d+ s in (.*)$", out.stderr, re.M)
    assert sorted(r for r, _ in pointers if r != "0") == ["1", "3"], out.stderr
    for r, rest in pointers:
        if r != "0":
            assert (
                rest
                == f"{psum} (over ranks 0, 1, 2, 3); rank 2 of the group has not arrived (rank 0 prints where every rank is)"
            )
    # The error that ends the wait names rank 2; so does the launcher's last line. (A rank whose
    # wait a faster peer's timeout ended says so: see the test below.)
    over = rf"{re.escape(psum)} \(over ranks 0, 1, 2, 3\)"
    TIMED_OUT = rf"timed out after \d+ s waiting in {over}"
    CLOSED = rf"stopped waiting after \d+ s in {over} when a rank that timed out there closed its connection"
    assert re.search(
        rf"fshard\.CollectiveError: rank \d (?:{TIMED_OUT}|{CLOSED}): rank 2 did not arrive \(rank 2 last finished #1 all_reduce \(fs\.psum\) over dp,tp of "
        rf"float32 \(2,\) at stuck\.py:{at_psum} and is at stuck\.py:{at_sleep} in <module>: time\.sleep\(60\)  # stuck in its "
        r"own data loading\)\. Every rank of a group must reach each of its collectives within the timeout "
        r"\(fs\.init\(timeout=\.\.\.\)\): look for work the missing rank does alone \(data loading, evaluation "
        r"or saving on one rank\), or a collective it skipped\n",
        out.stderr,
    ), out.stderr
    launcher = [line for line in out.stderr.splitlines() if line.startswith("fshard.run:")]
    assert len(launcher) == 1, out.stderr
    assert re.fullmatch(
        rf"fshard\.run: rank 2 \(pid \d+\) did not arrive at {re.escape(psum)}, where rank \d (?:timed out "
        r"waiting for it after \d+ s|stopped waiting for it after \d+ s \(a peer that timed out closed the "
        r"connection\)); terminating it and the \d other running rank\(s\)",
        launcher[0],
    ), out.stderr


RACE_SCRIPT = """
import time, torch
import torch.distributed as dist
import fshard as fs

fs.init(timeout=6, hang_report=30)
mesh = fs.Mesh(dp=2, tp=2)

@fs.shard_map(mesh=mesh, in_specs="(dp tp b)", out_specs="b")
def total(x):
    return fs.psum(x, ("dp", "tp"))  # psum

x = torch.arange(8.0)
print(total(x).tolist(), flush=True)
if dist.get_rank() == 2:
    time.sleep(60)  # stuck
if dist.get_rank() == 0:
    time.sleep(2.5)  # late: rank 1 times out first and closes its connections
print(total(x).tolist(), flush=True)
"""


def test_a_rank_whose_wait_a_faster_timeout_ended_names_the_missing_rank_too(tmp_path):
    # Ranks waiting for the same missing rank time out moments apart; the first to give up closes
    # its connections, so the others get gloo's "Connection closed by peer", not a timeout. They
    # must name the missing rank all the same, or the launcher (which names the first rank that
    # recorded a root cause) blames a victim. Here rank 0 arrives 2.5 s late, so rank 1 times out first.
    script = tmp_path / "race.py"
    script.write_text(RACE_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "-n", "4", str(script)],
        env=_clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 1, out.stderr
    psum = f"#2 all_reduce (fs.psum) over dp,tp of float32 (2,) at race.py:{_src_line(RACE_SCRIPT, 'psum')}"
    stuck = f"race.py:{_src_line(RACE_SCRIPT, 'stuck')} in <module>: time.sleep(60)  # stuck"
    where = f"rank 2 last finished #1 {psum[3:]} and is at {stuck}"
    closed = re.search(r"fshard\.CollectiveError: rank 0 stopped waiting after (\d+) s in (.*)\n", out.stderr)
    assert closed is not None, out.stderr
    assert 2 <= int(closed.group(1)) <= 5, out.stderr  # 6 s less the 2.5 s it arrived late
    assert closed.group(2) == (
        f"{psum} (over ranks 0, 1, 2, 3) when a rank that timed out there closed its connection: rank 2 did not "
        f"arrive ({where}). Every rank of a group must reach each of its collectives within the timeout "
        f"(fs.init(timeout=...)): look for work the missing rank does alone (data loading, evaluation or saving "
        f"on one rank), or a collective it skipped"
    )
    assert "Connection closed by peer" not in out.stderr.splitlines()[-1]
    launcher = [line for line in out.stderr.splitlines() if line.startswith("fshard.run:")]
    assert len(launcher) == 1, out.stderr
    # The ranks that raised may have exited before the launcher looks, so it terminates 0 to 2 of them.
    assert re.fullmatch(
        rf"fshard\.run: rank 2 \(pid \d+\) did not arrive at {re.escape(psum)}, where rank [01] "
        r"(?:timed out waiting for it after \d+ s|stopped waiting for it after \d+ s \(a peer that timed out "
        r"closed the connection\)); terminating it and the [0-2] other running rank\(s\)",
        launcher[0],
    ), out.stderr


def _rank_stuck_before_async_gather():
    import torch.distributed as dist

    fs.init(hang_report=2)  # the world exists: only the hang-report threshold is set
    mesh = fs.Mesh(dp=2)

    def f(x):
        if dist.get_rank() == 1:
            time.sleep(20)  # stuck-in-pool
        return fs.all_gather(x, "dp", dim=0, tiled=True, async_op=True).wait()  # pool-gather

    return fs.shard_map(f, mesh=mesh, in_specs="(dp b)", out_specs="b")(torch.arange(4.0))


def test_rank_pool_names_the_rank_that_did_not_arrive_at_an_async_collective():
    with RankPool(2, collective_timeout=6) as pool:
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            pool.run(_rank_stuck_before_async_gather, timeout=60)
        assert time.monotonic() - start < BOUND
    gather = f"#1 all_gather (fs.all_gather) over dp of float32 (2,) at {HERE}:{_line('pool-gather')}"
    stuck = f"{HERE}:{_line('stuck-in-pool')} in f: time.sleep(20)  # stuck-in-pool"
    first = str(info.value).splitlines()[0]
    assert re.fullmatch(
        rf"rank 0 \(of 2\) raised fshard\.CollectiveError: rank 0 timed out after \d+ s waiting in {re.escape(gather)} "
        rf"\(over ranks 0, 1\): rank 1 did not arrive \(rank 1 has finished no fshard collective and is at "
        rf"{re.escape(stuck)}\)\. Every rank of a group must reach each of its collectives within the timeout "
        r"\(fs\.init\(timeout=\.\.\.\)\): look for work the missing rank does alone \(data loading, evaluation "
        r"or saving on one rank\), or a collective it skipped",
        first,
    ), first
    assert "rank(s) [1] were still running" in str(info.value)


def test_hang_report_must_be_a_positive_number():
    with pytest.raises(fs.FshardError) as info:
        fs.init(hang_report=0)
    assert str(info.value) == (
        "fshard.init(): hang_report must be a positive number of seconds (or None for no report), got 0"
    )


# -- a 3-axis mesh (8 ranks) and torchrun -------------------------------------------------------------

EIGHT_SCRIPT = """
import json, os, time, torch
import torch.distributed as dist
import fshard as fs
import fshard._collectives, fshard._shard_map  # a first call's imports, before the rendezvous (below)

# The rendezvous lets every rank go on together; the collectives before the stuck one then start
# within a second of each other even on a busy machine, well within the timeout.
fs.init(timeout=10, hang_report=2)
rank = dist.get_rank()
open(os.path.join(os.environ["PID_DIR"], str(rank)), "w").write(str(os.getpid()))
mesh = fs.Mesh(dp=2, tp=2, pp=2)
x = torch.arange(16.0)

def skip(x):
    a = fs.psum(x, "tp") if rank != 5 else x  # first
    return fs.psum(a, "tp")  # second

try:
    y = fs.shard_map(skip, mesh=mesh, in_specs="(dp tp pp b)", out_specs="(dp tp pp b)")(x)
    result = ["value", y.local.tolist()]
except fs.CollectiveError as err:
    result = ["error", str(err)]
open(os.path.join(os.environ["PID_DIR"], f"result{rank}"), "w").write(json.dumps(result))

@fs.shard_map(mesh=mesh, in_specs="(dp tp pp b)", out_specs="(tp b)")
def total(x):
    return fs.psum(x, ("dp", "pp"))  # total

if rank in (5, 6):
    print(f"sleeping at t={time.time():.3f}", flush=True)
    time.sleep(60)  # stuck
print(total(x).tolist(), flush=True)
"""


def _src_line(script: str, marker: str) -> int:
    return next(i + 1 for i, t in enumerate(script.splitlines()) if t.endswith(f"# {marker}"))


def _assert_gone(pid_dir: Path, n: int) -> None:
    pids = [int((pid_dir / str(r)).read_text()) for r in range(n)]
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "zombie" not in _status(pid)]
        time.sleep(0.1)
    assert not alive, f"ranks left behind: {alive}"


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.mark.timeout(180)  # 8 ranks start in tens of seconds on 2 busy cores; the bound is asserted below
def test_a_3_axis_mesh_names_the_skipping_rank_and_every_rank_that_did_not_arrive(tmp_path):
    script = tmp_path / "eight.py"
    script.write_text(EIGHT_SCRIPT)
    env = {**_clean_env(), "PID_DIR": str(tmp_path), "FSHARD_DESYNC_TAGS": "1"}  # the opt-in tags
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "-n", "8", str(script)],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=170,
    )
    slept = max(float(t) for t in re.findall(r"sleeping at t=([0-9.]+)", out.stdout))
    assert time.time() - slept < BOUND, out.stderr
    assert out.returncode == 1, out.stderr
    _assert_gone(tmp_path, 8)
    # The skipped psum over tp: rank 5's group (ranks 5, 7) raises; every other rank has plain torch's value.
    got = {r: tuple(json.loads((tmp_path / f"result{r}").read_text())) for r in range(8)}
    first, second = (_src_line(EIGHT_SCRIPT, m) for m in ("first", "second"))
    # combined (the default): checked before it is sent, whatever each rank's bucket holds
    message = _tag_message(
        "tp",
        "ranks 5, 7",
        [
            (
                "rank 5",
                f"#1 all_reduce (fs.psum) over tp of float32 (2,) at eight.py:{second}, combining 1 call of psum: (2,)",
            ),
            (
                "rank 7",
                f"#1 all_reduce (fs.psum) over tp of float32 (2,) at eight.py:{first}, combining 1 call of psum: (2,)",
            ),
        ],
    ).replace(
        "Its result was not returned: every rank of the group raised this error when the collective ended (its "
        "tag disagreed)",
        "Nothing was sent: every rank of the group raised this error before the collective (the tags exchanged "
        "before it disagreed)",
    )
    B = torch.arange(16.0).reshape(2, 2, 2, 2)  # [dp, tp, pp, b]
    for r in range(8):
        dp, pp = r // 4, r % 2
        if r in (5, 7):
            assert got[r] == ("error", message)
        else:
            assert got[r][0] == "value"
            torch.testing.assert_close(torch.tensor(got[r][1]), 2 * B[dp, :, pp].sum(0))
    # Ranks 5 and 6 sleep before the psum over (dp, pp): one hang report per group, the rest point to it.
    psum = (
        f"#1 all_reduce (fs.psum) over dp,pp of float32 (2,) at eight.py:{_src_line(EIGHT_SCRIPT, 'total')}"
    )
    full = re.findall(r"^fshard: rank (\d) has waited \d+ s in (.*):$", out.stderr, re.M)
    assert sorted(full) == [
        ("0", f"{psum} (over ranks 0, 1, 4, 5); rank 5 of the group has not arrived"),
        ("2", f"{psum} (over ranks 2, 3, 6, 7); rank 6 of the group has not arrived"),
    ], out.stderr
    pointers = re.findall(
        r"^fshard: rank (\d) has waited \d+ s in .*\(rank (\d) prints where every rank is\)$",
        out.stderr,
        re.M,
    )
    assert sorted(pointers) == [("1", "0"), ("3", "2"), ("4", "0"), ("7", "2")], out.stderr
    launcher = [line for line in out.stderr.splitlines() if line.startswith("fshard.run:")]
    assert len(launcher) == 1, out.stderr
    assert re.fullmatch(
        rf"fshard\.run: ranks 5 \(pid \d+\), 6 \(pid \d+\) did not arrive at {re.escape(psum)}, where rank \d "
        r"(?:timed out waiting for it after \d+ s|stopped waiting for it after \d+ s \(a peer that timed out "
        r"closed the connection\)); terminating them and the \d other running rank\(s\)",
        launcher[0],
    ), out.stderr


TORCHRUN_SCRIPT = """
import os, time, torch
import torch.distributed as dist
import fshard as fs
import fshard._collectives, fshard._shard_map  # a first call's imports, before the rendezvous (below)

fs.init(timeout=10, hang_report=2)
rank = dist.get_rank()
open(os.path.join(os.environ["PID_DIR"], str(rank)), "w").write(str(os.getpid()))
mesh = fs.Mesh(dp=4)

@fs.shard_map(mesh=mesh, in_specs="(dp b)", out_specs="b")
def total(x):
    return fs.psum(x, "dp")  # total

# Every rank's first call (its planning) before one rank is stuck: the others then reach the next
# psum together, well within the 2 s of the hang report.
total(torch.arange(8.0))
if rank == 1:
    print(f"sleeping at t={time.time():.3f}", flush=True)
    time.sleep(60)  # stuck
print(total(torch.arange(8.0)).tolist(), flush=True)
"""


@pytest.mark.timeout(180)  # start-up on 2 busy cores; the bound is asserted below
def test_torchrun_names_the_rank_that_did_not_arrive(tmp_path):
    script = tmp_path / "under_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**_clean_env(), "PID_DIR": str(tmp_path), "FSHARD_DESYNC_TAGS": "1"}  # the opt-in tags
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(script),
    ]
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=170)
    slept = float(re.search(r"sleeping at t=([0-9.]+)", out.stdout).group(1))
    assert time.time() - slept < BOUND, out.stderr
    assert out.returncode != 0, out.stderr
    _assert_gone(tmp_path, 4)
    site = f"of float32 (2,) at under_torchrun.py:{_src_line(TORCHRUN_SCRIPT, 'total')}"
    psum, first = f"#2 all_reduce (fs.psum) over dp {site}", f"#1 all_reduce (fs.psum) over dp {site}"
    stuck = f"under_torchrun.py:{_src_line(TORCHRUN_SCRIPT, 'stuck')} in <module>: time.sleep(60)  # stuck"
    where = f"last finished {first} and is at {stuck}"
    full = re.findall(r"^fshard: rank (\d) has waited \d+ s in (.*):$", out.stderr, re.M)
    assert full == [("0", f"{psum} (over ranks 0, 1, 2, 3); rank 1 of the group has not arrived")], out.stderr
    assert f"  rank 1: {where}\n" in out.stderr
    errors = re.findall(
        r"fshard\.CollectiveError: rank (\d) timed out after \d+ s waiting in (.*)\n", out.stderr
    )
    assert errors, out.stderr
    for _, rest in errors:
        assert rest == (
            f"{psum} (over ranks 0, 1, 2, 3): rank 1 did not arrive (rank 1 {where}). Every rank of a group must reach each of its collectives within the timeout "
            f"(fs.init(timeout=...)): look for work the missing rank does alone (data loading, evaluation or "
            f"saving on one rank), or a collective it skipped"
        )


def _tags_setting(value):
    env = {k: v for k, v in os.environ.items() if k != "FSHARD_DESYNC_TAGS"}
    if value is not None:
        env["FSHARD_DESYNC_TAGS"] = value
    code = "from fshard import _watchdog as w; print(w.S.tags, w.S.gather_tags)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "value, want",
    [
        (None, "True False"),
        ("reduce", "True False"),
        ("all", "True True"),
        ("1", "True True"),
        ("0", "False False"),
    ],
)
def test_desync_tags_setting(value, want):
    out = _tags_setting(value)
    assert out.stdout.strip() == want, out.stderr


def test_desync_tags_setting_error():
    out = _tags_setting("yes")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: FSHARD_DESYNC_TAGS='yes' is not one of 0, 1, all, off, reduce: 'reduce' (the default) "
        "tags the all-reduces, 'all' every collective, '0' none"
    )


def test_a_rank_that_no_longer_answers_counts_as_what_it_last_answered():
    # A rank whose connection a peer's timeout closed may have ended before the timed-out rank asks
    # where everyone is: the sequence numbers it posted earlier (they only grow) still tell whether
    # it had reached the collective, so it is not named as a rank that did not arrive.
    from fshard import _watchdog as wd

    rec = (3, "all_reduce", ("dp",), (0, 1, 2, 3), (2,), torch.float32, "t.py", 7, "f", "psum", False)
    key = json.dumps([0, 1, 2, 3])

    def state(seq, current, stale):
        return {
            "seqs": {key: seq},
            "current": wd.describe(rec) if current else None,
            "waited": 2.0,
            "done": "#2 all_reduce (fs.psum) over dp of float32 (2,) at t.py:7",
            "where": "t.py:9 in <module>: load()",
            "stack": [],
            "stale": stale,
        }

    states = {0: state(3, True, False), 1: state(3, True, True), 2: state(2, False, True)}
    assert wd._missing(rec, states) == [2, 3]  # rank 2's last answer predates it; rank 3 never answered
    assert wd._whereabouts(states[1]) == (
        "last answered that it is waiting in #3 all_reduce (fs.psum) over dp of float32 (2,) at t.py:7 for 2 s"
    )
    assert wd._whereabouts(states[2]) == (
        "last answered that it last finished #2 all_reduce (fs.psum) over dp of float32 (2,) at t.py:7 and is "
        "at t.py:9 in <module>: load()"
    )
