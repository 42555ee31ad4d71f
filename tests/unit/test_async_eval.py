"""Evaluation on a rollout worker (asynchronous runs): the worker's evaluation of a weight set is the synchronous
trainer's evaluation of the same weights (same answers, same accuracy), and the metrics logger holds rows back until
their step's evaluation has arrived, keeping one row per step in step order."""

from __future__ import annotations

import torch

from conftest import small_overrides


def _perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0)
            for k, v in model.state_dict().items()}


def test_rollout_worker_evaluation_equals_the_controllers(tmp_path):
    from stalerl.config import load_config
    from stalerl.rollout.engine import evaluate_engine
    from stalerl.training.trainer import Trainer
    from stalerl.training.workers.rollout_worker import RolloutWorker

    cfg = load_config(small_overrides(tmp_path, **{"warm_start.steps": 60, "evaluator.n_prompts": 48,
                                                   "valid_dataset.batch_size": 16}))
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.run_warm_start()  # a model that answers some problems, so accuracy is not trivially 0 on both sides
    worker = RolloutWorker(cfg, index=0)
    digests = []
    for version, state in enumerate([trainer.model.state_dict(), _perturbed(trainer.model, 1)]):
        state = {k: v.detach().clone() for k, v in state.items()}
        trainer.model.load_state_dict(state)
        worker.load_weights(version, state)
        controller = trainer.evaluate()  # what the synchronous loop logs
        ref = evaluate_engine(trainer.engine, trainer.valid_examples, cfg.eval_gconfig, cfg.valid_dataset.batch_size)
        g = cfg.eval_gconfig
        settings = {k: getattr(g, k) for k in ("n_samples", "max_new_tokens", "temperature", "top_p", "top_k",
                                               "greedy")}
        out = worker.evaluate(version, [(e.question, e.final) for e in trainer.valid_examples], settings,
                              cfg.valid_dataset.batch_size)["eval"]
        assert out["version"] == version and out["n"] == 48
        assert out["digest"] == ref["digest"]  # every generated answer is the same
        assert out["accuracy"] == ref["accuracy"] == controller["eval/accuracy"]
        digests.append(out["digest"])
    assert digests[0] != digests[1]  # the two weight sets answer differently, so the equality above means something


def test_worker_refuses_to_evaluate_other_weights_than_requested(tmp_path):
    import pytest

    from stalerl.config import load_config
    from stalerl.training.workers.rollout_worker import RolloutWorker

    cfg = load_config(small_overrides(tmp_path))
    worker = RolloutWorker(cfg, index=0)
    worker.load_weights(2, worker.model.state_dict())
    with pytest.raises(RuntimeError, match="holds version 2"):
        worker.evaluate(3, [("1+1", "2")], {"n_samples": 1, "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0,
                                            "top_k": 0, "greedy": True}, 8)


class _Sink:
    def __init__(self):
        self.rows, self.closed = [], False

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed = True


def test_merging_logger_holds_rows_until_their_evaluation_and_keeps_step_order():
    from stalerl.training.async_source import EvalMergingLogger

    sink = _Sink()
    log = EvalMergingLogger(sink)
    log.log(0, {"a": 0})
    log.write_ready({0})  # step 0's evaluation is running
    log.log(1, {"a": 1})
    log.log(2, {"a": 2})
    log.write_ready({0})
    assert sink.rows == []  # nothing overtakes the held row
    log.merge(0, {"eval/accuracy": 0.5})
    log.write_ready(set())
    assert sink.rows == [(0, {"a": 0, "eval/accuracy": 0.5}), (1, {"a": 1}), (2, {"a": 2})]
    log.log(3, {"a": 3})
    log.write_ready({3})
    log.close()  # a run that stops early writes what it holds
    assert sink.rows[-1] == (3, {"a": 3}) and sink.closed
