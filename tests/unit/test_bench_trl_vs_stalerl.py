"""The pure parts of bench/trl_vs_stalerl.py (no TRL needed): the forward-dtype probe catches a float32 forward
under a bf16 claim and a checkpoint's recompute, the sampling resolution and what a recorded generate applied, and
the alternation's ratio / spread arithmetic."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
try:
    import _alternation as alt
    import _forward_dtype as fd
    import trl_vs_stalerl as bench
finally:
    sys.path.remove(str(REPO / "bench"))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def recorded(fn) -> dict:
    rec = fd.ForwardRecorder().install()
    try:
        fn()
    finally:
        rec.remove()
    return rec.summary()


# --------------------------------------------------------------------------------------------------- dtype probe


def test_an_fp32_forward_under_a_bf16_claim_fails_and_autocast_passes():
    model = small_model()
    x = torch.randn(3, 5, 8)
    fp32 = recorded(lambda: model(x).sum().backward())
    problems = fd.check_forward_dtype(fp32["flops"], "bfloat16")
    assert len(problems) == 1 and "train forward: 0% of the matmul FLOPs in bfloat16" in problems[0]
    assert fd.check_forward_dtype(fp32["flops"], "float32") == []

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).sum().backward()

    auto = recorded(bf16)
    assert fd.check_forward_dtype(auto["flops"], "bfloat16") == []
    assert fd.check_forward_dtype(auto["flops"], "float32") != []
    # the Linear's input stays float32 under autocast: the probe reads the output, where the matmul's dtype shows
    assert fd.dtype_shares(auto["flops"]) == {"train": {"bfloat16": 1.0}}


def test_the_share_is_weighed_by_flops_so_a_small_fp32_head_passes_and_a_large_one_fails():
    body, head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)
    x = torch.randn(4, 6, 64)

    def run(big_head: bool):
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = body(x)
            (torch.nn.Linear(64, 512) if big_head else head)(h.float())  # outside autocast: float32

    small, big = recorded(lambda: run(False)), recorded(lambda: run(True))
    share = fd.dtype_shares(small["flops"])["nograd"]
    assert share["bfloat16"] == pytest.approx(64 * 64 / (64 * 64 + 64 * 2))
    assert fd.check_forward_dtype(small["flops"], "bfloat16") == []
    assert fd.check_forward_dtype(big["flops"], "bfloat16")  # 512-wide fp32 head: 89% of the FLOPs
    assert fd.check_forward_dtype({}, "float32")[0].startswith("no nn.Linear forward was observed")


def test_phases_passes_and_tokens_are_counted_per_forward():
    model = small_model()

    def work():
        with torch.no_grad():
            with fd.generating():
                model(torch.randn(2, 7, 8))  # a prompt pass: 2 rows x 7 positions
                for _ in range(3):
                    model(torch.randn(2, 1, 8))  # three decode steps
            model(torch.randn(2, 9, 8))  # a log-prob pass, outside generation
        model(torch.randn(2, 9, 8)).sum().backward()

    s = recorded(work)
    assert s["passes"] == {"prefill": 1, "decode": 3, "nograd": 1, "train": 1}
    assert s["tokens"] == {"prefill": 14, "decode": 6, "nograd": 18, "train": 18}
    per_pass = 2 * (8 * 16 + 16 * 4)
    assert s["flops"]["train"] == {"float32": pytest.approx(18 * per_pass)}
    assert s["flops"]["decode"] == {"float32": pytest.approx(6 * per_pass)}


def test_a_head_called_in_chunks_does_not_count_as_more_passes():
    layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    head = torch.nn.Linear(8, 3)

    def work():
        h = layers(torch.randn(2, 6, 8))
        for chunk in h.split(3, dim=1):  # log-probs computed in chunks of positions: the head runs twice
            head(chunk).sum().backward(retain_graph=True)

    s = recorded(work)
    assert s["passes"] == {"train": 1} and s["tokens"] == {"train": 12}


def test_a_checkpoint_recompute_is_seen_inside_backward():
    from torch.utils.checkpoint import checkpoint

    model = small_model()
    x = torch.randn(2, 5, 8, requires_grad=True)
    plain = recorded(lambda: model(x).sum().backward())
    ckpt = recorded(lambda: checkpoint(model, x, use_reentrant=False).sum().backward())
    assert "recompute" not in plain["passes"]
    assert ckpt["passes"] == {"train": 1, "recompute": 1}
    side = bench.Side("float32", False, False, False, "test", "test")
    record = {**ckpt, "hf_processors": {}, "engine_calls": {}}
    assert any("ran inside backward" in p for p in bench.check_run("x", side, record, 0.75))
    on = bench.Side("float32", True, False, False, "test", "test")
    assert bench.check_run("x", on, record, 0.75) == []
    assert "no forward ran inside backward" in bench.check_run("x", on, {**plain}, 0.75)[0]


def test_the_site_hook_records_a_child_process_and_the_records_merge(tmp_path):
    """The way the bench runs it: a separate interpreter with bench/_probe_site on PYTHONPATH and the directory
    in the environment writes its records at exit."""
    code = ("import torch\nm = torch.nn.Linear(4, 3)\nwith torch.autocast('cpu', dtype=torch.bfloat16):\n"
            "    m(torch.randn(2, 5, 4)).sum().backward()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(bench.PROBE_SITE), str(REPO)]),
               **{fd.PROBE_DIR_ENV: str(tmp_path)})
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 2
    merged = fd.read_records(tmp_path)
    assert merged["passes"] == {"train": 2} and merged["tokens"] == {"train": 20}
    assert fd.check_forward_dtype(merged["flops"], "bfloat16") == []
    # without the variable the site hook does nothing
    none = tmp_path / "none"
    none.mkdir()
    env.pop(fd.PROBE_DIR_ENV)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert not list(none.iterdir())


def test_the_site_hook_records_a_transformers_generate_and_a_log_prob_pass(tmp_path):
    """transformers imported after the hook is installed: its generate gets wrapped on import, so the run records
    the processors generate built, the prompt rows, and prefill / decode apart from a no-grad pass outside."""
    code = """
