"""The adaptive warm start: its stop rule, the fixed-step path it must leave untouched, config checks, and the fields
it leaves in the log, the metrics and the run summary."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import CPU_CONFIG, small_overrides
from stalerl.config import ConfigError, load_config
from stalerl.data.synthetic import synthetic_splits
from stalerl.core.model import PromptFormatter
from stalerl.training.warm_start import sft_batch, sft_loss, warm_start


def _reference_fixed_steps(model, tok, fmt, target, examples, *, steps, batch_size, lr, seed):
    """The warm start as it was before the adaptive rule, literally: ``steps`` AdamW steps, nothing else."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    for _ in range(steps):
        picked = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        loss = sft_loss(model, sft_batch(tok, [fmt(e.question) for e in picked], [target(e) for e in picked]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _setup(seed: int = 0):
    from stalerl.core.model import load_policy

    torch.manual_seed(seed)
    model, tok = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=seed)
    examples, _ = synthetic_splits(task="add", max_operand=99, train_size=200, test_size=16)
    return model, tok, PromptFormatter(tok), examples


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class Scripted:
    """An accuracy() that returns a script, one value per check, and counts the checks."""

    def __init__(self, values):
        self.values, self.calls = list(values), 0

    def __call__(self) -> float:
        self.calls += 1
        return self.values[self.calls - 1]


def _run(model, tok, f, examples, **kw):
    lines: list[str] = []
    kw = {"steps": 10, "batch_size": 4, "lr": 1e-3, "seed": 3, "log": lines.append, **kw}
    return warm_start(model, tok, f.format, f.sft_target, examples, **kw), lines


def test_stops_at_the_first_check_at_or_above_target():
    model, tok, f, ex = _setup()
    acc = Scripted([0.1, 0.2, 0.3, 0.9, 0.9])
    info, lines = _run(model, tok, f, ex, steps=20, eval_interval=3, target_accuracy=0.3, accuracy=acc)
    assert acc.calls == 3 and info["warm_start/steps"] == 9.0  # checks at 3, 6, 9; 0.3 >= 0.3 stops
    assert info["warm_start/target_reached"] == 1.0 and info["warm_start/accuracy"] == 0.3
    assert info["warm_start/cap"] == 20.0 and info["warm_start/target_accuracy"] == 0.3
    assert any("target accuracy 0.3 reached at step 9/20" in line for line in lines)
    assert not any("WARNING" in line for line in lines)


def test_cap_is_respected_and_checked_and_says_so_loudly():
    model, tok, f, ex = _setup()
    acc = Scripted([0.0, 0.1, 0.2, 0.29])
    info, lines = _run(model, tok, f, ex, steps=10, eval_interval=3, target_accuracy=0.3, accuracy=acc)
    assert acc.calls == 4 and info["warm_start/steps"] == 10.0  # checks at 3, 6, 9 and at the cap, 10
    assert info["warm_start/target_reached"] == 0.0 and info["warm_start/accuracy"] == 0.29
    assert any(line.startswith("WARNING: warm start hit its cap of 10 steps before reaching target accuracy 0.3")
               for line in lines)


def test_a_cap_below_the_interval_checks_once_at_the_cap():
    model, tok, f, ex = _setup()
    acc = Scripted([0.5])
    info, lines = _run(model, tok, f, ex, steps=2, eval_interval=25, target_accuracy=0.3, accuracy=acc)
    assert acc.calls == 1 and info["warm_start/steps"] == 2.0 and info["warm_start/target_reached"] == 1.0


def test_the_check_does_not_change_the_supervised_steps():
    """Same steps done, same weights, whether or not checks ran in between (a check switches to eval mode and
    generates; the SFT stream and the train mode must come back unchanged)."""
    model_a, tok, f, ex = _setup()
    model_b, _, _, _ = _setup()
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine

    engine = HFRolloutEngine(model_b, tok, f.format, gsm8k_reward, device=torch.device("cpu"))

    def greedy_accuracy() -> float:
        out = engine.generate([e.question for e in ex[:8]], [e.final for e in ex[:8]], n_samples=1,
                              max_new_tokens=6, greedy=True)
        return float(out.rewards.mean())

    _run(model_a, tok, f, ex, steps=6)
    info, _ = _run(model_b, tok, f, ex, steps=6, eval_interval=2, target_accuracy=1.0, accuracy=greedy_accuracy)
    assert info["warm_start/steps"] == 6.0 and model_b.training
    assert all(torch.equal(a, b) for a, b in zip(_params(model_a), _params(model_b)))


def test_target_zero_is_the_fixed_step_warm_start_bit_for_bit():
    model, tok, f, ex = _setup()
    ref, _, _, _ = _setup()
    acc = Scripted([])
    info, lines = _run(model, tok, f, ex, steps=7, eval_interval=2, target_accuracy=0.0, accuracy=acc)
    _reference_fixed_steps(ref, tok, f.format, f.sft_target, ex, steps=7, batch_size=4, lr=1e-3, seed=3)
    assert acc.calls == 0 and info["warm_start/steps"] == 7.0
    assert set(info) == {"warm_start/steps", "warm_start/final_loss", "warm_start/seconds"}
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(ref)))
    assert lines == [lines[0]] and "held-out" not in lines[0]  # one line at the last step, as before


