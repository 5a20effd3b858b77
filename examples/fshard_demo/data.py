"""The task: 3-digit addition, generated at run time (no download).

``"123+456="`` followed by the digits of the sum in reverse order (``"9750"`` for 579); the loss
is on the answer tokens only. One pair of operands in 20 never appears in training; the
held-out exact-match accuracy is measured on those pairs by greedy decoding. Batches are a
function of the step, so a resumed run sees the same data.
"""

from __future__ import annotations

import torch

__all__ = ["EQUALS", "PLUS", "Task"]

PLUS, EQUALS = 10, 11  # tokens 0-9 are the digits


class Task:
    """``a+b=`` then the digits of ``a + b`` reversed, as tokens; one pair in 20 is held out.

    Training operands have 1 to ``digits`` digits (each length equally likely), so short
    problems teach the model early which digits line up, and training has no long loss
    plateau; the held-out evaluation uses operands drawn uniformly below ``10**digits``.
    Batches are a pure function of ``(seed, step)``, so a resumed run sees the same data.

    Examples:
        >>> t = Task(digits=3)
        >>> t.render(t.encode(torch.tensor([123]), torch.tensor([456]))[0])
        '123+456=9750'
    """

    def __init__(self, digits: int = 3, seed: int = 0):
        self.digits = digits
        self.seed = seed
        self.high = 10**digits

    def held_out(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Whether the pair ``(a, b)`` belongs to the held-out split (about 1 in 20)."""
        h = (a * 1_000_003 + b * 998_244_353 + 12345) % 1_000_000_007
        return (h * 48271 % 2_147_483_647) % 20 == 0

    def _digits(self, x: torch.Tensor, n: int) -> torch.Tensor:
        powers = 10 ** torch.arange(n - 1, -1, -1)
        return (x[:, None] // powers) % 10

    def encode(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n = a.shape[0]
        d = self.digits
        return torch.cat(
            [
                self._digits(a, d),
                torch.full((n, 1), PLUS),
                self._digits(b, d),
                torch.full((n, 1), EQUALS),
                self._digits(a + b, d + 1).flip(1),
            ],
            dim=1,
        )

    def _pairs(self, seed: int, n: int, held_out: bool):
        g = torch.Generator().manual_seed(seed)
        got_a, got_b, have = [], [], 0
        while have < n:
            if held_out:  # uniform below 10**digits
                a = torch.randint(0, self.high, (4 * n,), generator=g)
                b = torch.randint(0, self.high, (4 * n,), generator=g)
            else:  # a random length from 1 to digits, then uniform below 10**length
                a, b = (
                    (
                        torch.rand(4 * n, generator=g, dtype=torch.float64)
                        * 10.0 ** torch.randint(1, self.digits + 1, (4 * n,), generator=g)
                    ).long()
                    for _ in range(2)
                )
            keep = self.held_out(a, b) == held_out
            got_a.append(a[keep])
            got_b.append(b[keep])
            have += int(keep.sum())
        return torch.cat(got_a)[:n], torch.cat(got_b)[:n]

    def batch(self, step: int, size: int) -> torch.Tensor:
        """The training batch of ``step``: ``(size, seq_len)`` tokens, never a held-out pair."""
        a, b = self._pairs(self.seed * 1_000_003 + step, size, held_out=False)
        return self.encode(a, b)

    def eval_set(self, size: int) -> torch.Tensor:
        """``size`` held-out problems (fixed for a seed)."""
        a, b = self._pairs(self.seed * 1_000_003 - 1, size, held_out=True)
        return self.encode(a, b)

    def render(self, tokens) -> str:
        chars = "0123456789+="
        return "".join(chars[int(t)] if int(t) < len(chars) else "?" for t in tokens)
