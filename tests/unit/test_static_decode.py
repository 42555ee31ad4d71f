"""The static-cache decode loop (stalerl.rollout.static_decode) against transformers' generate: the HF engine's two
paths must give bit-identical tokens, behaviour log-probs and generator state, greedy and sampled, with several end
tokens, left padding of different lengths, rows ending at different steps, and with finished rows compacted away."""

import gc
import sys

import pytest
import torch

from conftest import save_two_end_token_model
from stalerl.core.model import PromptFormatter, load_policy
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.engine import HFRolloutEngine, _mask_through_first_eos
from stalerl.rollout.static_decode import (COMPACT_AT, PreallocatedKVLayer, _prefill_keeps_its_bits, linear_shapes,
                                           rows_keep_their_bits, static_decode)

# prompts of different lengths: the short ones are left-padded up to the long one
QUESTIONS = ["12+7=?", "3+45=?", "99+1=?", "What is 17 + 25 plus a long tail of words?"]
ANSWERS = ["19", "48", "100", "42"]
SAMPLING = [dict(greedy=True), dict(), dict(temperature=0.7), dict(temperature=0.8, top_k=7), dict(top_p=0.8),
            dict(temperature=0.6, top_k=10, top_p=0.9)]


def _eos_likely(model, tok, logit: float, eos_id=None):
    """Make the end token likely but not certain: its output-embedding row becomes ``logit`` x the mean final hidden
    state direction of the test prompts (divided by its squared norm), so its logit is ~``logit`` where the hidden
    state points the usual way. Greedy and sampled rows then end at different steps."""
    eos_id = tok.eos_token_id if eos_id is None else eos_id
    fmt = PromptFormatter(tok).format
    tok.padding_side = "left"
    enc = tok([fmt(q) for q in QUESTIONS], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        h = model(**enc, output_hidden_states=True).hidden_states[-1][enc["attention_mask"].bool()]
        d = h.mean(0)
        model.get_output_embeddings().weight[eos_id] = logit * d / d.dot(d)
    return model, tok


def _generate(model, tok, decode, compact=False, seed=11, n_samples=4, max_new_tokens=20, **kw):
    """``compact``: both of the static loop's row savings (finished rows compacted, one prefill per prompt)."""
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, decode=decode,
                             compact_finished_rows=compact, share_prompt_prefill=compact)
    torch.manual_seed(seed)
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=n_samples, max_new_tokens=max_new_tokens, **kw)
    return batch, torch.get_rng_state()


def _assert_same(a, b):
    batch_a, rng_a = a
    batch_b, rng_b = b
    assert torch.equal(batch_a.response_ids, batch_b.response_ids)
    assert torch.equal(batch_a.response_mask, batch_b.response_mask)
    assert torch.equal(batch_a.behavior_logp, batch_b.behavior_logp)  # bit-identical, not merely close
    assert batch_a.texts == batch_b.texts and torch.equal(batch_a.rewards, batch_b.rewards)
    assert torch.equal(rng_a, rng_b)  # the same draws consumed: what the caller samples next is the same too


@pytest.mark.parametrize("name", ["tiny:qwen2", "tiny:llama"])
@pytest.mark.parametrize("kw", SAMPLING, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "T=1")
def test_static_decode_equals_generate_bit_for_bit(name, kw):
    model, tok = _eos_likely(*load_policy(name, dtype="float32", device="cpu", seed=0), logit=1.3)
    reference = _generate(model, tok, "generate", **kw)
    lengths = reference[0].response_mask.sum(dim=1)
    assert lengths.min() < lengths.max()  # the construction works: rows end at different steps
    assert reference[0].prompt_mask.sum(dim=1).unique().numel() > 1  # and prompts are padded differently
    _assert_same(_generate(model, tok, "static", compact=False, **kw), reference)
    _assert_same(_generate(model, tok, "static", compact=True, **kw), reference)


@pytest.mark.parametrize("greedy", [True, False])
def test_static_decode_stops_at_either_end_token_and_keeps_it(tmp_path, greedy):
    """Two end tokens (eos and <bos>, as Qwen2.5-Instruct's two): the likelier one is <bos>, eos is also likely."""
    model, tok = load_policy(str(save_two_end_token_model(tmp_path / "two")), dtype="float32", device="cpu")
    _eos_likely(model, tok, logit=1.3, eos_id=tok.bos_token_id)
    reference = _generate(model, tok, "generate", greedy=greedy)
    batch = reference[0]
    ends = [batch.response_ids[r][batch.response_mask[r]][-1].item() for r in range(batch.num_rows)]
    assert tok.bos_token_id in ends  # the second end token ends rows
    _assert_same(_generate(model, tok, "static", greedy=greedy), reference)