import torch
from transformers import GenerationConfig
from stalerl.core.model import build_char_tokenizer, build_tiny_model
tok = build_char_tokenizer()
model = build_tiny_model("qwen2", tok, seed=1, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64)
ids = torch.tensor([[5, 6, 7], [5, 6, 7], [8, 9, 10]])
g = GenerationConfig(max_new_tokens=4, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                     pad_token_id=0, eos_token_id=None)
with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=g)
    model(out)  # a log-prob pass over prompt + completion, outside generate
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(bench.PROBE_SITE), str(REPO)]),
               **{fd.PROBE_DIR_ENV: str(tmp_path)})
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    record = fd.read_records(tmp_path)
    assert fd.sampled_settings(record) == [{**fd.resolve_sampling({}, temperature=0.7), "greedy": False}]
    assert record["first_prompts"] == [[5, 6, 7], [8, 9, 10]]  # distinct rows
    assert record["passes"]["prefill"] == 1 and record["passes"]["decode"] == 3  # 4 tokens: 1 from the prefill
    assert record["passes"]["nograd"] == 1 and record["tokens"]["nograd"] == 3 * 7
    assert "train" not in record["passes"]


# --------------------------------------------------------------------------------------------------- sampling


def test_resolve_sampling_flag_then_generation_config_then_neutral():
    gc = {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "do_sample": True, "eos_token_id": 2}
    assert fd.resolve_sampling(gc) == {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "min_p": None,
                                       "repetition_penalty": 1.0}
    assert fd.resolve_sampling(gc, temperature=0.7, top_k=0) == {"temperature": 0.7, "top_k": 0, "top_p": 0.9,
                                                                 "min_p": None, "repetition_penalty": 1.0}
    # a generation_config without sampling keys (the converted SmolLM2): neutral, not transformers' top_k=50
    assert fd.resolve_sampling({"bos_token_id": 1}, temperature=0.7) == {
        "temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}
    assert fd.resolve_sampling({"repetition_penalty": 1.3, "min_p": 0.05})["repetition_penalty"] == 1.3


def test_transformers_processors_are_read_back_as_sampling():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    class Cfg:
        do_sample = True

    rec = fd.SamplingRecorder()
    rec.record_processors([TemperatureLogitsWarper(0.7)], Cfg())
    rec.record_processors([TemperatureLogitsWarper(0.7)], Cfg())
    rec.record_processors([TemperatureLogitsWarper(0.7), TopKLogitsWarper(50)], Cfg())
    record = {"hf_processors": rec.summary()["hf_processors"], "engine_calls": {}}
    got = fd.effective_sampling(record)
    assert [(s["temperature"], s["top_k"], s["top_p"]) for s in got] == [(0.7, 0, 1.0), (0.7, 50, 1.0)]
    want = fd.resolve_sampling({}, temperature=0.7)
    problems = fd.check_sampling(record, want, "trl")
    assert len(problems) == 1 and "top_k 50" in problems[0]
    # TopP with its parameter; a greedy call is not a sampled one
    greedy = fd.SamplingRecorder()

    class Greedy:
        do_sample = False

    greedy.record_processors([], Greedy())
    greedy.record_processors([TopPLogitsWarper(0.9)], Cfg())
    s = fd.sampled_settings({"hf_processors": greedy.summary()["hf_processors"], "engine_calls": {}})
    assert s == [{**fd.NEUTRAL_SAMPLING, "top_p": pytest.approx(0.9), "greedy": False}]
    assert fd.check_sampling({"hf_processors": {}, "engine_calls": {}}, want, "x") == [
        "x: no sampled generate call was observed"]


def test_engine_arguments_are_the_sampling_and_a_processor_transformers_adds_is_flagged():
    rec = fd.SamplingRecorder()
    rec.record_engine({"temperature": 0.7, "top_p": 1.0, "top_k": 0}, ["What is 1+2?", "What is 3+4?"])

    class Cfg:
        do_sample = True

    rec.record_processors([], Cfg())  # the engine's plain sampling: nothing added by transformers
    record = rec.summary()
    assert record["first_questions"] == ["What is 1+2?", "What is 3+4?"]
    want = fd.resolve_sampling({}, temperature=0.7)
    assert fd.check_sampling(record, want, "sync") == []
    assert fd.check_sampling(record, fd.resolve_sampling({}, temperature=1.0), "sync")  # another temperature
    from transformers.generation.logits_process import TopKLogitsWarper

    rec.record_processors([TopKLogitsWarper(50)], Cfg())  # e.g. a checkpoint's top_k merged in by generate
    problems = fd.check_sampling(rec.summary(), want, "sync")
    assert len(problems) == 1 and "transformers also applied" in problems[0]


# --------------------------------------------------------------------------------------------------- ratios


def test_run_order_alternates_and_reverses():
    assert alt.run_order(["trl", "sync"], 3) == [(0, "trl"), (0, "sync"), (1, "sync"), (1, "trl"), (2, "trl"),
                                                 (2, "sync")]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        alt.run_order(["trl"], 0)


def test_ratio_spread_and_pooled_arithmetic():
    trl = [[10.0, 12.0], [14.0, 14.0], [9.0, 11.0]]
    other = [[5.0, 5.0], [7.0, 7.0], [10.0, 10.0]]
    per_round = alt.round_ratios([statistics.fmean(r) for r in trl], [statistics.fmean(r) for r in other])
    assert per_round == pytest.approx([11 / 5, 14 / 7, 10 / 10])
    assert alt.spread(per_round) == pytest.approx((1.0, 2.0, 2.2))
    assert alt.pooled_ratio(trl, other) == pytest.approx((70 / 6) / (44 / 6))
    text = alt.format_ratio(alt.pooled_ratio(trl, other), per_round)
    assert text.startswith("1.59x") and "min 1.00 / median 2.00 / max 2.20, 3 rounds" in text
    assert alt.steady([9.0, 1.0, 2.0], 1) == [1.0, 2.0]
    with pytest.raises(ValueError, match="no steady step left"):
        alt.steady([9.0], 1)
    with pytest.raises(ValueError, match="3 baseline rounds against 2"):
        alt.round_ratios([1, 2, 3], [1, 2])


def test_paired_reward_difference():
    trl = [[0.5, 0.25, 0.75], [0.5, 0.0]]
    other = [[0.25, 0.25, 0.5], [0.5, 0.25, 1.0]]  # the third step of round 1 has no TRL pair
    diffs = [-0.25, 0.0, -0.25, 0.0, 0.25]
    mean, se, pairs = alt.paired_difference(trl, other)
    assert pairs == 5 and mean == pytest.approx(statistics.fmean(diffs))
    assert se == pytest.approx(statistics.stdev(diffs) / 5 ** 0.5)
    assert alt.paired_difference([[1.0]], [[0.5]])[0] == -0.5
    with pytest.raises(ValueError, match="no paired steps"):
        alt.paired_difference([[]], [[1.0]])


# --------------------------------------------------------------------------------------------------- sides


def test_side_settings_state_each_mode():
    shipped = bench.side_settings("shipped", "default", checkpointing=False)
    assert (shipped["trl"].dtype, shipped["trl"].gradient_checkpointing) == ("bfloat16", True)
    assert (shipped["stalerl"].dtype, shipped["stalerl"].gradient_checkpointing) == ("float32", False)
    assert bench.side_settings("shipped", "float32", False)["trl"].dtype == "float32"
    equal = bench.side_settings("equal", "bfloat16", checkpointing=True)
    assert equal["trl"] == equal["stalerl"]
    assert (equal["trl"].dtype, equal["trl"].gradient_checkpointing, equal["trl"].old_logp_pass,
            equal["trl"].reference_model) == ("bfloat16", True, False, False)
    with pytest.raises(ValueError, match="--dtype default"):
        bench.side_settings("equal", "default", False)


def test_a_no_grad_pass_outside_generation_is_an_old_logp_or_reference_pass():
    model = small_model()

    def work(extra_pass: bool):
        with torch.no_grad():
            with fd.generating():
                model(torch.randn(2, 4, 8))
            if extra_pass:
                model(torch.randn(2, 6, 8))
        model(torch.randn(2, 6, 8)).sum().backward()

    none = bench.Side("float32", False, False, False, "test", "test")
    recompute = bench.Side("float32", False, True, False, "test", "test")
    with_pass, without = recorded(lambda: work(True)), recorded(lambda: work(False))
    assert bench.check_run("sync", none, without, 0.75) == []
    assert bench.check_run("sync", recompute, with_pass, 0.75) == []
    assert "1 no-grad forward passes outside generation" in bench.check_run("sync", none, with_pass, 0.75)[0]
    assert "no no-grad forward ran outside generation" in bench.check_run("sync", recompute, without, 0.75)[0]


def test_equal_tokens_check_compares_training_tokens():
    trl = {"tokens": {"prefill": 400, "train": 1200}}
    same = {"tokens": {"prefill": 100, "train": 1150}}  # a prefill shared by the group is not other work
    padded = {"tokens": {"prefill": 400, "train": 2000}}
    assert bench.check_equal_tokens(trl, same, "sync", 4, 4) == []
    problems = bench.check_equal_tokens(trl, padded, "sync", 4, 4)
    assert len(problems) == 1 and "training-forward tokens per step 500 against TRL's 300" in problems[0]


def test_model_generation_config_is_read(tmp_path):
    assert bench.model_generation_config(None) == {}
    assert bench.model_generation_config(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20}))
    assert bench.model_generation_config(str(tmp_path)) == {"top_k": 20}
