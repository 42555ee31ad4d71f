"""The real-scale training path (issue 9): fp32 master weights with bf16 compute, float16 refused, no clipping at
gradient_clipping=0, dropout off, the logged learning rate and token-weighted micro-batch metrics."""

from __future__ import annotations

import copy

import pytest
import torch

from recipe.declaration import MAX, SUM, mean_over, reduce_metrics
from stalerl.training.actor import Actor
from stalerl.training.advantage import grpo_advantages
from stalerl.config import ConfigError, NormConfig, load_config
from stalerl.core.model import PromptFormatter, load_policy, load_policy_from_config
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.engine import HFRolloutEngine

QUESTIONS = ["12+7=?", "3+45=?", "99+1=?", "8+8=?"]
ANSWERS = ["19", "48", "100", "16"]


def _batch(model, tok, *, compute_dtype="float32", seed=5, perturb=0.0):
    torch.manual_seed(seed)
    behaviour = model
    if perturb:
        behaviour = copy.deepcopy(model)
        with torch.no_grad():
            for p in behaviour.parameters():
                p.add_(perturb * torch.randn_like(p))
    engine = HFRolloutEngine(behaviour, tok, PromptFormatter(tok).format, gsm8k_reward, compute_dtype=compute_dtype)
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=8)
    batch.rewards = (torch.rand(batch.num_rows) > 0.5).float()
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.response_mask, adv_norm=NormConfig())
    return batch, adv


def _actor(model, *overrides, total_updates=1):
    cfg = load_config(list(overrides))
    return Actor(model, cfg.actor, temperature=1.0, total_updates=total_updates)


# ------------------------------------------------------------------------------------------------ mixed precision


def test_bfloat16_run_keeps_fp32_master_weights_and_moves_them_at_lr_1e6(tmp_path):
    cfg = load_config(["actor.dtype=bfloat16", "actor.device=cpu", "actor.optimizer.lr=1e-6",
                       f"cluster.fileroot={tmp_path}"])
    model, tok = load_policy_from_config(cfg)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    batch, adv = _batch(model, tok, compute_dtype="bfloat16", perturb=0.02)
    actor = Actor(model, cfg.actor, temperature=1.0, total_updates=1)
    layers = {n: p.detach().clone() for n, p in model.named_parameters() if ".layers." in n}
    actor.update(batch, adv)
    changed = sum(int((p.detach() != layers[n]).sum()) for n, p in model.named_parameters() if n in layers)
    total = sum(t.numel() for t in layers.values())
    # bf16 parameters would not move at all (an lr 1e-6 step is far below half a bf16 ulp of ~0.02-sized weights)
    assert changed / total > 0.9, changed / total


def test_bfloat16_compute_runs_under_autocast_and_recompute_equals_training_forward(tiny_policy):
    model, tok = tiny_policy
    batch, adv = _batch(model, tok)
    fp32 = _actor(copy.deepcopy(model)).compute_logp(batch)
    bf16_actor = _actor(copy.deepcopy(model), "actor.dtype=bfloat16", "actor.optimizer.type=sgd",
                        "actor.optimizer.lr=1e-30")
    bf16 = bf16_actor.compute_logp(batch)
    m = batch.response_mask
    diff = (bf16 - fp32)[m].abs().max().item()
    assert 0 < diff < 0.5, diff  # bf16 matmuls: close to, but not bit-equal with, the fp32 forward
    # behaviour log-probs recomputed in bf16 = the bf16 training forward at the same weights: log-ratio exactly 0
    batch.behavior_logp = bf16
    metrics = bf16_actor.update(batch, adv)
    assert metrics["actor/log_ratio_abs_max"] == 0.0


def test_actor_refuses_low_precision_parameters():
    model, _ = load_policy("tiny:qwen2", dtype="bfloat16", device="cpu", seed=0)
    with pytest.raises(ValueError, match="float32 master parameters"):
        _actor(model, "actor.dtype=bfloat16")


@pytest.mark.parametrize("device", ["cpu", "cuda", "auto"])
def test_float16_refused_at_load(device):
    with pytest.raises(ConfigError) as info:
        load_config(["actor.dtype=float16", f"actor.device={device}"])
    msg = str(info.value)
    assert "actor.dtype" in msg and "loss scaling" in msg and "bfloat16" in msg


