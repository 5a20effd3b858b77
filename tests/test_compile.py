"""``torch.compile`` traces fshard's communication layer (``fshard/_comm.py``), on real gloo ranks.

The collectives that torch has as functional ops (all-reduce, all-gather, reduce-scatter,
all-to-all, broadcast, and the asynchronous ``*_start`` forms) are issued through
``torch.ops._c10d_functional`` with ``wait_tensor``, so ``torch.compile(fullgraph=True)`` captures
them in one graph. One compiled function per rank (compilation is the slow part): its values are
compared with the same computation done by plain torch on the global tensors in one process, and
with the eager call; the captured ATen graph must hold the functional collectives.
"""

from __future__ import annotations

import torch

from tests.conftest import run_ranks

N = 2  # ranks
K = 6  # elements per rank

# The functional ops the compiled function must issue, by name, with how many of each.
EXPECTED_OPS = {
    "all_reduce": 3,  # sum, max, and the in-place all_reduce_ (traced functionally, + copy_)
    "all_reduce_": 0,
    "all_gather_into_tensor": 2,  # all_gather_blocks and all_gather_start
    "reduce_scatter_tensor": 2,  # reduce_scatter_blocks and reduce_scatter_start
    "all_to_all_single": 1,
    "broadcast": 1,
}


def _data(r: int) -> torch.Tensor:
    return torch.arange(K, dtype=torch.float64) * (r + 1) + 10 * r


def _body(x: torch.Tensor, g):
    from fshard import _comm

    blocks = x.reshape(N, K // N)  # block j goes to index j
    gathered = _comm.all_gather_start(x * 2, g)  # asynchronous: waited below
    scattered = _comm.reduce_scatter_start(blocks + 1, g)
    buf = x.clone()
    _comm.all_reduce_(buf, g)
    return (
        _comm.all_reduce(x, g),
        _comm.all_reduce(x, g, torch.distributed.ReduceOp.MAX),
        _comm.all_gather_blocks(x, g),
        _comm.reduce_scatter_blocks(blocks, g),
        _comm.all_to_all_blocks(blocks, g),
        _comm.broadcast(x, g, 1),
        gathered.wait(),
        scattered.wait(),
        buf,
    )


def _rank_compile_comm():
    import torch.distributed as dist
    from torch._dynamo.backends.common import aot_autograd

    import fshard as fs

    mesh = fs.Mesh(dp=N)
    g = mesh.axis_group("dp")
    x = _data(dist.get_rank())
    ops: list[str] = []

    graphs = 0

    def capture(gm, example_inputs):  # the ATen graph AOTAutograd hands to a compiler, run as is
        nonlocal graphs
        graphs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function" and "_c10d_functional" in str(node.target):
                ops.append(str(node.target).split(".")[-2])
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(_body, backend=aot_autograd(fw_compiler=capture), fullgraph=True)
    with fs.count_collectives() as eager_counts:
        eager = _body(x, g)
    with fs.count_collectives() as compiled_counts:
        got = compiled(x, g)
    with fs.count_collectives() as again_counts:
        again = compiled(x + 1, g)  # a second call runs the compiled graph
    return {
        "eager": [t.tolist() for t in eager],
        "compiled": [t.tolist() for t in got],
        "again": [t.tolist() for t in again],
        "ops": ops,
        "eager_counts": eager_counts.records,
        "compiled_counts": compiled_counts.records,
        "again_counts": again_counts.records,
        "graphs": graphs,
    }


def _reference(xs: list[torch.Tensor]) -> list[list]:
    """The same collectives done by plain torch on the global data (rank r holds ``xs[r]``)."""
    X = torch.stack(xs)  # [N, K]
    B = X.reshape(N, N, K // N)  # [rank, block, K // N]
    per_rank = []
    for r in range(N):
        per_rank.append(
            [
                X.sum(0).tolist(),
                X.max(0).values.tolist(),
                X.tolist(),
                B[:, r].sum(0).tolist(),
                B[:, r].tolist(),  # row i: the block index i sent to r
                X[1].tolist(),
                (2 * X).tolist(),
                (B[:, r] + 1).sum(0).tolist(),
                X.sum(0).tolist(),
            ]
        )
    return per_rank


def test_compile_traces_comm_collectives_in_one_graph():
    got = run_ranks(N, _rank_compile_comm, timeout=110)
    want = _reference([_data(r) for r in range(N)])
    want_again = _reference([_data(r) + 1 for r in range(N)])
    for r in range(N):
        assert got[r]["eager"] == want[r]
        assert got[r]["compiled"] == want[r]
        assert got[r]["again"] == want_again[r]
        counts = {name: got[r]["ops"].count(name) for name in EXPECTED_OPS}
        assert counts == EXPECTED_OPS, got[r]["ops"]
        assert got[r]["ops"].count("wait_tensor") == sum(EXPECTED_OPS.values())
        assert got[r]["graphs"] == 1  # one graph, compiled once
        # count_collectives sees the compiled collectives as it sees the eager ones
        assert got[r]["compiled_counts"] == got[r]["eager_counts"] == got[r]["again_counts"]
        assert len(got[r]["eager_counts"]) == 9
