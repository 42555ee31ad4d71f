"""recipe.trl's TRL-free parts: config rules, behaviour log-probs, the import error, and its import graph."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recipe.trl.inputs import behaviour_log_probs, loss_mask
from recipe.trl.losses import (
    STALERL_LOSS_TYPES,
    TRL_LOSS_TYPES,
    check_vllm_logprobs_mode,
    loss_config,
    validate_grpo_args,
)

REPO = Path(__file__).resolve().parents[2]


def _args(**overrides):
    base = dict(loss_type="m2po", m2_threshold=0.04, fipo_decay_rate=32.0, fipo_clip_ratio_c=10.0,
                fipo_influence_clip_ratio=0.2, fipo_influence_clip_high_only=True, fipo_safety_threshold=10.0,
                epsilon=0.2, epsilon_high=None, importance_sampling_level="token", delta=None,
                off_policy_mask_threshold=None, top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False,
                steps_per_generation=4, gradient_accumulation_steps=2, use_vllm=False,
                vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                vllm_importance_sampling_clip_max=3.0, vllm_importance_sampling_clip_min=None)
    base.update(overrides)
    return SimpleNamespace(**base)


def test_valid_settings_pass_and_map_to_registry_keys() -> None:
    validate_grpo_args(_args())
    validate_grpo_args(_args(loss_type="fipo", epsilon_high=0.28))
    validate_grpo_args(_args(loss_type="dapo", delta=2.0, m2_threshold=-1))  # TRL's own loss: TRL's rules only
    cfg = loss_config(_args(epsilon_high=0.28))
    assert cfg["clip_ratio_low"] == 0.2 and cfg["clip_ratio_high"] == 0.28 and cfg["m2_threshold"] == 0.04
    assert loss_config(_args())["clip_ratio_high"] == 0.2


@pytest.mark.parametrize(("overrides", "field"), [
    ({"loss_type": "ppo"}, "loss_type"),
    ({"m2_threshold": -0.01}, "m2_threshold"),
    ({"m2_threshold": float("nan")}, "m2_threshold"),
    ({"loss_type": "fipo", "fipo_clip_ratio_c": 1.2}, "fipo_clip_ratio_c"),
    ({"loss_type": "fipo", "fipo_safety_threshold": 0.0}, "fipo_safety_threshold"),
    ({"loss_type": "fipo", "fipo_influence_clip_ratio": -0.1}, "fipo_influence_clip_ratio"),
    ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
    ({"top_entropy_quantile": 0.2}, "top_entropy_quantile"),
    ({"use_adaptive_entropy": True}, "entropy_coef"),
    ({"steps_per_generation": 3}, "steps_per_generation"),
    ({"use_vllm": True}, "vllm_importance_sampling_correction"),
    ({"loss_type": "fipo", "use_vllm": True}, "vllm_importance_sampling_correction"),
    ({"use_vllm": True, "vllm_importance_sampling_correction": False, "vllm_importance_sampling_mode": "token_mask"},
     "vllm_importance_sampling_mode"),
    ({"use_vllm": True, "vllm_importance_sampling_correction": False, "vllm_importance_sampling_clip_min": 0.5},
     "vllm_importance_sampling_clip_min"),
])
def test_bad_values_name_the_field_in_one_line(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_grpo_args(_args(**overrides))
    assert f"GRPOConfig.{field}" in str(err.value) and "\n" not in str(err.value)


def test_behaviour_log_probs_prefers_the_sampler_then_old_then_on_policy() -> None:
    cur = torch.full((2, 3), -1.0)
    old = torch.full((2, 3), -2.0)
    sampled = torch.tensor([[-3.0, float("nan"), -3.0], [-3.0, -3.0, -3.0]])
    assert behaviour_log_probs({}, cur) is None
    assert torch.equal(behaviour_log_probs({"old_per_token_logps": old}, cur), old)
    both = behaviour_log_probs({"old_per_token_logps": old, "sampling_per_token_logps": sampled}, cur)
    assert torch.equal(both, torch.tensor([[-3.0, -2.0, -3.0], [-3.0, -3.0, -3.0]]))
    only_sampler = behaviour_log_probs({"sampling_per_token_logps": sampled}, cur)
    assert only_sampler[0, 1] == -1.0  # unscored by the sampler: log-ratio 0
    mask = torch.ones(2, 3, dtype=torch.int64)
    tool = torch.tensor([[1, 0, 1], [1, 1, 1]])
    assert torch.equal(loss_mask({"completion_mask": mask, "tool_mask": tool}), tool)


def test_vllm_settings_pass_when_they_cannot_act() -> None:
    validate_grpo_args(_args(use_vllm=True, vllm_importance_sampling_correction=False))
    validate_grpo_args(_args(use_vllm=False))  # TRL's default correction=True does nothing without vLLM
    validate_grpo_args(_args(loss_type="grpo", use_vllm=True))  # TRL's own loss: TRL's correction


def test_a_loss_named_like_trls_own_is_refused_alone_and_the_others_stay() -> None:
    """The clash check every adapter shares (recipe.registry.usable_declarations), TRL's side: a plugin loss named
    after TRL's own ``sapo``, and one whose parameter is a GRPOConfig field of TRL's, are left out of TRL in one line
    each; every built-in stays."""
    import recipe.registry as registry
    import recipe.trl.losses as trl_losses
    from recipe.declaration import LossDeclaration, param
    from recipe.testing import registry_state

    with registry_state():
        registry.register_policy_loss(LossDeclaration(name="sapo", summary="a plugin named like TRL's"))(
            lambda **kw: None)
        registry.register_policy_loss(LossDeclaration(name="takes_beta", summary="a TRL field as a parameter",
                                                      params=(param("beta", 0.1, help="mine"),)))(lambda **kw: None)
        old = trl_losses.TRL_OWN_FIELDS
        trl_losses.TRL_OWN_FIELDS = ("beta", "epsilon", "loss_type")
        try:
            ours = trl_losses.stalerl_loss_types()
        finally:
            trl_losses.TRL_OWN_FIELDS = old
        refused = registry.refusals()
    assert "sapo" not in ours and "takes_beta" not in ours
    assert set(registry.BUILTIN_POLICY_LOSSES) <= {d.name for d in trl_losses.declarations().values()}
    assert "trl has its own loss 'sapo'" in refused["trl:sapo"] and "framework_names" in refused["trl:sapo"]
    assert "'beta'" in refused["trl:takes_beta"] and "\n" not in refused["trl:takes_beta"]
    assert not set(STALERL_LOSS_TYPES) & set(TRL_LOSS_TYPES)


def test_raw_vllm_log_probs_are_refused() -> None:
    check_vllm_logprobs_mode("processed_logprobs", "m2po")
    for mode in ("raw_logprobs", "raw_logits", None):
        with pytest.raises(ValueError, match="processed_logprobs") as err:
            check_vllm_logprobs_mode(mode, "fipo")
        assert f"--logprobs-mode {mode}" in str(err.value) and "\n" not in str(err.value)


def test_missing_trl_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import recipe.trl

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    with pytest.raises(ImportError, match=r"\.\[trl\]"):
        recipe.trl.GRPOTrainer  # noqa: B018 - the lazy attribute is what raises


def test_adapter_imports_only_torch_recipe_and_trl() -> None:
    """recipe/trl never imports the stalerl runtime (installing it next to TRL must not change TRL's pins)."""
    allowed = {"torch", "trl", "recipe", "__future__"} | set(sys.stdlib_module_names)
    for path in sorted((REPO / "recipe" / "trl").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.relative_to(REPO)} imports {name}"
