"""recipe.trinity inside the real Trinity-RFT (0.6.0) and verl (>= 0.8) packages, on CPU. Marker: ``trinity``.

Run in Trinity's own environment (``bash scripts/ci_trinity.sh``): ``pytest -m trinity tests/integrations/trinity``.
Skipped with the reason where Trinity is not importable, an error instead when ``STALERL_REQUIRE_TRINITY=1``.

What is driven, and what is a stand-in:

- Trinity's registry resolves the dotted paths (``POLICY_LOSS_FN.get``), Trinity builds the loss as its trainer
  does (``TrinityPolicyLoss(AlgorithmConfig)`` = ``POLICY_LOSS_FN.get(name)(backend="verl", **args)``), its
  metaclass filters and renames the keywords (``KeyMapper``), and Ray's cloudpickle ships it.
- verl's engine (``FSDPEngine.forward_backward_batch``, verl's own code) counts the mini-batch's tokens, puts
  ``batch_num_tokens``/``dp_size`` in the data, splits it into micro-batches (fixed size or dynamic token budget),
  calls Trinity's loss per micro-batch and back-propagates. The one stand-in is the model: ``forward_step`` produces
  the per-token log-probs from a learnable table instead of a transformer forward (which needs a GPU engine), so the
  gradient on the table is the gradient of the loss with respect to each token's log-prob. Two data-parallel ranks
  run as spawned gloo processes through the same loop.
- The expected values come from ``recipe.registry`` called once on the whole mini-batch, and from the literal
  references in tests/unit (``reference_m2po``/``reference_loss``).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _trinity_cases as C  # noqa: E402
from _trinity_cases import ARGS, FIPO_PATH, M2PO_PATH, PATHS  # noqa: E402

torch.set_num_threads(1)

REQUIRED = os.environ.get("STALERL_REQUIRE_TRINITY") == "1"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


TRINITY = _importable("trinity")
def _verl_at_least_0_8() -> bool:
    from recipe.trinity.losses import ENGINE_PATH_MIN_VERL, _verl_version_tuple

    version = _verl_version_tuple()
    return version is not None and version >= ENGINE_PATH_MIN_VERL


ENGINE = TRINITY and _importable("tensordict") and _verl_at_least_0_8()
if REQUIRED and not ENGINE:
    raise RuntimeError("STALERL_REQUIRE_TRINITY=1 but trinity-rft, verl or tensordict is not importable here; "
                       "run these tests in the environment scripts/ci_trinity.sh builds")

pytestmark = [
    pytest.mark.trinity,
    pytest.mark.skipif(not TRINITY, reason="trinity-rft is not installed here; run bash scripts/ci_trinity.sh"),
]
needs_engine = pytest.mark.skipif(not ENGINE, reason="trinity-rft is not installed here; run bash scripts/ci_trinity.sh"
                                  if not TRINITY else "verl>=0.8 and tensordict are needed for Trinity's engine path")


# ------------------------------------------------------------------------------------------------ registry, keys


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_trinity_registry_resolves_the_dotted_paths(name: str) -> None:
    from trinity.algorithm import POLICY_LOSS_FN
    from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn

    import recipe.trinity as adapter

    cls = POLICY_LOSS_FN.get(PATHS[name])
    assert cls is getattr(adapter, PATHS[name].rsplit(".", 1)[1])
    assert issubclass(cls, PolicyLossFn)
    assert POLICY_LOSS_FN.modules[PATHS[name]] is cls  # registered under the dotted key, as Trinity does
    algo = C.validated_algorithm(PATHS[name], None)  # no args given: Trinity fills in default_args()
    assert algo.policy_loss_fn_args == cls.default_args()
    fn = POLICY_LOSS_FN.get(algo.policy_loss_fn)(backend="verl", **algo.policy_loss_fn_args)
    assert isinstance(fn, cls) and fn.loss_agg_mode == "token-mean"
    # Trinity overwrites the args' loss_agg_mode with algorithm.loss_agg_mode; a mode that would average per
    # micro-batch is refused when Trinity builds the loss (before the first update).
    algo = C.validated_algorithm(PATHS[name], dict(ARGS[name], loss_agg_mode="token-mean"),
                                loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(ValueError, match=r"algorithm\.loss_agg_mode='seq-mean-token-mean' is not supported: only "
                                         r"token-mean is exact across verl's micro-batches"):
        POLICY_LOSS_FN.get(algo.policy_loss_fn)(backend="verl", **algo.policy_loss_fn_args)


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_select_keys_are_verls_names_and_follow_the_verl_path(name: str) -> None:
    from trinity.algorithm import POLICY_LOSS_FN

    cls = POLICY_LOSS_FN.get(PATHS[name])
    engine = cls(backend="verl", batch_num_tokens_from_data=True)
    legacy = cls(backend="verl", batch_num_tokens_from_data=False)
    behaviour = ["rollout_log_probs"] if name == "m2po" else []
    assert engine.select_keys == ["old_log_probs", "response_mask", "advantages", *behaviour, "batch_num_tokens",
                                  "dp_size"]
    assert legacy.select_keys == ["old_log_probs", "response_mask", "advantages", *behaviour]
    from recipe.trinity import engine_path_passes_global_counts

    auto = cls(backend="verl")
    assert auto.uses_global_counts is engine_path_passes_global_counts()
    if ENGINE:
        import verl
        from packaging.version import parse

        assert auto.uses_global_counts is (parse(verl.__version__) >= parse("0.8.0"))


def _inputs(rows: dict, *keys: str) -> dict:
    return {k: rows[k] for k in ("old_log_probs", "response_mask", "advantages", "rollout_log_probs", *keys)}


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_legacy_call_convention_equals_the_reference(name: str) -> None:
    """verl < 0.8 (Trinity's dp_actor): ``fn(logprob=..., **micro_batch)`` with all of the batch's keys. Only with
    ``assume_one_micro_batch`` (logged): M2PO divides by the micro-batch's valid tokens, FIPO is the reference on it
    (dropped rows leave the sum and the count)."""
    from trinity.algorithm import POLICY_LOSS_FN

    rows = C.mini_batch(seed=3)
    fn = POLICY_LOSS_FN.get(PATHS[name])(backend="verl", batch_num_tokens_from_data=False,
                                         assume_one_micro_batch=True, **ARGS[name])
    lp = rows["table"].clone().requires_grad_(True)
    micro_batch = {k: v for k, v in rows.items() if k != "table"}
    loss, metrics = fn(logprob=lp, pad_token_id=0, **micro_batch)
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = rows["table"].clone().requires_grad_(True)
    n_valid = int(rows["response_mask"].sum())
    expected, expected_metrics = C.registry_loss(name, rows, lp_ref, num_tokens=n_valid if name == "m2po" else None)
    (expected_grad,) = torch.autograd.grad(expected, lp_ref)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert {k: metrics[k] for k in expected_metrics} == expected_metrics
    assert metrics[f"{name}/unverified_micro_batching"] == 1.0
    assert metrics["pg_loss"] == pytest.approx(float(expected.detach()))
    if name == "m2po":
        literal, n_masked = C.literal_m2po_loss(rows, rows["table"], n_valid)
        assert float(loss.detach()) == pytest.approx(literal, rel=1e-5)
        assert metrics["m2po/num_masked_tokens"] == n_masked > 0
    else:
        assert metrics["fipo/sequence_drop_ratio"] > 0, "the data must make FIPO drop a row"


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_legacy_path_refuses_what_it_cannot_check(name: str, monkeypatch) -> None:
    from trinity.algorithm import POLICY_LOSS_FN

    import recipe.trinity.losses as losses

    rows = C.mini_batch(seed=3)
    cls = POLICY_LOSS_FN.get(PATHS[name])
    with pytest.raises(ValueError, match=r"legacy path \(verl < 0\.8\) cannot show the loss whether the mini-batch "
                                         r"was split.*assume_one_micro_batch: true"):
        cls(backend="verl", batch_num_tokens_from_data=False, **ARGS[name])(logprob=rows["table"], **_inputs(rows))
    monkeypatch.setattr(losses, "_world_size", lambda: 2)  # two ranks: counts may differ, a collective could hang
    with pytest.raises(ValueError, match=r"may give the 2 ranks different micro-batch counts"):
        cls(backend="verl", batch_num_tokens_from_data=False, assume_one_micro_batch=True,
            **ARGS[name])(logprob=rows["table"], **_inputs(rows))
    with pytest.raises(ValueError, match=r"assume_one_micro_batch is for Trinity's legacy path"):
        cls(backend="verl", batch_num_tokens_from_data=True, assume_one_micro_batch=True)


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_the_loss_survives_pickling_as_ray_ships_it(name: str) -> None:
    import ray.cloudpickle
    from trinity.algorithm import POLICY_LOSS_FN

    fn = POLICY_LOSS_FN.get(PATHS[name])(backend="verl", batch_num_tokens_from_data=False,
                                         assume_one_micro_batch=True, **ARGS[name])
    rows = C.mini_batch(seed=5)
    expected = fn(logprob=rows["table"], **_inputs(rows))
    for dumps in (pickle.dumps, ray.cloudpickle.dumps):
        clone = pickle.loads(dumps(fn))
        assert type(clone) is type(fn) and clone.select_keys == fn.select_keys
        got = clone(logprob=rows["table"], **_inputs(rows))
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        assert got[1] == expected[1]


def test_bad_arguments_fail_at_construction_naming_the_key() -> None:
    from trinity.algorithm import POLICY_LOSS_FN

    m2po = POLICY_LOSS_FN.get(M2PO_PATH)
    fipo = POLICY_LOSS_FN.get(FIPO_PATH)
    with pytest.raises(ValueError, match=r"'m2_treshold' \(did you mean 'm2_threshold'\?\)"):
        m2po(backend="verl", m2_treshold=0.04)
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss_fn_args\.m2_threshold must be >= 0"):
        m2po(backend="verl", m2_threshold=-0.1)
    with pytest.raises(ValueError, match=r"m2_scope must be one of auto, local, dp_group"):
        m2po(backend="verl", m2_scope="world")
    with pytest.raises(ValueError, match=r"backend 'tinker' is not supported"):
        m2po(backend="tinker")
    with pytest.raises(ValueError, match=r"loss_agg_mode='sum' is not supported"):
        m2po(backend="verl", loss_agg_mode="sum")
    with pytest.raises(ValueError, match=r"allow_split_mini_batch must be true or false, got 'yes'"):
        m2po(backend="verl", allow_split_mini_batch="yes")
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss_fn_args\.fipo_clip_ratio_c must be > 1 \+ eps_high"):
        fipo(backend="verl", fipo_clip_ratio_c=1.1)
    with pytest.raises(ValueError, match=r"'clip_range' \(did you mean 'eps_clip'\?\); accepted keys: "):
        fipo(backend="verl", clip_range=0.2)


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_an_untested_trinity_version_is_refused_unless_overridden(name: str, monkeypatch) -> None:
    import recipe.versions as versions
    from trinity.algorithm import POLICY_LOSS_FN

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda key: "0.7.0" if key == "trinity-rft" else real(key))
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    monkeypatch.setattr(versions, "_warned", set())  # the override warns once per process and version
    cls = POLICY_LOSS_FN.get(PATHS[name])
    with pytest.raises(versions.UntestedFrameworkVersion,
                       match=r"recipe\.trinity: trinity-rft 0\.7\.0 is installed, but this adapter was tested on "
                             r"trinity-rft>=0\.6,<0\.7 only.*STALERL_ALLOW_UNTESTED_FRAMEWORKS=trinity-rft"):
        cls(backend="verl")
    monkeypatch.setenv(versions.ALLOW_ENV, "trinity-rft")
    with pytest.warns(RuntimeWarning, match=r"outside the tested range"):
        cls(backend="verl")


def test_dp_group_scope_refuses_a_world_larger_than_the_data_parallel_group() -> None:
    from trinity.algorithm import POLICY_LOSS_FN

    fn = POLICY_LOSS_FN.get(M2PO_PATH)(backend="verl", m2_scope="dp_group", batch_num_tokens_from_data=True)
    rows = C.mini_batch(seed=1)
    with pytest.raises(ValueError, match=r"m2_scope=dp_group reduces over the whole torch\.distributed world .* "
                                         r"data-parallel size is 2"):
        fn(logprob=rows["table"], batch_num_tokens=int(rows["response_mask"].sum()), dp_size=2, **_inputs(rows))


# ------------------------------------------------------------------------------------------------ verl engine path


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """verl's engine all-reduces the token count over its data-parallel group: a one-rank gloo world."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def padding_kernels():
    with C.torch_padding_kernels():
        yield


ONE = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8}
ONES = {  # one micro-batch per rank: a fixed size of the whole mini-batch, or Trinity's dynamic mode with a budget
    "fixed8": ONE,  # that holds it (trainer.max_token_len_per_gpu >= the rank's tokens)
    "dynamic_large": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 4096},
}
SPLITS = {
    "fixed2": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
    "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24},  # Trinity's default mode, a small budget
}
SPLIT_REFUSAL = (r"verl split this rank's optimizer mini-batch into micro-batches \(this call covers \d+ of the "
                 r"mini-batch's batch_num_tokens=\d+ valid tokens\).*trainer\.max_token_len_per_gpu >= .*"
                 r"allow_split_mini_batch: true")


