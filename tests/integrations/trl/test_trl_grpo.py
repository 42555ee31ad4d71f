"""recipe.trl against the real TRL GRPOTrainer (CPU, tiny Qwen2 built locally): loss = registry, the literal
Algorithm 1 mask of the whole optimizer step, metrics in TRL's logs, split invariance, built-in losses unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trl_cases import (base_args, capturing_trainer, digit_reward, prompts_dataset, require_trl,  # noqa: F401
                       tiny_model_and_tokenizer, train, weights)

pytestmark = pytest.mark.trl

TAU = 0.002  # small, so that Algorithm 1 masks tokens of the reuse pass at this tiny scale
# Split invariance is a property of the gradient; plain SGD turns it into weights 1:1. (AdamW's first step is about
# lr * sign(g) per entry, so fp32 round-off in near-zero gradient entries shows up as ~1e-4 weight differences.)
SGD = dict(optim="sgd", learning_rate=2.0)
# With SGD at that rate the reuse pass drifts far (m2 ~ 0.6): at this tau Algorithm 1 over the whole step and over
# each micro-batch keep different tokens (measured: 24 vs 22 of 60 kept with 2x4), so the splits are a real test.
SPLIT_TAU = 0.2
# Measured on CPU (torch 2.13, trl 1.16): max |w - w(8x1)| <= 1.8e-7 after two steps that move weights by 0.3-0.4.
SPLIT_ATOL = 1e-6


# one trainer helper and one capturing trainer for every TRL test file (trl_cases)
_train = train
_capturing_trainer = capturing_trainer


def _steps(calls: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for call in calls:
        out.setdefault(call["window"], []).append(call)
    return list(out.values())


def _cat(step: list[dict[str, Any]], key: str) -> torch.Tensor:
    return torch.cat([call[key] for call in step], dim=0)  # one generation batch: same padded width


def _assert_split_invariant(finals: dict[tuple[int, int], dict[str, torch.Tensor]], what: str) -> None:
    """The weights of every split against 8x1 (per-device batch x accumulation), within SPLIT_ATOL."""
    ref = finals[(8, 1)]
    for split, got in finals.items():
        worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        print(f"{what} {split[0]}x{split[1]}: max |w - w(8x1)| = {worst:.2e}")
        assert worst <= SPLIT_ATOL, f"{what} {split}: weights differ from 8x1 by {worst}"


@pytest.mark.parametrize("loss_type", ["m2po", "fipo"])
def test_loss_is_the_registry_loss_of_the_whole_optimizer_step(tmp_path: Path, loss_type: str) -> None:
    from m2po_reference import reference_m2po

    from recipe.registry import get_policy_loss_fn
    from recipe.trl.losses import loss_config

    trainer = _train(tmp_path, _capturing_trainer(), loss_type=loss_type, m2_threshold=TAU,
                     per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4)
    steps = _steps(trainer.calls)
    assert len(steps) == 4 and all(len(step) == 2 for step in steps)
    fn = get_policy_loss_fn(loss_type)
    masked_somewhere = False
    drift = 0.0
    for step in steps:
        old, new, adv, mask = (_cat(step, k) for k in ("old_log_prob", "log_prob", "advantages", "response_mask"))
        assert all(call["config"]["global_batch_info"]["batch_num_tokens"] == int(mask.sum()) for call in step)
        whole, _ = fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
                      config=loss_config(trainer.args))
        torch.testing.assert_close(sum(call["loss"] for call in step), whole, rtol=1e-5, atol=1e-7)
        drift = max(drift, float(((new - old).abs() * mask).max()))
        if loss_type == "m2po":
            keep = torch.cat([call["extras"]["keep_mask"] for call in step])
            literal = reference_m2po((new - old).float().tolist(), adv.float().tolist(), mask.bool().tolist(), TAU)
            expected = torch.tensor(literal["keep"], dtype=torch.bool)
            valid = mask.bool()
            assert torch.equal(keep[valid], expected[valid])
            masked_somewhere |= bool((~expected[valid]).any())
    assert drift > 1e-3, "the reuse pass must move the policy off the behaviour one"
    # one value per optimizer step, over the whole step (logging_steps=1: log row i is step i + 1): a per-micro-batch
    # append would log the mean of the two micro-batches' counts, half the step's
    rows = [row for row in trainer.state.log_history if f"{loss_type}/num_valid_tokens" in row]
    assert len(rows) == len(steps)
    for row, step in zip(rows, steps):
        assert row[f"{loss_type}/num_valid_tokens"] == int(_cat(step, "response_mask").sum())
    logged = {k for row in trainer.state.log_history for k in row}
    if loss_type == "m2po":
        assert masked_somewhere, "the run must make Algorithm 1 mask something"
        assert {"m2po/m2_before", "m2po/m2_after", "m2po/masked_fraction"} <= logged
        assert any(row.get("m2po/num_masked_tokens", 0) > 0 for row in trainer.state.log_history)
    else:
        from recipe.hf_step import FIPO_STEP_METRICS

        assert set(FIPO_STEP_METRICS) <= logged
        assert any(abs(row.get("fipo/influence_weights_mean_raw", 1.0) - 1.0) > 1e-4
                   for row in trainer.state.log_history), "FIPO's influence weights must move off 1"


@pytest.mark.parametrize("loss_type", ["m2po", "fipo"])
def test_split_invariance_8x1_4x2_2x4(tmp_path: Path, loss_type: str) -> None:
    """One generation batch of 8 completions trained as per-device batch x accumulation 8x1, 4x2, 2x4: same weights.
    Two optimizer steps: the on-policy pass and the reuse pass (num_iterations=2), where M2PO masks."""
    finals = {}
    for per_device, ga in ((8, 1), (4, 2), (2, 4)):
        trainer = _train(tmp_path / f"{per_device}x{ga}", loss_type=loss_type, m2_threshold=SPLIT_TAU,
                         per_device_train_batch_size=per_device, gradient_accumulation_steps=ga, max_steps=2, **SGD)
        finals[(per_device, ga)] = weights(trainer.model)
        if loss_type == "m2po":
            masked = [row["m2po/num_masked_tokens"] for row in trainer.state.log_history
                      if "m2po/num_masked_tokens" in row]
            assert masked[-1] > 0, "the reuse step must mask tokens, or the test shows nothing"
    ref = finals[(8, 1)]
    start = weights(tiny_model_and_tokenizer()[0])
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    assert moved > 1e-3
    for split, got in finals.items():
        worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        print(f"{loss_type} {split[0]}x{split[1]}: max |w - w(8x1)| = {worst:.2e} (weights moved {moved:.2e})")
        assert worst <= SPLIT_ATOL, f"{split}: weights differ from 8x1 by {worst}"


def test_a_per_micro_batch_selection_would_not_be_split_invariant(tmp_path: Path) -> None:
    """The same run with M2PO selecting per micro-batch (the registry without the step's keep_mask) gives other
    weights: the split-invariance test above can fail."""
    require_trl()
    from recipe.registry import get_policy_loss_fn
    from recipe.trl import GRPOTrainer

    class PerMicroBatch(GRPOTrainer):
        def _policy_loss(self, *, extras: dict, **kw: Any):
            return get_policy_loss_fn(self.loss_type)(loss_agg_mode="token-mean", **kw)

    exact = _train(tmp_path / "exact", loss_type="m2po", m2_threshold=SPLIT_TAU, per_device_train_batch_size=2,
                   gradient_accumulation_steps=4, max_steps=2, **SGD)
    local = _train(tmp_path / "local", PerMicroBatch, loss_type="m2po", m2_threshold=SPLIT_TAU,
                   per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=2, **SGD)
    a, b = weights(exact.model), weights(local.model)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 100 * SPLIT_ATOL


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_builtin_loss_types_are_trls_own(tmp_path: Path, loss_type: str) -> None:
    require_trl()
    import trl

    ours = _train(tmp_path / "ours", loss_type=loss_type, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    theirs = _train(tmp_path / "theirs", trl.GRPOTrainer, trl.GRPOConfig, loss_type=loss_type,
                    per_device_train_batch_size=4, gradient_accumulation_steps=2)
    a, b = weights(ours.model), weights(theirs.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith(("m2po/", "fipo/")) for row in ours.state.log_history for k in row)


def test_the_pinned_trl_loss_types_are_the_installed_trls_and_ours_shadow_none() -> None:
    """TRL has no public registry of its loss types: recipe.trl pins them (TRL_LOSS_TYPES), and this test keeps the
    pin equal to the values the installed ``trl.GRPOConfig`` documents for ``loss_type`` (its field help). A loss of
    ours whose TRL name is one of them is refused in TRL alone (recipe.registry.usable_declarations)."""
    require_trl()
    import dataclasses
    import re

    import trl

    from recipe.trl import STALERL_LOSS_TYPES, TRL_LOSS_TYPES

    help_text = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}["loss_type"].metadata["help"]
    supported = help_text.split("Supported values are", 1)[1].split(". ", 1)[0]
    theirs = set(re.findall(r"'([a-z_]+)'", supported))
    assert theirs == set(TRL_LOSS_TYPES), f"TRL's loss types are now {sorted(theirs)}; update TRL_LOSS_TYPES"
    assert not theirs & set(STALERL_LOSS_TYPES)


def test_trl_vllm_importance_sampling_defaults_are_trls() -> None:
    require_trl()
    import dataclasses

    import trl

    from recipe.trl.losses import TRL_VLLM_IS_DEFAULTS

    defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert {k: defaults[k] for k in TRL_VLLM_IS_DEFAULTS} == TRL_VLLM_IS_DEFAULTS
    assert defaults["vllm_importance_sampling_correction"] is True


def test_colocated_vllm_samples_processed_logprobs_and_a_raw_server_is_refused(tmp_path: Path) -> None:
    """Colocated vLLM: TRL itself builds the engine with processed log-probs (read from TRL's source). Server: the
    adapter asks the server (TRL asks only with its IS correction on, which m2po/fipo refuse) and refuses raw ones."""
    require_trl()
    import inspect
    from types import SimpleNamespace

    from trl.generation import vllm_generation

    from recipe.trl import GRPOTrainer

    assert 'logprobs_mode="processed_logprobs"' in inspect.getsource(vllm_generation)

    def stub(mode: str) -> SimpleNamespace:
        client = SimpleNamespace(get_server_info=lambda: {"model_config": {"logprobs_mode": mode}})
        return SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True, num_processes=1), loss_type="m2po",
                               vllm_generation=SimpleNamespace(vllm_client=client))

    GRPOTrainer._stalerl_check_vllm_server(stub("processed_logprobs"))
    with pytest.raises(ValueError, match="--logprobs-mode raw_logprobs") as err:
        GRPOTrainer._stalerl_check_vllm_server(stub("raw_logprobs"))
    assert "\n" not in str(err.value)


def test_deepspeed_or_fsdp_is_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    """DeepSpeed / FSDP come from accelerate's configuration (HF's Trainer knows them once it built its accelerator):
    refused for m2po/fipo; a real trainer has both attributes, off on CPU, so a renamed attribute would fail here."""
    require_trl()
    from types import SimpleNamespace

    from recipe.trl import GRPOConfig, GRPOTrainer

    model, tok = tiny_model_and_tokenizer()
    trainer = GRPOTrainer(model=model, reward_funcs=digit_reward, processing_class=tok, train_dataset=prompts_dataset(),
                          args=GRPOConfig(**base_args(tmp_path, loss_type="m2po")))
    assert trainer.is_deepspeed_enabled is False and trainer.is_fsdp_enabled is False
    for deepspeed, fsdp, backend in ((True, False, "DeepSpeed"), (False, True, "FSDP")):
        stub = SimpleNamespace(loss_type="fipo", is_deepspeed_enabled=deepspeed, is_fsdp_enabled=fsdp)
        message = rf"^recipe\.trl: loss_type='fipo' under {backend} is not supported"
        with pytest.raises(ValueError, match=message) as err:
            GRPOTrainer._stalerl_check_backend(stub)
        assert "\n" not in str(err.value)


def test_untested_trl_version_is_refused_unless_overridden(tmp_path: Path, monkeypatch) -> None:
    require_trl()
    import recipe.versions as versions
    from recipe.trl import GRPOConfig

    monkeypatch.setattr(versions, "installed_version", lambda key: "1.17.0" if key == "trl" else None)
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(versions.UntestedFrameworkVersion, match=r"trl 1\.17\.0 .*>=1\.16,<1\.17") as err:
        GRPOConfig(**base_args(tmp_path, loss_type="m2po"))
    assert "\n" not in str(err.value) and versions.ALLOW_ENV in str(err.value)
    monkeypatch.setenv(versions.ALLOW_ENV, "trl")
    with pytest.warns(RuntimeWarning, match="outside the tested range"):
        GRPOConfig(**base_args(tmp_path, loss_type="m2po"))


@pytest.mark.parametrize(("overrides", "field"), [
    ({"loss_type": "m2p0"}, "loss_type"),
    ({"loss_type": "m2po", "m2_threshold": -0.1}, "m2_threshold"),
    ({"loss_type": "fipo", "fipo_clip_ratio_c": 1.1}, "fipo_clip_ratio_c"),
    ({"loss_type": "fipo", "fipo_decay_rate": 0.0}, "fipo_decay_rate"),
    ({"loss_type": "fipo", "fipo_influence_clip_high_only": False, "fipo_influence_clip_ratio": 1.5},
     "fipo_influence_clip_ratio"),
    ({"loss_type": "m2po", "delta": 3.0}, "delta"),
    ({"loss_type": "m2po", "importance_sampling_level": "sequence"}, "importance_sampling_level"),
    ({"loss_type": "fipo", "steps_per_generation": 3, "gradient_accumulation_steps": 2}, "steps_per_generation"),
    ({"loss_type": "m2po", "use_vllm": True}, "vllm_importance_sampling_correction"),
    ({"loss_type": "fipo", "use_vllm": True, "vllm_mode": "server"}, "vllm_importance_sampling_correction"),
    ({"loss_type": "m2po", "use_vllm": True, "vllm_importance_sampling_correction": False,
      "vllm_importance_sampling_mode": "token_truncate"}, "vllm_importance_sampling_mode"),
    ({"loss_type": "fipo", "use_vllm": True, "vllm_importance_sampling_correction": False,
      "vllm_importance_sampling_clip_max": 2.0}, "vllm_importance_sampling_clip_max"),
])
def test_bad_values_fail_at_construction_naming_the_field(tmp_path: Path, overrides: dict, field: str) -> None:
    require_trl()
    from recipe.trl import GRPOConfig

    kwargs = base_args(tmp_path, per_device_train_batch_size=4)
    kwargs.update(overrides)
    with pytest.raises(ValueError) as err:
        GRPOConfig(**kwargs)
    message = str(err.value)
    assert f"GRPOConfig.{field}" in message and "\n" not in message


def test_trls_own_config_is_refused_for_stalerl_losses(tmp_path: Path) -> None:
    require_trl()
    import trl

    from recipe.trl import GRPOTrainer

    model, tok = tiny_model_and_tokenizer()
    with pytest.raises(TypeError, match="recipe.trl.GRPOConfig"):
        GRPOTrainer(model=model, reward_funcs=digit_reward, processing_class=tok, train_dataset=prompts_dataset(),
                    args=trl.GRPOConfig(**base_args(tmp_path, loss_type="m2po")))


def test_beta_adds_trls_kl_term_with_the_step_denominator_and_stays_split_invariant(tmp_path: Path) -> None:
    """beta > 0: TRL loads a reference copy (from the saved local model) and the KL term is logged, off 0; it uses the
    step's token count like the policy term, so 8x1 and 2x4 give the same weights."""
    require_trl()
    from recipe.trl import GRPOConfig, GRPOTrainer

    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path / "model")
    finals = {}
    for per_device, ga in ((8, 1), (2, 4)):
        torch.manual_seed(0)
        args = GRPOConfig(**base_args(tmp_path / f"{per_device}x{ga}", loss_type="m2po", beta=0.1,
                                      m2_threshold=SPLIT_TAU, per_device_train_batch_size=per_device,
                                      gradient_accumulation_steps=ga, **SGD))
        trainer = GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=digit_reward, args=args,
                              train_dataset=prompts_dataset(), processing_class=tok)
        trainer.train()
        kl = [row["kl"] for row in trainer.state.log_history if "kl" in row]
        assert kl and kl[-1] > 0
        finals[(per_device, ga)] = weights(trainer.model)
    a, b = finals[(8, 1)], finals[(2, 4)]
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"beta=0.1 m2po 2x4: max |w - w(8x1)| = {worst:.2e}")
    assert worst <= SPLIT_ATOL, f"with the KL term, 2x4 differs from 8x1 by {worst}"


