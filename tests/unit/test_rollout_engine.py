"""The HF engine's behaviour log-probs must be what the trainer computes for the same weights."""

import pytest
import torch

from stalerl.training.actor import Actor
from stalerl.config import load_config
from stalerl.core.model import PromptFormatter
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.batch import concat_batches
from conftest import end_token_state
from stalerl.rollout.engine import HFRolloutEngine, _mask_through_first_eos, stop_token_ids

QUESTIONS = ["12+7=?", "3+45=?", "99+1=?"]
ANSWERS = ["19", "48", "100"]


def _engine(model, tok, version=3):
    return HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, version=version)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logp_matches_trainer_recompute(tiny_policy, temperature):
    model, tok = tiny_policy
    torch.manual_seed(1)
    batch = _engine(model, tok).generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8, temperature=temperature)
    cfg = load_config([])
    actor = Actor(model, cfg.actor, temperature=temperature, total_updates=1)
    recomputed = actor.compute_logp(batch)
    m = batch.response_mask
    assert m.sum() > 0
    diff = (recomputed - batch.behavior_logp)[m].abs().max().item()
    assert diff < 1e-4, diff
    assert torch.all(batch.behavior_logp[m] <= 0)


def test_batch_layout_versions_groups_and_rewards(tiny_policy):
    model, tok = tiny_policy
    torch.manual_seed(2)
    batch = _engine(model, tok, version=7).generate(QUESTIONS, ANSWERS, n_samples=2, max_new_tokens=6)
    assert batch.num_rows == 6
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.all(batch.versions[batch.response_mask] == 7)
    assert torch.all(batch.versions[~batch.response_mask] == -1)
    assert torch.all(batch.response_ids[~batch.response_mask] == tok.pad_token_id)
    expected = [gsm8k_reward(t, a) for t, a in zip(batch.texts, batch.answers)]
    assert batch.rewards.tolist() == expected
    assert batch.answers == ["19", "19", "48", "48", "100", "100"]


def test_mask_through_first_eos():
    ids = torch.tensor([[5, 1, 9, 9], [5, 6, 7, 8], [1, 1, 0, 0]])
    mask = _mask_through_first_eos(ids, eos_id=1)
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True], [True, False, False, False]]


def _mask_reference(ids: torch.Tensor, stops: list[int]) -> torch.Tensor:
    """The literal rule: walk each row, keep tokens until (and including) the first end token."""
    out = torch.zeros(ids.shape, dtype=torch.bool)
    for i, row in enumerate(ids.tolist()):
        for j, token in enumerate(row):
            out[i, j] = True
            if token in stops:
                break
    return out


@pytest.mark.parametrize("seed", range(5))
def test_mask_through_first_end_token_equals_the_literal_rule(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (9, 11), generator=g)
    for stops in ([1], [1, 4], [0, 2, 5]):
        assert torch.equal(_mask_through_first_eos(ids, stops), _mask_reference(ids, stops)), stops


def test_stop_tokens_are_the_tokenizer_eos_and_every_generation_config_eos(two_end_token_policy, tiny_policy):
    model, tok = two_end_token_policy
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.bos_token_id]  # read from the file
    assert stop_token_ids(tok, model.generation_config) == (tok.eos_token_id, tok.bos_token_id)
    assert _engine(model, tok).stop_ids == (tok.eos_token_id, tok.bos_token_id)
    plain_model, plain_tok = tiny_policy
    assert _engine(plain_model, plain_tok).stop_ids == (plain_tok.eos_token_id,)


@pytest.mark.parametrize("decode", ["static", "generate"])
@pytest.mark.parametrize("greedy", [True, False])
def test_hf_engine_stops_at_the_second_end_token(two_end_token_policy, greedy, decode):
    """Before: the HF engine stopped only at the tokenizer's eos and ran past <bos> to max_new_tokens."""
    model, tok = two_end_token_policy
    model.load_state_dict(end_token_state(model, tok.bos_token_id))
    torch.manual_seed(7)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, decode=decode)
    out = engine.generate(QUESTIONS, ANSWERS, n_samples=2, max_new_tokens=6, greedy=greedy)
    assert out.response_ids[:, 0].tolist() == [tok.bos_token_id] * 6  # the construction works
    assert out.response_mask.sum(dim=1).tolist() == [1] * 6  # ended there, the end token kept
    assert (out.response_ids[:, 1:] == tok.pad_token_id).all()
    assert out.texts == [""] * 6


def test_greedy_is_deterministic(tiny_policy):
    model, tok = tiny_policy
    e = _engine(model, tok)
    a = e.generate(QUESTIONS, ANSWERS, n_samples=1, max_new_tokens=6, greedy=True)
    torch.manual_seed(123)
    b = e.generate(QUESTIONS, ANSWERS, n_samples=1, max_new_tokens=6, greedy=True)
    assert torch.equal(a.response_ids, b.response_ids)


