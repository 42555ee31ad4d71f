"""Shared pieces of the Trinity-RFT tests (imported by test_trinity_losses.py and by the DP rank processes).

Needs trinity-rft, verl >= 0.8 and tensordict only inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from m2po_reference import reference_loss, reference_m2po  # noqa: E402

M2PO_PATH = "recipe.trinity.M2POPolicyLossFn"
FIPO_PATH = "recipe.trinity.FIPOPolicyLossFn"
PATHS = {"m2po": M2PO_PATH, "fipo": FIPO_PATH}
# Arguments in stalerl's names; chosen so that M2PO masks tokens and FIPO's weights, clip and sequence drop act.
ARGS = {"m2po": {"m2_threshold": 0.04}, "fipo": {"fipo_decay_rate": 8.0, "fipo_clip_ratio_c": 3.0}}
RECIPE_CONFIG = {"m2po": {"m2_threshold": 0.04}, "fipo": {"fipo_decay_rate": 8.0, "fipo_clip_ratio_c": 3.0}}


def mini_batch(seed: int, n_seq: int = 8, max_prompt: int = 5, max_response: int = 12) -> dict[str, torch.Tensor]:
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
        "old_log_probs": old, "rollout_log_probs": old.clone(),  # algorithm.bypass_old_logprobs: true copies them
        "advantages": adv * response_mask, "table": table,
        "seq_id": torch.arange(n_seq),
    }


# Trinity's own KL and entropy terms (algorithm.kl_loss_fn / entropy_loss_fn), non-zero, beside our losses.
KL_COEF, ENTROPY_COEF = 0.3, 0.05
KL_ENTROPY = {"kl_loss_fn": "k3", "kl_loss_fn_args": {"kl_coef": KL_COEF}, "entropy_loss_fn": "default",
              "entropy_loss_fn_args": {"entropy_coef": ENTROPY_COEF}}


#: the two-rank KL run uses mini_batch(seed + this): its halves hold 32 and 20 valid tokens (seed 0's: 25 and 25)
KL_DP_SEED_OFFSET = 1


def with_reference_policy(rows: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``rows`` with verl's ``ref_log_prob`` (the reference model's log-probs): the current ones plus noise."""
    gen = torch.Generator().manual_seed(seed + 1000)
    ref = (rows["table"] + torch.randn(rows["table"].shape, generator=gen) * 0.4) * rows["response_mask"]
    return {**rows, "ref_log_prob": ref}