# ------------------------------------------------------------------------------------------------ clipping / lr


def _sgd_update(model, batch, adv, *overrides):
    m = copy.deepcopy(model)
    metrics = _actor(m, "actor.optimizer.type=sgd", "actor.optimizer.lr=0.5", *overrides).update(batch, adv)
    return [p.detach().clone() for p in m.parameters()], metrics


def test_gradient_clipping_zero_means_no_clipping(tiny_policy):
    model, tok = tiny_policy
    batch, adv = _batch(model, tok, perturb=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    off, m_off = _sgd_update(model, batch, adv, "actor.optimizer.gradient_clipping=0")
    huge, m_huge = _sgd_update(model, batch, adv, "actor.optimizer.gradient_clipping=1e12")
    assert m_off["actor/grad_norm"] > 0 and m_off["actor/grad_norm"] == pytest.approx(m_huge["actor/grad_norm"])
    assert any(not torch.equal(a, b) for a, b in zip(off, before))  # 0 used to multiply every gradient by 0
    for a, b in zip(off, huge):
        assert torch.equal(a, b)


def test_logged_lr_is_the_rate_of_this_step(tiny_policy):
    model, tok = tiny_policy
    batch, adv = _batch(model, tok)
    # linear warm-up over 4 of 8 updates: the first step runs at lr/4, the second at lr/2
    actor = _actor(copy.deepcopy(model), "actor.optimizer.lr=1e-3", "actor.optimizer.warmup_steps_proportion=0.5",
                   total_updates=8)
    seen = []
    for _ in range(2):
        used = actor.optimizer.param_groups[0]["lr"]
        seen.append((actor.update(batch, adv)["actor/lr"], used))
    assert seen[0] == (pytest.approx(2.5e-4), pytest.approx(2.5e-4))
    assert seen[1] == (pytest.approx(5e-4), pytest.approx(5e-4))


# ------------------------------------------------------------------------------------------------ micro-batch metrics


def test_reduce_metrics_rules():
    """Undeclared keys follow the naming convention; declared ones their rule (a declared weight may be a caller's
    count or another metric of the loss)."""
    c1, c3 = {"valid_tokens": 1.0, "rows": 1.0}, {"valid_tokens": 3.0, "rows": 1.0}
    parts = [(c1, {"l/clip_fraction": 1.0, "l/ratio_max": 3.0, "l/num_masked_tokens": 1.0}),
             (c3, {"l/clip_fraction": 0.0, "l/ratio_max": 2.0, "l/num_masked_tokens": 2.0})]
    out = reduce_metrics(parts, {})
    assert out == {"l/clip_fraction": 0.25, "l/ratio_max": 3.0, "l/num_masked_tokens": 3.0}
    zero = {"valid_tokens": 0.0, "rows": 0.0}
    assert reduce_metrics([(zero, {"a": 1.0}), (zero, {"a": 3.0})], {}) == {"a": 2.0}
    rules = {"l/clip_fraction": mean_over("rows"), "l/ratio_max": SUM, "l/num_masked_tokens": MAX}
    assert reduce_metrics(parts, rules) == {"l/clip_fraction": 0.5, "l/ratio_max": 5.0, "l/num_masked_tokens": 2.0}
    kept = [(c1, {"f/frac": 0.5, "f/num_kept": 4.0}), (c3, {"f/frac": 1.0, "f/num_kept": 12.0})]
    out = reduce_metrics(kept, {"f/frac": mean_over("f/num_kept"), "f/num_kept": SUM})
    assert out == {"f/frac": (0.5 * 4 + 12.0) / 16, "f/num_kept": 16.0}

@pytest.mark.parametrize("loss, keys", [("vanilla", ("vanilla/clip_fraction", "vanilla/ppo_kl")),
                                        ("no_trust_region", ("no_trust_region/ratio_mean",
                                                             "no_trust_region/ratio_max", "no_trust_region/ppo_kl")),
                                        # fipo/sequence_drop_ratio is a share of rows: token-weighting across
                                        # micro-batches makes it approximate, so it is not listed
                                        ("fipo", ("fipo/influence_weights_mean_raw",
                                                  "fipo/influence_weight_clip_ratio_upper",
                                                  "fipo/influence_weight_clip_ratio_lower"))])
def test_micro_batch_metrics_equal_whole_mini_batch_metrics(tiny_policy, loss, keys):
    model, tok = tiny_policy
    batch, adv = _batch(model, tok, perturb=0.05)
    # uneven response lengths (as eos makes them), so micro-batches hold different token counts
    for i in range(0, batch.num_rows, 3):
        batch.response_mask[i, 2 + i % 4:] = False
        batch.response_ids[i, 2 + i % 4:] = tok.pad_token_id
    adv = adv * batch.response_mask
    common = (f"actor.loss={loss}", "actor.optimizer.gradient_clipping=1e9")
    _, whole = _sgd_update(model, batch, adv, *common, "actor.mb_spec.max_tokens_per_mb=100000")
    _, split = _sgd_update(model, batch, adv, *common, "actor.mb_spec.max_tokens_per_mb=40")
    assert whole["actor/num_micro_batches"] == 1 and split["actor/num_micro_batches"] > 3
    assert whole[f"actor/{keys[0]}"] != 0
    for k in keys:
        assert split[f"actor/{k}"] == pytest.approx(whole[f"actor/{k}"], rel=1e-5, abs=1e-7), k


# ------------------------------------------------------------------------------------------------ dropout


@pytest.fixture
def dropout_policy(tmp_path):
    """A checkpoint whose config has attention_dropout 0.1 (the HF modules read it in train mode)."""
    model, tok = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    model.config.attention_dropout = 0.1
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    loaded, tok2 = load_policy(str(tmp_path / "ckpt"), device="cpu")
    assert any(getattr(m, "attention_dropout", 0.0) == 0.1 for m in loaded.modules())
    return loaded, tok2


def test_dropout_off_gives_zero_on_policy_log_ratio(dropout_policy):
    model, tok = dropout_policy
    batch, adv = _batch(model, tok)
    actor = _actor(model)
    batch.behavior_logp = actor.compute_logp(batch)  # staleness 0, behaviour at the current weights
    torch.manual_seed(0)
    metrics = actor.update(batch, adv)
    assert metrics["actor/log_ratio_abs_max"] == 0.0
    assert metrics["actor/m2_all_tokens"] == 0.0


def test_dropout_off_micro_batch_split_does_not_change_the_update(dropout_policy):
    model, tok = dropout_policy
    batch, adv = _batch(model, tok, perturb=0.05)
    common = ("actor.optimizer.gradient_clipping=1e9", "actor.loss=vanilla")
    torch.manual_seed(1)
    whole, _ = _sgd_update(model, batch, adv, *common, "actor.mb_spec.max_tokens_per_mb=100000")
    torch.manual_seed(2)
    split, m = _sgd_update(model, batch, adv, *common, "actor.mb_spec.max_tokens_per_mb=40")
    assert m["actor/num_micro_batches"] > 3
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ O(tokens) log-probs


@pytest.mark.parametrize("chunk", [None, 1 << 24, 7, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_equal_the_full_log_softmax(chunk, temperature):
    import stalerl.training.actor as actor_mod

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 4, 33, generator=g) * 3).requires_grad_()
    ids = torch.randint(0, 33, (5, 4), generator=g)
    fast = actor_mod.token_logprobs(logits, ids, temperature, chunk)
    slow = torch.log_softmax(logits.double() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(fast.double(), slow, rtol=0, atol=1e-5)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    (g_fast,) = torch.autograd.grad((fast.double() * w).sum(), logits)
    (g_slow,) = torch.autograd.grad((slow * w).sum(), logits)
    torch.testing.assert_close(g_fast.double(), g_slow.double(), rtol=1e-4, atol=1e-6)
    bf = actor_mod.token_logprobs(logits.detach().bfloat16(), ids, temperature)
    assert bf.dtype == torch.float32


def test_token_logprobs_rows_per_chunk_follow_the_device_budget(monkeypatch):
    """The plain path's row chunks use chunked_logprob's one device rule (no second constant): 2^22 logits on a CPU;
    on CUDA the device's budget (memory stubbed, no GPU here: a meta tensor stands in for the device's logits)."""
    import stalerl.core.chunked_logprob as cl
    import stalerl.training.actor as actor_mod

    assert cl.default_chunk_elements(torch.device("cpu")) == cl.CHUNK_ELEMENTS
    monkeypatch.setattr(cl, "_cuda_total_memory", lambda index: 80 * 2**30)
    assert cl.default_chunk_elements(torch.device("cuda", 0)) == cl.chunk_elements_for("cuda", 80 * 2**30) == 1 << 28
    seen, rows = [], []
    monkeypatch.setattr(actor_mod, "default_chunk_elements", lambda d: seen.append(d.type) or 3 * 4 * 33)
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda parts: rows.extend(p.shape[0] for p in parts) or real_cat(parts))
    logits, ids = torch.randn(7, 4, 33), torch.randint(0, 33, (7, 4))
    actor_mod.token_logprobs(logits, ids)
    assert seen == ["cpu"] and rows == [3, 3, 1]  # 3 rows of 4 x 33 logits per chunk


def test_recorder_gathers_each_sampled_token_under_the_processed_distribution():
    """Step t's scores are held until the token sampled from them shows up (next call's last column, or finish)."""
    from stalerl.rollout.engine import SampledLogProbRecorder

    g = torch.Generator().manual_seed(0)
    rec = SampledLogProbRecorder(temperature=0.9, top_k=4)
    ids = torch.tensor([[5, 6], [7, 8]])
    s1, s2 = torch.randn(2, 10, generator=g), torch.randn(2, 10, generator=g)
    p1 = rec(ids, s1.clone())
    p2 = rec(torch.cat([ids, p1.argmax(-1, keepdim=True)], 1), s2.clone())
    seqs = torch.cat([ids, p1.argmax(-1, keepdim=True), p2.argmax(-1, keepdim=True)], 1)
    out = rec.finish(seqs, 2)

    def ref(s, tok):
        top = s / 0.9
        kth = top.topk(4, dim=-1).values[:, -1:]
        top = top.masked_fill(top < kth, -float("inf"))
        return torch.log_softmax(top, -1).gather(-1, tok[:, None]).squeeze(-1)

    expected = torch.stack([ref(s1, seqs[:, 2]), ref(s2, seqs[:, 3])], 1)
    torch.testing.assert_close(out, expected)
    assert torch.isinf(p1).sum(-1).tolist() == [6, 6]  # the warpers ran inside the recorder
    with pytest.raises(RuntimeError, match="out of step"):
        SampledLogProbRecorder().finish(seqs, 2)


def test_ratio_max_is_the_largest_importance_ratio_for_every_loss(tiny_policy):
    """actor/ratio_max (kept in run summaries as a drift diagnostic) = max over valid tokens of exp(logp - behaviour),
    computed literally here from a forward at the pre-update weights; 1 exactly on-policy."""
    model, tok = tiny_policy
    batch, adv = _batch(model, tok, perturb=0.05)
    for loss in ("m2po", "vanilla"):
        actor = _actor(copy.deepcopy(model), f"actor.loss={loss}")
        current = actor.compute_logp(batch)
        literal = torch.exp((current - batch.behavior_logp)[batch.response_mask]).max().item()
        metrics = actor.update(batch, adv)
        assert metrics["actor/ratio_max"] == pytest.approx(literal, rel=1e-5)
        assert metrics["actor/ratio_max"] > 1.0
    actor = _actor(copy.deepcopy(model))
    batch.behavior_logp = actor.compute_logp(batch)
    assert actor.update(batch, adv)["actor/ratio_max"] == 1.0


def test_rollout_entropy_is_the_mean_surprisal_of_the_sampled_tokens(tiny_policy):
    from stalerl.training.trainer import Trainer

    model, tok = tiny_policy
    batch, _ = _batch(model, tok)
    vals = [-float(batch.behavior_logp[i, j]) for i in range(batch.num_rows)
            for j in range(batch.response_ids.shape[1]) if batch.response_mask[i, j]]
    assert Trainer.batch_metrics(batch)["rollout/entropy"] == pytest.approx(sum(vals) / len(vals), rel=1e-6)
