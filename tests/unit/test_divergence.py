"""A run whose loss turns non-finite ends with status 'diverged', its summary and its curves (the real trainer and
launcher path; the loss is a registered plugin that returns NaN from its third call on)."""

from __future__ import annotations

import json

import pytest

from conftest import CPU_CONFIG, small_overrides
from recipe.registry import get_policy_loss_fn, register_policy_loss
from stalerl.config import load_config, run_dir

CALLS = {"n": 0}


@register_policy_loss("test_nan_after_two")
def _nan_after_two(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                   rollout_is_weights=None, **kwargs):
    loss, metrics = get_policy_loss_fn("no_trust_region")(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
    CALLS["n"] += 1
    return (loss * float("nan") if CALLS["n"] > 2 else loss), metrics


def test_a_nan_loss_ends_the_run_as_diverged_with_its_curves(tmp_path):
    import stalerl.launch.launcher as launcher
    from stalerl_study.report import group
    from stalerl_study.metrics import CollapseRule, collapsed, run_metric
    from stalerl.training.trainer import TrainingDiverged

    CALLS["n"] = 0
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, **{
        "actor.loss": "test_nan_after_two", "total_train_steps": 9, "evaluator.freq_steps": 1})])
    with pytest.raises(TrainingDiverged, match="diverged at step 3: actor/loss=nan"):
        launcher.launch(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "diverged" and "diverged at step 3" in s["error"]
    assert s["steps_done"] == 3 and s["eval_every"] == 1 and s["steps_planned"] == 9
    assert [p[0] for p in s["curves"]["eval/accuracy"]] == [0, 1, 2]  # the diverged step is never evaluated
    assert "actor/ratio_max" in s["curves"] and "rollout/entropy" in s["diagnostics"]
    assert not (run_dir(cfg) / "finished.json").exists()
    cell = group([s])[0]
    assert cell.diverged and not cell.finished and cell.value("eval.final") == "diverged"
    assert collapsed(s, CollapseRule()) is True
    assert run_metric(s, "last3") == 0.0  # evals after the divergence count as 0, never as missing