def entropy_table(seed: int, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stand-in model's per-token entropy of the response tokens (indexed by seq_id like ``table``)."""
    gen = torch.Generator().manual_seed(seed + 2000)
    return torch.rand(rows["table"].shape, generator=gen) * 2.0


def kl_entropy_reference(rows: dict[str, torch.Tensor], log_prob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """KL_COEF x the token mean of k3 = exp(ref - logp) - 1 - (ref - logp) minus ENTROPY_COEF x the token mean of the
    entropy, over the valid tokens of ``rows`` (written out here, not Trinity's code)."""
    mask = rows["response_mask"].bool()
    log_r = rows["ref_log_prob"] - log_prob
    k3 = log_r.exp() - 1 - log_r
    n = int(mask.sum())
    return KL_COEF * k3[mask].sum() / n - ENTROPY_COEF * entropy[mask].sum() / n


def registry_loss(name: str, rows: dict[str, torch.Tensor], log_prob: torch.Tensor, *,
                   num_tokens: Optional[int] = None, **extras: torch.Tensor) -> tuple[torch.Tensor, dict]:
    from recipe.optimizer_batch import with_global_batch_info
    from recipe.registry import get_policy_loss_fn

    config = dict(RECIPE_CONFIG[name])
    if num_tokens is not None:
        config = with_global_batch_info(config, num_tokens=num_tokens, dp_size=1)
    return get_policy_loss_fn(name)(old_log_prob=rows["old_log_probs"], log_prob=log_prob,
                                    advantages=rows["advantages"], response_mask=rows["response_mask"].bool(),
                                    loss_agg_mode="token-mean", config=config, **extras)


def literal_m2po_loss(rows: dict[str, torch.Tensor], log_prob: torch.Tensor, num_tokens: int) -> tuple[float, int]:
    """Algorithm 1 over ``rows`` (literal reference), the unclipped objective summed, divided by ``num_tokens``."""
    d = (log_prob.detach() - rows["old_log_probs"]).float()
    mask = rows["response_mask"].bool()
    literal = reference_m2po(d.tolist(), rows["advantages"].tolist(), mask.tolist(), 0.04)
    flat = lambda t: [x for row in t for x in row]  # noqa: E731
    per_row_mean = reference_loss(flat(log_prob.detach().tolist()), flat(rows["old_log_probs"].tolist()),
                                  flat(rows["advantages"].tolist()), flat(literal["keep"]), flat(mask.tolist()))
    return per_row_mean * int(mask.sum()) / num_tokens, literal["num_masked"]


def validated_algorithm(path: str, args: Optional[dict], **algorithm: Any):
    """``algorithm:`` as Trinity's config validator leaves it (default args filled, loss_agg_mode synced)."""
    from trinity.common.config import AlgorithmConfig, Config
    from trinity.common.config_validator import AlgorithmConfigValidator

    algorithm = {"algorithm_type": "grpo", "kl_loss_fn": "none", "entropy_loss_fn": "none", **algorithm}
    config = Config(algorithm=AlgorithmConfig(policy_loss_fn=path, policy_loss_fn_args=args, **algorithm))
    AlgorithmConfigValidator().validate(config)
    return config.algorithm


@contextlib.contextmanager
def torch_padding_kernels():
    """verl's left_right_2_no_padding unpads with flash_attn.bert_padding (CUDA wheels only). verl ships the same
    four functions in pure torch for NPUs (verl.utils.npu_flash_attn_utils); point verl's dispatcher at those."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        yield
        return
    from verl.utils import attention_utils
    from verl.utils import npu_flash_attn_utils as torch_impl

    kernels = (torch_impl.index_first_axis, torch_impl.pad_input, torch_impl.rearrange, torch_impl.unpad_input)
    original = attention_utils._get_attention_functions
    attention_utils._get_attention_functions = lambda: kernels
    try:
        yield
    finally:
        attention_utils._get_attention_functions = original


def stand_in_engine(table: torch.Tensor, seen: list, entropy: Optional[torch.Tensor] = None):
    """verl's FSDPEngine with its own forward_backward_batch; only the model forward is replaced (see the module
    docstring): it writes ``table[seq_id]`` at the response positions of verl's packed layout (and ``entropy[seq_id]``
    as the model's per-token entropy, when given)."""
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
            ids = micro_batch["seq_id"].tolist()

            def packed(values: torch.Tensor) -> torch.Tensor:  # the value for token t+1 sits at t
                pieces = [torch.cat([torch.zeros(p - 1), values[sid, :r], torch.zeros(1)])
                          for sid, p, r in zip(ids, prompt_lens, response_lens)]
                lengths = torch.tensor([len(x) for x in pieces])
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
                return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets=offsets)

            log_probs = packed(table)
            output = {"log_probs": log_probs} if entropy is None else {"log_probs": log_probs,
                                                                        "entropy": packed(entropy)}
            loss, metrics = loss_function(model_output=output, data=micro_batch,
                                          dp_group=self.get_data_parallel_group())
            seen.append({"seq_id": micro_batch["seq_id"].tolist(), "batch_num_tokens": micro_batch["batch_num_tokens"],
                         "dp_size": micro_batch["dp_size"], "loss": loss.detach(), "metrics": metrics})
            return loss, {"model_output": {"log_probs": log_probs.detach()}, "loss": loss.item(), "metrics": metrics}

    return TableEngine()


