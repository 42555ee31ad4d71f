"""scripts/gpu_check_numerics.py (the GPU check's numerics) on CPU: every comparison states its tolerance and passes
for the code as it is, and each kind of entry catches an injected error: a log-prob moved by 1e-3 on one token
(float32 gradients), a bf16 gradient off by a fraction of a bf16 ulp, a float32 head computed in bf16, bf16 log-probs
rounded once more, a decision threshold moved (masked / clipped / dropped counts), an FSDP step with another learning
rate."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from conftest import REPO

_spec = importlib.util.spec_from_file_location("gpu_check_numerics", REPO / "scripts" / "gpu_check_numerics.py")
num = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(num)


def _by(result, check, dtype, quantity):
    return next(e for e in result["entries"] if e["check"] == check and e["dtype"] == dtype
                and e["quantity"] == quantity)


def test_losses_and_log_probs_pass_with_stated_tolerances_and_restore_torch_settings():
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    result = num.run_all("cpu", ("losses", "logprobs"))
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, det)
    assert result["ok"], result["summary"]
    entries = result["entries"]
    checks = {(e["check"], e["dtype"]) for e in entries}
    for loss in ("m2po", "fipo", "vanilla"):
        for dtype in ("float32", "bfloat16"):
            assert (f"loss/{loss}", dtype) in checks
    assert {e["dtype"] for e in entries if e["check"].startswith("logprob/")} == {"float32", "bfloat16"}
    for e in entries:
        assert e["passed"] and math.isfinite(e["error"]) and e["tolerance"] >= 0 and e["rule"], e
    # the fixed batch exercises every decision: M2PO masks, PPO clips, FIPO drops a row (and the reference agrees)
    for check, quantity in (("loss/m2po", "masked tokens"), ("loss/vanilla", "clipped tokens"),
                            ("loss/fipo", "dropped rows")):
        e = _by(result, check, "float32", quantity)
        assert e["reference"] > 0 and e["value"] == e["reference"] and e["tolerance"] == 0
    # bf16: inputs rounded to bf16, the loss computed after widening (float32 tolerance), the gradient in bf16:
    # every element equals the float64 reference rounded to bf16 (tolerance 0), and bf16 rounding is visible
    for loss in ("m2po", "fipo", "vanilla"):
        e = _by(result, f"loss/{loss}", "bfloat16", "grad log_prob")
        assert e["tolerance"] == 0 and e["error"] == 0 and e["exactly_rounded"] > 0 and e["max_rel_vs_float64"] > 1e-4
    # bf16 losses fed log-probs computed in bf16: the log-probs within their rounding bound (and near it: the bound
    # is tight), decisions as the reference's on those inputs and within their slack of the exact ones, the loss
    # within the bf16 inputs' effect + 2e-5 S of the exact loss, that effect within its a-priori bound
    for loss, dname in (("m2po", "masked tokens"), ("vanilla", "clipped tokens"), ("fipo", "dropped rows")):
        lp = _by(result, f"loss/{loss}", "bfloat16", "bf16 log-probs vs exact")
        assert 0.5 < lp["error"] <= 1
        assert _by(result, f"loss/{loss}", "bfloat16", dname)["tolerance"] == 0
        vs_exact = _by(result, f"loss/{loss}", "bfloat16", f"{dname} vs exact")
        assert vs_exact["reference"] > 0 and vs_exact["tolerance"] == (18 if loss == "m2po" else 0)
        e = _by(result, f"loss/{loss}", "bfloat16", "loss")
        assert e["rounding_effect"] > 0 and e["error"] <= e["tolerance"] < 2e-4  # the inputs really moved the loss
        prior = _by(result, f"loss/{loss}", "bfloat16", "rounding effect vs its a-priori bound")
        assert prior["passed"] and 0 < prior["error"] < prior["tolerance"]
    # the bf16 chunked-vs-plain log-prob bound comes from the rounding analysis: within 100x of the observed
    # difference (the old uniform 2^-7 |logit|max / T was ~40,000x on the H200)
    for e in result["entries"]:
        if e["check"].startswith("logprob/chunked_vs_plain") and e["dtype"] == "bfloat16" and e["quantity"] == "log-probs":
            assert 0.01 < e["error"] <= 1, e


def test_a_log_prob_off_by_1e_3_on_one_token_fails_the_float32_gradient_check(monkeypatch):
    import recipe.registry as registry

    real = registry.get_policy_loss_fn

    def nudged(name):
        fn = real(name)

        def wrapper(*, log_prob, **kw):
            bump = torch.zeros_like(log_prob)
            bump[0, 0] = 1e-3
            return fn(log_prob=log_prob + bump, **kw)
        return wrapper

    monkeypatch.setattr(registry, "get_policy_loss_fn", nudged)
    result = num.run_all("cpu", ("losses",))
    assert not result["ok"]
    for loss in ("m2po", "vanilla", "fipo"):
        e = _by(result, f"loss/{loss}", "float32", "grad log_prob")
        assert not e["passed"] and e["error"] > 10 * e["tolerance"], e


def test_bf16_logits_fail_the_float32_log_prob_bound(monkeypatch):
    """A float32 head that quietly computes its logits in bf16 is far outside the float32 bound (and inside bf16's)."""
    import stalerl.core.chunked_logprob as cl

    real = cl.chunked_token_logprobs

    def low(h, w, ids, temperature=1.0, chunk=None):
        return real(h.bfloat16().float(), w.bfloat16().float(), ids, temperature, chunk)

    monkeypatch.setattr(cl, "chunked_token_logprobs", low)
    result = num.run_all("cpu", ("logprobs",))
    bad = [e for e in result["entries"] if not e["passed"]]
    assert bad and all(e["dtype"] == "float32" and "chunked" in e["check"] for e in bad)
    assert _by(result, "logprob/chunked_vs_float64", "float32", "log-probs")["error"] > 10


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp_d1_step_equals_torch_d1_and_bf16_is_visible():
    result = num.run_all("cpu", ("fsdp",))
    assert result["ok"], result["summary"]
    fsdp = [e for e in result["entries"] if e["check"] == "fsdp_d1_vs_torch_d1"]
    assert {e["dtype"] for e in fsdp} == {"float32", "bfloat16"} and len(fsdp) == 7
    seen = _by(result, "fsdp_d1_vs_torch_d1", "bfloat16", "bf16 vs fp32 compute (the check can see bf16)")
    assert seen["comparison"] == ">=" and seen["error"] >= seen["tolerance"] > 0


def test_a_bf16_gradient_off_by_a_quarter_ulp_fails_the_exact_rounding_check(monkeypatch):
    """The loss scaled by 1 + 2^-9: a bf16 gradient moved by about a quarter of a bf16 ulp (still within two bf16
    roundings of the reference) is not the rounded float64 reference on many elements."""
    import recipe.registry as registry

    real = registry.get_policy_loss_fn

    def scaled(name):
        fn = real(name)

        def wrapper(**kw):
            loss, metrics = fn(**kw)
            return loss * (1 + 2 ** -9), metrics
        return wrapper

    monkeypatch.setattr(registry, "get_policy_loss_fn", scaled)
    result = num.run_all("cpu", ("losses",))
    for loss in ("m2po", "vanilla", "fipo"):
        e = _by(result, f"loss/{loss}", "bfloat16", "grad log_prob")
        assert not e["passed"] and e["error"] > 10, e
        assert e["max_rel_vs_float64"] < 2 * num.U_BF16  # a small error: within two bf16 roundings


def test_a_moved_threshold_fails_the_decision_entries(monkeypatch):
    """The device side run with another M2PO threshold / PPO clip: the masked and clipped counts differ from the
    reference's and those entries (tolerance 0) fail."""
    import recipe.registry as registry

    real = registry.get_policy_loss_fn

    def moved(name):
        fn = real(name)

        def wrapper(*, config, **kw):
            config = dict(config or {})
            if "m2_threshold" in config:
                config.update(m2_threshold=config["m2_threshold"] * 0.5, clip_ratio=config["clip_ratio"] * 0.5)
            return fn(config=config, **kw)
        return wrapper

    monkeypatch.setattr(registry, "get_policy_loss_fn", moved)
    result = num.run_all("cpu", ("losses",))
    for check, quantity in (("loss/m2po", "masked tokens"), ("loss/vanilla", "clipped tokens")):
        for dtype in ("float32", "bfloat16"):
            e = _by(result, check, dtype, quantity)
            assert not e["passed"] and e["error"] >= 1 and e["value"] != e["reference"], e


def test_bf16_log_probs_rounded_once_more_fail_the_bf16_bound(monkeypatch):
    """A chunked head that rounds its bf16 log-probs to bf16 (an error of ~2^-9 |logp|, below the old uniform bound
    2^-7 |logit|max / T) fails the bf16 chunked-vs-plain log-prob entry set from the rounding analysis."""
    import stalerl.core.chunked_logprob as cl

    real = cl.chunked_token_logprobs

    def rounded(h, w, ids, temperature=1.0, chunk=None):
        lp = real(h, w, ids, temperature, chunk)
        if torch.is_autocast_enabled("cpu"):
            return lp + (lp.detach().bfloat16().float() - lp.detach())
        return lp

    monkeypatch.setattr(cl, "chunked_token_logprobs", rounded)
    result = num.run_all("cpu", ("logprobs",))
    bad = [e for e in result["entries"] if not e["passed"]]
    assert bad and {e["dtype"] for e in bad} == {"bfloat16"}
    for e in result["entries"]:
        if e["check"].startswith("logprob/chunked_vs_plain") and e["dtype"] == "bfloat16" and e["quantity"] == "log-probs":
            assert not e["passed"] and e["error"] > 10, e


def test_a_bf16_loss_off_by_one_bf16_rounding_of_its_inputs_fails_the_bf16_loss_entries(monkeypatch):
    """A loss whose bf16 path moves its log-probs by two bf16 ulps (x (1 + 2^-7), as a bf16 kernel that rounds on
    the way would): the bf16 loss entries fail, though that is within the a-priori worst case; float32 untouched."""
    import recipe.registry as registry

    real = registry.get_policy_loss_fn

    def narrow(name):
        fn = real(name)

        def wrapper(*, log_prob, **kw):
            if log_prob.dtype == torch.bfloat16:
                log_prob = log_prob * (1 + 2 ** -7)
            return fn(log_prob=log_prob, **kw)
        return wrapper

    monkeypatch.setattr(registry, "get_policy_loss_fn", narrow)
    result = num.run_all("cpu", ("losses",))
    for loss in ("m2po", "vanilla", "fipo"):
        e = _by(result, f"loss/{loss}", "bfloat16", "loss")
        assert not e["passed"] and e["error"] > 2 * e["tolerance"], e
        assert _by(result, f"loss/{loss}", "float32", "loss")["passed"]


def test_bf16_log_probs_off_by_a_few_ulps_fail_their_rounding_bound(monkeypatch):
    """The bf16 log-softmax's result scaled by 1 + 2^-5 (a few bf16 ulps): above e_t on most tokens."""
    real = num.bf16_logprobs

    def off(lp64, device):
        lp, bound = real(lp64, device)
        return (lp.double() * (1 + 2 ** -5)).to(torch.bfloat16), bound

    monkeypatch.setattr(num, "bf16_logprobs", off)
    result = num.run_all("cpu", ("losses",))
    for loss in ("m2po", "vanilla", "fipo"):
        e = _by(result, f"loss/{loss}", "bfloat16", "bf16 log-probs vs exact")
        assert not e["passed"] and e["error"] > 2, e


@pytest.mark.slow
@pytest.mark.dist
def test_an_fsdp_step_with_another_learning_rate_fails_the_fsdp_entries(monkeypatch):
    """The sharded actor's learning rate moved by 0.1%: its update differs from torch:d1's by 1e-3 relative, above
    both dtypes' tolerances (1e-5, 1e-4)."""
    from stalerl.training.actor import Actor

    real = Actor.shard

    def shard(self, *a, **kw):
        real(self, *a, **kw)
        for group in self.optimizer.param_groups:
            group["lr"] *= 1.001

    monkeypatch.setattr(Actor, "shard", shard)
    result = num.run_all("cpu", ("fsdp",))
    for dtype in ("float32", "bfloat16"):
        e = _by(result, "fsdp_d1_vs_torch_d1", dtype, "relative update difference")
        assert not e["passed"] and e["error"] > 5 * e["tolerance"], e