@pytest.mark.parametrize("loss_type", ["m2po", "fipo"])
def test_on_policy_steps_use_a_zero_log_ratio_and_are_split_invariant(tmp_path: Path, loss_type: str) -> None:
    """TRL's defaults, num_iterations=1 and steps_per_generation = gradient_accumulation_steps: TRL computes no old
    log-probs, the behaviour policy is the current one (log-ratio 0), M2PO masks nothing, and 8x1 and 2x4 give the
    same weights after the step."""
    finals = {}
    for per_device, ga in ((8, 1), (2, 4)):
        trainer = _train(tmp_path / f"{per_device}x{ga}", _capturing_trainer(), loss_type=loss_type,
                         m2_threshold=SPLIT_TAU, per_device_train_batch_size=per_device,
                         gradient_accumulation_steps=ga, num_iterations=1, max_steps=1, **SGD)
        assert len(trainer.calls) == ga
        assert all(torch.equal(call["old_log_prob"], call["log_prob"]) for call in trainer.calls)
        if loss_type == "m2po":
            masked = [row["m2po/num_masked_tokens"] for row in trainer.state.log_history
                      if "m2po/num_masked_tokens" in row]
            assert masked == [0]
        finals[(per_device, ga)] = weights(trainer.model)
    a, b = finals[(8, 1)], finals[(2, 4)]
    start = weights(tiny_model_and_tokenizer()[0])
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3, "the step must move the weights"
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"{loss_type} on-policy 2x4: max |w - w(8x1)| = {worst:.2e}")
    assert worst <= SPLIT_ATOL, f"on-policy 2x4 differs from 8x1 by {worst}"


