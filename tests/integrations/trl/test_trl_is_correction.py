"""TRL's vLLM importance-sampling correction with this project's losses: the settings that
``recipe.rollout_correction`` reproduces exactly (token_truncate = tis_token, sequence_truncate = tis_seq, token_mask
= icepop's weights with the loss mask unchanged) run through the adapter's loss path; the others are refused at
construction in one line. Checked against TRL 1.16's formulas written out by hand (its
``_generate_and_score_completions``) on hand-made tensors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trl_cases import base_args, digit_reward, prompts_dataset, require_trl, tiny_model_and_tokenizer

pytestmark = pytest.mark.trl


def _trl_ratio(old, sampled, mask, mode, clip_min, clip_max):
    """TRL 1.16's vllm_importance_sampling_ratio, literally."""
    diff = torch.nan_to_num((old - sampled) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max).expand_as(old)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0).expand_as(old)


def _batch():
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=gen) * 2
    sampled = old + torch.randn(4, 6, generator=gen) * 0.8  # ratios on both sides of the bounds
    sampled[1, 2] = float("nan")  # a token the sampler could not score: ratio 1 (TRL)
    mask = torch.ones(4, 6)
    mask[2, 4:] = 0
    mask[3, 1:] = 0
    return old, sampled, mask


CASES = [("token_truncate", None, 2.0), ("token_truncate", 0.0, 1.5), ("sequence_truncate", None, 3.0),
         ("token_mask", None, 1.5), ("token_mask", 0.5, 2.0)]


@pytest.mark.parametrize(("mode", "clip_min", "clip_max"), CASES)
def test_mapped_weights_equal_trls(tmp_path: Path, mode: str, clip_min, clip_max) -> None:
    require_trl()
    from types import SimpleNamespace

    from recipe.trl.inputs import correction_weights_of
    from recipe.trl.losses import vllm_correction

    args = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                           vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max,
                           loss_type="m2po")
    old, sampled, mask = _batch()
    ours = correction_weights_of({"old_per_token_logps": old, "sampling_per_token_logps": sampled}, mask,
                                 vllm_correction(args))
    theirs = _trl_ratio(old, sampled, mask, mode, clip_min, clip_max)
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], theirs[valid], rtol=1e-6, atol=1e-7)
    if mode == "token_mask":
        assert bool((theirs[valid] == 0).any()), "the data must reject a token"


@pytest.mark.parametrize(("mode", "clip_min", "clip_max", "field"), [
    ("sequence_mask", None, 3.0, "vllm_importance_sampling_mode"),
    ("token_truncate", 0.5, 2.0, "vllm_importance_sampling_clip_min"),
    ("token_mask", 0.5, None, "vllm_importance_sampling_clip_max"),
])
def test_unmapped_settings_are_refused_at_construction(tmp_path: Path, mode, clip_min, clip_max, field) -> None:
    require_trl()
    from recipe.trl import GRPOConfig

    with pytest.raises(ValueError) as err:
        GRPOConfig(**base_args(tmp_path, loss_type="m2po", use_vllm=True, vllm_importance_sampling_mode=mode,
                               vllm_importance_sampling_clip_min=clip_min,
                               vllm_importance_sampling_clip_max=clip_max))
    message = str(err.value)
    assert "GRPOConfig.vllm_importance_sampling_correction" in message and f"GRPOConfig.{field}" in message
    assert "\n" not in message


@pytest.mark.parametrize(("mode", "clip_min", "clip_max"), CASES)
def test_the_trainers_loss_applies_trls_weights_against_the_old_log_probs(tmp_path: Path, mode, clip_min,
                                                                         clip_max) -> None:
    """The adapter's own ``_compute_loss`` on a hand-made TRL batch: no_trust_region's loss is
    sum(-A * exp(logp - old) * w_TRL) / tokens, the ratio against TRL's old_per_token_logps."""
    require_trl()
    from recipe.trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model, tok = tiny_model_and_tokenizer()
    args = GRPOConfig(**base_args(tmp_path, loss_type="no_trust_region"))
    trainer = GRPOTrainer(model=model, reward_funcs=digit_reward, args=args, train_dataset=prompts_dataset(),
                          processing_class=tok)
    # the settings as GRPOConfig(use_vllm=True, ...) would carry them (no vLLM on CPU to build the trainer with)
    trainer.args.use_vllm = True
    trainer.args.vllm_importance_sampling_correction = True
    trainer.args.vllm_importance_sampling_mode = mode
    trainer.args.vllm_importance_sampling_clip_min = clip_min
    trainer.args.vllm_importance_sampling_clip_max = clip_max
    old, sampled, mask = _batch()
    gen = torch.Generator().manual_seed(4)
    inputs = {"prompt_ids": torch.randint(3, 20, (4, 3), generator=gen), "prompt_mask": torch.ones(4, 3).long(),
              "completion_ids": torch.randint(3, 20, (4, 6), generator=gen), "completion_mask": mask.long(),
              "advantages": torch.randn(4, generator=gen), "old_per_token_logps": old,
              "sampling_per_token_logps": sampled}
    trainer.model.eval()  # one batch, no accumulation window
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
        logp = trainer._log_probs(trainer.model, inputs, compute_entropy=False)[0]
    w = _trl_ratio(old, sampled, mask, mode, clip_min, clip_max)
    adv = inputs["advantages"].unsqueeze(1)
    expected = (-(adv * torch.exp(logp - old) * w) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
