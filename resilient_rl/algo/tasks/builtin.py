"""Built-in synthetic tasks: copy, reverse and arith over the char vocabulary :data:`VOCAB_CHARS`.

Examples are generated lazily and independently per index from ``(seed, stream, index)``: ``example(i)`` costs
O(1) whatever ``num_prompts`` is, any worker can rebuild any example without the others, and growing
``num_prompts`` keeps the existing examples unchanged. Duplicate prompts are possible (e.g. ``max_len=1``
has only 10 distinct digit strings); they are not removed, so ``len(task) == num_prompts`` always.
"""

from __future__ import annotations

import numpy as np

from resilient_rl.algo.tasks.base import Example, RewardResult, Task
from resilient_rl.algo.tasks.rewards import positional_credit

# Salts separate the example streams from other users of the job seed (e.g. the sampler's permutations), so
# the same seed does not produce correlated draws in unrelated places.
_STREAM_COPY = 0x636F7079  # "copy"; also used by reverse so copy and reverse share digit strings for a seed
_STREAM_ARITH = 0x61726974  # "arit"


def _digits(rng: np.random.Generator, length: int, *, leading_nonzero: bool = False) -> str:
    """A string of ``length`` random decimal digits; with ``leading_nonzero`` a multi-digit string has no
    leading zero (so an arith operand really has ``length`` digits)."""
    ds = rng.integers(0, 10, size=length)
    if leading_nonzero and length > 1:
        ds[0] = rng.integers(1, 10)
    return "".join(str(int(d)) for d in ds)


class _DigitTask(Task):
    """Shared size / length bookkeeping for the digit-string tasks."""

    def __init__(self, name: str, *, seed: int, min_len: int, max_len: int, num_prompts: int) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}..{max_len}")
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        super().__init__(name)
        self.seed = seed
        self.min_len = min_len
        self.max_len = max_len
        self.num_prompts = num_prompts

    def __len__(self) -> int:
        return self.num_prompts

    def _rng(self, stream: int, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream, index])

    def _length(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.min_len, self.max_len + 1))


class CopyTask(_DigitTask):
    """``copy:<digits>=`` -> ``<digits>``; dense per-character reward."""

    def __init__(self, *, seed: int, min_len: int, max_len: int, num_prompts: int) -> None:
        super().__init__("copy", seed=seed, min_len=min_len, max_len=max_len, num_prompts=num_prompts)

    def _make_example(self, index: int) -> Example:
        rng = self._rng(_STREAM_COPY, index)
        digits = _digits(rng, self._length(rng))
        return Example(index=index, prompt=f"copy:{digits}=", answer=digits)

    def reward(self, example: Example, completion: str) -> RewardResult:
        return RewardResult(positional_credit(example.answer, completion))


class ReverseTask(_DigitTask):
    """``rev:<digits>=`` -> the digits reversed; dense per-character reward."""

    def __init__(self, *, seed: int, min_len: int, max_len: int, num_prompts: int) -> None:
        super().__init__("reverse", seed=seed, min_len=min_len, max_len=max_len, num_prompts=num_prompts)

    def _make_example(self, index: int) -> Example:
        rng = self._rng(_STREAM_COPY, index)
        digits = _digits(rng, self._length(rng))
        return Example(index=index, prompt=f"rev:{digits}=", answer=digits[::-1])

    def reward(self, example: Example, completion: str) -> RewardResult:
        return RewardResult(positional_credit(example.answer, completion))


class ArithTask(_DigitTask):
    """``<a>+<b>=`` -> ``str(a + b)``, each operand with ``min_len..max_len`` digits (drawn independently).

    Reward: exact match of the completion (trailing whitespace stripped) or, with ``partial=True``, the same
    left-aligned per-character credit as copy.
    """

    def __init__(self, *, seed: int, min_len: int, max_len: int, num_prompts: int, partial: bool = False) -> None:
        super().__init__("arith", seed=seed, min_len=min_len, max_len=max_len, num_prompts=num_prompts)
        self.partial = partial

    def _make_example(self, index: int) -> Example:
        rng = self._rng(_STREAM_ARITH, index)
        # Python ints: operands may have up to 64 digits, beyond numpy's int64.
        a = int(_digits(rng, self._length(rng), leading_nonzero=True))
        b = int(_digits(rng, self._length(rng), leading_nonzero=True))
        return Example(index=index, prompt=f"{a}+{b}=", answer=str(a + b))

    def reward(self, example: Example, completion: str) -> RewardResult:
        if self.partial:
            return RewardResult(positional_credit(example.answer, completion))
        return RewardResult(1.0 if completion.rstrip() == example.answer else 0.0)