def test_adaptive_needs_an_accuracy_callback():
    model, tok, f, ex = _setup()
    with pytest.raises(ValueError, match="accuracy"):
        _run(model, tok, f, ex, target_accuracy=0.5)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("override, key", [
    ("warm_start.target_accuracy=1.5", "warm_start.target_accuracy"),
    ("warm_start.target_accuracy=-0.1", "warm_start.target_accuracy"),
    ("warm_start.eval_interval=0", "warm_start.eval_interval"),
    ("warm_start.eval_problems=0", "warm_start.eval_problems"),
])
def test_bad_warm_start_values_are_refused_at_load(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(CPU_CONFIG), override])
    assert key in str(e.value)


def test_shipped_defaults_and_what_is_allowed():
    for name in ("gsm8k_m2po_cpu.yaml", "gsm8k_grpo_cpu.yaml"):
        ws = load_config(["--config", str(CPU_CONFIG.with_name(name))]).warm_start
        assert (ws.steps, ws.target_accuracy, ws.eval_interval, ws.eval_problems) == (1500, 0.25, 25, 256)
    # A disabled warm start (the study's cached runs) or the fixed-step one may keep any interval.
    load_config(["--config", str(CPU_CONFIG), "warm_start.steps=0"])
    load_config(["--config", str(CPU_CONFIG), "warm_start.target_accuracy=0", "warm_start.steps=10"])
    # A quick run that only shortens the cap keeps working: the target is checked once, at the cap (a missed target
    # is a warning there), rather than refusing every `warm_start.steps=N` below the check interval.
    assert load_config(["--config", str(CPU_CONFIG), "warm_start.steps=10"]).warm_start.eval_interval == 25


# ------------------------------------------------------------------------------------------------ trainer/summary
def test_trainer_holds_out_training_problems_and_reports_a_missed_target(tmp_path):
    """Run through the trainer: held-out problems never reach the supervised data, the step-0 metrics and the run
    summary carry the check, and a missed target is a warning in the log and in the summary."""
    from stalerl.config import run_dir
    from stalerl.results.metrics_log import read_metrics
    from stalerl.results.run_summary import build_summary
    from stalerl.training.trainer import Trainer

    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path, **{
        "warm_start.target_accuracy": 1.0, "warm_start.steps": 4, "warm_start.eval_interval": 2,
        "warm_start.eval_problems": 8, "total_train_steps": 1, "evaluator.freq_steps": 1})])
    lines: list[str] = []
    trainer = Trainer(cfg, log=lines.append)
    seen: list[list] = []
    import stalerl.training.trainer as trainer_mod

    real = trainer_mod.warm_start

    def spy(*args, **kw):
        seen.append(list(args[4]))
        return real(*args, **kw)

    trainer_mod.warm_start = spy
    try:
        trainer.train()
    finally:
        trainer_mod.warm_start = real
    held = {e.question for e in trainer.train_examples[-8:]}
    assert seen and not held & {e.question for e in seen[0]}
    assert len(seen[0]) < len(trainer.train_examples)
    assert any(line.startswith("WARNING: warm start hit its cap of 4 steps") for line in lines)
    assert sum("held-out greedy accuracy" in line for line in lines) >= 2  # the checks at 2 and 4
    row0 = next(r for r in read_metrics(run_dir(cfg)) if r["step"] == 0)
    assert row0["warm_start/steps"] == 4.0 and row0["warm_start/target_reached"] == 0.0
    s = build_summary(cfg, status="finished", wall_s=1.0)
    assert s["warm_start"]["target_reached"] == 0.0 and s["warm_start"]["cap"] == 4.0
    assert s["warm_start"]["target_accuracy"] == 1.0 and 0.0 <= s["warm_start"]["accuracy"] < 1.0
    assert len(s["warnings"]) == 1 and "hit its cap of 4 steps" in s["warnings"][0]


