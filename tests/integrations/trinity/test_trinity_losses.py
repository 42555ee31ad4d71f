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
    # Trinity overwrites the args' loss_agg_mode with algorithm.loss_agg_mode; the loss follows it.
    algo = C.validated_algorithm(PATHS[name], dict(ARGS[name], loss_agg_mode="token-mean"),
                                loss_agg_mode="seq-mean-token-mean")
    assert POLICY_LOSS_FN.get(algo.policy_loss_fn)(backend="verl", **algo.policy_loss_fn_args).loss_agg_mode == \
        "seq-mean-token-mean"


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_select_keys_are_verls_names_and_follow_the_verl_path(name: str) -> None:
    from trinity.algorithm import POLICY_LOSS_FN

    cls = POLICY_LOSS_FN.get(PATHS[name])
    engine = cls(backend="verl", batch_num_tokens_from_data=True)
    legacy = cls(backend="verl", batch_num_tokens_from_data=False)
    assert engine.select_keys == ["old_log_probs", "response_mask", "advantages", "batch_num_tokens", "dp_size"]
    assert legacy.select_keys == ["old_log_probs", "response_mask", "advantages"]
    from recipe.trinity import engine_path_passes_global_counts

    auto = cls(backend="verl")
    assert auto.uses_global_counts is engine_path_passes_global_counts()
    if ENGINE:
        import verl
        from packaging.version import parse

        assert auto.uses_global_counts is (parse(verl.__version__) >= parse("0.8.0"))


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_legacy_call_convention_equals_the_registry(name: str) -> None:
    """verl < 0.8 (Trinity's dp_actor): ``fn(logprob=..., **micro_batch)`` with all of the batch's keys; the loss
    divides by the micro-batch's valid tokens (what fix_actor_microbatch_loss_scale expects)."""
    from trinity.algorithm import POLICY_LOSS_FN

    rows = C.mini_batch(seed=3)
    fn = POLICY_LOSS_FN.get(PATHS[name])(backend="verl", batch_num_tokens_from_data=False, **ARGS[name])
    lp = rows["table"].clone().requires_grad_(True)
    micro_batch = {k: v for k, v in rows.items() if k != "table"}
    loss, metrics = fn(logprob=lp, pad_token_id=0, **micro_batch)
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = rows["table"].clone().requires_grad_(True)
    n_valid = int(rows["response_mask"].sum())
    expected, expected_metrics = C.registry_loss(name, rows, lp_ref, num_tokens=n_valid)
    (expected_grad,) = torch.autograd.grad(expected, lp_ref)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert {k: metrics[k] for k in expected_metrics} == expected_metrics
    assert metrics["pg_loss"] == pytest.approx(float(expected.detach()))
    if name == "m2po":
        literal, n_masked = C.literal_m2po_loss(rows, rows["table"], n_valid)
        assert float(loss.detach()) == pytest.approx(literal, rel=1e-5)
        assert metrics["m2po/num_masked_tokens"] == n_masked > 0
    else:
        assert metrics["fipo/sequence_drop_ratio"] > 0, "the data must make FIPO drop a row"


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_the_loss_survives_pickling_as_ray_ships_it(name: str) -> None:
    import ray.cloudpickle
    from trinity.algorithm import POLICY_LOSS_FN

    fn = POLICY_LOSS_FN.get(PATHS[name])(backend="verl", batch_num_tokens_from_data=False, **ARGS[name])
    rows = C.mini_batch(seed=5)
    inputs = {k: rows[k] for k in ("old_log_probs", "response_mask", "advantages")}
    expected = fn(logprob=rows["table"], **inputs)
    for dumps in (pickle.dumps, ray.cloudpickle.dumps):
        clone = pickle.loads(dumps(fn))
        assert type(clone) is type(fn) and clone.select_keys == fn.select_keys
        got = clone(logprob=rows["table"], **inputs)
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
    with pytest.raises(ValueError, match=r"m2_scope must be one of local, dp_group"):
        m2po(backend="verl", m2_scope="world")
    with pytest.raises(ValueError, match=r"backend 'tinker' is not supported"):
        m2po(backend="tinker")
    with pytest.raises(ValueError, match=r"loss_agg_mode .* must be one of"):
        m2po(backend="verl", loss_agg_mode="sum")
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss_fn_args\.fipo_clip_ratio_c must be > 1 \+ eps_high"):
        fipo(backend="verl", fipo_clip_ratio_c=1.1)
    with pytest.raises(ValueError, match=r"'clip_range' \(did you mean 'eps_clip'\?\); accepted keys: "):
        fipo(backend="verl", clip_range=0.2)


def test_dp_group_scope_refuses_a_world_larger_than_the_data_parallel_group() -> None:
    from trinity.algorithm import POLICY_LOSS_FN

    fn = POLICY_LOSS_FN.get(M2PO_PATH)(backend="verl", m2_scope="dp_group", batch_num_tokens_from_data=True)
    rows = C.mini_batch(seed=1)
    with pytest.raises(ValueError, match=r"m2_scope=dp_group .* data-parallel size is 2"):
        fn(logprob=rows["table"], old_log_probs=rows["old_log_probs"], response_mask=rows["response_mask"],
           advantages=rows["advantages"], batch_num_tokens=int(rows["response_mask"].sum()), dp_size=2)


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


