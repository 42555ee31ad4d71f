"""The shipped GPU configs are fast by default (issue 38 item 4), each behaviour checked on CPU without vLLM:

- ``rollout.backend=auto:dX`` runs vLLM when it is importable at a supported version, else hf, says which and why in
  one line at start, and the run's config records the engine that ran;
- vLLM requests carry no per-request seed unless ``rollout.vllm.seeded_requests`` asks;
- ``evaluator.n_prompts_during_training`` evaluates a fixed subset between the first and the last step, under its own
  metric name, and the full set at both ends;
- ``actor.mb_spec.length_bucketing`` packs micro-batches by length: less padding, the same update.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import random
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO, small_overrides
from stalerl.config import ConfigError, load_config
from stalerl.config import rules

GPU_CONFIGS = [REPO / "examples" / "math" / name for name in ("gsm8k_m2po.yaml", "gsm8k_grpo.yaml")]
CPU_CONFIG = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"
_real_find_spec = importlib.util.find_spec


def _vllm_present(monkeypatch, version: str = "0.32.0") -> None:
    """vLLM 'installed' at ``version`` as far as the auto check can tell (find_spec and package metadata)."""
    import recipe.versions

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: object() if name == "vllm" else _real_find_spec(name, *a, **k))
    monkeypatch.setattr(recipe.versions, "installed_version", lambda key: version if key == "vllm" else None)


def _vllm_absent(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "vllm" else _real_find_spec(name, *a, **k))


# ------------------------------------------------------------------------------------------------ (a) auto backend
@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_configs_ship_the_fast_settings(path):
    cfg = load_config(["--config", str(path)])
    assert cfg.rollout.backend == "auto:d1"
    assert cfg.rollout.vllm.seeded_requests is False
    assert cfg.actor.mb_spec.length_bucketing is True
    assert (cfg.evaluator.n_prompts, cfg.evaluator.n_prompts_during_training, cfg.evaluator.freq_steps) == (1319, 256,
                                                                                                           20)
    # the CPU default is untouched: hf, seeded vLLM requests if asked for vLLM, every evaluation full
    cpu = load_config(["--config", str(CPU_CONFIG)])
    assert cpu.rollout.backend == "hf:d1" and cpu.rollout.vllm.seeded_requests is True
    assert cpu.evaluator.n_prompts_during_training is None and cpu.actor.mb_spec.length_bucketing is False


def test_auto_without_vllm_resolves_to_hf_and_says_why(monkeypatch):
    _vllm_absent(monkeypatch)
    cfg = load_config(["--config", str(GPU_CONFIGS[0])])
    lines: list[str] = []
    line = rules.resolve_rollout_backend(cfg, log=lines.append)
    assert lines == [line]  # exactly one line
    assert cfg.rollout.backend == "hf:d1"
    assert "rollout.backend=auto:d1 -> hf:d1" in line and "vLLM is not installed" in line
    assert 'pip install "stalerl[vllm]"' in line
    assert rules.resolve_rollout_backend(cfg, log=lines.append) is None and len(lines) == 1  # resolved once


def test_auto_with_a_supported_vllm_resolves_to_vllm(monkeypatch):
    _vllm_present(monkeypatch, "0.32.0")
    cfg = load_config(["--config", str(GPU_CONFIGS[1]), "rollout.backend=auto:d1"])
    line = rules.resolve_rollout_backend(cfg, log=None)
    assert cfg.rollout.backend == "vllm:d1"
    assert line == "stalerl: rollout.backend=auto:d1 -> vllm:d1: vllm 0.32.0 is installed and supported"


def test_auto_with_an_unsupported_vllm_falls_back_to_hf_naming_the_range(monkeypatch):
    from recipe.versions import ALLOW_ENV

    _vllm_present(monkeypatch, "0.40.1")
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    engine, why = rules.choose_auto_rollout_engine()
    assert engine == "hf" and "vllm 0.40.1 is installed" in why and ">=0.32,<0.35" in why and ALLOW_ENV in why
    monkeypatch.setenv(ALLOW_ENV, "vllm")  # the project's one override for untested framework versions
    with pytest.warns(RuntimeWarning):
        assert rules.choose_auto_rollout_engine()[0] == "vllm"


def test_auto_keeps_the_dimensions_and_hf_vllm_strings_are_unchanged(monkeypatch):
    _vllm_absent(monkeypatch)
    assert rules.resolved_rollout_backend("auto:d2") == ("hf:d2", rules.choose_auto_rollout_engine()[1])
    for fixed in ("hf:d1", "vllm:d1", "vllm:d2t2", "hf:d3"):
        assert rules.resolved_rollout_backend(fixed) == (fixed, None)
    cfg = load_config(["--config", str(CPU_CONFIG), "rollout.backend=vllm:d1"])
    assert rules.resolve_rollout_backend(cfg) is None and cfg.rollout.backend == "vllm:d1"
    with pytest.raises(ConfigError, match="auto picks vllm or hf"):
        load_config(["rollout.backend=auto:d1t2"])


def test_auto_that_resolves_to_a_vllm_this_config_cannot_run_is_refused_at_start(monkeypatch):
    _vllm_present(monkeypatch)
    cfg = load_config(["--config", str(CPU_CONFIG), "rollout.backend=auto:d1", "rollout.vllm.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"rollout.backend='auto:d1' resolved to 'vllm:d1'.*tensor_parallel_size"):
        rules.resolve_rollout_backend(cfg, log=None)
    assert cfg.rollout.backend == "auto:d1"


def test_trainer_resolves_auto_once_at_start_and_records_the_engine_that_ran(tmp_path, monkeypatch):
    from stalerl.training.trainer import Trainer

    _vllm_absent(monkeypatch)
    cfg = load_config(small_overrides(tmp_path, **{"rollout.backend": "auto:d1", "warm_start.steps": 0}))
    lines: list[str] = []
    trainer = Trainer(cfg, log=lines.append)
    auto_lines = [line for line in lines if "rollout.backend=auto" in line]
    assert len(auto_lines) == 1 and "-> hf:d1" in auto_lines[0] and "vLLM is not installed" in auto_lines[0]
    assert trainer.engine_name == "hf" and type(trainer.engine).__name__ == "HFRolloutEngine"
    assert "backend: hf:d1" in (trainer.run_dir / "config.yaml").read_text()  # what ran, not "auto"
    from stalerl.results.run_summary import build_summary

    summary = build_summary(cfg, status="finished", wall_s=1.0, rows=[])
    again = build_summary(load_config(small_overrides(tmp_path, **{"warm_start.steps": 0})), status="finished",
                          wall_s=1.0, rows=[])
    assert summary["config_digest"] == again["config_digest"]  # the summary's config is the hf:d1 one


def test_trial_dir_compares_auto_as_the_engine_it_resolves_to(tmp_path, monkeypatch):
    from stalerl.core.errors import UserError
    from stalerl.training import trial_dir

    saved = load_config(small_overrides(tmp_path, **{"recover.mode": "auto"}))  # a checkpoint written by hf:d1
    run = tmp_path / "run"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "checkpoints" / "step_3" / "meta.json").write_text(json.dumps(
        {"step": 3, "config": trial_dir.config_dict(saved), "total_steps": 6, "steps_per_epoch": 50}))
    auto = load_config(small_overrides(tmp_path, **{"recover.mode": "auto", "rollout.backend": "auto:d1"}))
    _vllm_absent(monkeypatch)
    trial_dir.check_trial_dir(auto, run, log=lambda *a: None)  # auto -> hf:d1 here: the same engine, resumes
    _vllm_present(monkeypatch)
    with pytest.raises(UserError, match=r"rollout.backend \(checkpoint hf:d1, this run vllm:d1\)"):
        trial_dir.check_trial_dir(auto, run, log=lambda *a: None)


# ------------------------------------------------------------------------------------------------ (b) vLLM seeds
def test_vllm_requests_are_seeded_only_when_asked():
    from stalerl.rollout.vllm_engine import generate_kwargs, sample_seeds
    from stalerl.training.sources import FixedStalenessSource

    gpu = load_config(["--config", str(GPU_CONFIGS[0]), "rollout.backend=vllm:d1"])
    assert generate_kwargs(gpu, [0, 1, 2], 4) == {}
    seeded = load_config(["--config", str(GPU_CONFIGS[0]), "rollout.backend=vllm:d1",
                          "rollout.vllm.seeded_requests=true"])
    assert generate_kwargs(seeded, [5, 6], 4) == {"seeds": sample_seeds(seeded.seed, [5, 6], 4)}
    # the schema default keeps the seeded behaviour every existing config and the vLLM lane's tests rely on
    assert load_config([]).rollout.vllm.seeded_requests is True
    # the synchronous loop's call into a vLLM engine (an engine with source_model) and into the HF engine
    vllm_like = types.SimpleNamespace(engine=types.SimpleNamespace(source_model=None), rollout=gpu.rollout,
                                      seed=gpu.seed)
    assert FixedStalenessSource._engine_kwargs(vllm_like, 10, 3, 4) == {}
    vllm_like.rollout, vllm_like.seed = seeded.rollout, seeded.seed
    assert (FixedStalenessSource._engine_kwargs(vllm_like, 10, 3, 4)
            == {"seeds": sample_seeds(seeded.seed, [10, 11, 12], 4)})
    hf_like = types.SimpleNamespace(engine=object(), rollout=seeded.rollout, seed=seeded.seed)
    assert FixedStalenessSource._engine_kwargs(hf_like, 0, 3, 4) == {}


@pytest.mark.parametrize("seeded", [False, True])
def test_rollout_worker_and_engine_pass_no_seed_unless_asked(tmp_path, monkeypatch, seeded):
    """The vLLM engine's generate, driven by a rollout worker, with a stand-in vllm module: every SamplingParams of
    an unseeded run has seed None (vLLM's batched sampler); a seeded run gives each prompt its task's seed."""
    from stalerl.rollout.batch import RolloutBatch
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine, sample_seeds
    from stalerl.training.workers.rollout_worker import RolloutWorker

    made: list[dict] = []

    class SamplingParams:
        def __init__(self, **kw):
            made.append(kw)

    fake_inputs = types.ModuleType("vllm.inputs")
    fake_inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm.inputs", fake_inputs)
    engine = object.__new__(VLLMRolloutEngine)
    engine.vllm = types.SimpleNamespace(SamplingParams=SamplingParams)
    engine.stop_ids, engine.version, engine.llm = [2], 1, types.SimpleNamespace(generate=lambda *a, **k: [])
    engine.tokenizer = lambda text, add_special_tokens: {"input_ids": [3, 4]}
    engine.format_prompt = str
    empty = RolloutBatch(prompt_ids=torch.zeros(0, 1, dtype=torch.long),
                         prompt_mask=torch.zeros(0, 1, dtype=torch.bool), response_ids=torch.zeros(0, 1, dtype=torch.long),
                         response_mask=torch.zeros(0, 1, dtype=torch.bool), behavior_logp=torch.zeros(0, 1),
                         versions=torch.zeros(0, 1, dtype=torch.long), rewards=torch.zeros(0),
                         group_ids=torch.zeros(0, dtype=torch.long), texts=[], answers=[])
    engine._to_batch = lambda *a, **k: empty
    cfg = load_config(["--config", str(GPU_CONFIGS[0]), "rollout.backend=vllm:d1", "cluster.n_gpus_per_node=1",
                       f"rollout.vllm.seeded_requests={str(seeded).lower()}"])
    worker = object.__new__(RolloutWorker)
    worker.cfg, worker.is_vllm, worker.engine, worker.recompute, worker.index = cfg, True, engine, None, 0
    worker.generate([(7, "q7", "1"), (8, "q8", "2")])
    assert len(made) == 2
    expected = sample_seeds(cfg.seed, [7, 8], cfg.gconfig.n_samples) if seeded else [None, None]
    assert [kw["seed"] for kw in made] == expected


# ------------------------------------------------------------------------------------------------ (c) evaluation
def test_eval_subset_is_fixed_seeded_ordered_and_off_when_it_covers_everything():
    from stalerl.training.sources import eval_subset

    examples = list(range(1319))
    a, b = eval_subset(examples, 256), eval_subset(list(examples), 256)
    assert a == b and len(a) == 256 and a == sorted(a) and len(set(a)) == 256  # same subset every time, in order
    assert a != examples[:256]  # drawn across the set, not its head
    state = random.getstate()
    eval_subset(examples, 10)
    assert random.getstate() == state  # no global random state moves
    assert eval_subset(examples, None) is None and eval_subset(examples, 1319) is None
    assert eval_subset(examples, 5000) is None


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_training_evaluates_a_subset_between_full_evaluations_at_both_ends(tmp_path, monkeypatch):
    import stalerl.training.sources as sources_mod
    from stalerl.results.run_summary import summarize_metrics
    from stalerl.training.trainer import Trainer

    seen: list[list[str]] = []
    real = sources_mod.evaluate_engine

    def recording(engine, examples, gconfig, batch_size):
        seen.append([e.question for e in examples])
        return real(engine, examples, gconfig, batch_size)

    monkeypatch.setattr(sources_mod, "evaluate_engine", recording)
    over = {"total_train_steps": 4, "evaluator.freq_steps": 2, "evaluator.n_prompts": 24,
            "evaluator.n_prompts_during_training": 6, "warm_start.steps": 0, "train_dataset.batch_size": 4,
            "gconfig.n_samples": 2, "stats_logger.mismatch_freq_steps": "null"}
    cfg = load_config(small_overrides(tmp_path, **over))
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.train()
    evals = {r["step"]: r for r in _rows(trainer.run_dir) if any(k.startswith("eval/") for k in r)}
    assert sorted(evals) == [0, 2, 4]
    assert {k: v for k, v in evals[0].items() if k.startswith("eval/")}.keys() == {"eval/accuracy", "eval/n_prompts"}
    assert evals[0]["eval/n_prompts"] == evals[4]["eval/n_prompts"] == 24 and "eval/accuracy" in evals[4]
    assert "eval/accuracy" not in evals[2] and evals[2]["eval/n_prompts"] == 6
    assert 0.0 <= evals[2]["eval/accuracy_subset"] <= 1.0
    full = [e.question for e in trainer.valid_examples]
    assert seen[0] == seen[2] == full and seen[1] == [e.question for e in trainer.eval_subset]
    assert set(seen[1]) < set(full)
    # the run summary's initial / final / best read the full evaluations only
    ev = summarize_metrics(_rows(trainer.run_dir))["eval"]
    assert ev["initial"] == pytest.approx(evals[0]["eval/accuracy"], abs=1e-4) and ev["final_step"] == 4
    assert ev["best_step"] in (0, 4)


def test_without_the_key_every_evaluation_is_full_and_named_as_before(tmp_path):
    from stalerl.training.trainer import Trainer

    over = {"total_train_steps": 2, "evaluator.freq_steps": 1, "evaluator.n_prompts": 8, "warm_start.steps": 0,
            "train_dataset.batch_size": 4, "gconfig.n_samples": 2, "stats_logger.mismatch_freq_steps": "null"}
    trainer = Trainer(load_config(small_overrides(tmp_path, **over)), log=lambda *a, **k: None)
    assert trainer.eval_subset is None
    trainer.train()
    for row in _rows(trainer.run_dir):
        assert [k for k in row if k.startswith("eval/")] == ["eval/accuracy"]


def test_async_evaluations_send_the_subset_and_name_it(tmp_path):
    """The asynchronous trainer's evaluation plumbing (no workers): what it sends a rollout worker per version, and
    the names it merges the result under."""
    from stalerl.training.async_source import AdmissionSource, EvalMergingLogger
    from stalerl.training.sources import EvalPlan, eval_subset

    t = object.__new__(AdmissionSource)
    cfg = load_config(small_overrides(tmp_path))
    t.eval_gconfig, t.eval_batch_size = cfg.eval_gconfig, cfg.valid_dataset.batch_size
    examples = [types.SimpleNamespace(question=f"q{i}", final=str(i)) for i in range(20)]
    t.eval_plan, t.version = EvalPlan(examples, eval_subset(examples, 5), 6), 6
    t.cond, t.failure, t.log = threading.Condition(), None, lambda *a, **k: None
    t.eval_requested, t.eval_sent, t.eval_done, t.outstanding = [], {}, {}, {"rollout/0": 0}
    calls = []
    worker = types.SimpleNamespace(role="rollout/0", call=lambda *a: calls.append(a))
    t.rollout_workers, t._send_latest_weights = [worker], lambda w: None
    for version in (0, 3, 6):  # as training reaches each version: its weights are published, then evaluated
        t.latest_weights = (version, None, None)
        t.eval_requested.append(version)
        t._send_evaluations()
    assert [(c[1], len(c[2])) for c in calls] == [(0, 20), (3, 5), (6, 20)]
    assert [q for q, _ in calls[1][2]] == [e.question for e in t.eval_plan.subset]

    class Inner:
        rows: dict = {}

        def log(self, step, row):
            self.rows[step] = row

    logger = EvalMergingLogger(Inner(), [(0, {}), (3, {}), (6, {})])
    t.eval_done = {v: {"accuracy": 0.5, "seconds": 0.1} for v in (0, 3, 6)}
    t.log_finished_evaluations(logger, wait=False)
    names = {s: sorted(k for k in r if k.startswith("eval/") and k not in ("eval/seconds", "eval/latency_s"))
             for s, r in Inner.rows.items()}
    assert names == {0: ["eval/accuracy", "eval/n_prompts"], 3: ["eval/accuracy_subset", "eval/n_prompts"],
                     6: ["eval/accuracy", "eval/n_prompts"]}
    assert Inner.rows[3]["eval/n_prompts"] == 5 and Inner.rows[6]["eval/n_prompts"] == 20


# ------------------------------------------------------------------------------------------------ (d) micro-batches
def _gsm8k_like(seed: int) -> tuple[list[int], list[int]]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from micro_batch_padding import gsm8k_like_lengths
    finally:
        sys.path.remove(str(REPO / "bench"))
    return gsm8k_like_lengths(seed)


def test_length_bucketing_cuts_padding_on_a_gsm8k_like_batch():
    from stalerl.training.actor import pack_micro_batches, padded_tokens

    computed = {False: 0, True: 0}
    real = 0
    for seed in range(5):
        p, r = _gsm8k_like(seed)
        real += sum(p) + sum(r)
        for sort in (False, True):
            groups = pack_micro_batches(p, r, 8192, sort_by_length=sort)
            assert sorted(i for g in groups for i in g) == list(range(len(p)))  # every row exactly once
            for g in groups:  # within the budget (a single row may exceed it)
                assert len(g) == 1 or len(g) * (max(p[i] for i in g) + max(r[i] for i in g)) <= 8192
            computed[sort] += padded_tokens(p, r, groups)
    waste = {k: 1 - real / v for k, v in computed.items()}
    print(f"\npadded-token waste on GSM8K-like batches (64x4 rows, 8192 tokens per micro-batch): "
          f"consecutive {waste[False]:.1%}, length-bucketed {waste[True]:.1%}, "
          f"tokens computed x{computed[True] / computed[False]:.3f}")
    assert waste[True] < 0.6 * waste[False]


def test_a_batch_that_fits_one_micro_batch_keeps_its_order(tiny_policy):
    """The CPU default's batches (32 prompts x 4 samples, short prompts, 10 new tokens) fit one micro-batch, which
    keeps its row order even with length bucketing on: its update is bit-for-bit what it was either way (and the
    CPU configs leave bucketing off)."""
    from stalerl.training.actor import Actor, pack_micro_batches

    cfg = load_config(["--config", str(CPU_CONFIG)])
    model, _ = tiny_policy
    actor = Actor(copy.deepcopy(model), cfg.actor, temperature=1.0, total_updates=1)
    rows = cfg.train_dataset.batch_size * cfg.gconfig.n_samples
    longest_prompt = len("Q: 99+99=? A:") + 2  # the char tokenizer: one token per character, bos/eos to spare
    p = [longest_prompt - (i % 5) for i in range(rows)]
    r = [cfg.gconfig.max_new_tokens - (i % 7) for i in range(rows)]
    assert not actor.length_bucketing
    assert pack_micro_batches(p, r, actor.max_tokens_per_mb, sort_by_length=True) == [list(range(rows))]
    assert pack_micro_batches([3, 1, 2], [1, 1, 1], 100, sort_by_length=True) == [[0, 1, 2]]
    assert pack_micro_batches([3, 1, 2], [1, 1, 1], 6, sort_by_length=True) == [[1, 2], [0]]  # split: by length
    assert pack_micro_batches([3, 1, 2], [1, 1, 1], 6, sort_by_length=False) == [[0], [1, 2]]


@pytest.mark.parametrize("loss", ["m2po", "vanilla", "fipo"])
def test_length_bucketed_micro_batches_give_the_same_update(tiny_policy, loss):
    """A split whose rows the bucketing reorders: the update equals the consecutive split's and the whole batch's."""
    from test_actor import _stale_batch, _updated_params

    model, tok = tiny_policy
    batch, adv = _stale_batch(model, tok)
    common = {"loss": loss, "optimizer.type": "sgd", "optimizer.lr": 1.0, "optimizer.gradient_clipping": 1e9,
              "m2_threshold": 0.01, "fipo_clip_ratio_c": 1.5}
    from stalerl.training.actor import pack_micro_batches

    p, r = batch.prompt_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist()
    assert pack_micro_batches(p, r, 60, sort_by_length=True) != pack_micro_batches(p, r, 60)
    whole, m_whole = _updated_params(model, batch, adv, **common, **{"mb_spec.max_tokens_per_mb": 100000})
    runs = {flag: _updated_params(model, batch, adv, **common, **{"mb_spec.max_tokens_per_mb": 60,
                                                                  "mb_spec.length_bucketing": flag})
            for flag in ("true", "false")}
    for flag, (params, metrics) in runs.items():
        assert metrics["actor/num_micro_batches"] > 2
        for a, b in zip(whole, params):
            assert torch.allclose(a, b, atol=2e-6, rtol=1e-5), flag
        assert metrics["actor/loss"] == pytest.approx(m_whole["actor/loss"], abs=1e-6)
    assert math.isfinite(runs["true"][1]["actor/grad_norm"])
