"""Training/eval data: GSM8K-format examples from local files or the built-in synthetic generator, and a
resumable, seeded batch iterator.

``load_examples("synthetic", "train")`` -> the generator (``"synthetic:word"`` picks the task inline);
``load_examples("/data/gsm8k", "test")`` -> the GSM8K loader (see ``stalerl.data.gsm8k``).

It may import only ``stalerl.core`` (the answer normaliser of the reward, the user-error type).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from stalerl.data.gsm8k import GSM8KFormatError, load_gsm8k, parse_final_answer
from stalerl.data.synthetic import TASKS, generate_synthetic, synthetic_splits, write_gsm8k_jsonl
from stalerl.data.example import Example

__all__ = [
    "Example",
    "GSM8KFormatError",
    "PromptDataset",
    "TASKS",
    "generate_synthetic",
    "load_examples",
    "load_gsm8k",
    "parse_final_answer",
    "synthetic_splits",
    "write_gsm8k_jsonl",
]

_SPLITS = {"train": "train", "test": "test", "eval": "test", "validation": "test", "val": "test", "valid": "test"}


def load_examples(
    path: str,
    split: str,
    *,
    synthetic_task: str = "add",
    max_operand: int = 99,
    train_size: int = 20000,
    test_size: int = 256,
    seed: int = 1234,
    question_style: str = "equation",
    holdout: str = "ordered",
    max_length: Optional[int] = None,
    length_fn: Optional[Callable[[str], int]] = None,
) -> list[Example]:
    """Examples of ``split`` (``"train"`` or ``"test"``; ``"eval"``/``"validation"`` mean ``"test"``).

    ``path == "synthetic"`` (or ``"synthetic:<task>"``, overriding ``synthetic_task``) uses the generator with
    ``max_operand``, ``train_size``, ``test_size``, ``seed``, ``question_style`` and ``holdout``; any other path goes to the GSM8K loader (the
    synthetic-only arguments are ignored).

    ``max_length`` drops examples whose question is longer than that, measured by ``length_fn(question)``
    (default ``len``, i.e. characters; pass e.g. ``lambda q: len(tok(fmt.format(q)).input_ids)`` for prompt tokens).
    It is an error when nothing is left.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    canonical = _SPLITS[split]
    if isinstance(path, str) and (path == "synthetic" or path.startswith("synthetic:")):
        task = path.split(":", 1)[1] if ":" in path else synthetic_task
        examples = generate_synthetic(
            task, canonical, max_operand=max_operand, train_size=train_size, test_size=test_size, seed=seed,
            question_style=question_style, holdout=holdout,
        )
    else:
        examples = load_gsm8k(path, canonical)
    if max_length is not None:
        measure = length_fn or len
        kept = [ex for ex in examples if measure(ex.question) <= max_length]
        if not kept:
            raise ValueError(
                f"max_length={max_length} drops all {len(examples)} {split} examples from {path!r} "
                f"(shortest question: {min(measure(ex.question) for ex in examples)})"
            )
        examples = kept
    return examples


class PromptDataset:
    """Endless batches of examples, reshuffled every epoch with a seed, with a resumable position.

    Epoch ``e`` visits the examples in the order ``numpy.random.default_rng([seed, e]).permutation(n)`` (or
    ``0..n-1`` when ``shuffle=False``). With ``drop_last`` a final partial batch is skipped; otherwise it is
    returned (smaller). ``state_dict()`` -> ``{"epoch", "index", "seed"}`` is the position of the *next* batch;
    after ``load_state_dict`` the same batches follow as in the run that saved it.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(examples) == 0:
            raise ValueError("PromptDataset needs at least one example")
        if drop_last and batch_size > len(examples):
            raise ValueError(
                f"batch_size={batch_size} exceeds the {len(examples)} examples and drop_last=True: no batch "
                "could ever be produced"
            )
        _check_seed(seed)
        self.examples = list(examples)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order_epoch: Optional[int] = None
        self._order: Optional[np.ndarray] = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = len(self.examples), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.examples)
            self._order = (
                np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[Example]:
        n = len(self.examples)
        remaining = n - self.index
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.index = 0
        order = self._epoch_order(self.epoch)
        idx = order[self.index : self.index + self.batch_size]
        self.index += len(idx)
        return [self.examples[int(i)] for i in idx]

    def __iter__(self) -> Iterator[list[Example]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("epoch", "index", "seed") if k not in state]
        if missing:
            raise KeyError(f"PromptDataset state lacks {missing} (got {sorted(state)})")
        epoch, index, seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        if epoch < 0 or not 0 <= index <= len(self.examples):
            raise ValueError(
                f"PromptDataset state {state} does not fit a dataset of {len(self.examples)} examples"
            )
        _check_seed(seed)
        self.epoch, self.index, self.seed = epoch, index, seed
        self._order_epoch = None


def _check_seed(seed) -> None:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
