"""stalerl.data: synthetic generator, GSM8K loader, load_examples dispatch, resumable PromptDataset."""

import json
import os
import sys

import pytest

from stalerl.data import (
    Example,
    GSM8KFormatError,
    PromptDataset,
    generate_synthetic,
    load_examples,
    load_gsm8k,
    synthetic_splits,
    write_gsm8k_jsonl,
)
from stalerl.data.synthetic import problem_space_size
from stalerl.core.reward import gsm8k_reward

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A shop sold 1,200 pens at $1 each and then 400 more. How many dollars did it make?",
        "answer": "1200+400=<<1200+400=1600>>1600\n#### 1,600",
    },
]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


# ------------------------------------------------------------------------------------------------ synthetic


def test_add_format_matches_reference_default():
    train, test = synthetic_splits("add", max_operand=99, train_size=500, test_size=50, seed=3)
    for ex in train + test:
        a, b = ex.question[:-2].split("+")
        assert ex.question == f"{int(a)}+{int(b)}=?"
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert ex.answer == f"#### {int(a) + int(b)}"
        assert ex.final == str(int(a) + int(b))
        assert gsm8k_reward(" " + ex.answer, ex.answer) == 1.0
    # operands cover the range (uniform), not just small numbers
    operands = {int(x) for ex in train for x in ex.question[:-2].split("+")}
    assert min(operands) <= 2 and max(operands) >= 97


def test_word_problems_are_two_step_and_never_negative():
    train, test = synthetic_splits("word", max_operand=99, train_size=2000, test_size=100, seed=0)
    for ex in train + test:
        first, second, final = ex.answer.split(" ", 2)
        a, rest = first.split("+")
        b, s = rest.rstrip(".").split("=")
        s2, rest2 = second.split("-")
        c, r = rest2.rstrip(".").split("=")
        assert int(a) + int(b) == int(s) and s == s2 and int(s) - int(c) == int(r)
        assert int(r) >= 0 and final == f"#### {r}" and ex.final == r
        assert f" {a} " in ex.question and f" {b} " in ex.question and f" {c}" in ex.question
        assert ex.question.endswith("?")
        assert gsm8k_reward(ex.answer, ex.answer) == 1.0
    assert any(ex.final == "0" for ex in train) or min(int(ex.final) for ex in train) < 5


