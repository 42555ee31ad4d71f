"""The exact losses inside AReaL's own PPO actor (areal 1.0.4, CPU, gloo): a real ``FSDPPPOActor`` update.

AReaL's code does the work: ``PPOActor._ppo_update`` (its statistics and mini-batch split), the FSDP engine's
micro-batching into packed 1-D tokens with ``cu_seqlens`` of uneven lengths, its loss scaling and optimizer step, on a
tiny Qwen2 built from a config (no download). The references are independent: a plain transformers forward of the
same weights on the padded rows, ``recipe.registry``'s loss on those rows, and the literal Algorithm 1 of
tests/unit/m2po_reference.py.

Runs in AReaL's own virtual environment (``bash scripts/ci_areal.sh``); elsewhere the module skips, unless
``STALERL_REQUIRE_AREAL=1``, which turns a missing AReaL into an error.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from _areal_fixtures import model_dir  # noqa: F401 - pytest fixture
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "unit"))  # the literal references
sys.path.insert(0, str(HERE))  # the CPU varlen attention

from m2po_reference import reference_m2po  # noqa: E402

from _varlen_attention import varlen_sdpa_installed  # noqa: E402
from recipe.areal.packed import KEEP_MASK_KEY  # noqa: E402
from recipe.registry import get_policy_loss_fn  # noqa: E402

pytestmark = pytest.mark.areal

TAU = 0.04
N_SEQ = 8


@pytest.fixture(autouse=True)
def _varlen_attention():
    with varlen_sdpa_installed():
        yield


def _actor_config(model_dir: Path, loss: str, n_mbs: int, ppo_n_minibatches: int = 1, **extra: Any):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig

    from recipe.areal.config import ExactLossPPOActorConfig

    # SGD with lr 1 and no clipping: the parameter change of one step is minus the gradient, which is compared
    settings = dict(
        experiment_name="stalerl-areal-test", trial_name="t", path=str(model_dir), backend="fsdp:d1p1t1",
        dtype="float32", attn_impl="sdpa", disable_dropout=True, gradient_checkpointing=False,
        mb_spec=MicroBatchSpec(n_mbs=n_mbs),
        optimizer=OptimizerConfig(type="sgd", lr=1.0, weight_decay=0.0, gradient_clipping=1e9,
                                  lr_scheduler_type="constant", warmup_steps_proportion=0.0),
        ppo_n_minibatches=ppo_n_minibatches, kl_ctl=0.0, temperature=1.0, use_decoupled_loss=True,
        recompute_logprob=True, loss=loss)
    return ExactLossPPOActorConfig(**{**settings, **extra})


def _engine(config):
    from areal.api.io_struct import FinetuneSpec

    from recipe.areal.fsdp import ExactLossFSDPPPOActor

    engine = ExactLossFSDPPPOActor(config)
    engine.create_process_group()
    engine.initialize(addr=None, ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=N_SEQ,
                                                      train_batch_size=N_SEQ))
    return engine


def _full_params(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in engine.model.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = value.detach().clone().float()
    return out


def _hf_logprobs(model_dir: Path, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, grad: bool = False):
    """Reference: transformers' own model on the padded rows; position i holds log p(token i+1), AReaL's layout."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits.float()
        labels = torch.roll(input_ids, shifts=-1, dims=1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return model, logp


def _batch(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """A GRPO batch as AReaL's ``compute_advantages`` leaves it: right-padded rows of uneven length, the loss mask
    and the behaviour log-probs rolled to the next-token layout, the recomputed ``prox_logp`` of the current weights;
    behaviour = current + noise, so the batch is stale enough for M2PO to mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 19, 4, 13, 22, 9, 16, 11])
    prompts = torch.tensor([3, 5, 2, 4, 6, 3, 5, 4])
    width = int(lengths.max())
    positions = torch.arange(width).unsqueeze(0)
    attention = positions < lengths.unsqueeze(1)
    input_ids = torch.where(attention, torch.randint(4, 40, (N_SEQ, width), generator=gen), torch.zeros((), dtype=torch.long))
    # token j is a response token for j >= prompt; rolled: position j-1 predicts it
    loss_mask = ((positions >= prompts.unsqueeze(1) - 1) & (positions < lengths.unsqueeze(1) - 1)).float()
    _, current = _hf_logprobs(model_dir, input_ids, attention)
    behaviour = torch.where(loss_mask.bool(), current + torch.randn(current.shape, generator=gen) * 0.5,
                            torch.zeros(()))
    rewards = torch.randn(N_SEQ, generator=gen)
    advantages = (rewards - rewards.mean()).unsqueeze(1).expand(N_SEQ, width) * loss_mask
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask, "logprobs": behaviour,
            "prox_logp": current * attention, "advantages": advantages.contiguous(), "rewards": rewards,
            "kl_rewards": torch.zeros(N_SEQ, width), "tot_rewards": torch.zeros(N_SEQ, width)}


class _Recorder:
    """Wraps an engine's AReaL internals to record what AReaL computed: the scaled loss of every micro-batch, the
    packed micro-batches themselves, and every mini-batch the actor trained on (after its selection)."""

    def __init__(self, engine) -> None:
        self.scaled_losses: list[torch.Tensor] = []
        self.micro_batches: list[dict] = []
        self.mini_batches: list[dict] = []
        compute = engine._compute_logprobs_and_loss
        train_mini_batch = engine.actor.train_mini_batch

        def compute_and_record(logits, ctx, *args, **kwargs):
            loss = compute(logits, ctx, *args, **kwargs)
            self.scaled_losses.append(loss.detach())
            self.micro_batches.append(dict(ctx.mb_input))
            return loss

        def train_and_record(eng, mini_batch, *, first):
            stats = train_mini_batch(eng, mini_batch, first=first)
            self.mini_batches.append(dict(mini_batch))
            return stats

        engine._compute_logprobs_and_loss = compute_and_record
        engine.actor.train_mini_batch = train_and_record


def _update(model_dir: Path, loss: str, n_mbs: int, batch: dict, **config_extra: Any):
    engine = _engine(_actor_config(model_dir, loss, n_mbs, **config_extra))
    before = _full_params(engine)
    recorder = _Recorder(engine)
    engine.ppo_update([{k: v.clone() for k, v in batch.items()}])  # one trajectory group
    after = _full_params(engine)
    engine.destroy()
    return recorder, before, after


def _reference_step(model_dir: Path, loss: str, mini_batch: dict, **config_extra: Any
                    ) -> tuple[torch.Tensor, dict, torch.Tensor, dict]:
    """recipe.registry's loss and gradient for the whole mini-batch in one call on transformers' forward of the same
    weights (FIPO: the reference, a dropped row leaves the numerator and the denominator); for M2PO with the literal
    Algorithm 1 mask (also returned), and the loss's metrics."""
    mask = mini_batch["loss_mask"].bool()
    model, current = _hf_logprobs(model_dir, mini_batch["input_ids"], mini_batch["attention_mask"], grad=True)
    extras, keep = {}, mask
    if loss == "m2po":
        d = (current.detach() - mini_batch["logprobs"]).float()
        literal = reference_m2po(d.tolist(), mini_batch["advantages"].tolist(), mask.tolist(), TAU)
        keep = torch.tensor(literal["keep"]) & mask
        extras["keep_mask"] = keep
    config = {"m2_threshold": TAU, "eps_clip": 0.2, **config_extra}
    value, metrics = get_policy_loss_fn(loss)(old_log_prob=mini_batch["logprobs"], log_prob=current,
                                              advantages=mini_batch["advantages"], response_mask=mask,
                                              loss_agg_mode="token-mean", config=config, **extras)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return value.detach(), grads, keep, metrics


def _assert_step_is_minus_gradient(before: dict, after: dict, grads: dict) -> None:
    for name, grad in grads.items():
        key = name if name in before else name.replace("model.", "", 1)
        torch.testing.assert_close(before[key] - after[key], grad, rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")


#: FIPO's dual-clip constant in these tests: low enough that the stale batch makes FIPO drop rows (> 1 + eps 0.2).
FIPO_C = 1.3


def _exported() -> dict[str, float]:
    from areal.utils import stats_tracker

    return stats_tracker.export(reset=True)


@pytest.mark.parametrize("loss", ["m2po", "fipo"])
def test_areal_update_is_the_registry_loss_of_the_whole_mini_batch(model_dir: Path, loss: str) -> None:
    """AReaL's own loop, 3 packed micro-batches: its loss and update are the registry's on the whole mini-batch (FIPO:
    the reference, with rows dropped), and the step's m2po/* and fipo/* metrics reach AReaL's stats export pooled
    over the micro-batches: counts summed, fractions of the whole mini-batch."""
    extra = {"fipo_clip_ratio_c": FIPO_C} if loss == "fipo" else {}
    batch = _batch(model_dir, seed=11)
    _exported()  # a clean tracker
    recorder, before, after = _update(model_dir, loss, n_mbs=3, batch=batch, **extra)
    stats = _exported()
    # AReaL really split the mini-batch into packed micro-batches of uneven sequence lengths
    assert len(recorder.mini_batches) == 1 and len(recorder.micro_batches) == 3
    for mb in recorder.micro_batches:
        assert mb["input_ids"].dim() == 1 and "cu_seqlens" in mb
    seq_lens = torch.cat([mb["cu_seqlens"].diff() for mb in recorder.micro_batches])
    assert sorted(seq_lens.tolist()) == sorted(batch["attention_mask"].sum(1).tolist())

    mini_batch = recorder.mini_batches[0]
    expected_loss, grads, literal_keep, metrics = _reference_step(model_dir, loss, mini_batch, **extra)
    # the loss AReaL computed (sum of its scaled micro-batch losses) is the registry's on the same tokens
    torch.testing.assert_close(torch.stack(recorder.scaled_losses).sum(), expected_loss, rtol=1e-5, atol=1e-7)
    _assert_step_is_minus_gradient(before, after, grads)
    mask = mini_batch["loss_mask"].bool()
    if loss == "m2po":
        assert torch.equal(mini_batch[KEEP_MASK_KEY][mask], literal_keep[mask])
        assert (~literal_keep[mask]).any(), "the batch must be stale enough for Algorithm 1 to mask something"
        # and every micro-batch got its slice of that one selection
        kept = sum(int((mb[KEEP_MASK_KEY].bool() & mb["loss_mask"].bool()).sum()) for mb in recorder.micro_batches)
        assert kept == int(literal_keep[mask].sum())
        n_masked = int((~literal_keep[mask]).sum())
        assert stats["m2po/num_masked_tokens"] == n_masked and stats["m2po/num_valid_tokens"] == int(mask.sum())
        assert stats["m2po/masked_fraction"] == pytest.approx(n_masked / int(mask.sum()), rel=1e-6)
        for key in ("m2po/m2_before", "m2po/m2_after", "m2po/trust_region_fraction", "m2po/threshold"):
            assert stats[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-7), key
    else:
        assert metrics["fipo/sequence_drop_ratio"] > 0, "the batch must make FIPO drop a row"
        for key, value in metrics.items():  # pooled over AReaL's 3 micro-batches = the whole mini-batch's
            assert stats[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert stats["fipo/num_sequences"] == N_SEQ


@pytest.mark.parametrize("loss", ["m2po", "fipo"])
def test_areal_update_does_not_depend_on_the_micro_batch_split(model_dir: Path, loss: str) -> None:
    extra = {"fipo_clip_ratio_c": FIPO_C} if loss == "fipo" else {}
    batch = _batch(model_dir, seed=12)
    results = {n: _update(model_dir, loss, n_mbs=n, batch=batch, **extra) for n in (1, 4)}
    assert [len(results[n][0].micro_batches) for n in (1, 4)] == [1, 4]
    (_, before1, after1), (_, before4, after4) = results[1], results[4]
    for name in before1:
        torch.testing.assert_close(before1[name], before4[name], rtol=0, atol=0)
        torch.testing.assert_close(after1[name] - before1[name], after4[name] - before4[name], rtol=1e-4, atol=1e-7)
    assert any((after1[name] != before1[name]).any() for name in before1), "the update must move the weights"


def test_first_mini_batch_reuses_prox_logp_and_a_fresh_forward_gives_the_same_selection(model_dir: Path) -> None:
    """prox_logp_method=recompute reuses AReaL's prox_logp; no decoupled loss (no prox_logp) and loglinear (prox_logp
    only approximated: here deliberately wrong) run a forward instead: the same selection and update each time."""
    batch = _batch(model_dir, seed=13)
    with_prox, _, after_prox = _update(model_dir, "m2po", n_mbs=2, batch=batch)
    without = {k: v for k, v in batch.items() if k != "prox_logp"}
    fresh, _, after_fresh = _update(model_dir, "m2po", n_mbs=2, batch=without,
                                    use_decoupled_loss=False, recompute_logprob=False)
    approximated = {**batch, "prox_logp": batch["prox_logp"] + 0.3 * batch["loss_mask"]}
    loglinear, _, after_loglinear = _update(model_dir, "m2po", n_mbs=2, batch=approximated,
                                            prox_logp_method="loglinear")
    metrics_method, _, after_metrics = _update(model_dir, "m2po", n_mbs=2, batch=batch, prox_logp_method="metrics")
    keep_a = with_prox.mini_batches[0][KEEP_MASK_KEY]
    for other in (fresh, loglinear, metrics_method):
        assert torch.equal(keep_a, other.mini_batches[0][KEEP_MASK_KEY])
    for name in after_prox:
        for other in (after_fresh, after_loglinear, after_metrics):
            torch.testing.assert_close(after_prox[name], other[name], rtol=1e-5, atol=1e-7)


def test_later_mini_batches_select_with_the_updated_weights(model_dir: Path) -> None:
    batch = _batch(model_dir, seed=14)
    engine = _engine(_actor_config(model_dir, "m2po", n_mbs=2, ppo_n_minibatches=2))
    recorder = _Recorder(engine)
    seen: list[tuple[bool, torch.Tensor, dict]] = []
    current_logprobs = engine.actor.current_logprobs

    def record_current(eng, mini_batch, *, first):
        params = _full_params(engine)
        out = current_logprobs(eng, mini_batch, first=first)
        seen.append((first, out.clone(), params))
        return out

    engine.actor.current_logprobs = record_current
    engine.ppo_update([{k: v.clone() for k, v in batch.items()}])  # one trajectory group
    engine.destroy()
    assert [first for first, _, _ in seen] == [True, False] and len(recorder.mini_batches) == 2
    _, second, params = seen[1]
    mini_batch = recorder.mini_batches[1]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.load_state_dict(params)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=mini_batch["input_ids"], attention_mask=mini_batch["attention_mask"].long()).logits
        labels = torch.roll(mini_batch["input_ids"], shifts=-1, dims=1)
        expected = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mask = mini_batch["loss_mask"].bool()
    torch.testing.assert_close(second[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(second[mask], mini_batch["prox_logp"][mask]), "the weights must have moved"
    d = (second - mini_batch["logprobs"]).float()
    literal = torch.tensor(reference_m2po(d.tolist(), mini_batch["advantages"].tolist(), mask.tolist(), TAU)["keep"])
    assert torch.equal(mini_batch[KEEP_MASK_KEY][mask], literal[mask])


def test_actor_config_refuses_what_the_exact_loss_would_ignore(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"actor\.rejection_sampling=null"):
        _actor_config(model_dir, "m2po", 1, rejection_sampling={"upper": 5.0})
    with pytest.raises(ValueError, match=r"actor\.enable_tree_training=false"):
        _actor_config(model_dir, "fipo", 1, enable_tree_training=True)
    with pytest.raises(ValueError, match=r"actor\.use_decoupled_loss=true"):
        _actor_config(model_dir, "m2po", 1, use_decoupled_loss=False)
    with pytest.raises(ValueError, match=r"actor\.loss must be one of"):
        _actor_config(model_dir, "m3po", 1)


def test_an_untested_areal_version_is_refused_when_the_adapter_is_built(model_dir: Path, monkeypatch) -> None:
    import recipe.versions as versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda key: "1.1.0" if key == "areal" else real(key))
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(versions.UntestedFrameworkVersion, match=r"recipe\.areal: areal 1\.1\.0 is installed, but "
                                                              r"this adapter was tested on areal>=1\.0\.4,<1\.1"):
        _actor_config(model_dir, "m2po", 1)
    from recipe.areal.actor import ExactLossPPOActor

    with pytest.raises(versions.UntestedFrameworkVersion, match=r"STALERL_ALLOW_UNTESTED_FRAMEWORKS=areal"):
        ExactLossPPOActor(object(), object())  # the actor checks before it reads anything


def test_a_release_that_moves_the_update_loop_fails_loudly_and_never_runs_arealss_own_m2po(model_dir: Path,
                                                                                           monkeypatch) -> None:
    """Two simulated AReaL releases: (a) ``_ppo_update`` reaches the engine through a reference it took at
    construction, so AReaL's grpo_loss_fn would reach engine.train_batch behind the adapter's view; (b) the loop moved
    elsewhere (here: ``_ppo_update`` trains nothing through the view). Both stop with one error, the weights untouched;
    AReaL's own M2PO attribute is off either way."""
    from areal.trainer.ppo.actor import PPOActor

    from recipe.areal.actor import ExactPathNotTaken

    batch = _batch(model_dir, seed=15)
    original_init, original_update = PPOActor.__init__, PPOActor._ppo_update

    def init_keeping_the_engine(self, config, engine):
        original_init(self, config, engine)
        self._engine_at_init = engine

    def update_through_the_kept_engine(self, data):
        view, self.engine = self.engine, self._engine_at_init
        try:
            original_update(self, data)
        finally:
            self.engine = view

    monkeypatch.setattr(PPOActor, "__init__", init_keeping_the_engine)
    monkeypatch.setattr(PPOActor, "_ppo_update", update_through_the_kept_engine)
    engine = _engine(_actor_config(model_dir, "m2po", n_mbs=2, m2_threshold=TAU))
    assert engine.actor.m2_threshold is None and engine.config.m2_threshold == TAU
    before = _full_params(engine)
    with pytest.raises(ExactPathNotTaken, match=r"engine\.train_batch was called with grpo_loss_fn, not the exact "
                                               r"loss.*stopped instead of falling back to AReaL's own loss"):
        engine.ppo_update([{k: v.clone() for k, v in batch.items()}])
    assert "train_batch" not in vars(engine), "the guard is removed after the update"
    monkeypatch.setattr(PPOActor, "_ppo_update", lambda self, data: None)  # (b): the loop is somewhere else
    with pytest.raises(ExactPathNotTaken, match=r"_ppo_update returned without calling the adapter's "
                                               r"engine\.train_batch"):
        engine.ppo_update([{k: v.clone() for k, v in batch.items()}])
    after = _full_params(engine)
    engine.destroy()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_a_batch_for_arealss_distillation_is_refused_by_the_exact_loss() -> None:
    from recipe.areal.actor import exact_loss_fn

    packed = {"loss_mask": torch.ones(3), "logprobs": torch.zeros(3), "advantages": torch.ones(3),
              "cu_seqlens": torch.tensor([0, 3]), "teacher_logp": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"teacher distillation \(teacher_logp in the batch\) is part of AReaL's own "
                                         r"loss only; unset actor\.loss or the teacher"):
        exact_loss_fn(torch.zeros(3), torch.zeros(3), packed, loss_name="fipo", config={})