def test_compaction_happens_and_stays_exact_where_the_matmul_is_batch_invariant():
    model, tok = _eos_likely(*load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0), logit=4.0)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward)
    prompt_ids, prompt_mask = engine.tokenize_prompts(QUESTIONS)
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0)
    results = {}
    for compact in (False, True):
        torch.manual_seed(3)
        results[compact] = static_decode(model.eval(), prompt_ids, prompt_mask, max_new_tokens=20,
                                         stop_ids=engine.stop_ids, pad_id=engine.pad_id, greedy=False,
                                         compact=compact)
    full, compacted = results[False], results[True]
    assert full.compactions == 0
    assert torch.equal(full.tokens, compacted.tokens) and torch.equal(full.logp, compacted.logp)
    lengths = _mask_through_first_eos(full.tokens, engine.stop_ids).sum(dim=1)
    # the rows still live after the first step at which at most COMPACT_AT of them are
    live_sets = [(lengths > t + 1).nonzero().squeeze(1) for t in range(full.steps - 1)]
    first = next((rows for rows in live_sets if 0 < rows.numel() <= COMPACT_AT * 16), None)
    assert first is not None  # the construction works: most rows end early, some run on
    if rows_keep_their_bits(linear_shapes(model), 16, first):
        assert compacted.compactions > 0  # it did leave finished rows behind where that is exact


def _first_of_each_prompt_reference(ids, mask):
    """The literal rule: walk the rows, a prompt (its unmasked tokens) seen for the first time gets the next index."""
    seen, first, index = {}, [], []
    for row in range(ids.shape[0]):
        key = tuple(ids[row][mask[row]].tolist()) + (int(mask[row].sum()),)
        if key not in seen:
            seen[key] = len(first)
            first.append(row)
        index.append(seen[key])
    return first, index


@pytest.mark.parametrize("seed", range(4))
def test_first_of_each_prompt_equals_the_literal_rule(seed):
    from stalerl.rollout.static_decode import _first_of_each_prompt

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 3, (5, 6), generator=g)
    lengths = torch.randint(1, 7, (5,), generator=g)
    rows = torch.randint(0, 5, (12,), generator=g)
    ids = prompts[rows]
    mask = torch.arange(6).unsqueeze(0) >= (6 - lengths[rows]).unsqueeze(1)  # left padding
    ids = torch.where(mask, ids, torch.full_like(ids, 9))
    first, index = _first_of_each_prompt(ids, mask)
    assert (first.tolist(), index.tolist()) == _first_of_each_prompt_reference(ids, mask)


def test_the_samples_of_a_prompt_share_one_prefill_and_the_same_results():
    model, tok = _eos_likely(*load_policy("tiny:llama", dtype="float32", device="cpu", seed=0), logit=1.3)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward)
    prompt_ids, prompt_mask = engine.tokenize_prompts(QUESTIONS)
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(3, 0), prompt_mask.repeat_interleave(3, 0)
    results = {}
    for share in (False, True):
        torch.manual_seed(2)
        results[share] = static_decode(model.eval(), prompt_ids, prompt_mask, max_new_tokens=12,
                                       stop_ids=engine.stop_ids, pad_id=engine.pad_id, greedy=False,
                                       temperature=0.9, share_prefill=share)
    assert results[False].prefill_rows == 12
    exact_here = _prefill_keeps_its_bits(model, linear_shapes(model), 12, torch.arange(0, 12, 3), prompt_ids.shape[1])
    assert results[True].prefill_rows == (4 if exact_here else 12)  # only where the probe finds it exact
    assert torch.equal(results[False].tokens, results[True].tokens)
    assert torch.equal(results[False].logp, results[True].logp)


class _RowCountDependentLinear(torch.nn.Linear):
    """A linear layer whose rows come out differently in a smaller batch (as a small-M GEMM kernel may)."""

    def forward(self, x):
        out = super().forward(x)
        return out + (1e-6 if x.shape[0] < 8 else 0.0)


class _PositionDependentLinear(torch.nn.Linear):
    """A linear layer whose rows from position 6 on come out differently (a second thread's or tile's share)."""

    def forward(self, x):
        out = super().forward(x)
        out[6:] += 1e-6
        return out