def test_chain_writes_both_intermediate_sums_and_fits_the_generation_budget():
    from stalerl.config import load_config
    from stalerl.core.model import build_char_tokenizer

    train, test = synthetic_splits("chain", max_operand=99, train_size=2000, test_size=1024, seed=0)
    tok = build_char_tokenizer()
    lengths = []
    for ex in train + test:
        a, b, c = (int(x) for x in ex.question[:-2].split("+"))
        assert ex.question == f"{a}+{b}+{c}=?" and max(a, b, c) <= 99
        assert ex.answer == f"{a}+{b}={a + b} {a + b}+{c}={a + b + c} #### {a + b + c}" and ex.final == str(a + b + c)
        assert gsm8k_reward(" " + ex.answer, ex.answer) == 1.0
        assert gsm8k_reward(f" {a}+{b}={a + b} {a + b}+{c}={a + b + c + 1} #### {a + b + c + 1}", ex.answer) == 0.0
        ids = tok(" " + ex.answer, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        lengths.append(len(ids) + 1)  # + EOS
    cfg = load_config(["--config", "examples/math/gsm8k_chain_cpu.yaml"])
    assert max(lengths) <= cfg.gconfig.max_new_tokens == cfg.eval_gconfig.max_new_tokens
    assert 25 <= sum(lengths) / len(lengths) <= 31  # ~30 response tokens (the add task: 9.5)
    assert cfg.evaluator.n_prompts == cfg.valid_dataset.synthetic.test_size >= 1024 and cfg.evaluator.freq_steps <= 50
    assert cfg.train_dataset.synthetic.task == cfg.valid_dataset.synthetic.task == "chain"
    assert cfg.train_dataset.synthetic.test_size == cfg.valid_dataset.synthetic.test_size  # disjoint splits
    assert problem_space_size("chain", 99) == 100 ** 3


@pytest.mark.parametrize("task", ["add", "addcot", "chain", "word"])
def test_generator_deterministic_and_splits_disjoint(task):
    kw = dict(max_operand=99, train_size=3000, test_size=200, seed=7)
    train, test = synthetic_splits(task, **kw)
    train2, test2 = synthetic_splits(task, **kw)
    assert train == train2 and test == test2
    assert len(train) == 3000 and len(test) == 200
    assert len({ex.question for ex in test}) == 200  # distinct test problems
    assert not {ex.question for ex in train} & {ex.question for ex in test}
    if task == "word":  # disjoint by numbers too, not just by wording
        nums = lambda ex: ex.answer.split(" #### ")[0]  # noqa: E731
        assert not {nums(ex) for ex in train} & {nums(ex) for ex in test}
    other_train, other_test = synthetic_splits(task, **{**kw, "seed": 8})
    assert other_test != test and other_train[:50] != train[:50]
    # per-split generation agrees with the joint one; the test split does not depend on train_size
    assert generate_synthetic(task, "test", **kw) == test
    assert generate_synthetic(task, "test", **{**kw, "train_size": 10}) == test
    assert generate_synthetic(task, "train", **{**kw, "train_size": 100}) == train[:100]


def test_generator_independent_of_global_rng():
    import random

    random.seed(1)
    a = generate_synthetic("add", "train", train_size=50, test_size=10)
    random.seed(2)
    b = generate_synthetic("add", "train", train_size=50, test_size=10)
    assert a == b


def test_generator_errors():
    with pytest.raises(ValueError, match="unknown synthetic task 'mul'"):
        synthetic_splits("mul")
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        synthetic_splits("add", max_operand=9, test_size=256)
    assert problem_space_size("add", 9) == 100
    assert len(synthetic_splits("add", max_operand=9, train_size=100, test_size=50)[1]) == 50
    with pytest.raises(ValueError, match="max_operand"):
        synthetic_splits("word", max_operand=0)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        generate_synthetic("add", "dev")


def test_write_and_reload_synthetic_jsonl(tmp_path):
    train, test = synthetic_splits("word", train_size=300, test_size=40, seed=5)
    write_gsm8k_jsonl(train, str(tmp_path / "train.jsonl"))
    write_gsm8k_jsonl(test, str(tmp_path / "test.jsonl"))
    rows = [json.loads(line) for line in open(tmp_path / "test.jsonl")]
    assert set(rows[0]) == {"question", "answer"}
    assert load_examples(str(tmp_path), "train") == train
    assert load_examples(str(tmp_path), "test") == test
    assert load_examples(str(tmp_path / "test.jsonl"), "train") == test  # a single file is the split


# -------------------------------------------------------------------------------------------------- loader


def test_loader_official_format_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    exs = load_gsm8k(path)
    assert [e.final for e in exs] == ["72", "1600"]
    assert exs[0] == Example(GSM8K_ROWS[0]["question"], GSM8K_ROWS[0]["answer"], "72")


def test_loader_json_variants(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(GSM8K_ROWS))
    (tmp_path / "splits.json").write_text(json.dumps({"train": GSM8K_ROWS[:1], "test": GSM8K_ROWS}))
    (tmp_path / "columns.json").write_text(
        json.dumps({"question": [r["question"] for r in GSM8K_ROWS], "answer": [r["answer"] for r in GSM8K_ROWS]})
    )
    _write_jsonl(tmp_path / "lines.json", GSM8K_ROWS)  # JSON lines in a .json file
    assert len(load_gsm8k(str(tmp_path / "list.json"))) == 2
    assert len(load_gsm8k(str(tmp_path / "splits.json"), "train")) == 1
    assert len(load_gsm8k(str(tmp_path / "splits.json"), "test")) == 2
    assert [e.final for e in load_gsm8k(str(tmp_path / "columns.json"))] == ["72", "1600"]
    assert len(load_gsm8k(str(tmp_path / "lines.json"))) == 2


def test_loader_parquet_file_and_hub_layout_dir(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(GSM8K_ROWS)
    pq.write_table(table, tmp_path / "x.parquet")
    assert [e.final for e in load_gsm8k(str(tmp_path / "x.parquet"))] == ["72", "1600"]
    hub = tmp_path / "gsm8k" / "main"
    hub.mkdir(parents=True)
    pq.write_table(table, hub / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS[:1]), hub / "train-00000-of-00001.parquet")
    assert len(load_examples(str(tmp_path / "gsm8k"), "test")) == 2
    assert len(load_examples(str(tmp_path / "gsm8k"), "train")) == 1


def test_loader_save_to_disk_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GSM8K_ROWS), "test": datasets.Dataset.from_list(GSM8K_ROWS[1:])}
    )
    dd.save_to_disk(str(tmp_path / "saved"))
    assert [e.final for e in load_examples(str(tmp_path / "saved"), "train")] == ["72", "1600"]
    assert [e.final for e in load_examples(str(tmp_path / "saved"), "test")] == ["1600"]


