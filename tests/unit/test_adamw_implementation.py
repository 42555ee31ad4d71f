"""actor.optimizer.implementation: foreach (default, bit-identical to the per-parameter loop) or fused (torch's fused
AdamW, opt-in): fused trains and stays within a stated tolerance of foreach; where torch has no fused kernel for the
parameters, the actor is refused at start in one line, never silently run with foreach."""

import copy

import pytest
import torch

from stalerl.config import load_config
from stalerl.core.model import load_policy
from stalerl.training.actor import Actor, build_optimizer

# Fused computes the same update with other roundings (one fused kernel per parameter). On the same gradients,
# 5 steps at lr 1e-3 differ by float32 rounding only (measured: 1.2e-7 = 1 ulp at |w| ~ 1): bounded by 5e-7.
SAME_GRADIENTS_ATOL = 5e-7
# Training (gradients from the parameters, so rounding differences feed back): 5 steps at lr 1e-3 differ by 2.6e-6
# (measured on tiny:qwen2) against parameter moves of ~5e-3: bounded by 1% of lr.
PARAM_ATOL = 1e-5


def _cfg(impl: str, **extra):
    over = {"optimizer.implementation": impl, "optimizer.lr": 1e-3, **extra}
    return load_config([f"actor.{k}={v}" for k, v in over.items()]).actor


def _steps(model, impl: str, n: int = 5) -> tuple[list[torch.Tensor], Actor]:
    """n steps of the actor's optimizer on fixed pseudo-gradients (the same on both sides)."""
    actor = Actor(model, _cfg(impl), temperature=1.0, total_updates=n)
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    for step in range(n):
        torch.manual_seed(step)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        actor.optimizer.step()
        actor.optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], actor


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)[0]


def test_default_is_foreach_and_fused_is_opt_in(tiny):
    group = Actor(copy.deepcopy(tiny), _cfg("foreach"), temperature=1.0, total_updates=1).optimizer.param_groups[0]
    assert group["foreach"] is True and not group["fused"]
    group = Actor(copy.deepcopy(tiny), _cfg("fused"), temperature=1.0, total_updates=1).optimizer.param_groups[0]
    assert group["fused"] is True and not group["foreach"]


def test_fused_step_equals_foreach_on_the_same_gradients():
    """The optimizer alone: the same gradient sequence into the per-parameter loop, foreach and fused AdamW. Foreach
    equals the loop bit for bit (the default's promise); fused is within rounding."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32) * 1e-3, torch.randn(128, 16) * 10]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    after = {}
    for impl in ("loop", "foreach", "fused"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        kernel = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, **kernel)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        after[impl] = [p.detach() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(after["loop"], after["foreach"]))
    diff = max(float((a - b).abs().max()) for a, b in zip(after["foreach"], after["fused"]))
    assert diff <= SAME_GRADIENTS_ATOL, diff
    assert all(float((a - s).abs().max()) > 1e-3 for a, s in zip(after["fused"], start))


def test_fused_trains_and_matches_foreach(tiny):
    start = [p.detach().clone() for p in tiny.parameters()]
    foreach, _ = _steps(copy.deepcopy(tiny), "foreach")
    fused, _ = _steps(copy.deepcopy(tiny), "fused")
    moved = max(float((a - s).abs().max()) for a, s in zip(fused, start))
    assert moved > 1e-3  # it trained: 5 steps at lr 1e-3 moved parameters by ~lr each
    diff = max(float((a - b).abs().max()) for a, b in zip(foreach, fused))
    assert diff <= PARAM_ATOL, diff


def test_fused_update_through_the_actor(tiny):
    """A full Actor.update with fused AdamW runs and moves the weights like foreach does."""
    from stalerl.rollout.batch import RolloutBatch

    n, p, r = 4, 5, 6
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(prompt_ids=torch.randint(3, 50, (n, p), generator=g),
                         prompt_mask=torch.ones(n, p, dtype=bool),
                         response_ids=torch.randint(3, 50, (n, r), generator=g),
                         response_mask=torch.ones(n, r, dtype=bool), behavior_logp=-torch.rand(n, r, generator=g) - 3,
                         versions=torch.zeros(n, r, dtype=torch.long), rewards=torch.rand(n),
                         group_ids=torch.arange(n) // 2)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1).expand(n, r).contiguous()
    after = {}
    for impl in ("foreach", "fused"):
        model = copy.deepcopy(tiny)
        Actor(model, _cfg(impl), temperature=1.0, total_updates=1).update(batch, adv)
        after[impl] = [p.detach() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after["fused"], tiny.parameters()))
    assert max(float((a - b).abs().max()) for a, b in zip(after["foreach"], after["fused"])) <= PARAM_ATOL


def test_fused_without_a_kernel_is_refused_in_one_line():
    model = torch.nn.Linear(4, 4, device="meta")  # no fused AdamW kernel on the meta device
    refusal = (r"^actor.optimizer.implementation=fused: torch .* no fused AdamW for a torch.float32 parameter on "
               r"meta .*set actor.optimizer.implementation=foreach$")
    with pytest.raises(ValueError, match=refusal):
        build_optimizer(model, _cfg("fused").optimizer)
    build_optimizer(model, _cfg("foreach").optimizer)  # foreach builds there


def test_a_checkpoint_keeps_this_runs_implementation(tiny):
    """A foreach run's checkpoint resumed with fused (and back) steps with the resuming run's kernel."""
    _, foreach_actor = _steps(copy.deepcopy(tiny), "foreach", n=1)
    _, fused_actor = _steps(copy.deepcopy(tiny), "fused", n=1)
    into_fused = Actor(copy.deepcopy(tiny), _cfg("fused"), temperature=1.0, total_updates=1)
    into_fused.load_state_dict(foreach_actor.state_dict())
    assert all(g["fused"] is True and not g["foreach"] for g in into_fused.optimizer.param_groups)
    into_foreach = Actor(copy.deepcopy(tiny), _cfg("foreach"), temperature=1.0, total_updates=1)
    into_foreach.load_state_dict(fused_actor.state_dict())
    assert all(g["foreach"] is True and not g["fused"] for g in into_foreach.optimizer.param_groups)
