"""Train a small GPT on 3-digit addition with fshard: Megatron tensor parallel x data parallel.

Run from the repository root (the same program as the ``fshard-demo`` console script)::

    python examples/train_gpt.py                        # 4 local ranks, dp=2 x tp=2 (relaunches itself)
    python examples/train_gpt.py --layout fsdp_tp       # also shard parameters and optimizer state over dp
    python -m fshard.run -n 4 examples/train_gpt.py     # explicit launcher
    torchrun --nproc-per-node 4 examples/train_gpt.py   # or torchrun
    python examples/train_gpt.py --check-reference      # compare every loss with a 1-process run

    # stop half way, then resume on another mesh shape: the loss curve continues
    python examples/train_gpt.py --out run1 --stop-after 400
    python examples/train_gpt.py --out run1 --resume --dp 1 --tp 4

The model, the task and the training loop live in the package ``examples/fshard_demo/``
(``model.py``, ``data.py``, ``train.py``, ``cli.py``); ``--help`` lists the options.
"""

import os
import sys

if __name__ == "__main__":
    # This file's directory (first on sys.path) holds the `fshard_demo` package; make `import
    # fshard` work from a source checkout without installing it.
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fshard_demo.cli import main

    sys.exit(main())
