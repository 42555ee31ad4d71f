"""stalerl.training.last_step: the kept state of the last completed step, and the host copy behind it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from stalerl.training.last_step import LIVE, LastStep, host_copy, host_copy_reference


def _random_state(seed: int) -> dict:
    """A model-and-optimizer-like nested state: tensors of random shapes and dtypes, ints, floats, lists, tuples."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)

    def tensor():
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        t = torch.randn(shape, generator=g)
        return t.to(rng.choice([torch.float32, torch.float64, torch.bfloat16])) if rng.random() < 0.7 else \
            (t * 100).to(torch.int64)

    model = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict with _metadata
    return {"model": model, "optimizer": {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": tensor()}
                                                    for i in range(rng.randint(1, 4))},
                                          "param_groups": [{"lr": rng.random(), "params": [0, 1]}]},
            "lr_scheduler": {"last_epoch": rng.randint(0, 9), "base_lrs": [0.1]}, "pair": (tensor(), "x")}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("seed", range(6))
def test_host_copy_matches_the_literal_copy_and_shares_no_storage(seed):
    state = _random_state(seed)
    fast, slow = host_copy(state), host_copy_reference(state)
    assert _same(fast, slow)
    assert fast["model"]._metadata == state["model"]._metadata
    fast["model"]["weight"].add_(1.0)  # independent of the source
    assert not torch.equal(fast["model"]["weight"], state["model"]["weight"])


@pytest.mark.parametrize("seed", range(4))
def test_host_copy_into_an_earlier_copy_reuses_its_buffers_and_matches_a_fresh_copy(seed):
    first = host_copy(_random_state(seed))
    buffers = {id(t) for t in (first["model"]["weight"], first["model"]["bias"])}
    moved = _random_state(seed)
    with torch.no_grad():
        for t in moved["model"].values():
            t.mul_(3.0)  # same shapes, new values: the next step's state
    again = host_copy(moved, first)
    assert _same(again, host_copy_reference(moved))
    assert {id(again["model"]["weight"]), id(again["model"]["bias"])} == buffers
    source = _random_state(seed + 100)
    other = host_copy(source, first)  # other shapes and values: fresh tensors where shapes differ, still right
    assert _same(other, host_copy_reference(source))


def _actor():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return SimpleNamespace(model=model, opt=opt,
                           state_dict=lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()})


def _train_once(actor) -> None:
    actor.model(torch.randn(3, 4)).sum().backward()
    actor.opt.step()
    actor.opt.zero_grad()


def test_a_kept_step_gives_the_actor_as_it_was_before_the_update_and_the_live_one_before_it():
    actor = _actor()
    _train_once(actor)
    before = host_copy_reference(actor.state_dict())
    kept = LastStep()
    kept.keep(1, {"actor": LIVE, "step": 1, "rng": [1, 2]})
    assert _same(kept.state(actor.state_dict)["actor"], before)  # untouched since: the live state, no copy
    kept.freeze(actor.state_dict)  # the update starts
    _train_once(actor)
    kept.freeze(actor.state_dict)  # again within the same step: no second copy of the moved state
    state = kept.state(actor.state_dict)
    assert _same(state["actor"], before) and state["step"] == 1 and state["rng"] == [1, 2]
    assert not _same(host_copy_reference(actor.state_dict())["model"], before["model"])


def test_nothing_is_kept_or_copied_once_the_step_is_on_disk():
    actor = _actor()
    kept = LastStep()
    kept.clear()
    kept.freeze(actor.state_dict)
    assert not kept.held and kept._actor is None  # no host copy made for a step that is on disk
    with pytest.raises(RuntimeError):
        kept.state(actor.state_dict)
    with pytest.raises(ValueError):
        kept.keep(2, {"actor": actor.state_dict()})  # the actor is copied by freeze, never by keep


def test_without_the_actor_copy_the_kept_step_is_dropped_when_the_update_starts():
    """recover.last_step_copy=false: no host copy is ever made (the actor's state is never read at freeze); the kept
    step holds until the update starts, then is dropped and says why."""
    actor = _actor()
    kept = LastStep(copy_actor=False)
    kept.keep(1, {"actor": LIVE, "step": 1})
    assert kept.held and _same(kept.state(actor.state_dict)["actor"], host_copy_reference(actor.state_dict()))

    def never_read():
        raise AssertionError("the actor's state was read for a copy")

    kept.freeze(never_read)
    assert not kept.held and kept.dropped_for_update and kept.step is None
    kept.keep(2, {"actor": LIVE, "step": 2})  # the next step boundary keeps again
    assert kept.held and not kept.dropped_for_update
