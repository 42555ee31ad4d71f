"""recipe.areal's torch-only parts (no AReaL needed): packed micro-batches give the registry's whole-batch loss, the
mini-batch selection is the literal Algorithm 1 mask, the config rules name the key and the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from m2po_reference import reference_m2po
from recipe.areal.packed import KEEP_MASK_KEY, packed_policy_loss, packed_rows, select_mini_batch
from recipe.areal.rules import check_areal_version, exact_loss_config_errors
from recipe.versions import ALLOW_ENV, UntestedFrameworkVersion
from recipe.registry import get_policy_loss_fn


def _padded_batch(gen: torch.Generator, n_seq: int = 7, width: int = 13) -> dict[str, torch.Tensor]:
    """An AReaL-style padded mini-batch: right-padded rows of uneven length, a prompt then a response."""
    lengths = torch.randint(3, width + 1, (n_seq,), generator=gen)
    attention = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    prompt = torch.randint(1, 3, (n_seq,), generator=gen)
    loss_mask = attention & (torch.arange(width).unsqueeze(0) >= prompt.unsqueeze(1))
    loss_mask[torch.arange(n_seq), lengths - 1] = False  # the last token predicts past the end (AReaL's roll)
    old = -torch.rand(n_seq, width, generator=gen) * 3
    adv = torch.randn(n_seq, 1, generator=gen).expand(n_seq, width).clone()
    return {"attention_mask": attention, "loss_mask": loss_mask, "logprobs": old, "advantages": adv}


def _pack(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """AReaL's packing of some rows: each row's first len tokens laid end to end, plus cu_seqlens (written here,
    independently of recipe.areal.packed)."""
    attention = batch["attention_mask"][rows]
    lengths = attention.sum(1)
    out = {"cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])}
    for key, value in batch.items():
        if key != "attention_mask":
            out[key] = torch.cat([row[:n] for row, n in zip(value[rows], lengths.tolist())])
    return out


def test_packed_rows_lays_out_sequences_of_uneven_length() -> None:
    values = torch.arange(1.0, 10.0)
    rows = packed_rows(values, torch.tensor([0, 2, 7, 9]), fill=-1.0)
    assert rows.tolist() == [[1, 2, -1, -1, -1], [3, 4, 5, 6, 7], [8, 9, -1, -1, -1]]
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        packed_rows(values, torch.tensor([0, 5, 3]))


@pytest.mark.parametrize("loss_name", ["m2po", "fipo", "vanilla", "no_trust_region"])
@pytest.mark.parametrize("split", [[7], [3, 4], [1, 2, 4]])
def test_weighted_packed_micro_batches_give_the_whole_mini_batch_loss(loss_name: str, split: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(split) * 10 + len(loss_name))
    batch = _padded_batch(gen)
    current = batch["logprobs"] + torch.randn(batch["logprobs"].shape, generator=gen) * 0.4
    for row in range(batch["loss_mask"].shape[0]):  # one A < 0 row with two tokens of ratio e > c: FIPO drops it
        where = batch["loss_mask"][row].nonzero().flatten()
        if batch["advantages"][row, 0] < 0 and where.numel() >= 2:
            current[row, where[:2]] = batch["logprobs"][row, where[:2]] + 1.0
            break
    # c = 1.3: FIPO drops rows here (two A < 0 tokens with ratio > c)
    config = SimpleNamespace(m2_threshold=0.04, eps_clip=0.2, eps_clip_higher=None, fipo_clip_ratio_c=1.3)
    decided = select_mini_batch(loss_name, batch, current, config)
    assert (KEEP_MASK_KEY in batch) == (loss_name == "m2po")
    if loss_name == "fipo":
        assert decided.num_kept_tokens < decided.num_valid_tokens == int(batch["loss_mask"].sum())
        assert decided.step_scale == decided.num_valid_tokens / decided.num_kept_tokens
    else:
        assert decided.step_scale == 1.0

    # what AReaL does: per micro-batch loss * its valid tokens / all valid tokens of the mini-batch
    total_valid = int(batch["loss_mask"].sum())
    current_leaf = current.clone().requires_grad_(True)
    total = torch.zeros(())
    start = 0
    for n in split:
        part = _pack({**batch, "current": current_leaf}, slice(start, start + n))
        start += n
        loss, metrics, kept = packed_policy_loss(loss_name, part.pop("current"), part, config,
                                                 step_scale=decided.step_scale)
        total = total + loss * part["loss_mask"].count_nonzero() / total_valid
        assert kept.shape == part["loss_mask"].shape and metrics
    total.backward()

    # the registry's loss in one call on the whole mini-batch (FIPO: the reference, dropped rows out of both sums)
    extras = {"keep_mask": batch[KEEP_MASK_KEY]} if loss_name == "m2po" else {}
    expected_leaf = current.clone().requires_grad_(True)
    expected, _ = get_policy_loss_fn(loss_name)(
        old_log_prob=batch["logprobs"], log_prob=expected_leaf, advantages=batch["advantages"],
        response_mask=batch["loss_mask"], loss_agg_mode="token-mean", config=vars(config), **extras)
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(current_leaf.grad, expected_leaf.grad, rtol=1e-6, atol=1e-8)


def test_mini_batch_selection_is_the_literal_algorithm_1_mask() -> None:
    gen = torch.Generator().manual_seed(5)
    batch = _padded_batch(gen, n_seq=12, width=11)
    current = batch["logprobs"] + torch.randn(batch["logprobs"].shape, generator=gen) * 0.5
    plan = select_mini_batch("m2po", batch, current, {"m2_threshold": 0.04})
    d = (current - batch["logprobs"]).float()
    literal = reference_m2po(d.tolist(), batch["advantages"].tolist(), batch["loss_mask"].tolist(), 0.04)
    expected = torch.tensor(literal["keep"])
    valid = batch["loss_mask"]
    assert torch.equal(batch[KEEP_MASK_KEY][valid], expected[valid])
    assert (~expected[valid]).any(), "the data must make Algorithm 1 mask something"
    assert plan.num_valid_tokens == int(valid.sum()) and plan.selection.num_masked == int((~expected[valid]).sum())


def test_m2po_on_a_micro_batch_without_the_mini_batch_selection_is_refused() -> None:
    gen = torch.Generator().manual_seed(1)
    part = _pack(_padded_batch(gen), slice(0, 3))
    with pytest.raises(ValueError, match="needs the mini-batch selection"):
        packed_policy_loss("m2po", part["logprobs"].clone(), part, {"m2_threshold": 0.04})


def _actor(**overrides):
    base = dict(loss="m2po", use_decoupled_loss=True, recompute_logprob=True, use_sapo_loss=False,
                importance_sampling_level="token", rejection_sampling=None, c_clip=None, m2_threshold=None,
                eps_clip=0.2, eps_clip_higher=None, fipo_clip_ratio_c=10.0)
    base.update(overrides)
    return SimpleNamespace(**base)


def test_config_rules_accept_the_documented_settings() -> None:
    assert exact_loss_config_errors(_actor()) == []
    assert exact_loss_config_errors(_actor(m2_threshold=0.02)) == []
    assert exact_loss_config_errors(_actor(loss="fipo")) == []
    assert exact_loss_config_errors(_actor(use_decoupled_loss=False, recompute_logprob=False)) == []
    # actor.loss unset: AReaL's own loss, nothing of ours is checked
    assert exact_loss_config_errors(_actor(loss=None, use_decoupled_loss=False, m2_threshold=-1)) == []


@pytest.mark.parametrize("overrides, key", [
    (dict(loss="m3po"), "actor.loss must be one of"),
    (dict(use_decoupled_loss=False), "actor.use_decoupled_loss=true"),
    (dict(use_sapo_loss=True), "actor.use_sapo_loss=false"),
    (dict(importance_sampling_level="sequence"), "actor.importance_sampling_level=token"),
    (dict(rejection_sampling={"upper": 5.0}), "actor.rejection_sampling=null"),
    (dict(c_clip=3.0), "actor.c_clip=null"),
    (dict(loss="fipo", m2_threshold=0.04), "actor.m2_threshold=null"),
    (dict(m2_threshold=-0.1), "actor.m2_threshold must be >= 0"),
    (dict(m2_threshold=True), "actor.m2_threshold must be a number, got True"),
    (dict(enable_tree_training=True), "actor.enable_tree_training=false"),
    (dict(loss="fipo", fipo_clip_ratio_c=1.1), "actor.fipo_clip_ratio_c must be > 1"),
])
def test_config_rules_name_the_key_and_the_fix(overrides: dict, key: str) -> None:
    errors = exact_loss_config_errors(_actor(**overrides))
    assert len(errors) == 1 and key in errors[0], errors


def test_areal_versions_outside_the_tested_range_are_refused_unless_overridden(monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert check_areal_version("1.0.4") == "1.0.4"
    for version in ("1.0.3", "1.1.0", "2.0.0rc1"):
        with pytest.raises(UntestedFrameworkVersion, match=rf"recipe\.areal: areal {version} is installed, but this "
                                                           rf"adapter was tested on areal>=1\.0\.4,<1\.1 only"):
            check_areal_version(version)
    monkeypatch.setenv(ALLOW_ENV, "areal")
    with pytest.warns(RuntimeWarning, match="outside the tested range"):
        assert check_areal_version("1.1.0") == "1.1.0"


def test_a_loss_parameter_named_like_an_areal_field_is_refused_alone() -> None:
    """The clash check every adapter shares, AReaL's side: AReaL has no loss names of its own, but a loss parameter
    named like one of its actor fields (``kl_ctl``) would take that field; that loss alone is left out of AReaL's
    actor config, in one line; every built-in's keys stay."""
    import dataclasses

    import recipe.registry as registry
    from recipe.areal import rules
    from recipe.declaration import LossDeclaration, param
    from recipe.testing import registry_state

    @dataclasses.dataclass
    class FakeActorConfig:  # the AReaL fields that matter here
        kl_ctl: float = 0.0
        m2_threshold: object = None  # AReaL's own M2PO key (AREAL_OWN_KEYS)

    with registry_state():
        registry.register_policy_loss(LossDeclaration(
            name="kl_thief", summary="x", params=(param("kl_ctl", 0.5, help="mine"),)))(lambda **kw: None)
        old = set(rules._AREAL_FIELDS)
        try:
            keys = {name for name, _, _ in rules.loss_param_fields(FakeActorConfig)}
            losses = rules.usable_losses()
        finally:
            rules._AREAL_FIELDS.clear()
            rules._AREAL_FIELDS.update(old)
        refused = registry.refusals()
    assert "kl_thief" not in losses and "kl_ctl" not in keys
    assert set(registry.BUILTIN_POLICY_LOSSES) <= set(losses) and "fipo_decay_rate" in keys
    assert "'kl_ctl'" in refused["areal:kl_thief"] and "Fix:" in refused["areal:kl_thief"]


def test_the_step_scope_comes_from_the_declaration_not_a_loss_name():
    """AReaL's loss config hands a loss call the declared in-plan value of the step-scope parameter (M2PO's
    ``m2_scope``: ``local``), and the plan spans the group unless that parameter is set to its declared local
    value; a loss without one always plans over the group."""
    from types import SimpleNamespace

    from recipe.areal.rules import loss_config, plan_scope, plans_over_group

    m2po = SimpleNamespace(loss="m2po", m2_threshold=0.02, m2_scope="dp_group", eps_clip=0.2, eps_clip_higher=None)
    assert loss_config(m2po)["m2_scope"] == "local" and loss_config(m2po)["m2_threshold"] == 0.02
    assert plan_scope(m2po) == "dp_group" and plans_over_group(m2po)
    local = SimpleNamespace(**{**vars(m2po), "m2_scope": "local"})
    assert plan_scope(local) == "local" and not plans_over_group(local)
    fipo = SimpleNamespace(loss="fipo", eps_clip=0.2, eps_clip_higher=None)
    assert plan_scope(fipo) is None and plans_over_group(fipo) and "m2_scope" not in loss_config(fipo)
