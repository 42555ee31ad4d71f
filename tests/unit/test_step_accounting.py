"""What a train step spends and what it skips: actor.skip_zero_advantage_groups (which rows, what it does to the
loss's denominator, a step with nothing left) and the step-time split (generation, log-prob passes, forward/backward,
optimizer, evaluation)."""

from __future__ import annotations

import pytest
import torch

from conftest import small_overrides
from stalerl.training.advantage import zero_advantage_rows


def _literal_zero_rows(adv, mask, groups):
    out = []
    for i in range(adv.shape[0]):
        members = [j for j in range(adv.shape[0]) if int(groups[j]) == int(groups[i])]
        out.append(all(float(adv[j, t]) == 0.0 for j in members for t in range(adv.shape[1]) if bool(mask[j, t])))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_zero_advantage_rows_equals_the_literal_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, t = 12, 5
    groups = torch.randint(0, 4, (n,), generator=g)
    adv = torch.randn(n, t, generator=g)
    adv[torch.rand(n, generator=g) < 0.6] = 0.0  # whole rows zero; some groups all-zero
    mask = torch.rand(n, t, generator=g) > 0.2
    adv = torch.where(mask, adv, torch.full_like(adv, 7.0))  # padding never counts
    assert zero_advantage_rows(adv, mask, groups).tolist() == _literal_zero_rows(adv, mask, groups)


def _trainer(tmp_path, trial, **over):
    from stalerl.config import load_config
    from stalerl.training.trainer import Trainer

    base = {"trial_name": trial, "actor.optimizer.type": "sgd", "actor.optimizer.lr": 1.0,
            "actor.optimizer.gradient_clipping": 0, "warm_start.steps": 0, "saver.save_final": False}
    base.update(over)
    return Trainer(load_config(small_overrides(tmp_path, **base)), log=lambda *a, **k: None)


def _batch_with_zero_groups(trainer):
    """A generated batch whose rewards make groups 0 and 2 all-equal (zero advantages) and the others mixed."""
    torch.manual_seed(0)
    batch = trainer.source.generate_batch()
    n = trainer.cfg.gconfig.n_samples
    rewards = torch.tensor([float(i % 2) for i in range(batch.num_rows)])
    for group in (0, 2):
        rewards[group * n:(group + 1) * n] = float(group == 2)
    batch.rewards = rewards
    return batch


@pytest.mark.parametrize("loss", ["m2po", "vanilla"])
def test_skipping_zero_advantage_groups_scales_the_token_mean_step_by_all_over_kept_tokens(tmp_path, loss):
    """With token-mean aggregation, leaving the zero-advantage groups out removes their tokens from the denominator
    only: the step equals the full batch's step times (all valid tokens / kept tokens). Exact up to float rounding."""
    deltas, metrics = {}, {}
    for skip in (False, True):
        trainer = _trainer(tmp_path, f"{loss}-{skip}", **{"actor.loss": loss,
                                                        "actor.skip_zero_advantage_groups": skip})
        batch = _batch_with_zero_groups(trainer)
        adv = trainer.advantages(batch)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        metrics[skip] = trainer.update_actor(batch, adv)
        deltas[skip] = [p.detach() - b for p, b in zip(trainer.model.parameters(), before)]
        zero = zero_advantage_rows(adv, batch.response_mask, batch.group_ids)
        all_tokens, kept_tokens = float(batch.response_mask.sum()), float(batch.response_mask[~zero].sum())
    assert zero.sum() == 2 * trainer.cfg.gconfig.n_samples  # groups 0 and 2
    scale = all_tokens / kept_tokens
    assert scale > 1.0
    for a, b in zip(deltas[False], deltas[True]):
        torch.testing.assert_close(b, a * scale, rtol=2e-4, atol=1e-3 * float(a.abs().max()))  # fp32 sums in another order; the scale is ~30%
    assert any(float(d.abs().max()) > 0 for d in deltas[True])
    assert metrics[True]["skip/groups"] == 2.0 and metrics[True]["skip/rows"] == float(zero.sum())
    assert metrics[True]["skip/token_fraction"] == pytest.approx(1.0 - kept_tokens / all_tokens)
    assert "skip/groups" not in metrics[False]  # off: nothing counted, the update sees the whole batch


def test_a_step_with_every_group_zero_takes_no_optimizer_step_and_advances_the_schedule(tmp_path):
    trainer = _trainer(tmp_path, "allzero", **{"actor.skip_zero_advantage_groups": True,
                                               "actor.optimizer.lr_scheduler_type": "linear"})
    torch.manual_seed(0)
    batch = trainer.source.generate_batch()
    batch.rewards = torch.ones(batch.num_rows)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    lr0 = trainer.actor.optimizer.param_groups[0]["lr"]
    out = trainer.update_actor(batch, trainer.advantages(batch))
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))
    assert out["skip/group_fraction"] == 1.0 and out["actor/num_micro_batches"] == 0.0 and out["actor/lr"] == lr0
    assert trainer.actor.optimizer.param_groups[0]["lr"] < lr0  # the linear schedule moved on


def test_the_step_time_split_adds_up_and_evaluation_is_timed(tmp_path):
    from stalerl.config import load_config, run_dir
    from stalerl.results.metrics_log import read_metrics
    from stalerl.training.trainer import Trainer

    cfg = load_config(small_overrides(tmp_path, total_train_steps=3, **{"saver.save_final": False,
                                                                        "evaluator.freq_steps": 2}))
    Trainer(cfg, log=lambda *a, **k: None).train()
    rows = [r for r in read_metrics(run_dir(cfg)) if r["step"] > 0]
    for r in rows:
        parts = r["timing/split/forward_backward_s"] + r["timing/split/optimizer_s"]
        assert r["timing/split/optimizer_s"] > 0
        assert parts == pytest.approx(r["timing/split/training_s"], rel=1e-9, abs=1e-9)
        assert (r["timing/split/generation_s"] + r["timing/split/logp_s"] + r["timing/split/training_s"]
                <= r["timing/step_s"] + 1e-6)
        assert r["actor/chunked_logprobs"] == 1.0
    assert [("timing/eval_s" in r) for r in rows] == [False, True, True]  # step 2, and the last step