def test_cached_warm_start_result_reaches_the_summary(tmp_path):
    """A study's cached warm start: the RL run has warm_start.steps=0; its summary takes the steps done and the
    check from the cache's marker, warning included."""
    from stalerl.results.run_summary import WARM_START_MARKER, build_summary

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / WARM_START_MARKER).write_text(json.dumps({
        "base_path": "tiny:qwen2", "seed": 1, "warm_start": {"steps": 1500, "target_accuracy": 0.25},
        "final_loss": 0.4, "result": {"steps": 1500.0, "final_loss": 0.4, "cap": 1500.0, "target_accuracy": 0.25,
                                      "accuracy": 0.2, "target_reached": 0.0}}))
    cfg = load_config(["--config", str(CPU_CONFIG), *small_overrides(tmp_path), f"actor.path={cache}",
                       "warm_start.steps=0"])
    s = build_summary(cfg, status="finished", wall_s=1.0, rows=[])
    assert s["warm_start"] == {"steps": 1500.0, "final_loss": 0.4, "cap": 1500.0, "target_accuracy": 0.25,
                               "accuracy": 0.2, "target_reached": 0.0}
    assert s["warnings"] and "1500 steps before reaching target accuracy 0.25" in s["warnings"][0]
    reached = dict(json.loads((cache / WARM_START_MARKER).read_text()))
    reached["result"] = dict(reached["result"], steps=350.0, accuracy=0.27, target_reached=1.0)
    (cache / WARM_START_MARKER).write_text(json.dumps(reached))
    s = build_summary(cfg, status="finished", wall_s=1.0, rows=[])
    assert s["warm_start"]["steps"] == 350.0 and s["warnings"] == []


def test_study_cache_keys_on_the_adaptive_fields(tmp_path):
    from stalerl_study.cli import warm_start_dir

    base = ["--config", str(CPU_CONFIG), f"cluster.fileroot={tmp_path}"]
    dirs = {str(warm_start_dir(load_config(base + list(o)))) for o in (
        [], ["warm_start.target_accuracy=0.3"], ["warm_start.eval_interval=50"], ["warm_start.eval_problems=128"],
        ["eval_gconfig.max_new_tokens=12"])}
    assert len(dirs) == 5
    assert warm_start_dir(load_config(base)) == warm_start_dir(load_config(base + ["total_train_steps=7"]))


def test_report_shows_the_adaptive_warm_start_and_flags_a_missed_target():
    from stalerl_study.report import group, render_markdown

    def summary(seed: int, steps: float, acc: float, reached: float) -> dict:
        return {"status": "finished", "seed": seed, "loss": "m2po", "setting": "fixed_staleness 4",
                "eval": {"final": 0.5}, "warm_start": {"steps": steps, "cap": 1500.0, "target_accuracy": 0.25,
                                                        "accuracy": acc, "target_reached": reached}}

    runs = [summary(1, 300.0, 0.26, 1.0), summary(2, 500.0, 0.30, 1.0), summary(3, 1500.0, 0.2, 0.0)]
    text = render_markdown(group(runs, seeds=[1, 2, 3]), study="d")
    assert "warm start hit its cap before its target: seed 3" in text
    line = next(x for x in text.splitlines() if x.startswith("- fixed_staleness 4, m2po:"))
    assert "target 0.25 reached by 2/3 seeds" in line and "(cap 1500)" in line
    assert "steps 767 ± " in line  # mean of 300, 500, 1500
    assert "seed 1 0.260 at step 300, seed 2 0.300 at step 500, seed 3 0.200 at step 1500" in line
    # A fixed-step warm start (no target in the summary) adds nothing: committed blocks stay byte for byte.
    fixed = [dict(r, warm_start={"steps": 500.0, "final_loss": 0.4}) for r in runs]
    assert "Adaptive warm start" not in render_markdown(group(fixed, seeds=[1, 2, 3]), study="d")
    assert "warm start hit" not in render_markdown(group(fixed, seeds=[1, 2, 3]), study="d")
