"""Seeded generator of GSM8K-format arithmetic problems (short enough for a char-level model).

Tasks:

* ``add``: question ``53+5=?``, worked answer ``#### 58`` (single step: the answer is just the final line).
  With the char tokenizer's prompt ``Q: {question} A:`` and target ``" " + answer`` this is the measured
  ``add:99`` default of docs ``cpu-tiny-model.md``.
* ``addcot``: question ``53+5=?``, worked answer ``53+5=58 #### 58``.
* ``chain``: a chained addition of three operands with every intermediate result written out, question
  ``47+38+16=?``, worked answer ``47+38=85 85+16=101 #### 101`` (~30 response characters, two dependent steps: a
  task whose responses are long enough for stale rollouts to drift on).
* ``word``: a two-step word problem, ``Tom has 36 apples. He buys 13 more and gives 20 away. How many apples does
  he have now?`` with worked answer ``36+13=49. 49-20=29. #### 29``. Results are never negative.

Operands are uniform in ``[0, max_operand]`` (``chain``: three of them; ``word``: ``a, b`` in ``[1, max_operand]``,
the amount taken away in ``[1, min(max_operand, a+b)]``).

Splits: the test set is ``test_size`` distinct problems; the train set is ``train_size`` problems drawn (with
repetition) from the rest, so no train problem has the numbers of a test problem. Both depend only on
``(task, max_operand, seed, test_size, holdout)`` (and the train set on ``train_size`` as a prefix), never on global
RNG state.

``holdout``: what "the same problem" means for the split. ``ordered`` (the default, and what every committed study
used): the numbers in order, so ``7+12`` may be tested while ``12+7`` is trained on (SmolLM2's ``smollm2_add``: 83 of
its 128 test problems had their reversed twin in the training pool). ``unordered``: problems whose operands of a sum
can be swapped into each other are one problem (``a+b`` / ``b+a``; ``chain`` any order of its three operands;
``word`` its two added amounts), so a test problem's twins never reach the train split.
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterable

from stalerl.data.example import Example

__all__ = ["HOLDOUTS", "QUESTION_STYLES", "TASKS", "generate_synthetic", "problem_class", "synthetic_splits", "write_gsm8k_jsonl",
           "problem_space_size"]

TASKS = ("add", "addcot", "chain", "word")
# How an arithmetic question reads: "equation" ``53+5=?`` (the char model's format) or "what_is" ``What is 53+5?``,
# which an instruct model answers far more often (SmolLM2-135M-Instruct, operands <= 20, greedy: 0.43 vs 0.30).
# ``word`` problems are sentences already and ignore it.
QUESTION_STYLES = ("equation", "what_is")
HOLDOUTS = ("ordered", "unordered")

_NAMES = (
    ("Tom", "He", "he"), ("Anna", "She", "she"), ("Ben", "He", "he"), ("Mia", "She", "she"),
    ("Sam", "He", "he"), ("Lucy", "She", "she"), ("Max", "He", "he"), ("Emma", "She", "she"),
    ("Leo", "He", "he"), ("Nora", "She", "she"), ("Jack", "He", "he"), ("Lily", "She", "she"),
)
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards", "shells", "stamps")
_TEMPLATES = (
    "{N} has {a} {item}. {P} buys {b} more and gives {c} away. How many {item} does {p} have now?",
    "{N} has {a} {item}. {P} finds {b} more and loses {c}. How many {item} does {p} have now?",
    "{N} has {a} {item}. {P} gets {b} more from a friend and then uses {c}. How many {item} are left?",
    "{N} had {a} {item} and got {b} more. Then {p} sold {c}. How many {item} does {p} have left?",
)


def _check(task: str, max_operand: int, train_size: int, test_size: int, question_style: str = "equation",
           holdout: str = "ordered") -> None:
    if holdout not in HOLDOUTS:
        raise ValueError(f"unknown synthetic holdout {holdout!r}; choose one of {', '.join(HOLDOUTS)}")
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {', '.join(TASKS)}")
    if question_style not in QUESTION_STYLES:
        raise ValueError(f"unknown question style {question_style!r}; choose one of {', '.join(QUESTION_STYLES)}")
    low = 1 if task == "word" else 0
    if not isinstance(max_operand, int) or isinstance(max_operand, bool) or max_operand < low:
        raise ValueError(f"max_operand must be an integer >= {low} for task {task!r}, got {max_operand!r}")
    for name, value in (("train_size", train_size), ("test_size", test_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def problem_space_size(task: str, max_operand: int) -> int:
    """How many distinct problems (by their numbers) the task has."""
    m = max_operand
    if task in ("add", "addcot"):
        return (m + 1) ** 2
    if task == "chain":
        return (m + 1) ** 3
    if task == "word":
        if m > 2000:  # large enough that the exact count never matters; avoid the O(m^2) sum
            return m * m * m
        return sum(min(m, a + b) for a in range(1, m + 1) for b in range(1, m + 1))
    raise ValueError(f"unknown synthetic task {task!r}; choose one of {', '.join(TASKS)}")


def _draw_key(task: str, rng: random.Random, m: int) -> tuple:
    if task == "word":
        a = rng.randint(1, m)
        b = rng.randint(1, m)
        c = rng.randint(1, min(m, a + b))
        return (a, b, c)
    if task == "chain":
        return (rng.randint(0, m), rng.randint(0, m), rng.randint(0, m))
    return (rng.randint(0, m), rng.randint(0, m))


def _restyle(example: Example, style: str) -> Example:
    if style == "equation" or not example.question.endswith("=?"):
        return example
    if style != "what_is":
        raise ValueError(f"unknown question style {style!r}; choose one of {', '.join(QUESTION_STYLES)}")
    return Example(question=f"What is {example.question[:-2]}?", answer=example.answer, final=example.final)


def _render(task: str, key: tuple, rng: random.Random) -> Example:
    if task == "add":
        a, b = key
        return Example(question=f"{a}+{b}=?", answer=f"#### {a + b}", final=str(a + b))
    if task == "addcot":
        a, b = key
        return Example(question=f"{a}+{b}=?", answer=f"{a}+{b}={a + b} #### {a + b}", final=str(a + b))
    if task == "chain":
        a, b, c = key
        s1, s2 = a + b, a + b + c
        return Example(question=f"{a}+{b}+{c}=?", answer=f"{a}+{b}={s1} {s1}+{c}={s2} #### {s2}", final=str(s2))
    a, b, c = key
    name, cap, low = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    template = rng.choice(_TEMPLATES)
    s = a + b
    r = s - c
    assert r >= 0
    question = template.format(N=name, P=cap, p=low, a=a, b=b, c=c, item=item)
    return Example(question=question, answer=f"{a}+{b}={s}. {s}-{c}={r}. #### {r}", final=str(r))


def _rng(task: str, max_operand: int, seed: int, split: str) -> random.Random:
    # str seeds are hashed with SHA-512 by random.Random: stable across runs and platforms (no PYTHONHASHSEED).
    return random.Random(f"stalerl.synthetic/{task}/{max_operand}/{seed}/{split}")


def problem_class(task: str, key: tuple, holdout: str) -> tuple:
    """The held-out unit a problem belongs to: itself (``ordered``), or every problem whose summed operands are the
    same up to order (``unordered``: ``(a, b)`` and ``(b, a)``; ``chain``'s three; ``word``'s ``a`` and ``b``, with
    the amount taken away kept)."""
    if holdout == "ordered":
        return key
    if task == "word":
        a, b, c = key
        return (min(a, b), max(a, b), c)
    return tuple(sorted(key))


def _test_keys(task: str, max_operand: int, test_size: int, seed: int, holdout: str = "ordered") -> list[tuple]:
    space = problem_space_size(task, max_operand)
    if holdout == "unordered":
        # about half as many classes as problems for a sum of two: the train split must keep at least as many
        # unseen classes as the test split takes
        space = _class_count(task, max_operand)
    if test_size > space // 2:
        raise ValueError(
            f"synthetic task {task!r} with max_operand={max_operand} has only {space} distinct problems"
            f"{' up to the order of operands (holdout=unordered)' if holdout == 'unordered' else ''}; "
            f"test_size={test_size} must be at most half of that ({space // 2}) so the train split keeps enough "
            "unseen problems. Lower test_size or raise max_operand."
        )
    rng = _rng(task, max_operand, seed, "test-keys")
    keys: list[tuple] = []
    seen: set = set()
    while len(keys) < test_size:
        key = _draw_key(task, rng, max_operand)
        unit = problem_class(task, key, holdout)
        if unit not in seen:
            seen.add(unit)
            keys.append(key)
    return keys


def _class_count(task: str, max_operand: int) -> int:
    """Distinct ``unordered`` classes (a literal count for the sizes the checks need; a formula for large ones)."""
    m = max_operand
    if task in ("add", "addcot"):
        return (m + 1) * (m + 2) // 2
    if task == "chain":
        return (m + 1) * (m + 2) * (m + 3) // 6
    if m > 300:  # word: close enough for the half-the-space check at sizes where the exact count is slow
        return problem_space_size(task, m) // 2
    return len({(min(a, b), max(a, b), c) for a in range(1, m + 1) for b in range(1, m + 1)
                for c in range(1, min(m, a + b) + 1)})


def synthetic_splits(
    task: str = "add",
    *,
    max_operand: int = 99,
    train_size: int = 20000,
    test_size: int = 256,
    seed: int = 1234,
    question_style: str = "equation",
    holdout: str = "ordered",
) -> tuple[list[Example], list[Example]]:
    """``(train, test)`` example lists, disjoint by problem numbers (``holdout``: in order, or up to the order of
    summed operands) and deterministic in the arguments. The question style changes only the question's wording,
    never which problems are drawn; ``ordered`` gives the splits every earlier version gave."""
    _check(task, max_operand, train_size, test_size, question_style, holdout)
    test_keys = _test_keys(task, max_operand, test_size, seed, holdout)
    text_rng = _rng(task, max_operand, seed, "test-text")
    test = [_render(task, k, text_rng) for k in test_keys]
    held_out = {problem_class(task, k, holdout) for k in test_keys}
    rng = _rng(task, max_operand, seed, "train")
    train: list[Example] = []
    while len(train) < train_size:
        key = _draw_key(task, rng, max_operand)
        if problem_class(task, key, holdout) in held_out:
            continue
        train.append(_render(task, key, rng))
    return [_restyle(e, question_style) for e in train], [_restyle(e, question_style) for e in test]


def generate_synthetic(
    task: str,
    split: str,
    *,
    max_operand: int = 99,
    train_size: int = 20000,
    test_size: int = 256,
    seed: int = 1234,
    question_style: str = "equation",
    holdout: str = "ordered",
) -> list[Example]:
    """One split (``"train"`` or ``"test"``) of ``synthetic_splits``. The test split is the same whatever
    ``train_size``; asking for the test split does not generate the train split."""
    if split == "test":
        _check(task, max_operand, train_size, test_size, question_style, holdout)
        text_rng = _rng(task, max_operand, seed, "test-text")
        return [_restyle(_render(task, k, text_rng), question_style)
                for k in _test_keys(task, max_operand, test_size, seed, holdout)]
    if split == "train":
        return synthetic_splits(
            task, max_operand=max_operand, train_size=train_size, test_size=test_size, seed=seed,
            question_style=question_style, holdout=holdout,
        )[0]
    raise ValueError(f"synthetic split must be 'train' or 'test', got {split!r}")


def write_gsm8k_jsonl(examples: Iterable[Example], path: str) -> str:
    """Write examples as GSM8K JSON lines (``{"question": ..., "answer": ...}``); returns ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"question": ex.question, "answer": ex.answer}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