@needs_engine
@pytest.mark.parametrize("one", list(ONES))
@pytest.mark.parametrize("seed", [0, 1])
def test_fipo_one_micro_batch_through_verls_engine_is_the_reference_on_the_mini_batch(
        world_of_one, padding_kernels, seed: int, one: str) -> None:
    """Dropped rows leave the numerator and the denominator of the step (the FIPO reference), although verl's
    batch_num_tokens counts them; the metrics are the whole mini-batch's."""
    rows = C.mini_batch(seed)
    grad, seen = C.run_engine("fipo", rows, ONES[one])
    n_valid = int(rows["response_mask"].sum())
    assert len(seen) == 1 and seen[0]["batch_num_tokens"] == n_valid
    lp = rows["table"].clone().requires_grad_(True)
    expected, metrics = C.registry_loss("fipo", rows, lp)  # the registry's FIPO alone: the reference
    expected.backward()
    torch.testing.assert_close(seen[0]["loss"], expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-6, atol=1e-8)
    assert metrics["fipo/sequence_drop_ratio"] > 0, "the data must make FIPO drop a row"
    for key, value in metrics.items():
        assert seen[0]["metrics"][f"actor/{key}"] == pytest.approx(value, rel=1e-6, abs=1e-9)
    # what keeping the dropped rows in the denominator (verl's count) would have given instead (the step plan's
    # sequence drop with verl's count as given: FIPO itself takes its own count less the dropped rows' tokens)
    from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch

    plan = plan_optimizer_batch("fipo", [MicroBatch(rows["old_log_probs"], rows["table"], rows["advantages"],
                                                    rows["response_mask"].bool())], C.RECIPE_CONFIG["fipo"])
    verl_count, _ = C.registry_loss("fipo", rows, rows["table"], num_tokens=n_valid, **plan.extras[0])
    assert float(verl_count) != pytest.approx(float(expected.detach()), rel=1e-3)


