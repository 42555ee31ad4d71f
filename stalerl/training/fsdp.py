"""Data-parallel plumbing of the training engines: FSDP2 sharding (``actor.backend=fsdp:dY``) and the bucketed
gradient all-reduce of the plain engine (``torch:dY``).

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every decoder layer, then the root (embeddings, final norm,
tied head), over all Y train ranks. Parameters are sharded in fp32 (the master weights the optimizer steps), and
the forward runs under the same ``torch.autocast`` as generation and the plain engine
(stalerl.core.model.autocast_context), so ``fsdp:dY`` computes what ``torch:dY`` computes in either dtype.

bf16 (``actor.dtype=bfloat16``). Autocast keeps fp32 parameters and casts to bf16 only the inputs of the ops on its
lower-precision list: in a transformer, the weights and biases of the ``nn.Linear`` projections. Embeddings, norm
weights and hence the residual stream stay fp32. FSDP's ``param_dtype`` casts *every* parameter of a group, so one
bf16 policy over a whole layer or the root would run norms, embeddings and the residual stream in bf16 (a different
computation: log-probs up to ~7e-3 away from the rollout engine's, ~1% different updates). Instead the groups follow
autocast (:func:`shard_model`): inside each decoder layer, every largest submodule whose parameters all belong to
``nn.Linear`` modules (Qwen2/Llama: ``self_attn``, ``mlp``) is its own group with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=False)``: its weights are
all-gathered in bf16, which is exactly the cast autocast would make of the fp32 weights (round to nearest), its fp32
inputs are left for autocast to cast as in the plain engine, and its bf16 weight gradients (what the plain engine's
bf16 matmuls produce before the cast back to fp32) are reduce-scattered in fp32. The rest of each layer (norms) and
the root (embeddings, tied head, final norm) keep fp32 groups. So values and gradients are the plain engine's,
operation for operation; only the order of the fp32 gradient sums over ranks differs (tests/unit/test_fsdp.py).
That equality is per update, from the same weights (within 1e-5 of the update, on any instruction set): over
several bf16 updates the engines drift apart at the bf16 noise floor, since a weight an fp32 ulp apart after one
update can be cast to a neighbouring bf16 value in the next (a few 1e-4 to 2e-3 of the update after two; the test
states how much and why).
All-gather bytes per full unshard (:func:`all_gather_bytes`), Qwen2.5-1.5B (1.54B parameters, 233M of them the tied
embedding): 3.55 GB, against 6.17 GB for fp32 everywhere and 3.09 GB for the bf16-everywhere policy (+15%); the
gradient reduce-scatters are fp32 in every case. Each layer then issues three all-gathers (norms, attention, MLP)
instead of one.

Gradients are averaged over ranks by the reduce-scatter, matching the plain engine's all-reduce + divide.

Transport. nccl on GPUs; on CPU the gloo backend of torch 2.13 implements everything FSDP2 calls
(``all_gather_into_tensor``, ``reduce_scatter_tensor`` with SUM/AVG, fp32 and bf16; checked by
tests/unit/test_fsdp.py), so CPU tests run the real FSDP2 code path with a plain ``gloo`` process group and a
``cpu`` device mesh.

Every forward of a sharded model is a collective (it all-gathers each layer), so all ranks must run the same number
of forward/backward passes: the actor pads a rank with fewer micro-batches with empty ones
(:func:`dummy_forward`), whose zero loss adds nothing to any gradient.

Checkpoints hold the *full* state, gathered on rank 0 (:func:`full_state_dict`) and broadcast back from rank 0 on
resume (:func:`load_full_optimizer_state`). Chosen over ``torch.distributed.checkpoint``'s per-rank shards because
rank 0 (the controller) gathers the full weights every step anyway to publish them to the rollout workers, the
checkpoint also carries controller state (data order, staleness queue), and one file keeps the existing atomic
commit (temp dir, sha256, rename, ``latest`` last) and lets a run resume with another number of ranks. Its cost is
rank-0 host memory of about three fp32 copies of the model (weights and two AdamW moments) while saving.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

# DDP's default bucket size: large enough that per-call latency no longer matters, small enough to bound the extra
# flattened copy.
GRAD_BUCKET_BYTES = 25 * 2**20
FULL_STATE_FORMAT = "full-fqn"  # the actor state's "format" when the optimizer state is keyed by parameter name


# ------------------------------------------------------------------------------------------- plain engine buckets
def all_reduce_gradients(params: Iterable[torch.nn.Parameter], group: Any, world_size: int,
                         bucket_bytes: int = GRAD_BUCKET_BYTES) -> int:
    """Average the gradients of ``params`` over the group in flattened buckets (one all-reduce per bucket, not per
    tensor). Returns the number of all-reduce calls. A parameter without a gradient (a rank with no rows) joins
    with zeros, so every rank issues the same calls. Element-wise the result is the same sum as one all-reduce per
    tensor, so the update does not depend on the bucketing."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple, list[torch.Tensor]] = {}
    sizes: dict[tuple, int] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        key = (p.grad.device, p.grad.dtype)
        bucket = open_bucket.setdefault(key, [])
        bucket.append(p.grad)
        sizes[key] = sizes.get(key, 0) + p.grad.numel() * p.grad.element_size()
        if sizes[key] >= bucket_bytes:
            buckets.append(open_bucket.pop(key))
            sizes[key] = 0
    buckets += [b for b in open_bucket.values() if b]
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(world_size)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    return len(buckets)


