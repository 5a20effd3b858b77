"""Collectives stay on their side of the forward/backward split of a compiled graph, on every rank.

Inductor's min-cut partitioner computes in the forward whatever the forward's inputs alone reach.
In a backward where one rank's operand of a collective does not depend on the incoming gradient
(a zero block: a rank that only receives in a ``fs.ppermute`` chain gives its weight and input
blocks zero gradients), that rank's collective moved into its forward while the other ranks ran
it in their backward: the ranks paired different collectives and hung (or returned wrong rows).
fshard tags every backward collective ``must_be_in_backward`` for the partitioner
(``_compile.keep_collectives_in_place``).

Each case runs a chain permutation (rank 0 only sends, the last rank only receives) with a
replicated weight that needs a gradient, compiled with inductor's partitioning: the partitioned
graphs' collectives must be the same on every rank, and values and gradients equal eager's and
one process's. ``inductor`` is the real backend (code generation included);
``inductor partition`` runs inductor's decompositions, joint-graph passes and min-cut
partitioner without code generation (the part that moved collectives), and reports the graphs.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

ROWS, D = 8, 4


def _partition_backend(log: list):
    """aot_autograd with inductor's decompositions, joint-graph passes and partitioner; the
    collectives of the forward and backward graphs appended to ``log``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    def compiler(which):
        def compile_graph(gm, example_inputs):
            log.append(
                (
                    which,
                    [
                        str(n.target).split(".")[1]
                        for n in gm.graph.nodes
                        if n.op == "call_function"
                        and "_c10d_functional" in str(n.target)
                        and "wait_tensor" not in str(n.target)
                    ],
                )
            )
            return gm.forward

        return compile_graph

    def partition(joint, inputs, **kwargs):
        return min_cut_rematerialization_partition(joint_graph_passes(joint), inputs, **kwargs)

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=partition,
        decompositions=select_decomp_table(),
    )


def _rank_chain(backend_name: str):
    import fshard as fs

    torch._dynamo.reset()
    n = torch.distributed.get_world_size()
    mesh = fs.Mesh(dp=n)
    chain = [(i, i + 1) for i in range(n - 1)]
    f = fs.shard_map(
        lambda w, x: fs.ppermute(torch.tanh(x @ w), "dp", chain),
        mesh=mesh,
        in_specs=("...", "(dp b) d"),
        out_specs="(dp b) d",
    )
    W, X = randn(0, D, D) / 2, randn(1, ROWS, D)
    weights = torch.linspace(0.5, 1.5, ROWS * D).view(ROWS, D)
    rows = ROWS // n

    def run(fn):
        w, x = W.clone().requires_grad_(), X.clone().requires_grad_()
        y = fn(w, x)
        y = fs.full(y) if isinstance(y, fs.Sharded) else y
        gw, gx = torch.autograd.grad((y * weights).sum(), (w, x))
        return y.detach(), gw, gx

    def reference(w, x):  # block i goes to block i + 1; block 0 receives zeros
        return torch.cat([torch.zeros(rows, D), torch.tanh(x @ w)[: ROWS - rows]])

    log: list = []
    backend = _partition_backend(log) if backend_name == "inductor partition" else "inductor"
    errs: list[str] = []
    want, eager = run(reference), run(f)
    got = run(torch.compile(f, backend=backend, fullgraph=True))
    for what, e, g, r in zip(("value", "grad w", "grad x"), eager, got, want):
        close(errs, f"eager {what} vs one process", e, r)
        close(errs, f"{backend_name} {what} vs one process", g, r)
    return errs, log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["inductor partition", "inductor"])
def test_backward_collectives_stay_in_the_backward_on_every_rank(backend):
    got = run_ranks(4, _rank_chain, backend, timeout=280)
    assert_ok([errs for errs, _ in got])
    if backend == "inductor partition":
        logs = [log for _, log in got]
        # the forward holds the chain's all-to-all only; the backward the inverse chain, the
        # weight's gradient all-reduce and the input's gradient all-gather: on every rank
        assert logs[0] == [
            ("forward", ["all_to_all_single"]),
            ("backward", ["all_to_all_single", "all_reduce", "all_gather_into_tensor"]),
        ], logs[0]
        assert all(log == logs[0] for log in logs), logs
