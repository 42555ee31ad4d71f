"""Chunked log-probs from hidden states (stalerl.core.chunked_logprob) against the literal plain computation: full logits
``F.linear(h, W)`` under the same autocast, float32 ``log_softmax`` over the whole vocabulary, gather. Values and
gradients (hidden states and weight) on random inputs; through the actor on real tiny models; and the memory claim
(nothing of size tokens x vocab is saved for backward)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from stalerl.core.chunked_logprob import (chunked_logprob_check, chunked_token_logprobs, head_returns_token_logprobs,
                                         reproduces_plain_logprobs)

U_BF16 = 2.0 ** -8  # bf16 unit roundoff is 2^-9 (8 significand bits); 2^-8 bounds two roundings


def _autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cpu", enabled=False)


def plain_logprobs(h, w, ids, temperature):
    """The literal reference: whole (N, T, V) logits, full log-softmax, gather."""
    logits = torch.nn.functional.linear(h, w)
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _run(fn, h0, w0, ids, go, dtype):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    with _autocast(dtype):
        lp = fn(h, w)
    (lp * go).sum().backward()
    return lp.detach(), h.grad, w.grad


def _inputs(seed, n=3, t=7, hidden=16, vocab=301):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, t, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    ids = torch.randint(0, vocab, (n, t), generator=g)
    go = torch.randn(n, t, generator=g)
    return h, w, ids, go


@pytest.mark.parametrize("chunk", [1, 4, 21, 1000, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_values_and_gradients_equal_the_plain_computation(chunk, temperature, seed):
    h, w, ids, go = _inputs(seed)
    fast = _run(lambda a, b: chunked_token_logprobs(a, b, ids, temperature, chunk), h, w, ids, go, "fp32")
    slow = _run(lambda a, b: plain_logprobs(a, b, ids, temperature), h, w, ids, go, "fp32")
    assert fast[0].dtype == torch.float32 and fast[0].shape == ids.shape
    # 1e-5, plus float32 rounding relative to the value for the largest gradients here (|grad| up to ~7; the plain
    # float32 computation itself is ~2e-6 away from a float64 one)
    for name, a, b in zip(("log-probs", "grad hidden", "grad weight"), fast, slow):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-5, msg=name)
    assert float(slow[2].abs().max()) > 0.1  # real gradients


@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_autocast_matches_the_plain_computation_within_the_stated_bound(chunk, temperature):
    """Under bf16 autocast both compute the same bf16 logits and the same bf16 gradient of them; the log-probs and
    the hidden-state gradient are the same operations (bound: one bf16 rounding of the logits, 2^-8 |logit| / T, in
    case a matmul blocks differently by chunk). The weight gradient is a sum over tokens: plain rounds the full sum
    to bf16 once, chunked rounds each chunk's sum and adds them in float32, so each element differs by at most
    2^-8 * sum_t |dL/dlogit_tv * h_t| (two roundings of partial sums bounded by that sum)."""
    h, w, ids, go = _inputs(2, vocab=257)
    fast = _run(lambda a, b: chunked_token_logprobs(a, b, ids, temperature, chunk), h, w, ids, go, "bf16")
    slow = _run(lambda a, b: plain_logprobs(a, b, ids, temperature), h, w, ids, go, "bf16")
    logits = torch.nn.functional.linear(h.bfloat16(), w.bfloat16()).float()
    assert float((fast[0] - slow[0]).abs().max()) <= 2 * U_BF16 * float(logits.abs().max()) / temperature
    # |dL/dlogits| from the float32 reference, as bf16 would round it
    h32, w32 = h.clone().requires_grad_(), w.clone()
    x = torch.nn.functional.linear(h32, w32)
    (gx,) = torch.autograd.grad((plain_logprobs_from_logits(x, ids, temperature) * go).sum(), x)
    grad_h_scale = (gx.abs() @ w.abs()).reshape(h.shape)
    grad_w_scale = gx.abs().reshape(-1, w.shape[0]).t() @ h.abs().reshape(-1, h.shape[-1])
    assert bool(((fast[1] - slow[1]).abs() <= 2 * U_BF16 * grad_h_scale + 1e-6).all())
    assert bool(((fast[2] - slow[2]).abs() <= 2 * U_BF16 * grad_w_scale + 1e-6).all())
    # and the bf16 results are bf16-accurate, not equal by accident of both being wrong
    ref = _run(lambda a, b: plain_logprobs(a, b, ids, temperature), h, w, ids, go, "fp32")
    assert float((fast[0] - ref[0]).abs().max()) > 0  # bf16 really ran
    assert float((fast[2] - ref[2]).abs().max()) <= 4 * U_BF16 * float(grad_w_scale.max())


def plain_logprobs_from_logits(x, ids, temperature):
    return torch.log_softmax(x.float() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def test_no_grad_pass_and_bad_shapes():
    h, w, ids, _ = _inputs(3)
    with torch.no_grad():
        got = chunked_token_logprobs(h, w, ids, 1.0, 5)
    torch.testing.assert_close(got, plain_logprobs(h, w, ids, 1.0), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="do not match target ids"):
        chunked_token_logprobs(h[:, :3], w, ids)
    with pytest.raises(ValueError, match="must be \\(vocab, 16\\)"):
        chunked_token_logprobs(h, w[:, :5], ids)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_token_logprobs(h, w, ids, 0.0)


def test_nothing_of_size_tokens_by_vocab_is_saved_for_backward():
    """The memory claim: the plain path saves the (tokens, vocab) logits (and softmax) for backward; the chunked
    one saves only tokens x hidden and per-token scalars besides the weight."""
    n, t, hidden, vocab = 4, 16, 8, 4096
    h, w, ids, _ = _inputs(4, n, t, hidden, vocab)
    saved: list[int] = []

    def pack(x):
        saved.append(x.numel())
        return x

    for fn, expect_big in ((plain_logprobs, True), (chunked_token_logprobs, False)):
        saved.clear()
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn(hh, ww, ids, 1.0)
        biggest_activation = max(s for s in saved if s != vocab * hidden)  # the weight itself is saved by both
        assert (biggest_activation >= n * t * vocab) == expect_big, (fn.__name__, biggest_activation)


# ------------------------------------------------------------------------------------------------ through the actor


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_actor_log_probs_and_gradients_equal_the_plain_logits_path(arch, dtype):
    from stalerl.training.actor import Actor
    from stalerl.config import load_config
    from stalerl.core.model import PromptFormatter, load_policy
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine

    model, tok = load_policy(f"tiny:{arch}", dtype="float32", device="cpu", seed=0)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward)
    batch = engine.generate(["1+2=?", "30+4=?"], ["3", "34"], n_samples=3, max_new_tokens=8)
    cfg = load_config([f"actor.dtype={dtype}"]).actor
    go = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for chunked in (True, False):
        m = copy.deepcopy(model)
        actor = Actor(m, cfg, temperature=0.8, total_updates=1)
        assert actor.chunked_logprobs  # both tiny models qualify
        actor.chunked_logprobs = chunked
        lp = actor._forward_logp(batch)
        (lp * go).sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in m.parameters()]))
    (lp_c, g_c), (lp_p, g_p) = results
    # one chunk at this vocabulary (128): the same operations, so equal to float rounding in either dtype
    torch.testing.assert_close(lp_c, lp_p, rtol=0, atol=1e-5)
    for a, b in zip(g_c, g_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_models_that_post_process_logits_keep_the_plain_path():
    from stalerl.core.model import load_policy

    model, _ = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    assert reproduces_plain_logprobs(model)

    class SoftCapped(torch.nn.Module):  # e.g. Gemma 2: tanh soft-capping after the head
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kw):
            out = self.inner(**kw)
            return types.SimpleNamespace(logits=30.0 * torch.tanh(out.logits / 30.0) * 2.0)

    assert not reproduces_plain_logprobs(SoftCapped(model))
    biased = copy.deepcopy(model)
    biased.lm_head = torch.nn.Linear(biased.config.hidden_size, biased.config.vocab_size, bias=True)
    assert not reproduces_plain_logprobs(biased)
    # the patch is undone on exit, also after an exception
    with pytest.raises(RuntimeError):
        with head_returns_token_logprobs(model, torch.zeros(1, 1, dtype=torch.long), slice(0, 1)):
            raise RuntimeError
    assert "forward" not in vars(model.lm_head)
    # the reason is said (the actor logs it once and records actor/chunked_logprobs=0)
    assert chunked_logprob_check(model) == (True, "")
    ok, why = chunked_logprob_check(SoftCapped(model))
    assert not ok and "post-processes the head's output" in why
    ok, why = chunked_logprob_check(biased)
    assert not ok and "bias-free linear output head" in why


def test_the_plain_path_fallback_is_logged_once_and_recorded_in_every_update(tmp_path, monkeypatch):
    import stalerl.training.actor as actor_mod
    from conftest import small_overrides
    from stalerl.config import load_config
    from stalerl.training.trainer import Trainer

    monkeypatch.setattr(actor_mod, "chunked_logprob_check", lambda model: (False, "a test's reason"))
    lines: list[str] = []
    cfg = load_config(small_overrides(tmp_path, total_train_steps=2, **{"saver.save_final": False}))
    trainer = Trainer(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    said = [line for line in lines if "plain logits path" in line]
    assert len(said) == 1 and "a test's reason" in said[0]
    assert trainer.train_step()["actor/chunked_logprobs"] == 0.0
    from stalerl.results.run_summary import summarize_metrics

    rows = [{"step": 1, "actor/chunked_logprobs": 1.0}, {"step": 2, "actor/chunked_logprobs": 0.0}]
    assert summarize_metrics(rows)["chunked_logprobs"] == 0  # the summary says so too
    assert summarize_metrics(rows[:1])["chunked_logprobs"] == 1 and summarize_metrics([])["chunked_logprobs"] is None


# ------------------------------------------------------------------------------------ chunk size by device, no sync
def test_chunk_size_follows_the_device_rule():
    """CPU: today's 2^22 logits per chunk (27 tokens at Qwen2's vocabulary), whatever the memory; CUDA: a fraction
    of the device's memory, capped at 2^28 elements (1,766 tokens at 151,936), never below the CPU size. The CUDA
    branch is the pure rule with a given memory (no GPU here); default_chunk_tokens asks the device for it."""
    from stalerl.core import chunked_logprob as cl

    vocab = 151_936
    assert cl.chunk_elements_for("cpu") == cl.CHUNK_ELEMENTS == 1 << 22
    assert cl.chunk_elements_for("cpu", 141 * 2**30) == 1 << 22
    assert cl.chunk_tokens_for(vocab, cl.chunk_elements_for("cpu")) == 27
    assert cl.default_chunk_tokens(torch.device("cpu"), vocab) == 27
    h200, h100, a100_40, card_24 = 141 * 10**9, 80 * 2**30, 40 * 2**30, 24 * 2**30
    assert cl.chunk_tokens_for(vocab, cl.chunk_elements_for("cuda", h200)) == (1 << 28) // vocab == 1766
    assert cl.chunk_tokens_for(vocab, cl.chunk_elements_for("cuda", h100)) == 1766
    assert cl.chunk_tokens_for(vocab, cl.chunk_elements_for("cuda", a100_40)) == (40 * 2**30 // 256) // vocab == 1104
    assert cl.chunk_tokens_for(vocab, cl.chunk_elements_for("cuda", card_24)) == 662
    assert cl.chunk_elements_for("cuda", 2**20) == cl.CHUNK_ELEMENTS  # a tiny device never goes below the CPU size
    with pytest.raises(ValueError, match="total memory"):
        cl.chunk_elements_for("cuda", None)


def test_cpu_default_chunk_is_unchanged(monkeypatch):
    """chunked_token_logprobs on CPU tensors runs with today's chunk (what CPU training used before sizing by
    device), and default_chunk_tokens asks a CUDA device for its memory (stubbed: no GPU here)."""
    from stalerl.core import chunked_logprob as cl

    seen = []
    real = cl._ChunkedTokenLogprob.apply
    monkeypatch.setattr(cl._ChunkedTokenLogprob, "apply", lambda *a: seen.append(a[-1]) or real(*a))
    h, w, ids, _ = _inputs(5, vocab=5000)
    cl.chunked_token_logprobs(h, w, ids)
    assert seen == [cl.CHUNK_ELEMENTS // 5000]
    monkeypatch.setattr(cl, "_cuda_total_memory", lambda index: 80 * 2**30)
    assert cl.default_chunk_tokens(torch.device("cuda:0"), 151_936) == 1766


def _fake_pass(fn):
    """Forward and backward of ``fn(h, w, ids)`` on fake tensors: FakeTensorMode computes only shapes, so an op whose
    output shape depends on tensor values (nonzero behind boolean-mask indexing, masked_select, .item()) raises
    there. On CUDA exactly those ops make the host wait for the device; the test runs the same code on CPU fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h = torch.randn(6, 5, 8, requires_grad=True)
        w = torch.randn(300, 8, requires_grad=True)
        ids = torch.randint(0, 300, (6, 5))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = fn(h, w, ids)
        (lp * 1.5).sum().backward()
        return tuple(h.grad.shape), tuple(w.grad.shape)