def run_engine(name: str, rows: dict[str, torch.Tensor], micro_batching: dict[str, Any],
               args: Optional[dict] = None, table: Optional[torch.Tensor] = None,
               algorithm: Optional[dict] = None, entropy: Optional[torch.Tensor] = None):
    """Trinity's _update_actor layout (DataProto -> TensorDict -> no padding) through verl's forward_backward_batch
    with Trinity's TrinityPolicyLoss built from an AlgorithmConfig (``algorithm``: more of its keys, e.g. the KL and
    entropy terms). Returns (table gradient, per-micro-batch log); ``entropy`` (the stand-in model's per-token entropy,
    a leaf the caller made) gets its gradient in place."""
    import ray.cloudpickle
    from trinity.trainer.verl.losses import build_trinity_loss
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    algo = validated_algorithm(PATHS[name], dict(ARGS[name] if args is None else args), **(algorithm or {}))
    loss_fn = build_trinity_loss(algo)

    loss_fn = pickle.loads(ray.cloudpickle.dumps(loss_fn))  # set_loss_fn ships it to the workers through Ray
    table = (rows["table"] if table is None else table).clone().requires_grad_(True)  # indexed by seq_id
    batch = DataProto.from_dict(tensors={k: v for k, v in rows.items() if k != "table"},
                                meta_info={"temperature": 1.0})
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=len(rows["seq_id"]), **micro_batching)
    seen: list = []
    stand_in_engine(table, seen, entropy).forward_backward_batch(data, loss_function=loss_fn)
    return table.grad, seen


# Runs of the two-rank test: (label, loss, policy_loss_fn_args, micro-batching of each rank's half). A run whose
# loss refuses records the message instead (every rank must refuse at the same call, none may hang).
DP_RUNS = (
    ("m2po_auto", "m2po", {"m2_threshold": 0.04}, {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4}),
    ("fipo_one", "fipo", ARGS["fipo"], {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4}),
    ("m2po_split", "m2po", {"m2_threshold": 0.04}, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24}),
    ("fipo_split", "fipo", ARGS["fipo"], {"use_dynamic_bsz": True, "max_token_len_per_gpu": 24}),
    ("m2po_local", "m2po", {"m2_threshold": 0.04, "m2_scope": "local"},
     {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4}),
)


def dp_rank(rank: int, world: int, store: str, out_dir: str, seed: int) -> None:
    """One data-parallel rank (torch.multiprocessing.spawn target): its contiguous share of ``mini_batch(seed)``
    through verl's engine loop with Trinity's loss; saves the gradient and the per-micro-batch log (or the error)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        rows = mini_batch(seed)
        share = len(rows["seq_id"]) // world
        mine = {k: v[rank * share:(rank + 1) * share] for k, v in rows.items() if k != "table"}
        results = {}
        with torch_padding_kernels():
            for label, name, args, batching in DP_RUNS:
                try:
                    grad, seen = run_engine(name, mine, batching, args=args, table=rows["table"])
                except ValueError as err:
                    results[label] = {"error": str(err)}
                else:
                    results[label] = {"grad": grad, "seen": seen}
            # Trinity's KL and entropy terms beside M2PO (the default scope, one micro-batch per rank), on a
            # mini-batch whose halves hold different numbers of tokens
            kl_seed = seed + KL_DP_SEED_OFFSET
            kl_rows = with_reference_policy(mini_batch(kl_seed), kl_seed)
            mine_kl = {k: v[rank * share:(rank + 1) * share] for k, v in kl_rows.items() if k != "table"}
            entropy = entropy_table(kl_seed, kl_rows).requires_grad_(True)
            grad, seen = run_engine("m2po", mine_kl, DP_RUNS[0][3], args=DP_RUNS[0][2], table=kl_rows["table"],
                                    algorithm=KL_ENTROPY, entropy=entropy)
            results["m2po_kl_entropy"] = {"grad": grad, "seen": seen, "entropy_grad": entropy.grad}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
