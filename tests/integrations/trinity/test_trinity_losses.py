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
  gradient on the table is the gradient of the loss with respect to each token's log-prob.
- The expected values come from ``recipe.registry`` called once on the whole mini-batch, and from the literal
  references in tests/unit (``reference_m2po``/``reference_loss``).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from m2po_reference import reference_loss, reference_m2po  # noqa: E402

torch.set_num_threads(1)

REQUIRED = os.environ.get("STALERL_REQUIRE_TRINITY") == "1"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


TRINITY = _importable("trinity")
ENGINE = TRINITY and _importable("verl") and _importable("tensordict")
if REQUIRED and not ENGINE:
    raise RuntimeError("STALERL_REQUIRE_TRINITY=1 but trinity-rft, verl or tensordict is not importable here; "
                       "run these tests in the environment scripts/ci_trinity.sh builds")

pytestmark = [
    pytest.mark.trinity,
    pytest.mark.skipif(not TRINITY, reason="trinity-rft is not installed here; run bash scripts/ci_trinity.sh"),
]
needs_engine = pytest.mark.skipif(not ENGINE, reason="trinity-rft is not installed here; run bash scripts/ci_trinity.sh"
                                  if not TRINITY else "verl>=0.8 and tensordict are needed for Trinity's engine path")

M2PO_PATH = "recipe.trinity.M2POPolicyLossFn"
FIPO_PATH = "recipe.trinity.FIPOPolicyLossFn"
PATHS = {"m2po": M2PO_PATH, "fipo": FIPO_PATH}
# Arguments in stalerl's names; chosen so that M2PO masks tokens and FIPO's weights, clip and sequence drop act.
ARGS = {"m2po": {"m2_threshold": 0.04}, "fipo": {"fipo_decay_rate": 8.0, "fipo_clip_ratio_c": 3.0}}
RECIPE_CONFIG = {"m2po": {"m2_threshold": 0.04}, "fipo": {"fipo_decay_rate": 8.0, "fipo_clip_ratio_c": 3.0}}


# ------------------------------------------------------------------------------------------------ data


