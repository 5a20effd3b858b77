"""fshard benchmark suite.

Run from the repository root::

    python -m benchmarks.run --world 2            # full run (a few minutes)
    python -m benchmarks.run --world 2 4          # both world sizes, one report
    python -m benchmarks.run --world 2 --smoke    # tiny CI run (< 60 s)
    python -m benchmarks.run --world 2 --verify   # check every contender against a reference first

Layout:

* ``common.py``    -- the context every contender gets (``Ctx``), what it returns (``Prepared``),
                      shared weights/data, single-process references, small helpers.
* ``contenders.py`` -- one function per contender per benchmark + the ``CONTENDERS`` registry
                      and the benchmark cases (sizes, step counts).
* ``fshard_contenders.py`` -- where the fshard contenders go (one function per benchmark).
* ``gpt.py``       -- the demo's GPT (``fshard_demo.model``) benchmarks: weights, data, the plain-torch
                      reference, the ``nn.Module`` and the torch contenders (floor, DDP, FSDP2, DTensor).
* ``timing.py``    -- interleaved timing (wall + main-thread CPU), collective counting, memory.
* ``report.py``    -- RESULTS.md and results.png.
* ``run.py``       -- the entry point: spawns the ranks, runs everything, writes the report.
"""
