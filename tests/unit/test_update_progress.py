"""An update running longer than its progress interval prints progress lines through the run's log (issue 43 item
7): micro-batches done / total, tokens and tokens/s, ETA; none for a short update or on ranks other than 0."""

import re

import torch

from stalerl.config import load_config
from stalerl.core.model import load_policy
from stalerl.rollout.batch import RolloutBatch
from stalerl.training.actor import Actor, DataParallel, UpdateProgress


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_follow_the_interval_with_their_fields():
    clock, lines = FakeClock(), []
    progress = UpdateProgress(total_micro_batches=4, total_tokens=400, log=lines.append, every_s=30.0, clock=clock)
    clock.now += 10
    progress.done(100)  # 10 s: under the interval, silent
    assert lines == []
    clock.now += 30
    progress.done(100)  # 40 s: first line; 200 tokens in 40 s = 5 tokens/s, 200 left = 40 s
    assert lines == ["update: 2/4 micro-batches done, 200/400 tokens at 5.0 tokens/s, 40 s so far, ETA ~40 s"]
    clock.now += 20
    progress.done(100)  # 20 s after the last line: silent
    assert len(lines) == 1
    clock.now += 10
    progress.done(100)  # 30 s after the last line
    assert lines[1] == "update: 4/4 micro-batches done, 400/400 tokens at 5.7 tokens/s, 70 s so far, ETA ~0 s"


def test_long_etas_are_readable():
    clock, lines = FakeClock(), []
    progress = UpdateProgress(total_micro_batches=100, total_tokens=100_000, log=lines.append, every_s=30.0,
                              clock=clock)
    clock.now += 60
    progress.done(1000)  # 1000 tokens / 60 s; 99,000 left: 5940 s
    assert lines[0].endswith("ETA ~1 h 39 min")


def _batch(n: int = 6) -> tuple[RolloutBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p, r = 6, 5
    batch = RolloutBatch(prompt_ids=torch.randint(3, 100, (n, p), generator=g),
                         prompt_mask=torch.ones(n, p, dtype=bool),
                         response_ids=torch.randint(3, 100, (n, r), generator=g),
                         response_mask=torch.ones(n, r, dtype=bool), behavior_logp=-torch.rand(n, r, generator=g) - 3,
                         versions=torch.zeros(n, r, dtype=torch.long), rewards=torch.rand(n),
                         group_ids=torch.arange(n) // 2)
    return batch, torch.randn(n, 1).expand(n, r).contiguous()


def _run(every_s: float, rank: int = 0, n_mini: int = 2, loss: str = "vanilla") -> list[str]:
    torch.manual_seed(0)
    model, _ = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    cfg = load_config(["actor.mb_spec.max_tokens_per_mb=22", f"actor.ppo_n_minibatches={n_mini}",
                       f"actor.loss={loss}"])
    lines: list[str] = []
    actor = Actor(model, cfg.actor, temperature=1.0, total_updates=1, log=lines.append, progress_every_s=every_s)
    actor.dp = DataParallel(rank=rank, size=1)  # rank only decides who prints (size 1: no collectives)
    batch, adv = _batch()
    metrics = actor.update(batch, adv)
    # 3 rows of 11 tokens per mini-batch at 22 tokens per micro-batch: 2 rows, then 1
    assert metrics["actor/num_micro_batches"] == 2
    return lines


def test_an_update_over_the_interval_prints_through_the_log():
    lines = _run(every_s=0.0)  # every micro-batch is past the interval
    pattern = re.compile(r"update: (\d+)/4 micro-batches done, (\d+)/66 tokens at [\d.]+ tokens/s, \d+ s so far, "
                         r"ETA ~\d+ s")
    matches = [pattern.fullmatch(line) for line in lines]
    assert all(matches), lines
    assert [int(m.group(1)) for m in matches] == [1, 2, 3, 4]  # 2 mini-batches x 2 micro-batches
    assert [int(m.group(2)) for m in matches] == [22, 33, 55, 66]


def test_a_short_update_and_other_ranks_are_silent():
    assert _run(every_s=1e9) == []
    assert _run(every_s=0.0, rank=1) == []


def test_the_planners_pass_prints_too():
    """M2PO over several micro-batches runs a no-grad selection pass over the mini-batch first: it checks the clock
    after each of its micro-batches, so a long pass is not silent (the counts are the training micro-batches')."""
    lines = _run(every_s=0.0, loss="m2po")
    done = [int(re.match(r"update: (\d+)/4 micro-batches done", line).group(1)) for line in lines]
    assert done == [0, 0, 1, 2, 2, 2, 3, 4]  # per mini-batch: 2 selection-pass lines, then 2 training ones