@needs_engine
@pytest.mark.parametrize("name", ["m2po", "fipo"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_a_split_mini_batch_is_refused_at_its_first_micro_batch(world_of_one, padding_kernels, name: str,
                                                                split: str) -> None:
    rows = C.mini_batch(0)
    with pytest.raises(ValueError, match=SPLIT_REFUSAL):
        C.run_engine(name, rows, SPLITS[split])


@needs_engine
@pytest.mark.parametrize("split", list(SPLITS))
def test_opted_in_split_selects_per_micro_batch_and_says_so_on_every_call(world_of_one, padding_kernels,
                                                                         split: str) -> None:
    """allow_split_mini_batch: M2PO's Algorithm 1 over each micro-batch (literal reference), the mini-batch's
    denominator, and m2po/split_mini_batch = 1 on every call."""
    rows = C.mini_batch(0)
    grad, seen = C.run_engine("m2po", rows, SPLITS[split], args={"m2_threshold": 0.04, "allow_split_mini_batch": True})
    n_valid = int(rows["response_mask"].sum())
    assert len(seen) > 1 and all(s["batch_num_tokens"] == n_valid for s in seen)
    assert [s["metrics"]["actor/m2po/split_mini_batch"] for s in seen] == [1.0] * len(seen)
    expected_grad = torch.zeros_like(rows["table"])
    for s in seen:
        part = {k: v[s["seq_id"]] for k, v in rows.items()}
        literal, n_masked = C.literal_m2po_loss(part, part["table"], n_valid)
        assert float(s["loss"]) == pytest.approx(literal, rel=1e-5, abs=1e-7)
        assert s["metrics"]["actor/m2po/num_masked_tokens"] == n_masked
        lp = part["table"].clone().requires_grad_(True)
        loss, _ = C.registry_loss("m2po", part, lp, num_tokens=n_valid)
        (g,) = torch.autograd.grad(loss, lp)
        expected_grad[s["seq_id"]] += g
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    _, fipo_seen = C.run_engine("fipo", rows, SPLITS[split], args={**ARGS["fipo"], "allow_split_mini_batch": True})
    assert [s["metrics"]["actor/fipo/split_mini_batch"] for s in fipo_seen] == [1.0] * len(fipo_seen)


@needs_engine
@pytest.mark.parametrize("one", list(ONES))
@pytest.mark.parametrize("seed", [0, 1])
def test_m2po_one_micro_batch_through_verls_engine_is_algorithm_1_on_the_mini_batch(
        world_of_one, padding_kernels, seed: int, one: str) -> None:
    rows = C.mini_batch(seed)
    grad, seen = C.run_engine("m2po", rows, ONES[one])
    n_valid = int(rows["response_mask"].sum())
    assert len(seen) == 1 and seen[0]["batch_num_tokens"] == n_valid and seen[0]["dp_size"] == 1
    lp = rows["table"].clone().requires_grad_(True)
    whole, metrics = C.registry_loss("m2po", rows, lp)
    whole.backward()
    torch.testing.assert_close(seen[0]["loss"], whole.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad, lp.grad, rtol=0, atol=0)
    literal, n_masked = C.literal_m2po_loss(rows, rows["table"], n_valid)
    assert float(whole.detach()) == pytest.approx(literal, rel=1e-5)
    assert seen[0]["metrics"]["actor/m2po/num_masked_tokens"] == metrics["m2po/num_masked_tokens"] == n_masked > 0
    assert "actor/m2po/split_mini_batch" not in seen[0]["metrics"]  # only the opt-in logs it


@needs_engine
def test_recomputed_old_log_probs_are_refused_for_m2po(world_of_one, padding_kernels) -> None:
    """algorithm.bypass_old_logprobs: false: Trinity recomputes old_log_probs with the trainer's weights, so they no
    longer equal the rollout's; the loss refuses instead of measuring the ratio against that proximal policy."""
    rows = C.mini_batch(0)
    rows["old_log_probs"] = rows["table"].detach().clone() * rows["response_mask"]  # recomputed: current weights
    with pytest.raises(ValueError, match=r"old_log_probs differ from rollout_log_probs: algorithm\.bypass_old_logprobs: "
                                         r"false .* Fix: algorithm\.bypass_old_logprobs: true"):
        C.run_engine("m2po", rows, ONE)


@needs_engine
def test_fipo_with_recomputed_old_log_probs_takes_them_as_its_ratios_denominator(world_of_one,
                                                                                  padding_kernels) -> None:
    """algorithm.bypass_old_logprobs: false: Trinity's old_log_probs (recomputed by the trainer, here those of an
    earlier optimizer step) differ from rollout_log_probs; FIPO's ratio is pi_theta / old_log_probs (FIPO's own
    definition), not against the rollout's, and its loss, gradient and metrics are the registry's on those."""
    rows = C.mini_batch(0)
    gen = torch.Generator().manual_seed(7)
    recomputed = (rows["old_log_probs"] + torch.randn(rows["old_log_probs"].shape, generator=gen) * 0.3)
    rows["old_log_probs"] = recomputed * rows["response_mask"]  # rollout_log_probs stay the explorer's
    valid = rows["response_mask"].bool()
    assert not torch.equal(rows["old_log_probs"][valid], rows["rollout_log_probs"][valid])
    grad, seen = C.run_engine("fipo", rows, ONE)
    assert len(seen) == 1
    lp = rows["table"].clone().requires_grad_(True)
    expected, metrics = C.registry_loss("fipo", rows, lp)
    expected.backward()
    torch.testing.assert_close(seen[0]["loss"], expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-6, atol=1e-8)
    for key, value in metrics.items():
        assert seen[0]["metrics"][f"actor/{key}"] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    against_rollout, _ = C.registry_loss("fipo", {**rows, "old_log_probs": rows["rollout_log_probs"]}, rows["table"])
    assert float(against_rollout) != pytest.approx(float(expected.detach()), rel=1e-3), "the denominators must differ"


@needs_engine
@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_trinitys_kl_and_entropy_terms_are_token_means_of_the_mini_batch_beside_the_exact_loss(
        world_of_one, padding_kernels, name: str) -> None:
    """kl_loss_fn: k3 and entropy_loss_fn: default with non-zero coefficients, one rank, one micro-batch: Trinity's
    TrinityPolicyLoss adds KL_COEF x the mini-batch's token-mean k3 and subtracts ENTROPY_COEF x its token-mean
    entropy to the registry's loss; the loss and the gradients (log-probs and entropy) are that sum's."""
    rows = C.with_reference_policy(C.mini_batch(0), 0)
    entropy = C.entropy_table(0, rows).requires_grad_(True)
    grad, seen = C.run_engine(name, rows, ONE, algorithm=C.KL_ENTROPY, entropy=entropy)
    assert len(seen) == 1
    lp = rows["table"].clone().requires_grad_(True)
    ent = C.entropy_table(0, rows).requires_grad_(True)
    policy, _ = C.registry_loss(name, rows, lp)
    extra = C.kl_entropy_reference(rows, lp, ent)
    (policy + extra).backward()
    assert abs(float(extra)) > 1e-3 and ent.grad.abs().sum() > 0, "the terms must act"
    torch.testing.assert_close(seen[0]["loss"], (policy + extra).detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(entropy.grad, ent.grad, rtol=1e-6, atol=1e-9)
    assert seen[0]["metrics"]["actor/kl_coef"] == C.KL_COEF


@needs_engine
def test_two_data_parallel_ranks_reproduce_the_whole_mini_batch(tmp_path) -> None:
    """Two gloo ranks, each with half of the mini-batch, through verl's engine loop (which all-reduces the token count
    and passes dp_size=2). The update is the mean of the ranks' gradients (what FSDP's reduction does).

    - M2PO with the default scope (auto: one selection over both ranks) and one micro-batch per rank: exactly
      Algorithm 1 on the whole mini-batch, and the registry's loss and gradient on it.
    - FIPO with one micro-batch per rank: the reference on the whole mini-batch (drops pooled over the ranks).
    - A split (dynamic micro-batches) is refused by both ranks at the same call, for both losses; m2_scope=local
      is refused with two ranks. Nothing hangs (the spawn would time out the test).
    """
    import torch.multiprocessing as mp

    mp.spawn(C.dp_rank, args=(2, str(tmp_path / "store"), str(tmp_path), 0), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2)]
    rows = C.mini_batch(0)
    n_valid = int(rows["response_mask"].sum())
    for label, name in (("m2po_auto", "m2po"), ("fipo_one", "fipo")):
        seen = [s for r in ranks for s in r[label]["seen"]]
        assert len(seen) == 2 and all(s["batch_num_tokens"] == n_valid and s["dp_size"] == 2 for s in seen)
        lp = rows["table"].clone().requires_grad_(True)
        whole, metrics = C.registry_loss(name, rows, lp, num_tokens=n_valid if name == "m2po" else None)
        whole.backward()
        torch.testing.assert_close(sum(s["loss"] for s in seen) / 2, whole.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close((ranks[0][label]["grad"] + ranks[1][label]["grad"]) / 2, lp.grad,
                                   rtol=1e-6, atol=1e-8)
        # the step's metrics, identical on both ranks (so any mean over ranks logs them)
        for key, value in metrics.items():
            assert [s["metrics"][f"actor/{key}"] for s in seen] == pytest.approx([value, value], rel=1e-6, abs=1e-9), key
        if name == "m2po":
            literal, n_masked = C.literal_m2po_loss(rows, rows["table"], n_valid)
            assert float(whole.detach()) == pytest.approx(literal, rel=1e-5)
            assert n_masked == metrics["m2po/num_masked_tokens"] > 0
        else:
            assert metrics["fipo/sequence_drop_ratio"] > 0
    for label in ("m2po_split", "fipo_split"):
        errors = [r[label].get("error", "") for r in ranks]
        assert all(e and e == errors[0] for e in errors), errors
        assert "over all 2 data-parallel ranks" in errors[0] and "allow_split_mini_batch: true" in errors[0]
    assert all("m2_scope=local selects over one rank's tokens" in r["m2po_local"].get("error", "") for r in ranks)
    # Trinity's KL and entropy terms beside M2PO: each rank adds its own token means (Trinity's definition), so the
    # update is the whole mini-batch's M2PO plus the mean over the ranks of each rank's terms
    kl_seed = C.KL_DP_SEED_OFFSET
    rows = C.with_reference_policy(C.mini_batch(kl_seed), kl_seed)
    n_valid = int(rows["response_mask"].sum())
    lp = rows["table"].clone().requires_grad_(True)
    ent = C.entropy_table(kl_seed, rows).requires_grad_(True)
    whole, _ = C.registry_loss("m2po", rows, lp, num_tokens=n_valid)
    halves = [{k: v[r * 4:(r + 1) * 4] for k, v in rows.items()} for r in range(2)]
    terms = sum(C.kl_entropy_reference(h, lp[r * 4:(r + 1) * 4], ent[r * 4:(r + 1) * 4])
                for r, h in enumerate(halves)) / 2
    (whole + terms).backward()
    runs = [r["m2po_kl_entropy"] for r in ranks]
    torch.testing.assert_close(sum(float(run["seen"][0]["loss"]) for run in runs) / 2, float(whole + terms),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close((runs[0]["grad"] + runs[1]["grad"]) / 2, lp.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close((runs[0]["entropy_grad"] + runs[1]["entropy_grad"]) / 2, ent.grad, rtol=1e-6,
                               atol=1e-9)
    # which is not the token mean over the whole mini-batch: the ranks hold different numbers of tokens
    token_mean = C.kl_entropy_reference(rows, rows["table"], C.entropy_table(kl_seed, rows))
    assert [int(h["response_mask"].sum()) for h in halves][0] != n_valid / 2
    assert float(terms) != pytest.approx(float(token_mean), rel=1e-3)