def test_loader_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*synthetic"):
        load_gsm8k(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples("/definitely/not/here", "train")


def test_loader_unknown_extension(tmp_path):
    p = tmp_path / "data.csv"
    p.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"data\.csv: unknown data file extension '\.csv'.*\.jsonl"):
        load_gsm8k(str(p))


def test_loader_rows_missing_fields(tmp_path):
    rows = GSM8K_ROWS + [{"question": "q"}, {"prompt": "x", "answer": "#### 1"}]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(GSM8KFormatError) as err:
        load_gsm8k(path)
    msg = str(err.value)
    assert "2 of 4 rows" in msg and "bad.jsonl: line 3" in msg and "'answer'" in msg


def test_loader_answers_without_final(tmp_path):
    rows = [GSM8K_ROWS[0], {"question": "q", "answer": "just 5"}, {"question": "q", "answer": "#### five"}]
    path = _write_jsonl(tmp_path / "nofinal.jsonl", rows)
    with pytest.raises(GSM8KFormatError) as err:
        load_gsm8k(path)
    msg = str(err.value)
    assert "2 of 3 rows" in msg and "nofinal.jsonl: line 2" in msg and "#### N" in msg


def test_loader_bad_json_and_empty(tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text(json.dumps(GSM8K_ROWS[0]) + "\n{not json\n")
    with pytest.raises(GSM8KFormatError, match="broken.jsonl: line 2 is not valid JSON"):
        load_gsm8k(str(p))
    e = tmp_path / "empty.jsonl"
    e.write_text("\n")
    with pytest.raises(GSM8KFormatError, match="no rows"):
        load_gsm8k(str(e))


def test_loader_directory_without_split(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"no 'test' split found.*test\.jsonl.*notes\.txt"):
        load_examples(str(tmp_path), "test")
    _write_jsonl(tmp_path / "validation.jsonl", GSM8K_ROWS[:1])  # accepted as the test split
    assert len(load_examples(str(tmp_path), "test")) == 1


def test_hub_name_offline_error(monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    if "datasets" not in sys.modules:
        try:
            import datasets  # noqa: F401
        except ImportError:
            pass
    with pytest.raises(FileNotFoundError) as err:
        load_examples("openai/gsm8k", "test")
    msg = str(err.value)
    assert "no" in msg and "download" in msg and "local file" in msg and ".jsonl" in msg
    assert "HF_HUB_OFFLINE" not in os.environ  # restored


def test_hub_name_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(FileNotFoundError, match=r"`datasets` package is not installed.*local file"):
        load_examples("gsm8k", "train")


def test_load_examples_dispatch_and_filter():
    a = load_examples("synthetic", "test", test_size=30, seed=1)
    assert a == generate_synthetic("add", "test", test_size=30, seed=1)
    w = load_examples("synthetic:word", "eval", test_size=30, seed=1)
    assert w == generate_synthetic("word", "test", test_size=30, seed=1)
    assert load_examples("synthetic", "train", synthetic_task="word", train_size=20, seed=1) == generate_synthetic(
        "word", "train", train_size=20, seed=1
    )
    short = load_examples("synthetic:word", "train", train_size=300, seed=1, max_length=85)
    assert short and all(len(e.question) <= 85 for e in short) and len(short) < 300
    tokens = load_examples("synthetic", "test", test_size=100, max_length=7, length_fn=lambda q: len(q) + 1)
    assert tokens and all(len(e.question) <= 6 for e in tokens) and len(tokens) < 100
    with pytest.raises(ValueError, match="drops all"):
        load_examples("synthetic", "test", test_size=30, max_length=2)
    with pytest.raises(ValueError, match="split must be one of"):
        load_examples("synthetic", "dev")


# ------------------------------------------------------------------------------------------------- dataset


def _ids(batch):
    return [e.question for e in batch]


def test_prompt_dataset_epochs_and_shuffle():
    exs = [Example(f"q{i}", f"#### {i}", str(i)) for i in range(10)]
    ds = PromptDataset(exs, 3, seed=5)
    assert len(ds) == 3
    epoch0 = [_ids(ds.next_batch()) for _ in range(3)]
    assert all(len(b) == 3 for b in epoch0)
    flat = sum(epoch0, [])
    assert len(set(flat)) == 9  # no repeats within an epoch
    assert flat != [f"q{i}" for i in range(9)]  # shuffled
    assert ds.state_dict() == {"epoch": 0, "index": 9, "seed": 5}
    epoch1_first = _ids(ds.next_batch())  # drop_last: the 10th example is skipped, new epoch
    assert ds.state_dict() == {"epoch": 1, "index": 3, "seed": 5}
    assert epoch1_first != epoch0[0] or _ids(ds.next_batch()) != epoch0[1]  # reshuffled per epoch
    same = PromptDataset(exs, 3, seed=5)
    assert [_ids(same.next_batch()) for _ in range(3)] == epoch0  # deterministic by seed
    other = PromptDataset(exs, 3, seed=6)
    assert [_ids(other.next_batch()) for _ in range(3)] != epoch0
    ordered = PromptDataset(exs, 4, shuffle=False, drop_last=False)
    sizes = [len(ordered.next_batch()) for _ in range(4)]
    assert sizes == [4, 4, 2, 4] and len(ordered) == 3


def test_prompt_dataset_resume_sees_same_batches():
    exs = generate_synthetic("add", "train", train_size=50, test_size=4, seed=0)
    ds = PromptDataset(exs, 8, seed=11)
    for _ in range(9):  # into the second epoch
        ds.next_batch()
    state = json.loads(json.dumps(ds.state_dict()))  # serialisable
    expected = [_ids(ds.next_batch()) for _ in range(10)]
    resumed = PromptDataset(exs, 8, seed=0)  # the loaded seed wins
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch()) for _ in range(10)] == expected
    it = iter(PromptDataset(exs, 8, seed=11))
    assert _ids(next(it)) == _ids(PromptDataset(exs, 8, seed=11).next_batch())