def test_the_bit_probe_tells_row_count_and_position_dependent_matmuls_apart():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 8))
    assert rows_keep_their_bits(linear_shapes(plain), 16, torch.arange(8))
    assert rows_keep_their_bits(linear_shapes(plain), 16, torch.tensor([0, 3, 9, 15]))
    by_count = torch.nn.Sequential(torch.nn.Linear(16, 8), _RowCountDependentLinear(16, 24))
    assert rows_keep_their_bits(linear_shapes(by_count), 16, torch.arange(8))
    assert not rows_keep_their_bits(linear_shapes(by_count), 16, torch.arange(4))
    by_place = torch.nn.Sequential(_PositionDependentLinear(16, 32))
    assert rows_keep_their_bits(linear_shapes(by_place), 16, torch.arange(12))  # the first rows stay in place
    assert rows_keep_their_bits(linear_shapes(by_place), 16, torch.tensor([0, 1, 2, 3, 4, 5, 8, 9]))  # 8, 9 stay >= 6
    assert not rows_keep_their_bits(linear_shapes(by_place), 16, torch.tensor([0, 2, 3, 4, 5, 6, 7]))  # 6 moves to 5


def test_preallocated_layer_returns_the_filled_prefix_as_dynamic_cache_does():
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(0)
    static, dynamic = PreallocatedKVLayer(capacity=9), DynamicLayer()
    for n in (4, 1, 1, 3):
        k, v = torch.randn(3, 2, n, 5, generator=g), torch.randn(3, 2, n, 5, generator=g)
        ks, vs = static.update(k, v)
        kd, vd = dynamic.update(k, v)
        assert torch.equal(ks, kd) and torch.equal(vs, vd)
        assert static.get_seq_length() == dynamic.get_seq_length()
        assert static.get_mask_sizes(1) == dynamic.get_mask_sizes(1)
    static.keep_rows(torch.tensor([2, 0]))
    assert torch.equal(static.keys, kd[[2, 0]]) and torch.equal(static.values, vd[[2, 0]])
    with pytest.raises(RuntimeError, match="capacity of 9"):
        static.update(torch.zeros(2, 2, 1, 5), torch.zeros(2, 2, 1, 5))


def _python_calls(fn) -> int:
    calls = 0

    def profiler(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    gc.collect()
    gc.disable()  # a collection inside the window runs finalizers: calls that belong to no decode step
    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def test_python_work_per_step_does_not_grow_with_the_step_count(tiny_policy):
    """Python function calls are linear in the steps with a constant slope: step 40 costs what step 4 costs."""
    model, tok = tiny_policy
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward)
    prompt_ids, prompt_mask = engine.tokenize_prompts(QUESTIONS)
    model.eval()

    def run(steps):
        torch.manual_seed(0)
        out = static_decode(model, prompt_ids, prompt_mask, max_new_tokens=steps, stop_ids=(-1,),
                            pad_id=engine.pad_id, greedy=False, temperature=0.7)
        assert out.steps == steps

    run(4)  # warm-up: transformers' first-call caches
    c10, c20, c40 = (_python_calls(lambda s=s: run(s)) for s in (10, 20, 40))
    # Constant per-step work makes c40 - c20 equal 2 (c20 - c10); per-step work growing by b calls a step makes
    # them differ by 300 b. A few calls of slack for one-off work (a lazy import or cache fill landing in one window:
    # the suite once saw a difference of 2 at ~465 calls a step) still fails any growth of one call per 30 steps.
    assert abs((c40 - c20) - 2 * (c20 - c10)) <= 8, (c10, c20, c40)


def test_progress_lines_only_for_long_generations(tiny_policy):
    model, tok = tiny_policy
    lines = []
    quiet = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, log=lines.append)
    quiet.generate(QUESTIONS, ANSWERS, n_samples=2, max_new_tokens=6)
    assert lines == []  # under 30 s: silent
    chatty = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, log=lines.append,
                             progress_every_s=0.0)
    chatty.generate(QUESTIONS, ANSWERS, n_samples=2, max_new_tokens=6)
    assert len(lines) == chatty.last_decode_steps - 1  # every step but the last (it ends the call) at period 0
    assert lines[0].startswith("generation: ") and "/8 rows done, step 1/6, " in lines[0]
    assert "tokens/s" in lines[0] and "ETA <= " in lines[0]


def test_unknown_decode_path_is_refused_by_name(tiny_policy):
    model, tok = tiny_policy
    with pytest.raises(ValueError, match="decode='fast': expected one of static, generate"):
        HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, decode="fast")