@pytest.mark.parametrize("loss_type", ["m2po", "fipo"])
def test_steps_per_generation_twice_the_accumulation_is_split_invariant(tmp_path: Path, loss_type: str) -> None:
    """steps_per_generation = 2 x gradient_accumulation_steps: one generation batch of 16 completions feeds two
    optimizer steps of 8 (TRL indexes _buffered_inputs[k % steps_per_generation] and computes old log-probs, so the
    second step trains on stale data). 8x1 (spg 2), 4x2 (spg 4), 2x4 (spg 8): same weights; every call's
    denominator is its own step's tokens (not TRL's generation-batch count), and M2PO masks on the second step."""
    finals = {}
    for per_device, ga in ((8, 1), (4, 2), (2, 4)):
        trainer = _train(tmp_path / f"{per_device}x{ga}", _capturing_trainer(), loss_type=loss_type,
                         m2_threshold=SPLIT_TAU, per_device_train_batch_size=per_device, gradient_accumulation_steps=ga,
                         steps_per_generation=2 * ga, num_iterations=1, max_steps=2, **SGD)
        steps = _steps(trainer.calls)
        assert [len(step) for step in steps] == [ga, ga]
        assert [step[0]["window"] for step in steps] == [0, ga]
        for step in steps:
            tokens = int(_cat(step, "response_mask").sum())
            assert all(call["config"]["global_batch_info"]["batch_num_tokens"] == tokens for call in step)
        stale = _cat(steps[1], "log_prob") - _cat(steps[1], "old_log_prob")
        assert float((stale.abs() * _cat(steps[1], "response_mask")).max()) > 1e-3, "step 2 must train on stale data"
        if loss_type == "m2po":
            masked = [row["m2po/num_masked_tokens"] for row in trainer.state.log_history
                      if "m2po/num_masked_tokens" in row]
            assert masked[-1] > 0, "the second step must mask tokens, or the test shows nothing"
        finals[(per_device, ga)] = weights(trainer.model)
    _assert_split_invariant(finals, f"{loss_type} spg=2ga")


