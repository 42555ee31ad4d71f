"""A loss's declared metric rules hold over the whole step in the runtime: across micro-batches, mini-batches and
data-parallel ranks (issue 44 item 4). The loss under test declares a SUM, a MAX and a MEAN metric; the actor's
logged values must equal the literal reduction of every call the loss saw on every rank."""

import json
import os
import sys

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import metric_rule_worker  # noqa: E402
from _ports import held_store  # noqa: E402


def _literal(calls):
    tokens = sum(c["valid_tokens"] for c in calls)
    return {
        "actor/probe/num_tokens": sum(c["metrics"]["probe/num_tokens"] for c in calls),
        "actor/probe/ratio_max": max(c["metrics"]["probe/ratio_max"] for c in calls),
        "actor/probe/ratio_mean": sum(c["valid_tokens"] * c["metrics"]["probe/ratio_mean"] for c in calls) / tokens,
    }


@pytest.mark.parametrize("world", [1, 2])
def test_sum_max_and_mean_metrics_reduce_over_micro_batches_mini_batches_and_ranks(tmp_path, world):
    if world == 1:
        metric_rule_worker.run_rank(0, 1, 0, str(tmp_path))
    else:
        store = held_store()  # held until both ranks are done (tests/_ports.py)
        mp.spawn(metric_rule_worker.run_rank, args=(world, store.port, str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    calls = [c for r in ranks for c in r["calls"]]
    # the step really was cut: 2 mini-batches, several micro-batches each, on every rank
    assert all(len(r["calls"]) >= 4 for r in ranks)
    expected = _literal(calls)
    for r in ranks:  # every rank logs the step's value, not its own share's
        for key, value in expected.items():
            assert r["metrics"][key] == pytest.approx(value, rel=1e-12), key
    if world == 2:  # a rank's own reduction would differ: the test can fail
        own = _literal(ranks[0]["calls"])
        assert own["actor/probe/num_tokens"] < expected["actor/probe/num_tokens"]