def test_forward_and_backward_have_no_data_dependent_shapes():
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    assert _fake_pass(lambda h, w, ids: chunked_token_logprobs(h, w, ids, 0.7, 4)) == ((6, 5, 8), (300, 8))

    def boolean_mask_onehot(h, w, ids):  # the check can fail: the previous backward's rows[hit] / ids[hit]
        lp = chunked_token_logprobs(h, w, ids, 1.0, 4)
        hit = ids.reshape(-1) < 100
        return lp.reshape(-1)[torch.arange(30)[hit]]

    with pytest.raises(DynamicOutputShapeException):
        _fake_pass(boolean_mask_onehot)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_hot_term_is_the_index_put_it_replaced(dtype):
    """The scatter_add one-hot gives bit for bit the previous boolean-mask index_put (kept here as the literal
    reference), so CPU training does not change: gradients compared exactly, with a block boundary inside the
    vocabulary and targets at both ends of blocks."""
    from stalerl.core import chunked_logprob as cl

    h, w, ids, go = _inputs(7, n=4, t=9, vocab=97)
    ids[0, :4] = torch.tensor([0, 96, 31, 32])

    def index_put_backward(ctx, grad_out):  # the code before sizing by device, verbatim
        hidden, weight, ids_, lse = ctx.saved_tensors
        cd, t = ctx.compute_dtype, ctx.temperature
        m, vocab = hidden.shape[0], weight.shape[0]
        block = max(1, (ctx.chunk * vocab) // max(1, m))
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32)
        grad_w = torch.empty_like(weight)
        g = grad_out.float()
        rows = torch.arange(m)
        with torch.autocast("cpu", enabled=False):
            hh = hidden.to(cd)
            for j in range(0, vocab, block):
                ww = weight[j:j + block].to(cd)
                x = cl._chunk_logits(hh, ww, cd, t)
                grad_x = torch.exp(x - lse.unsqueeze(-1)).mul_(-g.unsqueeze(-1))
                hit = (ids_ >= j) & (ids_ < j + block)
                grad_x.index_put_((rows[hit], ids_[hit] - j), g[hit], accumulate=True)
                if t != 1.0:
                    grad_x.div_(t)
                grad_logits = grad_x.to(cd)
                grad_w[j:j + block] = (grad_logits.t() @ hh).to(weight.dtype)
                if cd == torch.float32:
                    grad_h.addmm_(grad_logits, ww)
                else:
                    grad_h.add_(grad_logits @ ww)
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None

    new = _run(lambda a, b: chunked_token_logprobs(a, b, ids, 0.7, 3), h, w, ids, go, dtype)

    class Old(cl._ChunkedTokenLogprob):
        backward = staticmethod(index_put_backward)

    def old_fn(a, b):
        cd = cl._compute_dtype(a.device, torch.float32)
        return Old.apply(a.reshape(-1, a.shape[-1]), b, ids.reshape(-1), 0.7, cd, 3).view(ids.shape)

    old = _run(old_fn, h, w, ids, go, dtype)
    for a, b in zip(new, old):
        assert torch.equal(a, b)
    assert float(new[2].abs().max()) > 0.1