def test_select_and_concat_roundtrip(tiny_policy):
    model, tok = tiny_policy
    torch.manual_seed(3)
    e = _engine(model, tok)
    b1 = e.generate(QUESTIONS[:2], ANSWERS[:2], n_samples=2, max_new_tokens=5)
    b2 = e.generate(QUESTIONS[2:], ANSWERS[2:], n_samples=2, max_new_tokens=8)
    both = concat_batches([b1, b2], tok.pad_token_id)
    assert both.num_rows == 6
    assert both.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    again = both.select([4, 5])
    # the same tokens and log-probs as b2, after trimming the extra padding
    assert torch.equal(again.response_ids[again.response_mask], b2.response_ids[b2.response_mask])
    assert torch.equal(again.behavior_logp[again.response_mask], b2.behavior_logp[b2.response_mask])


def test_checkpoint_generation_config_does_not_distort_behaviour_logp(tiny_policy, tmp_path):
    """A real checkpoint's generation_config.json (repetition_penalty, top_k, ...) must not reach the sampler."""
    from stalerl.core.model import load_policy

    model, tok = tiny_policy
    model.generation_config.repetition_penalty = 1.5
    model.generation_config.top_k = 3
    model.generation_config.do_sample = True
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    loaded, tok2 = load_policy(str(tmp_path / "ckpt"), device="cpu")
    assert loaded.generation_config.repetition_penalty == 1.5
    torch.manual_seed(4)
    batch = _engine(loaded, tok2).generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8)
    cfg = load_config([])
    recomputed = Actor(loaded, cfg.actor, temperature=1.0, total_updates=1).compute_logp(batch)
    m = batch.response_mask
    assert (recomputed - batch.behavior_logp)[m].abs().max().item() < 1e-4


def _processed_logp_reference(model, batch, temperature, top_k, top_p):
    """Behaviour log-probs the slow way: a full forward, transformers' warpers on every position, log_softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from stalerl.rollout.batch import position_ids_from_mask

    attn = batch.attention_mask()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids(), attention_mask=attn.long(),
                       position_ids=position_ids_from_mask(attn)).logits.float()
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    cols = []
    for t in range(r):
        s = logits[:, p - 1 + t]
        for w in ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []) + \
                 ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []):
            s = w(None, s)
        cols.append(torch.log_softmax(s, dim=-1).gather(-1, batch.response_ids[:, t:t + 1]).squeeze(-1))
    return torch.stack(cols, dim=1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 7, 1.0),
                                                       (1.0, 0, 0.8), (0.6, 10, 0.9)])
def test_behaviour_logp_is_the_processed_distribution(tiny_policy, temperature, top_k, top_p):
    model, tok = tiny_policy
    torch.manual_seed(6)
    batch = _engine(model, tok).generate(QUESTIONS, ANSWERS, n_samples=3, max_new_tokens=7, temperature=temperature,
                                         top_k=top_k, top_p=top_p)
    m = batch.response_mask
    ref = _processed_logp_reference(model, batch, temperature, top_k, top_p)
    assert torch.isfinite(ref[m]).all()  # every sampled token lies inside the truncated support
    assert (ref - batch.behavior_logp)[m].abs().max().item() < 1e-4


def test_generation_keeps_no_per_step_score_stack(tiny_policy, monkeypatch):
    """O(tokens) memory on the generate path: generate is never asked for the (rows x steps x vocab) scores (the
    static path keeps one step's scores by construction: stalerl.rollout.static_decode)."""
    model, tok = tiny_policy
    seen = []
    original = model.generate

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append((kwargs["generation_config"].output_scores, getattr(out, "scores", None)))
        return out

    monkeypatch.setattr(model, "generate", spy)
    torch.manual_seed(7)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, decode="generate")
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=2, max_new_tokens=6, temperature=0.9)
    assert len(seen) == 1 and not seen[0][0] and seen[0][1] is None
    assert (batch.behavior_logp[batch.response_mask] < 0).all()


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0)])
def test_truncated_sampling_makes_the_on_policy_log_ratio_negative_on_every_token(tiny_policy, top_k, top_p):
    """Why gconfig.top_p < 1 / top_k > 0 are refused for training: the trainer's log-prob (full softmax) of a token
    drawn from the truncated distribution is below the behaviour log-prob by log(kept mass) on every token."""
    model, tok = tiny_policy
    torch.manual_seed(8)
    batch = _engine(model, tok).generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8, top_k=top_k, top_p=top_p)
    actor = Actor(model, load_config([]).actor, temperature=1.0, total_updates=1)
    ratio = (actor.compute_logp(batch) - batch.behavior_logp)[batch.response_mask]
    assert ratio.numel() > 20 and (ratio < -1e-3).all(), ratio.max()
