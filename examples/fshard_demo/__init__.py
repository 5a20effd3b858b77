"""fshard's flagship demo: a small GPT learns 3-digit addition, trained with dp x tp on local ranks.

An application built on fshard, not part of the library: it installs as the top-level package
``fshard_demo`` (console script ``fshard-demo``) from ``examples/fshard_demo/``.

The model is a GPT-style decoder written as pure functions over a parameter pytree. The loss and
its gradients are computed inside one ``fs.shard_map``: Megatron tensor parallelism splits the
attention heads and the MLP over ``tp`` (one ``fs.psum`` after the attention output and one after
the MLP output), the batch is split over ``dp``, and every gradient collective follows from the
specs; none is written by hand. Clipping (``fs.optim.clip_by_global_norm``) and AdamW
(``fs.optim.adamw``) then update the Sharded parameters leaf by leaf, each in its own layout.

The task is generated at run time (no download): ``"123+456="`` followed by the digits of the
sum in reverse order (``"9750"`` for 579), loss on the answer tokens only. One pair of operands
in 20 never appears in training; the held-out exact-match accuracy is measured on those pairs
by greedy decoding. Batches are a function of the step, so a resumed run sees the same data.

Run (each command runs the same code; without RANK in the environment the program relaunches
itself on ``--nprocs`` local ranks with ``python -m fshard.run``)::

    fshard-demo                                        # 4 ranks, dp=2 x tp=2, 800 steps
    python -m fshard_demo                              # the same
    python examples/train_gpt.py --layout fsdp_tp      # also FSDP (ZeRO-3) over dp
    python -m fshard.run -n 4 examples/train_gpt.py    # explicit launcher
    torchrun --nproc-per-node 4 examples/train_gpt.py  # or torchrun
    fshard-demo --check-reference                      # compare every loss with a 1-process run

    # stop half way, then resume on another mesh shape: the loss curve continues
    fshard-demo --out run1 --stop-after 400
    fshard-demo --out run1 --resume --dp 1 --tp 4

    # after a failure, restart every rank (up to 2 times): they resume from the latest checkpoint
    fshard-demo --max-restarts 2

Layouts (``--layout``): ``dp_tp`` (default: Megatron TP over tp, data parallel over dp),
``fsdp_tp`` (the same, with every parameter and its optimizer state also split over dp and
all-gathered inside the step), ``dp`` (pure data parallel), ``fsdp`` (pure FSDP).

``--check-reference`` trains the same steps again in one process (a 1x1 mesh: the same code
with every collective a no-op) and compares every step's loss. Float32 rounding differs between
the two and training amplifies it exponentially, so the 1-process run restarts from the sharded
run's state every ``--ref-every`` steps; the largest difference must stay below ``--tolerance``.

Outputs in ``--out``: ``ckpt/step_*`` (sharded checkpoints, `fshard.checkpoint`),
``metrics.json`` (losses, evaluations, resumes) and ``loss.png`` (the loss curve).

Modules: :mod:`~fshard_demo.model` (the parameters, their specs, the forward pass and the loss,
as pure functions of a :class:`~fshard_demo.model.Config`), :mod:`~fshard_demo.data` (the task),
:mod:`~fshard_demo.train` (the steps, the training loop, checkpoints, the reference check),
:mod:`~fshard_demo.plot` (the loss curve) and :mod:`~fshard_demo.cli` (flags, relaunch, ``main``).
"""

from .cli import main
from .data import Task
from .model import Config, forward, fsdp_dims, init_params, loss_fn, param_specs
from .train import make_eval_step, make_train_step

__all__ = [
    "Config",
    "Task",
    "forward",
    "fsdp_dims",
    "init_params",
    "loss_fn",
    "main",
    "make_eval_step",
    "make_train_step",
    "param_specs",
]