def _mini_batch(seed: int, n_seq: int = 8, max_prompt: int = 5, max_response: int = 12) -> dict[str, torch.Tensor]:
    """A GRPO-style mini-batch in verl's left/right padded layout, prompts and responses of uneven lengths.

    ``table`` holds the current policy's response log-probs (what the stand-in model outputs); the log-ratio is
    large enough that Algorithm 1 masks tokens, and two A < 0 rows carry two tokens with ratio > 3 (FIPO drops them).
    """
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, max_prompt + 1, (n_seq,), generator=gen)
    response_lens = torch.randint(1, max_response + 1, (n_seq,), generator=gen)
    response_lens[0] = max_response  # the padded width is reached
    prompt_mask = (torch.arange(max_prompt) >= max_prompt - prompt_lens[:, None]).long()  # left padded
    response_mask = (torch.arange(max_response) < response_lens[:, None]).long()  # right padded
    prompts = torch.randint(3, 50, (n_seq, max_prompt), generator=gen) * prompt_mask
    responses = torch.randint(3, 50, (n_seq, max_response), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    old = -torch.rand(n_seq, max_response, generator=gen) * 3
    table = old + torch.randn(n_seq, max_response, generator=gen) * 0.5
    adv = torch.randn(n_seq, 1, generator=gen).expand(n_seq, max_response).contiguous()
    for row in (1, 2):  # FIPO's sequence drop: A < 0 and two tokens with ratio > c = 3
        adv[row] = -adv[row].abs()
        length = int(response_lens[row])
        if length >= 2:
            table[row, :2] = old[row, :2] + 1.5
    return {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask,
        "old_log_probs": old, "advantages": adv * response_mask, "table": table,
        "seq_id": torch.arange(n_seq),
    }


def _registry_loss(name: str, rows: dict[str, torch.Tensor], log_prob: torch.Tensor, *,
                   num_tokens: Optional[int] = None) -> tuple[torch.Tensor, dict]:
    from recipe.optimizer_batch import with_global_batch_info
    from recipe.registry import get_policy_loss_fn

    config = dict(RECIPE_CONFIG[name])
    if num_tokens is not None:
        config = with_global_batch_info(config, num_tokens=num_tokens, dp_size=1)
    return get_policy_loss_fn(name)(old_log_prob=rows["old_log_probs"], log_prob=log_prob,
                                    advantages=rows["advantages"], response_mask=rows["response_mask"].bool(),
                                    loss_agg_mode="token-mean", config=config)


def _literal_m2po_loss(rows: dict[str, torch.Tensor], log_prob: torch.Tensor, num_tokens: int) -> tuple[float, int]:
    """Algorithm 1 over ``rows`` (literal reference), the unclipped objective summed, divided by ``num_tokens``."""
    d = (log_prob.detach() - rows["old_log_probs"]).float()
    mask = rows["response_mask"].bool()
    literal = reference_m2po(d.tolist(), rows["advantages"].tolist(), mask.tolist(), 0.04)
    flat = lambda t: [x for row in t for x in row]  # noqa: E731
    per_row_mean = reference_loss(flat(log_prob.detach().tolist()), flat(rows["old_log_probs"].tolist()),
                                  flat(rows["advantages"].tolist()), flat(literal["keep"]), flat(mask.tolist()))
    return per_row_mean * int(mask.sum()) / num_tokens, literal["num_masked"]


def _validated_algorithm(path: str, args: Optional[dict], **algorithm: Any):
    """``algorithm:`` as Trinity's config validator leaves it (default args filled, loss_agg_mode synced)."""
    from trinity.common.config import AlgorithmConfig, Config
    from trinity.common.config_validator import AlgorithmConfigValidator

    algorithm = {"algorithm_type": "grpo", "kl_loss_fn": "none", "entropy_loss_fn": "none", **algorithm}
    config = Config(algorithm=AlgorithmConfig(policy_loss_fn=path, policy_loss_fn_args=args, **algorithm))
    AlgorithmConfigValidator().validate(config)
    return config.algorithm


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
    algo = _validated_algorithm(PATHS[name], None)  # no args given: Trinity fills in default_args()
    assert algo.policy_loss_fn_args == cls.default_args()
    fn = POLICY_LOSS_FN.get(algo.policy_loss_fn)(backend="verl", **algo.policy_loss_fn_args)
    assert isinstance(fn, cls) and fn.loss_agg_mode == "token-mean"
    # Trinity overwrites the args' loss_agg_mode with algorithm.loss_agg_mode; the loss follows it.
    algo = _validated_algorithm(PATHS[name], dict(ARGS[name], loss_agg_mode="token-mean"),
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

    rows = _mini_batch(seed=3)
    fn = POLICY_LOSS_FN.get(PATHS[name])(backend="verl", batch_num_tokens_from_data=False, **ARGS[name])
    lp = rows["table"].clone().requires_grad_(True)
    micro_batch = {k: v for k, v in rows.items() if k != "table"}
    loss, metrics = fn(logprob=lp, pad_token_id=0, **micro_batch)
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = rows["table"].clone().requires_grad_(True)
    n_valid = int(rows["response_mask"].sum())
    expected, expected_metrics = _registry_loss(name, rows, lp_ref, num_tokens=n_valid)
    (expected_grad,) = torch.autograd.grad(expected, lp_ref)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert {k: metrics[k] for k in expected_metrics} == expected_metrics
    assert metrics["pg_loss"] == pytest.approx(float(expected.detach()))
    if name == "m2po":
        literal, n_masked = _literal_m2po_loss(rows, rows["table"], n_valid)
        assert float(loss.detach()) == pytest.approx(literal, rel=1e-5)
        assert metrics["m2po/num_masked_tokens"] == n_masked > 0
    else:
        assert metrics["fipo/sequence_drop_ratio"] > 0, "the data must make FIPO drop a row"


@pytest.mark.parametrize("name", ["m2po", "fipo"])
def test_the_loss_survives_pickling_as_ray_ships_it(name: str) -> None:
    import ray.cloudpickle
    from trinity.algorithm import POLICY_LOSS_FN

    fn = POLICY_LOSS_FN.get(PATHS[name])(backend="verl", batch_num_tokens_from_data=False, **ARGS[name])
    rows = _mini_batch(seed=5)
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
    rows = _mini_batch(seed=1)
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
def torch_padding_kernels():
    """verl's left_right_2_no_padding unpads with flash_attn.bert_padding (CUDA wheels only). verl ships the same
    four functions in pure torch for NPUs (verl.utils.npu_flash_attn_utils); point verl's dispatcher at those."""
    if _importable("flash_attn"):
        yield
        return
    from verl.utils import attention_utils
    from verl.utils import npu_flash_attn_utils as torch_impl

    kernels = (torch_impl.index_first_axis, torch_impl.pad_input, torch_impl.rearrange, torch_impl.unpad_input)
    original = attention_utils._get_attention_functions
    attention_utils._get_attention_functions = lambda: kernels
    yield
    attention_utils._get_attention_functions = original


def _stand_in_engine(table: torch.Tensor, seen: list):
    """verl's FSDPEngine with its own forward_backward_batch; only the model forward is replaced (see the module
    docstring): it writes ``table[seq_id]`` at the response positions of verl's packed layout."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    class TableEngine(FSDPEngine):
        def __init__(self) -> None:  # FSDPEngine.__init__ builds a model; the attributes its batch loop reads:
            self.ulysses_sequence_parallel_size = 1
            self.ulysses_device_mesh = None

        def forward_step(self, micro_batch, loss_function, forward_only):
            prompt_width = micro_batch["prompts"].shape[1]
            mask = micro_batch["attention_mask"]
            prompt_lens = mask[:, :prompt_width].sum(dim=1).tolist()
            response_lens = mask[:, prompt_width:].sum(dim=1).tolist()
            pieces = []
            for sid, p, r in zip(micro_batch["seq_id"].tolist(), prompt_lens, response_lens):
                before = torch.zeros(p - 1)
                after = torch.zeros(1)
                pieces.append(torch.cat([before, table[sid, :r], after]))  # log-prob of token t+1 sits at t
            lengths = torch.tensor([len(x) for x in pieces])
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            log_probs = torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets=offsets)
            loss, metrics = loss_function(model_output={"log_probs": log_probs}, data=micro_batch,
                                          dp_group=self.get_data_parallel_group())
            seen.append({"seq_id": micro_batch["seq_id"].tolist(), "batch_num_tokens": micro_batch["batch_num_tokens"],
                         "dp_size": micro_batch["dp_size"], "loss": loss.detach(), "metrics": metrics})
            return loss, {"model_output": {"log_probs": log_probs.detach()}, "loss": loss.item(), "metrics": metrics}

    return TableEngine()


def _run_engine(name: str, rows: dict[str, torch.Tensor], micro_batching: dict[str, Any]):
    """Trinity's _update_actor layout (DataProto -> TensorDict -> no padding) through verl's forward_backward_batch
    with Trinity's TrinityPolicyLoss built from an AlgorithmConfig. Returns (table gradient, per-micro-batch log)."""
    import ray.cloudpickle
    from trinity.trainer.verl.losses import build_trinity_loss
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    algo = _validated_algorithm(PATHS[name], dict(ARGS[name]))
    loss_fn = build_trinity_loss(algo)

    loss_fn = pickle.loads(ray.cloudpickle.dumps(loss_fn))  # set_loss_fn ships it to the workers through Ray
    table = rows["table"].clone().requires_grad_(True)
    batch = DataProto.from_dict(tensors={k: v for k, v in rows.items() if k != "table"},
                                meta_info={"temperature": 1.0})
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=len(rows["seq_id"]), **micro_batching)
    seen: list = []
    _stand_in_engine(table, seen).forward_backward_batch(data, loss_function=loss_fn)
    return table.grad, seen


MICRO_BATCHINGS = {
    "one": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8},
    "fixed2": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
    "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24},
}


