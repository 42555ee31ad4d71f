"""Adding a loss touches one module (issue 37 item 3), ms-swift's lane: the throwaway loss of tests/throwaway_loss.py,
installed into a temporary directory and found through its ``recipe.losses`` entry point, runs through a real
``swift rlhf --rlhf_type grpo --loss_type throwaway`` (ms-swift's own GRPO trainer, the adapter's plugin) with
``tl_scale`` set through the generated variable ``STALERL_TL_SCALE``: its loss is ``no_trust_region``'s at tl_scale=1
and scales with tl_scale, its metrics reach ms-swift's log reduced by the declared rules once per optimizer step,
and ``STALERL_TL_SCALE=0`` is refused with one line naming the variable before any training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import throwaway_loss
from _swift_tiny import build_model_dir, write_dataset, write_plugins
from recipe import swift as recipe_swift
from recipe.registry import get_policy_loss_fn

pytestmark = pytest.mark.swift

REPO = Path(__file__).resolve().parents[3]
STEPS = 4


def _argv(root: Path, ws: dict, name: str) -> list[str]:
    return ["--rlhf_type", "grpo", "--loss_type", "throwaway", "--external_plugins", recipe_swift.plugin_path(),
            str(ws["reward"]), str(ws["capture"]), "--model", str(ws["model"]), "--model_type", "qwen2",
            "--template", "qwen2_5", "--torch_dtype", "float32", "--check_model", "false", "--dataset",
            str(ws["data"]), "--split_dataset_ratio", "0", "--dataset_num_proc", "1", "--reward_funcs", "tiny_parity",
            "--tuner_type", "full", "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--num_iterations", "2", "--max_steps", str(STEPS),
            "--max_completion_length", "12", "--temperature", "1.0", "--beta", "0", "--optim", "sgd",
            "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--max_grad_norm",
            "0", "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none",
            "--dataloader_num_workers", "0", "--seed", "0", "--output_dir", str(root / name)]


def test_throwaway_loss_runs_through_swift_rlhf(tmp_path: Path) -> None:
    site = throwaway_loss.install(tmp_path / "site")
    # beside the good plugin (issue 44 item 1): one named after ms-swift's own sapo, and ones that fail to import or
    # clash; each is refused alone, and the throwaway below still trains
    throwaway_loss.install_clashing(site, "sapo", "swift")
    throwaway_loss.install_broken(site)
    reward, capture, _ = write_plugins(tmp_path / "plugins")
    ws = {"reward": reward, "capture": capture, "model": build_model_dir(tmp_path / "model"),
          "data": write_dataset(tmp_path / "data.jsonl")}
    runs = []
    for name, scale in (("s1", "1.0"), ("s2", "2.0"), ("bad", "0")):
        (tmp_path / name).mkdir()
        runs.append({"argv": _argv(tmp_path, ws, name),
                     "env": {"STALERL_TL_SCALE": scale, "SWIFT_TEST_CAPTURE": str(tmp_path / name / "capture.pt"),
                             "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""},
                     "error_file": str(tmp_path / name / "error.txt") if name == "bad" else None})
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs), encoding="utf-8")
    env = throwaway_loss.env_with(site, dict(os.environ, PYTHONPATH=str(REPO)))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_swift_runs.py")), str(spec)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]

    message = (tmp_path / "bad" / "error.txt").read_text()
    assert "STALERL_TL_SCALE" in message and "\n" not in message, message
    assert not (tmp_path / "bad" / "capture.pt").exists(), "refused before training"

    ntr = get_policy_loss_fn("no_trust_region")
    for name, scale in (("s1", 1.0), ("s2", 2.0)):
        run = torch.load(tmp_path / name / "capture.pt", weights_only=False)
        records = run["records"]
        assert len(records) == 2 * STEPS, "four optimizer steps of two micro-batches each"
        for r in records:  # the framework really ran it: no_trust_region's loss times tl_scale, on the same inputs
            assert r["config"]["tl_scale"] == scale
            ref, _ = ntr(old_log_prob=r["old_log_prob"], log_prob=r["log_prob"], advantages=r["advantages"],
                         response_mask=r["response_mask"], loss_agg_mode="token-mean", config=r["config"])
            assert float(ref) != 0.0
            torch.testing.assert_close(r["loss"], scale * ref, rtol=1e-6, atol=1e-7)
        # metrics once per optimizer step: num_tokens summed over its micro-batches (SUM), ratio_mean weighted by
        # their valid tokens (MEAN)
        logs = [e for e in run["log_history"] if "throwaway/num_tokens" in e]
        assert len(logs) == STEPS
        for i, entry in enumerate(logs):
            step = records[2 * i:2 * i + 2]
            tokens = [float(r["response_mask"].sum()) for r in step]
            assert entry["throwaway/num_tokens"] == sum(tokens)
            mean = sum(t * r["metrics"]["throwaway/ratio_mean"] for t, r in zip(tokens, step)) / sum(tokens)
            assert abs(entry["throwaway/ratio_mean"] - mean) <= 1e-6


def test_the_pinned_swift_loss_types_are_the_installed_ms_swifts_and_a_clashing_plugin_is_refused_alone(
        tmp_path: Path) -> None:
    """recipe.swift.config.SWIFT_LOSS_TYPES (pinned) names every loss type the installed ms-swift's GRPO trainer
    compares ``self.loss_type`` with; a plugin named like one of them is no ``--loss_type`` of the adapter (one
    logged line), the good plugin beside it is."""
    import inspect
    import re

    from swift.rlhf_trainers import grpo_trainer

    from recipe.swift.config import SWIFT_LOSS_TYPES

    source = inspect.getsource(grpo_trainer)
    compared = set(re.findall(r"self\.loss_type\s*==\s*'([a-z_]+)'", source))
    for group in re.findall(r"self\.loss_type\s+in\s+\[([^\]]*)\]", source):
        compared |= set(re.findall(r"'([a-z_]+)'", group))
    assert compared <= set(SWIFT_LOSS_TYPES), f"ms-swift's loss types are now {sorted(compared)}"
    site = throwaway_loss.install(tmp_path / "site")
    throwaway_loss.install_clashing(site, "sapo", "swift")
    code = ("from recipe.swift.config import swift_loss_types; from recipe.registry import refusals; "
            "t = swift_loss_types(); r = refusals(); "
            "assert 'throwaway' in t and 'sapo' not in t, t; "
            "assert \"swift has its own loss 'sapo'\" in r['swift:sapo'], r; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], env=throwaway_loss.env_with(site, dict(os.environ)),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
