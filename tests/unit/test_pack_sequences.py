"""actor.mb_spec.pack_sequences: a micro-batch's rows as one padding-free row must give the padded path's log-probs
and update (float32, up to rounding), with each row run alone as the literal reference; a model whose attention does
not keep packed rows apart is refused at start."""

import copy
import dataclasses
import random

import pytest
import torch

from stalerl.config import load_config
from stalerl.core.model import load_policy
from stalerl.rollout.batch import RolloutBatch, pack_rows
from stalerl.training.actor import Actor, pack_micro_batches, packing_check

LOGP_ATOL = 1e-5  # packed vs padded / alone log-probs, float32
PARAM_ATOL, PARAM_RTOL = 2e-6, 1e-5  # parameters after one SGD(lr=1) step: the gradients, float32


def _random_batch(vocab: int, seed: int, n: int = 7) -> RolloutBatch:
    """Rows of different prompt (left-padded) and response (right-padded, prefix mask) lengths, random tokens."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    p_len = [rng.randint(1, 9) for _ in range(n)]
    r_len = [rng.randint(1, 8) for _ in range(n)]
    r_len[0] = 0  # a row whose response is empty (an immediate stop with its token cut): nothing to score
    pw, rw = max(p_len), max(r_len)
    prompt_mask = torch.tensor([[j >= pw - p for j in range(pw)] for p in p_len])
    response_mask = torch.tensor([[j < r for j in range(rw)] for r in r_len])
    return RolloutBatch(prompt_ids=torch.randint(3, vocab, (n, pw), generator=g) * prompt_mask,
                        prompt_mask=prompt_mask,
                        response_ids=torch.randint(3, vocab, (n, rw), generator=g) * response_mask,
                        response_mask=response_mask, behavior_logp=(-torch.rand(n, rw, generator=g) - 1.5)
                        * response_mask, versions=torch.zeros(n, rw, dtype=torch.long), rewards=torch.rand(n),
                        group_ids=torch.arange(n) // 2, texts=[""] * n, answers=[""] * n)


def _actor(model, pack: bool, **overrides) -> Actor:
    over = {"mb_spec.pack_sequences": str(pack).lower(), **overrides}
    cfg = load_config([f"actor.{k}={v}" for k, v in over.items()])
    return Actor(model, cfg.actor, temperature=1.0, total_updates=1)


@pytest.fixture(params=["qwen2", "llama"])
def tiny(request):
    torch.manual_seed(0)
    model, _ = load_policy(f"tiny:{request.param}", dtype="float32", device="cpu", seed=0)
    return model


def test_pack_rows_matches_a_literal_packing():
    batch = _random_batch(vocab=50, seed=3)
    packed = pack_rows(batch)
    ids, pos, targets = [], [], []  # the literal layout, row by row
    for i in range(batch.num_rows):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        resp = batch.response_ids[i][batch.response_mask[i]].tolist()
        offset = len(ids)
        for j, tok in enumerate(resp):
            targets.append((offset + len(prompt) + j - 1, tok, i, j))
        ids += prompt + resp
        pos += list(range(len(prompt) + len(resp)))
    assert packed.input_ids.tolist() == [ids] and packed.position_ids.tolist() == [pos]
    assert list(zip(packed.predictor.tolist(), packed.target_ids.tolist(), packed.rows.tolist(),
                    packed.cols.tolist())) == targets
    assert packed.num_tokens == int(batch.prompt_mask.sum() + batch.response_mask.sum())


def test_pack_rows_refuses_a_row_without_prompt():
    batch = _random_batch(vocab=50, seed=3)
    batch.prompt_mask[2] = False
    with pytest.raises(ValueError, match="row 2 has response tokens but no prompt token"):
        pack_rows(batch)


def test_packed_micro_batches_count_real_tokens():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 20)
        p = [rng.randint(1, 30) for _ in range(n)]
        r = [rng.randint(0, 30) for _ in range(n)]
        budget = rng.randint(1, 300)
        for sort in (False, True):
            groups = pack_micro_batches(p, r, budget, sort_by_length=sort, packed=True)
            # literal: walk the rows (in the same order) and cut when the next row would overflow the budget
            order = sorted(range(n), key=lambda i: (r[i], p[i])) if sort else list(range(n))
            if sum(p) + sum(r) <= budget:
                order = list(range(n))
            expected, cur, used = [], [], 0
            for i in order:
                if cur and used + p[i] + r[i] > budget:
                    expected.append(cur)
                    cur, used = [], 0
                cur.append(i)
                used += p[i] + r[i]
            expected.append(cur)
            assert groups == expected
            assert sorted(i for g in groups for i in g) == list(range(n))
            assert all(len(g) == 1 or sum(p[i] + r[i] for i in g) <= budget for g in groups)


def test_the_tiny_models_keep_packed_rows_apart(tiny):
    assert packing_check(tiny) == (True, "")


def test_a_model_that_ignores_packing_is_refused_at_start(tiny):
    original = tiny.forward

    def forward(*args, position_ids=None, **kwargs):  # drops the position ids: one causal sequence
        return original(*args, **kwargs)

    tiny.forward = forward
    ok, reason = packing_check(tiny)
    assert not ok and "differ from each row's own" in reason
    with pytest.raises(ValueError, match=r"actor.mb_spec.pack_sequences=true: .* set actor.mb_spec.pack_sequences"):
        _actor(tiny, pack=True)
    _actor(tiny, pack=False)  # the padded path never asks


def test_packing_under_fsdp_is_refused_at_start(tiny):
    cfg = load_config(["actor.mb_spec.pack_sequences=true"])
    cfg.actor.backend = "fsdp:d2"
    with pytest.raises(ValueError, match="pack_sequences=true is not supported with actor.backend=fsdp:d2"):
        Actor(tiny, cfg.actor, temperature=1.0, total_updates=1)


@pytest.mark.parametrize("head", ["chunked", "plain", "plain_no_logits_to_keep"])
def test_packed_logprobs_equal_padded_and_each_row_alone(tiny, head):
    vocab = tiny.config.vocab_size
    padded, packed = _actor(tiny, pack=False), _actor(copy.deepcopy(tiny), pack=True)
    for actor in (padded, packed):
        if head != "chunked":
            actor.chunked_logprobs = False
        if head == "plain_no_logits_to_keep":
            actor._logits_to_keep = False
    for seed in range(3):
        batch = _random_batch(vocab, seed)
        mask = batch.response_mask
        lp_padded, lp_packed = padded.compute_logp(batch), packed.compute_logp(batch)
        # literal reference: each row on its own (select trims it to no padding at all)
        alone = torch.zeros_like(lp_padded)
        for i in range(batch.num_rows):
            row = batch.select([i])
            alone[i, :row.response_ids.shape[1]] = padded.compute_logp(row)[0]
        assert mask.sum() > 10 and (lp_packed[mask] != 0).all()
        assert torch.allclose(lp_packed[mask], alone[mask], atol=LOGP_ATOL, rtol=0)
        assert torch.allclose(lp_packed[mask], lp_padded[mask], atol=LOGP_ATOL, rtol=0)
        assert (lp_packed[~mask] == 0).all()
        # the differentiable forward scatters to the same padded layout
        packed.model.train()
        mb = batch.select(list(range(batch.num_rows)))
        lp_grad = packed._forward_logp(mb)
        assert lp_grad.shape == mb.response_ids.shape and lp_grad.requires_grad


@pytest.mark.parametrize("loss", ["m2po", "vanilla"])
def test_packed_update_equals_padded_update(tiny, loss):
    """Same rows per micro-batch (one micro-batch, and a split by the same rows): the parameters after one SGD(lr=1)
    step (so the gradients) agree, and the loss is called with the same global token counts."""
    vocab = tiny.config.vocab_size
    batch = _random_batch(vocab, seed=11, n=9)
    adv = torch.randn(batch.num_rows, 1).expand_as(batch.response_mask).contiguous() * batch.response_mask
    common = {"loss": loss, "optimizer.type": "sgd", "optimizer.lr": 1.0, "optimizer.gradient_clipping": 1e9,
              "m2_threshold": 0.01}
    for budget in (100000, 30):
        results = {}
        for pack in (False, True):
            model = copy.deepcopy(tiny)
            actor = _actor(model, pack, **common, **{"mb_spec.max_tokens_per_mb": budget})
            if budget == 30:  # the same rows per micro-batch on both sides, so only the packing differs
                actor.micro_batches = lambda b: [list(range(0, 3)), list(range(3, 6)), list(range(6, b.num_rows))]
            seen = []
            fn = actor.spec.fn

            def recording(*args, _fn=fn, _seen=seen, **kwargs):
                _seen.append(dict(kwargs["config"]["global_batch_info"]))
                return _fn(*args, **kwargs)

            actor.spec = dataclasses.replace(actor.spec, fn=recording)
            metrics = actor.update(batch, adv)
            results[pack] = ([p.detach().clone() for p in model.parameters()], metrics, seen)
        (p0, m0, s0), (p1, m1, s1) = results[False], results[True]
        assert s0 == s1 and len(s0) >= 1 and s0[0]["batch_num_tokens"] == int(batch.response_mask.sum())
        assert m0["actor/num_micro_batches"] == m1["actor/num_micro_batches"] == (1 if budget > 1000 else 3)
        assert any(not torch.equal(a, b) for a, b in zip(p0, [p.detach() for p in tiny.parameters()]))
        for a, b in zip(p0, p1):
            assert torch.allclose(a, b, atol=PARAM_ATOL, rtol=PARAM_RTOL)
        assert m0["actor/loss"] == pytest.approx(m1["actor/loss"], abs=1e-6)
        assert m0["actor/m2_all_tokens"] == pytest.approx(m1["actor/m2_all_tokens"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_packed_logprobs_equal_padded_and_each_row_alone(real_model_dir):
    """SmolLM2-135M (llama architecture, sdpa): the probe passes and packed log-probs equal the padded path's and each
    row's own. float32 rounding across shapes is larger at its scale (logits up to ~35): measured <= 2e-5."""
    model, _ = load_policy(str(real_model_dir), dtype="float32", device="cpu")
    assert packing_check(model) == (True, "")
    padded, packed = _actor(model, pack=False), _actor(model, pack=True)
    batch = _random_batch(model.config.vocab_size, seed=1, n=5)
    mask = batch.response_mask
    lp_padded, lp_packed = padded.compute_logp(batch), packed.compute_logp(batch)
    alone = torch.zeros_like(lp_padded)
    for i in range(batch.num_rows):
        row = batch.select([i])
        alone[i, :row.response_ids.shape[1]] = padded.compute_logp(row)[0]
    assert torch.allclose(lp_packed[mask], alone[mask], atol=1e-4, rtol=0)
    assert torch.allclose(lp_packed[mask], lp_padded[mask], atol=1e-4, rtol=0)
