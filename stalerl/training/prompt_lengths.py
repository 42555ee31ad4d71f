"""The longest prompt a run can send to its rollout engine, in the engine's tokens: what vLLM's planned
``max_model_len`` is sized from (``stalerl.rollout.vllm_memory.planned_seq_len``). Here in the training room, which
may read the data; the rollout room receives the number."""

from __future__ import annotations

from typing import Any, Callable, Optional

from stalerl.data import load_examples


def longest_prompt_tokens(cfg: Any, tokenizer, format_prompt: Callable[[str], str],
                          log: Callable[[str], None] = print) -> Optional[int]:
    """The longest formatted prompt of the run's train and valid data, in the tokens generate() sends to vLLM (the
    formatter's text, no special tokens added), or None when the data cannot be read here (a rollout worker on a
    node without the data: the prompt cap or the model's length then bounds the prompt). The whole splits, before
    the trainer drops prompts over train_dataset.max_length or keeps evaluator.n_prompts: an upper bound of what any
    request can hold (planned_seq_len takes the smaller of it and the cap)."""
    longest = 0
    for key in ("train_dataset", "valid_dataset"):
        ds = getattr(cfg, key)
        try:
            examples = load_examples(ds.path, ds.split, synthetic_task=ds.synthetic.task,
                                     max_operand=ds.synthetic.max_operand, train_size=ds.synthetic.train_size,
                                     test_size=ds.synthetic.test_size, seed=ds.synthetic.seed,
                                     question_style=ds.synthetic.question_style, holdout=ds.synthetic.holdout)
        except (FileNotFoundError, ValueError) as exc:
            log(f"vLLM max_model_len: {key}.path={ds.path!r} not readable here ({exc}); the prompt cap or the "
                "model's length bounds the prompt instead")
            return None
        texts = [format_prompt(q) for q in sorted({e.question for e in examples})]
        if texts:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            longest = max(longest, max(len(x) for x in ids))
    return longest or None
