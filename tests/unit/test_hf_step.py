"""recipe.hf_step: the shared HF-trainer step window and the one metrics policy (sums, ratios, extrema over the
micro-batches and ranks of a step), against literal references; two gloo processes for the rank reduction."""

from __future__ import annotations

import math
import os

import pytest
import torch

from recipe.hf_step import StepMetrics, StepWindow, check_sharding_backend, step_micro_batches


def test_window_reads_the_step_from_the_buffer_once_and_checks_every_micro_batch() -> None:
    buffer = [object() for _ in range(4)]  # steps_per_generation 4, accumulation 2
    window, planned = StepWindow("recipe.test"), []
    seen = []
    for micro_step in range(8):  # num_iterations 2: the buffer is trained twice
        plan, index = window.enter(micro_step, buffer[micro_step % 4], buffer=buffer, accumulation=2,
                                   steps_per_generation=4, num_iterations=2,
                                   make_plan=lambda b: planned.append(list(b)) or len(planned))
        seen.append((plan, index))
    assert seen == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1), (4, 0), (4, 1)]
    assert planned == [buffer[0:2], buffer[2:4], buffer[0:2], buffer[2:4]]
    with pytest.raises(RuntimeError, match="micro-batch 1 of the optimizer step is not the one planned"):
        window.enter(7, buffer[0], buffer=buffer, accumulation=2, steps_per_generation=4, num_iterations=2,
                     make_plan=lambda b: 0)


def test_a_step_that_spans_a_generation_or_a_moved_buffer_fails_in_one_line() -> None:
    buffer = [object() for _ in range(3)]
    with pytest.raises(RuntimeError, match="spans a new generation batch") as err:
        step_micro_batches(buffer, micro_step=2, accumulation=2, steps_per_generation=3, num_iterations=1,
                           where="recipe.test")
    assert "\n" not in str(err.value) and "steps_per_generation to a multiple" in str(err.value)
    with pytest.raises(RuntimeError, match=r"is not _buffered_inputs\[0\]"):
        StepWindow("recipe.test").enter(0, object(), buffer=buffer, accumulation=1, steps_per_generation=3,
                                        num_iterations=1, make_plan=lambda b: 0)


def test_metrics_reduce_by_the_declared_rules_and_add_the_plans_step_values() -> None:
    from types import SimpleNamespace

    from recipe.declaration import MAX, MEAN, SUM, mean_over

    rules = {"x/mean": MEAN, "x/count": SUM, "x/max": MAX, "x/per_kept": mean_over("x/kept"), "x/kept": SUM}
    gen = torch.Generator().manual_seed(0)
    acc = StepMetrics()
    parts = []
    for _ in range(4):
        mask = torch.rand(3, 5, generator=gen) > 0.3
        vals = torch.rand(4, generator=gen).tolist()
        kept = float(torch.randint(1, 9, (1,), generator=gen))
        metrics = {"x/mean": vals[0], "x/count": vals[1], "x/max": vals[2], "x/per_kept": vals[3], "x/kept": kept}
        parts.append((float(mask.sum()), metrics))
        acc.add(mask, metrics)
    selection = SimpleNamespace(metrics=lambda: {"x/step_wide": 7.0})
    acc.add_plan(SimpleNamespace(selection=selection, row_drops=None))
    acc.add_constant("x/flag", 1.0)
    out = acc.reduce(rules)
    # the literal definitions
    assert math.isclose(out["x/mean"], sum(n * m["x/mean"] for n, m in parts) / sum(n for n, _ in parts))
    assert math.isclose(out["x/count"], sum(m["x/count"] for _, m in parts))
    assert out["x/max"] == max(m["x/max"] for _, m in parts)
    assert math.isclose(out["x/per_kept"], sum(m["x/kept"] * m["x/per_kept"] for _, m in parts)
                        / sum(m["x/kept"] for _, m in parts))
    assert out["x/step_wide"] == 7.0 and out["x/flag"] == 1.0
    assert acc.reduce(rules) == {}  # cleared for the next step


def test_fipo_metrics_of_a_split_step_equal_those_of_the_step_in_one_call() -> None:
    """The loss's own fipo/* metrics of a step split into micro-batches, reduced by FIPO's declared rules (plus the
    plan's counts), equal the loss's metrics of the step in one call: whatever the split."""
    from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch
    from recipe.registry import get_policy_loss_spec

    spec = get_policy_loss_spec("fipo")
    gen = torch.Generator().manual_seed(1)
    rows, width = 8, 12
    old = -torch.rand(rows, width, generator=gen) * 3
    new = old + torch.randn(rows, width, generator=gen) * 1.5  # stale enough for drops, clips
    adv = torch.randn(rows, 1, generator=gen).expand(rows, width).contiguous()
    mask = torch.rand(rows, width, generator=gen) > 0.2
    config = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    _, whole = spec.fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, config=config)
    parts = [torch.arange(rows)[i:i + 3] for i in range(0, rows, 3)]
    plan = plan_optimizer_batch("fipo", [MicroBatch(old[r], new[r], adv[r], mask[r]) for r in parts], config)
    acc = StepMetrics()
    acc.add_plan(plan)
    for r, extras in zip(parts, plan.extras):
        _, metrics = spec.fn(old_log_prob=old[r], log_prob=new[r], advantages=adv[r], response_mask=mask[r],
                             config=plan.config_for(config), **extras)
        acc.add(mask[r], metrics)
    split = acc.reduce(spec.declaration.metrics)
    assert set(whole) <= set(split)
    for key in whole:
        assert math.isclose(whole[key], split[key], rel_tol=1e-6, abs_tol=1e-9), key
    assert whole["fipo/clip_fraction"] > 0 and split["fipo/num_valid_tokens"] == int(mask.sum())
    assert split["fipo/num_dropped_sequences"] > 0, "the data must make FIPO drop a row"


def _rank(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    from recipe.declaration import MAX, SUM

    # a client of the store the test holds (tests/_ports.py): no rank binds the port
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank, world_size=2)
    acc = StepMetrics()
    acc.add(torch.ones(1, rank + 1, dtype=torch.bool), {"c": rank + 1, "f": 10 * (rank + 1), "hi": -rank})
    out[rank] = acc.reduce({"c": SUM, "hi": MAX}, dist.group.WORLD)
    dist.destroy_process_group()


def test_metrics_are_reduced_over_ranks() -> None:
    import torch.multiprocessing as mp

    from _ports import held_store

    store = held_store()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(store.port, out), nprocs=2, join=True)
        results = dict(out)
    for rank in (0, 1):  # f: the valid-token-weighted mean (1 token x 10, 2 tokens x 20)
        assert results[rank] == {"c": 3.0, "f": 50 / 3, "hi": 0.0}


@pytest.mark.parametrize(("deepspeed", "fsdp", "backend"), [(True, False, "DeepSpeed"), (False, True, "FSDP"),
                                                            (True, True, "DeepSpeed")])
def test_deepspeed_and_fsdp_are_refused_in_one_line_naming_the_backend_and_the_fix(deepspeed, fsdp, backend) -> None:
    check_sharding_backend("recipe.trl", "loss_type='m2po'", deepspeed=False, fsdp=False)  # plain DDP / one process
    with pytest.raises(ValueError) as err:
        check_sharding_backend("recipe.trl", "loss_type='m2po'", deepspeed=deepspeed, fsdp=fsdp)
    message = str(err.value)
    assert message.startswith(f"recipe.trl: loss_type='m2po' under {backend} is not supported")
    assert f"Fix: drop --{backend.lower()}" in message and "\n" not in message
