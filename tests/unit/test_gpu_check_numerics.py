"""scripts/gpu_check_numerics.py (the GPU check's numerics) on CPU: every comparison states its tolerance and passes
for the code as it is, and the tolerances are tight enough to see a small error (a log-prob moved by 1e-3 on one
token, a float32 head computed in bf16)."""

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
    # bf16: inputs rounded to bf16, the loss computed after widening (float32 tolerance), the gradient in bf16
    assert _by(result, "loss/m2po", "bfloat16", "grad log_prob")["error"] > 1e-4  # bf16 rounding is visible


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