MICRO_BATCHINGS = {
    "one": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8},
    "fixed2": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
    "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24},
}


@needs_engine
@pytest.mark.parametrize("split", list(MICRO_BATCHINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_fipo_through_verls_engine_equals_the_whole_mini_batch(world_of_one, padding_kernels, split: str,
                                                              seed: int) -> None:
    rows = C.mini_batch(seed)
    grad, seen = C.run_engine("fipo", rows, MICRO_BATCHINGS[split])
    n_valid = int(rows["response_mask"].sum())
    assert (len(seen) == 1) == (split == "one")
    assert all(s["batch_num_tokens"] == n_valid and s["dp_size"] == 1 for s in seen)
    assert sorted(i for s in seen for i in s["seq_id"]) == list(range(len(rows["seq_id"])))
    lp = rows["table"].clone().requires_grad_(True)
    expected, _ = C.registry_loss("fipo", rows, lp, num_tokens=n_valid)
    expected.backward()
    torch.testing.assert_close(sum(s["loss"] for s in seen), expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-6, atol=1e-8)
    assert any(s["metrics"]["actor/fipo/sequence_drop_ratio"] > 0 for s in seen)


@needs_engine
@pytest.mark.parametrize("split", list(MICRO_BATCHINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_m2po_through_verls_engine_selects_per_micro_batch_and_divides_by_the_mini_batch(
        world_of_one, padding_kernels, split: str, seed: int) -> None:
    """The denominator is the mini-batch's; the selection is Algorithm 1 over each micro-batch (the whole
    mini-batch's when there is one micro-batch)."""
    rows = C.mini_batch(seed)
    grad, seen = C.run_engine("m2po", rows, MICRO_BATCHINGS[split])
    n_valid = int(rows["response_mask"].sum())
    assert all(s["batch_num_tokens"] == n_valid and s["dp_size"] == 1 for s in seen)
    expected_grad = torch.zeros_like(rows["table"])
    for s in seen:
        part = {k: v[s["seq_id"]] for k, v in rows.items()}
        literal, n_masked = C.literal_m2po_loss(part, part["table"], n_valid)
        assert float(s["loss"]) == pytest.approx(literal, rel=1e-5, abs=1e-7)
        assert s["metrics"]["actor/m2po/num_masked_tokens"] == n_masked
        lp = part["table"].clone().requires_grad_(True)
        loss, _ = C.registry_loss("m2po", part, lp, num_tokens=n_valid)
        torch.testing.assert_close(s["loss"], loss.detach(), rtol=0, atol=0)
        (g,) = torch.autograd.grad(loss, lp)
        expected_grad[s["seq_id"]] += g
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    if split == "one":  # one micro-batch: exactly Algorithm 1 and the registry's loss on the whole mini-batch
        lp = rows["table"].clone().requires_grad_(True)
        whole, metrics = C.registry_loss("m2po", rows, lp)
        torch.testing.assert_close(seen[0]["loss"], whole.detach(), rtol=0, atol=0)
        assert seen[0]["metrics"]["actor/m2po/num_masked_tokens"] == metrics["m2po/num_masked_tokens"] > 0
    else:
        assert len(seen) > 1


@needs_engine
def test_two_data_parallel_ranks_reproduce_the_whole_mini_batch(tmp_path) -> None:
    """Two gloo ranks, each with half of the mini-batch, through verl's engine loop (which all-reduces the token count
    and passes dp_size=2). The update is the mean of the ranks' gradients (what FSDP's reduction does).

    - M2PO with m2_scope=dp_group and one micro-batch per rank: exactly Algorithm 1 on the whole mini-batch, and the
      registry's loss and gradient on it.
    - FIPO with dynamic micro-batches on each rank: the registry's whole-mini-batch loss and gradient.
    """
    import torch.multiprocessing as mp

    mp.spawn(C.dp_rank, args=(2, str(tmp_path / "store"), str(tmp_path), 0), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2)]
    rows = C.mini_batch(0)
    n_valid = int(rows["response_mask"].sum())
    for label, name, _, _ in C.DP_RUNS:
        seen = [s for r in ranks for s in r[label]["seen"]]
        assert all(s["batch_num_tokens"] == n_valid and s["dp_size"] == 2 for s in seen)
        lp = rows["table"].clone().requires_grad_(True)
        whole, metrics = C.registry_loss(name, rows, lp, num_tokens=n_valid)
        whole.backward()
        torch.testing.assert_close(sum(s["loss"] for s in seen) / 2, whole.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close((ranks[0][label]["grad"] + ranks[1][label]["grad"]) / 2, lp.grad,
                                   rtol=1e-6, atol=1e-8)
        if name == "m2po":
            assert len(seen) == 2
            literal, n_masked = C.literal_m2po_loss(rows, rows["table"], n_valid)
            assert float(whole.detach()) == pytest.approx(literal, rel=1e-5)
            # the selection's diagnostics count the whole mini-batch on both ranks
            assert [s["metrics"]["actor/m2po/num_masked_tokens"] for s in seen] == [n_masked, n_masked]
            assert n_masked == metrics["m2po/num_masked_tokens"] > 0
        else:
            assert len(seen) > 2
