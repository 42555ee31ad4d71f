"""Shared pieces of the TRL tests: the skip rule, a tiny Qwen2 + char tokenizer, data and a reward, a config.

Everything is built locally (nothing downloaded). The reward depends on the completion's characters so groups have
non-zero advantages from the first step.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "unit"))  # the literal references (m2po_reference, fipo_reference)

REQUIRE_ENV = "STALERL_REQUIRE_TRL"


def require_trl() -> None:
    """Skip with one line when TRL is missing, unless STALERL_REQUIRE_TRL=1 (CI's TRL step): then fail."""
    if importlib.util.find_spec("trl") is not None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but trl is not importable: run scripts/ci_trl.sh (or pip install 'stalerl[trl]')")
    pytest.skip("trl is not installed (its own venv: scripts/ci_trl.sh); set STALERL_REQUIRE_TRL=1 to make this fail")


def tiny_model_and_tokenizer(seed: int = 0) -> tuple[Any, Any]:
    from stalerl.core.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model("qwen2", tok, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, intermediate_size=128, seed=seed)
    return model, tok


def prompts_dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"Q: {i}+{2 * i + 1}=? A:" for i in range(n)]})


def digit_reward(prompts, completions, **_: Any) -> list[float]:
    """Fraction of digits in the completion: varies within a group from the random initial policy on."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def base_args(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """GRPOConfig keyword arguments for a few-second CPU run (override any)."""
    args = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", bf16=False, seed=0,
                per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
                max_completion_length=8, temperature=1.0, learning_rate=3e-2, lr_scheduler_type="constant",
                max_steps=2, logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                beta=0.0, num_iterations=2, warmup_steps=0, weight_decay=0.0, max_grad_norm=1e9)
    args.update(overrides)
    return args


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(tmp_path: Path, trainer_cls: Any = None, config_cls: Any = None, trainer_kwargs: Any = None,
          **overrides: Any):
    """Train the tiny model with TRL's GRPOTrainer (or ``trainer_cls``) on ``base_args(tmp_path, **overrides)``."""
    require_trl()
    from recipe.trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model, tok = tiny_model_and_tokenizer()
    args = (config_cls or GRPOConfig)(**base_args(tmp_path, **overrides))
    trainer = (trainer_cls or GRPOTrainer)(model=model, reward_funcs=digit_reward, args=args,
                                           train_dataset=prompts_dataset(), processing_class=tok,
                                           **(trainer_kwargs or {}))
    trainer.train()
    return trainer


def capturing_trainer():
    """GRPOTrainer that records what every micro-batch's registry call received and returned (its window start,
    loss, metrics, config, tensors and extras), in ``trainer.calls``."""
    require_trl()
    from recipe.trl import GRPOTrainer

    class Capturing(GRPOTrainer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.calls: list[dict[str, Any]] = []

        def _policy_loss(self, **kw: Any):
            loss, metrics = super()._policy_loss(**kw)
            if self.model.training:
                self.calls.append({"window": self._stalerl_window_start, "loss": loss.detach().clone(),
                                   "metrics": dict(metrics), "config": kw["config"],
                                   **{k: v.detach().clone() for k, v in kw.items() if isinstance(v, torch.Tensor)},
                                   "extras": {k: v.clone() for k, v in kw["extras"].items()}})
            return loss, metrics

    return Capturing
