"""CISPO and DPPO inside verl 0.9.1, through the verl plugin (recipe/verl) and verl's own ``ppo_loss``. Needs the
`verl` extra.

- Registered in verl's registry under names that clash with none of verl's own (``stalerl_cispo``,
  ``stalerl_dppo_tv``, ``stalerl_dppo_kl``), verl's ``cispo`` / ``dppo_tv`` / ``dppo_kl`` untouched.
- ``stalerl_cispo`` through ``ppo_loss`` equals verl's own ``cispo`` through ``ppo_loss`` (loss and gradient, both
  layouts, three PPO clips), and is split-invariant over micro-batches and two data-parallel ranks.
- ``stalerl_dppo_*`` through ``ppo_loss`` has verl's own ``dppo_*`` gradient where verl agrees with the paper (its
  truncation ``clip_ratio_c`` above every ratio, one delta for both sides), and another where verl's default
  ``clip_ratio_c = 3`` truncates a ratio; the loss values differ by construction (verl's is the log-prob form).
- A bad delta in the generated verl config class is refused at config time, naming verl's key.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _verl_cases as C  # noqa: E402

pytestmark = C.VERL_MARKS

OURS = {"cispo": "stalerl_cispo", "dppo_tv": "stalerl_dppo_tv", "dppo_kl": "stalerl_dppo_kl"}


@pytest.fixture(scope="module")
def verl_env():
    import verl  # noqa: F401
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    import recipe.verl
    from recipe.registry import get_policy_loss_fn
    from recipe.verl.config import policy_loss_config_class
    from recipe.verl.losses import verl_loss

    recipe.verl.register()
    return SimpleNamespace(core_algos=core_algos, ActorConfig=ActorConfig, PolicyLossConfig=PolicyLossConfig,
                           ppo_loss=ppo_loss, get_policy_loss_fn=get_policy_loss_fn, verl_loss=verl_loss,
                           policy_loss_config_class=policy_loss_config_class)


def _case(seed: int = 0, drift: float = 0.35) -> dict:
    """verl's synthetic micro-batches with finite padding (verl's own losses multiply, so NaN padding would poison
    them, not ours) and probabilities below 1 (a log-prob > 0 is no probability)."""
    case = C.make_case(seed)
    g = torch.Generator().manual_seed(100 + seed)
    mask = case["mask"]
    new = torch.clamp(case["old"].nan_to_num(-1.0) + torch.randn(mask.shape, generator=g) * drift, max=-1e-3)
    case["old"] = torch.where(mask, case["old"], torch.full_like(new, -1.0))
    case["new"] = torch.where(mask, new, torch.zeros_like(new))
    for i, (p, r) in enumerate(zip(case["prompt_lens"], case["response_lens"])):
        start = case["offsets"][i] + p - 1
        case["flat"][start:start + r] = new[i, :r]
    return case


def _actor(env, policy_loss, **actor):
    return env.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, policy_loss=policy_loss,
                           **actor)


def _run(env, config, case, layout="padded", parts=None, dp_size=1):
    """(sum of the micro-batch losses / dp_size, gradient w.r.t. the flat model output, metrics of each call) of
    verl's ppo_loss over ``parts`` (lists of rows; each its own micro-batch) with the step's global batch info."""
    bsz = len(case["response_lens"])
    parts = parts or [list(range(bsz))]
    flat = C.flat_for_rows(case, range(bsz)).requires_grad_(True)
    offsets, total, metrics = case["offsets"], 0.0, []
    for rows in parts:
        td = C.build_td(case, rows, layout, dp_size=dp_size, batch_num_tokens=C.num_tokens(case),
                        global_batch_size=bsz)
        out = C.model_output(flat[offsets[rows[0]]:offsets[rows[-1] + 1]], case, rows, layout)
        loss, m = env.ppo_loss(config, out, td)
        total = total + loss
        metrics.append(m)
    total = total / dp_size  # DDP/FSDP average the ranks' gradients
    total.backward()
    return total.detach(), flat.grad, metrics


def test_registered_under_names_that_clash_with_none_of_verls(verl_env):
    for name, verl_name in OURS.items():
        fn = verl_env.core_algos.get_policy_loss_fn(verl_name)
        assert fn is verl_env.verl_loss(name)  # the registry's loss, its metrics named for verl (recipe.verl.metrics)
        # verl's own loss of the runtime name is still verl's
        assert verl_env.core_algos.get_policy_loss_fn(name).__module__ == "verl.trainer.ppo.core_algos"
    assert verl_env.policy_loss_config_class("cispo")().loss_mode == "stalerl_cispo"
    assert verl_env.policy_loss_config_class("dppo_tv")().dppo_tv_delta == 0.15


@pytest.mark.parametrize("layout", ["padded", "nested"])
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28), (1.0, 4.0)])
def test_cispo_equals_verls_own_cispo_through_ppo_loss(verl_env, layout, low, high):
    case = _case(0)
    clip = dict(clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high)
    ours = _run(verl_env, _actor(verl_env, verl_env.policy_loss_config_class("cispo")(), **clip), case, layout)
    theirs = _run(verl_env, _actor(verl_env, verl_env.PolicyLossConfig(loss_mode="cispo"), **clip), case, layout)
    # the same products in the same order: bit for bit
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert float(ours[1].abs().sum()) > 0
    m = ours[2][0]
    clipped = m["cispo/clip_fraction_low"].values[0] + m["cispo/clip_fraction_high"].values[0]
    assert clipped == pytest.approx(theirs[2][0]["actor/pg_clipfrac"].values[0], rel=1e-6, abs=1e-9)
    if high < 1:
        assert clipped > 0, "the case must exercise the clip"


@pytest.mark.parametrize("name", sorted(OURS))
def test_micro_batches_and_two_ranks_reproduce_the_one_call_step(verl_env, name):
    case = _case(1)
    policy_loss = verl_env.policy_loss_config_class(name)()
    whole = _run(verl_env, _actor(verl_env, policy_loss), case, "nested")
    split = _run(verl_env, _actor(verl_env, policy_loss), case, "nested", parts=[[0, 1], [2, 3], [4, 5], [6, 7]],
                 dp_size=2)
    torch.testing.assert_close(split[0], whole[0], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(split[1], whole[1], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name,delta", [("dppo_tv", 0.15), ("dppo_tv", 0.05), ("dppo_kl", 0.05), ("dppo_kl", 0.01)])
def test_dppo_has_verls_own_gradient_where_verl_agrees_with_the_paper(verl_env, name, delta):
    case = _case(2, drift=0.6)
    ours = _run(verl_env, _actor(verl_env, verl_env.policy_loss_config_class(name)(**{f"{name}_delta": delta})),
                case)
    # verl reads delta from the PPO clip keys; its ratio truncation clip_ratio_c above every ratio (the paper has none)
    theirs_cfg = _actor(verl_env, verl_env.PolicyLossConfig(loss_mode=name), clip_ratio=delta, clip_ratio_low=delta,
                        clip_ratio_high=delta, clip_ratio_c=1e9)
    theirs = _run(verl_env, theirs_cfg, case)
    assert ours[2][0][f"{name}/num_masked_tokens/mean_per_call"].values[0] > 0, "the case must drop tokens"
    assert theirs[2][0]["actor/pg_clipfrac"].values[0] > 0
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-8)
    # the values differ: ours is the paper's -M r A, verl's -M sg(r) A log pi
    assert abs(float(ours[0] - theirs[0])) > 1e-3


@pytest.mark.parametrize("name", sorted(n for n in OURS if n.startswith("dppo")))
def test_dppo_differs_from_verls_default_truncation(verl_env, name):
    """verl's dppo uses the actor's clip_ratio_c (3.0 by default) as a truncation of the ratio; the paper's objective
    has none, so a token with r > 3 gets another gradient. (The authors' script sets clip_ratio_c=10000.)"""
    case = _case(3, drift=1.0)
    r = torch.exp(case["new"] - case["old"])[case["mask"]]
    assert bool((r > 3.0).any())
    delta = 1.0 if name == "dppo_tv" else 1e3  # nothing dropped: only the truncation differs
    ours = _run(verl_env, _actor(verl_env, verl_env.policy_loss_config_class(name)(**{f"{name}_delta": delta})),
                case)
    theirs = _run(verl_env, _actor(verl_env, verl_env.PolicyLossConfig(loss_mode=name), clip_ratio=delta,
                                   clip_ratio_low=delta, clip_ratio_high=delta), case)
    assert not torch.allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name,value", [("dppo_tv", 0.0), ("dppo_kl", -1.0), ("dppo_tv", "big")])
def test_bad_delta_is_refused_at_config_time_naming_verls_key(verl_env, name, value):
    with pytest.raises(ValueError, match=rf"^actor_rollout_ref\.actor\.policy_loss\.{name}_delta must be "):
        verl_env.policy_loss_config_class(name)(**{f"{name}_delta": value})