def test_prompt_dataset_errors():
    exs = generate_synthetic("add", "train", train_size=5, test_size=4, seed=0)
    with pytest.raises(ValueError, match="exceeds the 5 examples"):
        PromptDataset(exs, 6)
    with pytest.raises(ValueError, match="batch_size"):
        PromptDataset(exs, 0)
    with pytest.raises(ValueError, match="at least one"):
        PromptDataset([], 1)
    ds = PromptDataset(exs, 2)
    with pytest.raises(KeyError, match="lacks"):
        ds.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="does not fit"):
        ds.load_state_dict({"epoch": 0, "index": 99, "seed": 0})


@pytest.mark.parametrize("task", ["add", "addcot", "chain", "word"])
def test_question_style_rewords_the_same_problems(task):
    eq_train, eq_test = synthetic_splits(task, max_operand=20, train_size=50, test_size=20, seed=3)
    wi_train, wi_test = synthetic_splits(task, max_operand=20, train_size=50, test_size=20, seed=3,
                                         question_style="what_is")
    for a, b in zip(eq_train + eq_test, wi_train + wi_test):
        assert (a.answer, a.final) == (b.answer, b.final)
        if task == "word":
            assert a.question == b.question
        else:
            assert b.question == f"What is {a.question[:-2]}?"
    loaded = load_examples("synthetic", "test", synthetic_task=task, max_operand=20, test_size=20, seed=3,
                           question_style="what_is")
    assert [e.question for e in loaded] == [e.question for e in wi_test]
    with pytest.raises(ValueError, match="unknown question style 'words'"):
        synthetic_splits(task, max_operand=20, train_size=5, test_size=2, question_style="words")