def test_extra_forwards_run_as_trls_own_log_prob_forward(tmp_path: Path) -> None:
    """With gradient checkpointing on: the no-grad forwards M2PO adds for micro-batches 1..n-1 run in the state of
    TRL's own old-log-prob forward (no grad, same train/eval mode, checkpointing off for the call), and the run's
    weights equal those of the same run without gradient checkpointing."""
    require_trl()
    from recipe.trl import GRPOTrainer

    class Recording(GRPOTrainer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.states: list[tuple[str, bool, bool, bool]] = []
            self._ours = False

        def _extra_log_probs(self, batch):
            self._ours = True
            try:
                return super()._extra_log_probs(batch)
            finally:
                self._ours = False

        def _get_per_token_logps_and_entropies(self, model, *a: Any, **kw: Any):
            if not torch.is_grad_enabled():
                self.states.append(("ours" if self._ours else "trl", torch.is_grad_enabled(), model.training,
                                    bool(model.is_gradient_checkpointing)))
            return super()._get_per_token_logps_and_entropies(model, *a, **kw)

    common = dict(loss_type="m2po", m2_threshold=SPLIT_TAU, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_steps=2, **SGD)
    checkpointed = _train(tmp_path / "gc", Recording, gradient_checkpointing=True, **common)
    assert checkpointed.model.is_gradient_checkpointing  # restored after every extra forward
    ours = {s[1:] for s in checkpointed.states if s[0] == "ours"}
    trls = {s[1:] for s in checkpointed.states if s[0] == "trl"}
    assert ours and trls, checkpointed.states
    assert ours == trls == {(False, True, False)}
    plain = _train(tmp_path / "plain", gradient_checkpointing=False, **common)
    a, b = weights(checkpointed.model), weights(plain.model)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= SPLIT_ATOL, f"gradient checkpointing changed the weights by {worst}"


# ------------------------------------------------------------------------- tool masks, FIPO's drops, refusals

TOOL_COLUMNS = slice(2, 5)  # completion positions a rollout marks as tool output (env_mask 0)


def _rollout_with_tool_output(prompts: list[Any], trainer: Any) -> dict[str, Any]:
    """A TRL ``rollout_func``: TRL's own HF generation, with ``env_mask`` (TRL's ``tool_mask``) 0 on completion
    positions 2..4, as a tool call's result would be. Column-wise, so the same tokens whatever the row shuffle."""
    prompt_ids, images, fields = trainer._tokenize_prompts(prompts)
    completion_ids, _ = trainer._generate_single_turn(prompt_ids, images, fields, trainer.num_generations)
    env_mask = [[0 if TOOL_COLUMNS.start <= j < TOOL_COLUMNS.stop else 1 for j in range(len(ids))]
                for ids in completion_ids]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_mask}