# ------------------------------------------------------------------------------------------------------- FSDP2
def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks to shard one by one: modules whose class is in the HF model's ``_no_split_modules``
    (e.g. ``Qwen2DecoderLayer``), else the children of a ``layers`` / ``h`` ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return list(module)
    return []


def mixed_precision_policy(dtype: str):
    """The policy of the groups that hold only ``nn.Linear`` parameters: plain fp32 for float32; for bfloat16, bf16
    all-gathers (autocast's cast of those weights), fp32 gradient reduction, and inputs left to autocast (FSDP would
    otherwise cast every floating input, e.g. the rotary cos/sin, which autocast keeps in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from stalerl.core.model import parse_dtype

    compute = parse_dtype(dtype)
    if compute == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _only_linear_parameters(module: torch.nn.Module) -> bool:
    """Every parameter of ``module`` belongs directly to an ``nn.Linear`` inside it (and it has some)."""
    owners = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    return bool(owners) and all(isinstance(m, torch.nn.Linear) for m in owners)


def linear_groups(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest submodules of ``layer`` (not the layer itself) whose parameters are all ``nn.Linear`` weights
    and biases: the parameters autocast runs in bf16 (Qwen2: ``self_attn`` and ``mlp``; a Qwen3 attention, which
    holds q/k norms, contributes its four projections one by one)."""
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if _only_linear_parameters(child):
                found.append(child)
            elif next(child.parameters(), None) is not None:
                visit(child)

    visit(layer)
    return found


def shard_model(model: torch.nn.Module, world_size: int, dtype: str = "float32") -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root, over a 1-D mesh of all ``world_size`` ranks (the default
    process group). Parameters are cast to fp32 first: the sharded parameters are the master weights. For bfloat16
    the linear projections inside each layer are groups of their own with the bf16 policy (module doc); layers and
    root keep fp32 parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    model.to(torch.float32)
    mesh = init_device_mesh(device.type, (world_size,))
    linear_policy = mixed_precision_policy(dtype)
    fp32 = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        if linear_policy.param_dtype is not None:
            for group in linear_groups(layer):
                fully_shard(group, mesh=mesh, mp_policy=linear_policy)
        fully_shard(layer, mesh=mesh, mp_policy=fp32)
    fully_shard(model, mesh=mesh, mp_policy=fp32)
    return model


def all_gather_bytes(model: torch.nn.Module, dtype: str) -> dict[str, int]:
    """Bytes one full unshard of ``model`` (unsharded; a meta-device model is fine) all-gathers: ``ours`` with
    :func:`shard_model`'s groups, ``fp32`` with fp32 everywhere, ``all_low`` with ``param_dtype`` on every group."""
    from stalerl.core.model import parse_dtype

    low = parse_dtype(dtype).itemsize
    in_linear_groups = {id(p) for layer in decoder_layers(model) for g in linear_groups(layer) for p in g.parameters()}
    params = list(model.parameters())  # tied weights once
    total = sum(p.numel() for p in params)
    linear = sum(p.numel() for p in params if id(p) in in_linear_groups)
    return {"ours": linear * low + (total - linear) * 4, "fp32": total * 4, "all_low": total * low}


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def max_over_ranks(value: int, group: Any) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0])


def dummy_forward(model: torch.nn.Module, device: torch.device, compute_dtype: Any = "float32") -> torch.Tensor:
    """One token through the sharded model, so this rank joins the all-gathers of a micro-batch it does not have.
    Returns a zero loss connected to every parameter (its backward joins the reduce-scatters, adding zeros). Runs
    under the actor's autocast: bf16 linear groups take fp32 inputs only through autocast."""
    from stalerl.core.model import autocast_context

    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    with autocast_context(device, compute_dtype):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits.float().sum() * 0.0


def to_float(x: Any) -> float:
    """A scalar that may be a DTensor (clip_grad_norm_ over sharded gradients returns one)."""
    full = getattr(x, "full_tensor", None)
    return float(full() if full is not None else x)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _trained_names(model: torch.nn.Module) -> list[str]:
    # build_optimizer's order: model.parameters() (a tied weight once, under its first name), trainable only.
    return [n for n, p in model.named_parameters() if p.requires_grad]


def optimizer_state_by_name(model: torch.nn.Module, state: dict) -> dict:
    """A plain optimizer's ``state_dict()`` (keyed by index) in the layout ``get_optimizer_state_dict`` uses
    (keyed by parameter name), for an unsharded ``model``; pure bookkeeping, no communication."""
    names = _trained_names(model)
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_index(model: torch.nn.Module, state: dict) -> dict:
    """The inverse of :func:`optimizer_state_by_name`: a name-keyed full optimizer state for a plain optimizer."""
    index = {n: i for i, n in enumerate(_trained_names(model))}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded weights on rank 0 (CPU), ``{}`` on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: full weights and optimizer state (keyed by parameter name) on rank 0, empty dicts elsewhere."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"model": full_model_state(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))}


def load_full_model_state(model: torch.nn.Module, state: Optional[dict]) -> None:
    """Collective: rank 0's full weights (``state``; ignored elsewhere) into every rank's shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state if dist.get_rank() == 0 else {}, options=_options(broadcast_from_rank0=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: Optional[dict]) -> None:
    """Collective: rank 0's full optimizer state (``state``; ignored elsewhere) into every rank's shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state if dist.get_rank() == 0 else {},
                             options=_options(broadcast_from_rank0=True))