# ---------------------------------------------------------------- holdout: ordered vs unordered (issue 47 item 1)
from stalerl.data.synthetic import problem_class, synthetic_splits  # noqa: E402


def _operands(task, example):
    import re
    nums = [int(n) for n in re.findall(r"\d+", example.question)]
    return tuple(nums[:3] if task in ("chain", "word") else nums[:2])


def _literal_class(task, key):
    """The unordered class, written out: every ordering of the summed operands."""
    import itertools
    if task == "word":
        a, b, c = key
        return frozenset({(a, b, c), (b, a, c)})
    return frozenset(itertools.permutations(key))


@pytest.mark.parametrize("task", ["add", "chain", "word"])
def test_unordered_holdout_keeps_every_twin_of_a_test_problem_out_of_training(task):
    train, test = synthetic_splits(task, max_operand=12, train_size=3000, test_size=40, seed=7, holdout="unordered")
    held = set().union(*(_literal_class(task, _operands(task, e)) for e in test))
    assert len(test) == 40
    assert not any(_operands(task, e) in held for e in train)
    # the same problem space under the old rule does let twins through (the check can fail)
    train_o, test_o = synthetic_splits(task, max_operand=12, train_size=3000, test_size=40, seed=7)
    twins = set().union(*(_literal_class(task, _operands(task, e)) for e in test_o))
    assert any(_operands(task, e) in twins for e in train_o)
    # and no test problems share a class
    assert len({problem_class(task, _operands(task, e), "unordered") for e in test}) == 40


def test_ordered_holdout_is_the_split_every_earlier_version_gave():
    default = synthetic_splits("add", max_operand=20, train_size=500, test_size=128, question_style="what_is")
    ordered = synthetic_splits("add", max_operand=20, train_size=500, test_size=128, question_style="what_is",
                               holdout="ordered")
    assert default == ordered
    # smollm2_add's split (the README's 83 of 128): the test problems whose reversed twin is in the training pool
    train, test = synthetic_splits("add", max_operand=20, train_size=20000, test_size=128, question_style="what_is")
    pool = {_operands("add", e) for e in train}
    assert sum((b, a) in pool for a, b in (_operands("add", e) for e in test)) == 83


def test_an_unknown_holdout_is_one_line():
    with pytest.raises(ValueError, match="unknown synthetic holdout 'sorted'; choose one of ordered, unordered"):
        synthetic_splits("add", max_operand=20, holdout="sorted")


def test_unordered_holdout_refuses_a_test_split_over_half_the_classes():
    # add with max_operand 3: 10 unordered classes, so at most 5 test problems
    synthetic_splits("add", max_operand=3, train_size=10, test_size=5, holdout="unordered")
    with pytest.raises(ValueError, match="test_size=6 must be at most half"):
        synthetic_splits("add", max_operand=3, train_size=10, test_size=6, holdout="unordered")