def _whole_step_loss(trainer: Any, step: list[dict[str, Any]]) -> torch.Tensor:
    """The registry loss of the whole step in one call (its own selection, drop and token count)."""
    from recipe.registry import get_policy_loss_fn
    from recipe.trl.losses import loss_config

    old, new, adv, mask = (_cat(step, k) for k in ("old_log_prob", "log_prob", "advantages", "response_mask"))
    whole, _ = get_policy_loss_fn(trainer.loss_type)(old_log_prob=old, log_prob=new, advantages=adv,
                                                     response_mask=mask, loss_agg_mode="token-mean",
                                                     config=loss_config(trainer.args))
    return whole


def test_tool_mask_leaves_tool_tokens_out_of_the_loss_and_the_count_split_invariantly(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """TRL's tool mask (here from a rollout_func's ``env_mask``, TRL's path for environment / tool output): the
    masked tokens are in no loss call and not in the step's token count, each step's loss is the one-call loss
    over the tool-masked step, and 8x1 / 2x4 give the same weights. (TRL's ``tools=`` loop fills the same
    ``tool_mask`` key; it needs a tool-calling chat template, which the tiny tokenizer has not.)"""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's notice that rollout_func is experimental
    finals = {}
    for per_device, ga in ((8, 1), (2, 4)):
        trainer = _train(tmp_path / f"{per_device}x{ga}", _capturing_trainer(), loss_type="m2po",
                         m2_threshold=SPLIT_TAU, per_device_train_batch_size=per_device,
                         gradient_accumulation_steps=ga, max_steps=2,
                         trainer_kwargs={"rollout_func": _rollout_with_tool_output}, **SGD)
        steps = _steps(trainer.calls)
        assert len(steps) == 2 and all(len(step) == ga for step in steps)
        for step in steps:
            mask = _cat(step, "response_mask")
            assert float(mask[:, TOOL_COLUMNS].sum()) == 0 and float(mask[:, :TOOL_COLUMNS.start].sum()) > 0
            assert all(call["config"]["global_batch_info"]["batch_num_tokens"] == int(mask.sum()) for call in step)
            torch.testing.assert_close(sum(call["loss"] for call in step), _whole_step_loss(trainer, step),
                                       rtol=1e-5, atol=1e-7)
        finals[(per_device, ga)] = weights(trainer.model)
    _assert_split_invariant(finals, "m2po with tool_mask")


FIPO_DROP_EPSILON, FIPO_DROP_C = 0.02, 1.05  # PPO clip and dual clip c (> 1 + eps_high): the reuse pass drops rows


def test_fipo_rows_dropped_in_the_trainer_are_the_reference_fipo_and_split_invariant(tmp_path: Path) -> None:
    """FIPO's sequence drop through trainer.train(): one generation batch feeds two steps (steps_per_generation =
    2 x accumulation), and with c = 1.05 (PPO clip 0.02) rows of the second, stale step drop
    (fipo/sequence_drop_ratio > 0; with num_iterations=2 instead, the reuse pass lowers the A < 0 tokens' ratios and
    no row has two above c); each step's micro-batch losses add up to the registry's FIPO of the whole step in
    one call (which removes the dropped rows from its numerator and denominator), and 8x1 / 4x2 / 2x4 give the same
    weights."""
    finals = {}
    for per_device, ga in ((8, 1), (4, 2), (2, 4)):
        trainer = _train(tmp_path / f"{per_device}x{ga}", _capturing_trainer(), loss_type="fipo",
                         fipo_clip_ratio_c=FIPO_DROP_C, epsilon=FIPO_DROP_EPSILON,
                         per_device_train_batch_size=per_device, gradient_accumulation_steps=ga,
                         steps_per_generation=2 * ga, num_iterations=1, max_steps=2, **SGD)
        for step in _steps(trainer.calls):
            torch.testing.assert_close(sum(call["loss"] for call in step), _whole_step_loss(trainer, step),
                                       rtol=1e-5, atol=1e-7)
        # the second step's count leaves the dropped row's tokens out
        counted = trainer.calls[-1]["config"]["global_batch_info"]["batch_num_tokens"]
        assert counted < int(_cat(_steps(trainer.calls)[-1], "response_mask").sum())
        rows = [row for row in trainer.state.log_history if "fipo/sequence_drop_ratio" in row]
        dropped = [row["fipo/num_dropped_sequences"] for row in rows]
        print(f"fipo c={FIPO_DROP_C} {per_device}x{ga}: rows dropped per step {dropped}")
        assert len(rows) == 2 and rows[-1]["fipo/sequence_drop_ratio"] > 0, "no row dropped: the test shows nothing"
        finals[(per_device, ga)] = weights(trainer.model)
    _assert_split_invariant(finals, f"fipo c={FIPO_DROP_C} (rows dropped)")


def _tiny_moe(tok: Any) -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2MoeForCausalLM(config)


def test_moe_router_auxiliary_loss_is_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    """A MoE model whose config returns router logits (TRL then adds its load-balancing loss, a function of each
    micro-batch's routing, so not split-invariant): refused in one line; router_aux_loss_coef=0.0 builds."""
    require_trl()
    from recipe.trl import GRPOConfig, GRPOTrainer

    _, tok = tiny_model_and_tokenizer()
    with pytest.raises(ValueError) as err:
        GRPOTrainer(model=_tiny_moe(tok), reward_funcs=digit_reward, processing_class=tok,
                    train_dataset=prompts_dataset(), args=GRPOConfig(**base_args(tmp_path, loss_type="m2po")))
    message = str(err.value)
    assert message.startswith("recipe.trl: loss_type='m2po' does not support the MoE router auxiliary loss of "
                              "Qwen2MoeForCausalLM (router_aux_loss_coef=0.001)") and "\n" not in message
    assert message.endswith("Fix: GRPOConfig(router_aux_loss_coef=0.0)")
    trainer = GRPOTrainer(model=_tiny_moe(tok), reward_funcs=digit_reward, processing_class=tok,
                          train_dataset=prompts_dataset(),
                          args=GRPOConfig(**base_args(tmp_path, loss_type="m2po", router_aux_loss_coef=0.0)))
    assert not trainer.aux_loss_enabled


def test_vision_inputs_are_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    """A processor as processing_class is TRL's vision-language path (its ``_is_vlm``): refused in one line. (This
    venv has neither torchvision nor Pillow for a real image processor; a processor holding only the tokenizer is
    a ProcessorMixin all the same, which is what TRL decides on.)"""
    require_trl()
    from transformers import ProcessorMixin

    from recipe.trl import GRPOConfig, GRPOTrainer

    class TokenizerOnlyProcessor(ProcessorMixin):
        attributes = ["tokenizer"]

        def __init__(self, tokenizer: Any) -> None:
            super().__init__(tokenizer)

    model, tok = tiny_model_and_tokenizer()
    with pytest.raises(ValueError) as err:
        GRPOTrainer(model=model, reward_funcs=digit_reward, processing_class=TokenizerOnlyProcessor(tok),
                    train_dataset=prompts_dataset(), args=GRPOConfig(**base_args(tmp_path, loss_type="fipo")))
    message = str(err.value)
    assert message.startswith("recipe.trl: loss_type='fipo' does not support vision inputs (processing_class is "
                              "TokenizerOnlyProcessor, a processor") and "\n" not in message
