"""recipe.hf_step: the shared HF-trainer step window and the one metrics policy (sums, ratios, extrema over the
micro-batches and ranks of a step), against literal references; two gloo processes for the rank reduction."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch

from recipe.hf_step import StepMetrics, StepWindow, add_fipo_micro_batch, check_sharding_backend, step_micro_batches


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


def test_metrics_sum_counts_divide_summed_numerators_and_take_extrema() -> None:
    gen = torch.Generator().manual_seed(0)
    acc = StepMetrics()
    parts = []
    for _ in range(5):
        num, den = torch.randint(0, 10, (2,), generator=gen).tolist()
        val = torch.randn(2, generator=gen).tolist()
        parts.append((num, den + 1, val))
        acc.add_sum("x/count", num)
        acc.add_ratio("x/fraction", num, den + 1)
        acc.add_max("x/max", val[0])
        acc.add_min("x/min", val[1])
        acc.add_constant("x/constant", val[0])
    out = acc.reduce()
    # the literal definitions
    assert out["x/count"] == sum(p[0] for p in parts)
    assert out["x/fraction"] == sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert out["x/max"] == max(p[2][0] for p in parts)
    assert out["x/min"] == min(p[2][1] for p in parts)
    assert out["x/constant"] == parts[0][2][0]
    # a mean of per-micro-batch fractions would differ here (the test can fail)
    assert not math.isclose(out["x/fraction"], sum(p[0] / p[1] for p in parts) / len(parts))
    assert acc.reduce() == {}  # cleared for the next step


def test_fipo_metrics_of_a_split_step_equal_those_of_the_step_in_one_call() -> None:
    """The step's fipo/* figures do not depend on how its rows are split into micro-batches."""
    gen = torch.Generator().manual_seed(1)
    rows, width = 8, 12
    old = -torch.rand(rows, width, generator=gen) * 3
    new = old + torch.randn(rows, width, generator=gen) * 1.5  # stale enough for drops, clips
    adv = torch.randn(rows, 1, generator=gen).expand(rows, width).contiguous()
    mask = torch.rand(rows, width, generator=gen) > 0.2
    config = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    whole = StepMetrics()
    add_fipo_micro_batch(whole, old, new, adv, mask, config)
    whole = whole.reduce()
    split = StepMetrics()
    for part in torch.arange(rows).split(3):
        add_fipo_micro_batch(split, old[part], new[part], adv[part], mask[part], config)
    split = split.reduce()
    assert whole.keys() == split.keys()
    for key in whole:
        assert math.isclose(whole[key], split[key], rel_tol=1e-6, abs_tol=1e-9), key
    assert whole["fipo/clip_fraction"] > 0 and whole["fipo/num_valid_tokens"] == int(mask.sum())
    assert whole["fipo/num_dropped_sequences"] > 0, "the data must make FIPO drop a row"


def _rank(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    acc = StepMetrics()
    acc.add_sum("c", rank + 1)
    acc.add_ratio("f", rank + 1, 10 * (rank + 1))
    acc.add_max("hi", -rank)
    acc.add_min("lo", rank)
    out[rank] = acc.reduce(dist.group.WORLD)
    dist.destroy_process_group()


def test_metrics_are_reduced_over_ranks() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
        results = dict(out)
    for rank in (0, 1):
        assert results[rank] == {"c": 3.0, "f": 3 / 30, "hi": 0.0, "lo": 0.0}


@pytest.mark.parametrize(("deepspeed", "fsdp", "backend"), [(True, False, "DeepSpeed"), (False, True, "FSDP"),
                                                            (True, True, "DeepSpeed")])
def test_deepspeed_and_fsdp_are_refused_in_one_line_naming_the_backend_and_the_fix(deepspeed, fsdp, backend) -> None:
    check_sharding_backend("recipe.trl", "loss_type='m2po'", deepspeed=False, fsdp=False)  # plain DDP / one process
    with pytest.raises(ValueError) as err:
        check_sharding_backend("recipe.trl", "loss_type='m2po'", deepspeed=deepspeed, fsdp=fsdp)
    message = str(err.value)
    assert message.startswith(f"recipe.trl: loss_type='m2po' under {backend} is not supported")
    assert f"Fix: drop --{backend.lower()}" in message and "\n" not in message