@needs_engine
@pytest.mark.parametrize("split", list(MICRO_BATCHINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_fipo_through_verls_engine_equals_the_whole_mini_batch(world_of_one, torch_padding_kernels, split: str, seed: int) -> None:
    rows = _mini_batch(seed)
    grad, seen = _run_engine("fipo", rows, MICRO_BATCHINGS[split])
    n_valid = int(rows["response_mask"].sum())
    assert (len(seen) == 1) == (split == "one")
    assert all(s["batch_num_tokens"] == n_valid and s["dp_size"] == 1 for s in seen)
    assert sorted(i for s in seen for i in s["seq_id"]) == list(range(len(rows["seq_id"])))
    lp = rows["table"].clone().requires_grad_(True)
    expected, _ = _registry_loss("fipo", rows, lp, num_tokens=n_valid)
    expected.backward()
    torch.testing.assert_close(sum(s["loss"] for s in seen), expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-6, atol=1e-8)
    assert any(s["metrics"]["actor/fipo/sequence_drop_ratio"] > 0 for s in seen)


@needs_engine
@pytest.mark.parametrize("split", list(MICRO_BATCHINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_m2po_through_verls_engine_selects_per_micro_batch_and_divides_by_the_mini_batch(
        world_of_one, torch_padding_kernels, split: str, seed: int) -> None:
    """The denominator is the mini-batch's; the selection is Algorithm 1 over each micro-batch (the whole
    mini-batch's when there is one micro-batch)."""
    rows = _mini_batch(seed)
    grad, seen = _run_engine("m2po", rows, MICRO_BATCHINGS[split])
    n_valid = int(rows["response_mask"].sum())
    assert all(s["batch_num_tokens"] == n_valid and s["dp_size"] == 1 for s in seen)
    expected_grad = torch.zeros_like(rows["table"])
    for s in seen:
        part = {k: v[s["seq_id"]] for k, v in rows.items()}
        literal, n_masked = _literal_m2po_loss(part, part["table"], n_valid)
        assert float(s["loss"]) == pytest.approx(literal, rel=1e-5, abs=1e-7)
        assert s["metrics"]["actor/m2po/num_masked_tokens"] == n_masked
        lp = part["table"].clone().requires_grad_(True)
        loss, _ = _registry_loss("m2po", part, lp, num_tokens=n_valid)
        torch.testing.assert_close(s["loss"], loss.detach(), rtol=0, atol=0)
        (g,) = torch.autograd.grad(loss, lp)
        expected_grad[s["seq_id"]] += g
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    if split == "one":  # one micro-batch: exactly Algorithm 1 and the registry's loss on the whole mini-batch
        lp = rows["table"].clone().requires_grad_(True)
        whole, metrics = _registry_loss("m2po", rows, lp)
        torch.testing.assert_close(seen[0]["loss"], whole.detach(), rtol=0, atol=0)
        assert seen[0]["metrics"]["actor/m2po/num_masked_tokens"] == metrics["m2po/num_masked_tokens"] > 0
    else:
        assert len(seen) > 1
