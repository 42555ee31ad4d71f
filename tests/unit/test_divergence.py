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


def test_divergence_is_classified_by_the_exception_type_not_its_words():
    """``NonFiniteLogProbError`` (in this process, or a train worker's, named by its WorkerFailure) is a divergence
    whatever its message; any other error is not, even one whose message says "non-finite"."""
    from recipe.common import NonFiniteLogProbError
    from stalerl.training.trainer import divergence_reason
    from stalerl.training.workers.process import WorkerFailure

    assert divergence_reason(NonFiniteLogProbError("m2po: NaN on a valid token\nmore")) == "m2po: NaN on a valid token"
    assert divergence_reason(ValueError("non-finite values on valid tokens")) is None
    assert divergence_reason(RuntimeError("non-finite")) is None
    worker = WorkerFailure("train/1", None, "NonFiniteLogProbError: m2po: NaN on a valid token\nTraceback ...",
                           exc_type="NonFiniteLogProbError")
    assert divergence_reason(worker) == "train/1: m2po: NaN on a valid token"
    assert divergence_reason(WorkerFailure("train/1", None, "RuntimeError: non-finite values",
                                           exc_type="RuntimeError")) is None
    assert divergence_reason(WorkerFailure("train/1", 1, "the process exited unexpectedly")) is None


def test_a_loss_that_refuses_non_finite_log_probs_ends_the_run_as_diverged(tmp_path, monkeypatch):
    """The in-process path of a refusal: the loss raises NonFiniteLogProbError (its message without the words
    "non-finite"), the run ends diverged at that step."""
    import stalerl.launch.launcher as launcher
    from recipe.common import NonFiniteLogProbError
    from stalerl.training.trainer import TrainingDiverged

    calls = {"n": 0}

    def refuse_third(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                     rollout_is_weights=None, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise NonFiniteLogProbError("test_refuse_third: NaN log_prob on a valid token")
        return get_policy_loss_fn("no_trust_region")(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
            loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)

    from recipe.testing import registry_state

    with registry_state():
        register_policy_loss("test_refuse_third")(refuse_third)
        cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, **{
            "actor.loss": "test_refuse_third", "total_train_steps": 6})])
        with pytest.raises(TrainingDiverged, match="diverged at step 3: test_refuse_third: NaN log_prob"):
            launcher.launch(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "diverged" and s["steps_done"] == 2
