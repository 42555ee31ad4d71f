"""``train_dataset.synthetic.holdout`` reaches the generator: ``unordered`` keeps every test problem's reversed twin
out of the training pool, ``ordered`` (the committed studies' split) does not."""

from stalerl.config.loading import apply_overrides
from stalerl.training.trainer import Trainer

CONFIG = "examples/math/smollm2_add_m2po_cpu.yaml"


def _operands(examples) -> set[tuple[int, int]]:
    pairs = set()
    for ex in examples:
        a, b = ex.question.split("What is ", 1)[-1].split("=")[0].rstrip("?").split("+")
        pairs.add((int(a), int(b)))
    return pairs


def _splits(holdout: str):
    cfg = apply_overrides(CONFIG, [f"train_dataset.synthetic.holdout={holdout}",
                                   f"valid_dataset.synthetic.holdout={holdout}",
                                   # max_operand 20 has 231 unordered problems: at most half may be held out
                                   "train_dataset.synthetic.test_size=64", "valid_dataset.synthetic.test_size=64"])
    train = Trainer._load_split(cfg.train_dataset)
    test = Trainer._load_split(cfg.valid_dataset, "valid_dataset")
    return _operands(train), _operands(test)


def test_unordered_holdout_keeps_reversed_twins_out_of_training():
    train, test = _splits("unordered")
    assert test and not any((b, a) in train or (a, b) in train for a, b in test)


def test_ordered_holdout_is_the_default_and_lets_reversed_twins_in():
    cfg = apply_overrides(CONFIG, [])
    assert cfg.train_dataset.synthetic.holdout == "ordered"
    train, test = _splits("ordered")
    assert not test & train  # same ordered pair never in both
    assert any((b, a) in train for a, b in test if a != b)  # but a reversed twin is (83 of 128 in the old study)


def test_an_unknown_holdout_is_refused_naming_the_key():
    import pytest

    from stalerl.config.errors import ConfigError

    with pytest.raises(ConfigError, match="holdout"):
        apply_overrides(CONFIG, ["train_dataset.synthetic.holdout=sideways"])
