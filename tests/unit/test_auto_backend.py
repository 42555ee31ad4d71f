"""The real-model CPU configs run the fastest installed engine (issue 43 item 3), checked without vLLM:

- examples/math/smollm2_*.yaml say ``rollout.backend: auto:d1``: here (no vLLM) it resolves to hf:d1 and the start
  line says why; with a supported vLLM "installed" it resolves to vllm:d1 and the config still validates on CPU;
- ``rollout.vllm.max_model_len=null`` is planned from the data (the longest formatted prompt in tokens, or the prompt
  cap, + max_new_tokens, in whole 16-token blocks), not the model's length: compared with a literal reference;
- a request longer than the planned length is refused with one line naming the key, before vLLM runs.

The vLLM side (auto -> vllm, greedy tokens and fp32 log-probs equal to the HF engine's) is
tests/integration/test_vllm_auto.py, in the vLLM lane.
"""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import pytest

from conftest import REPO
from stalerl.config import load_config
from stalerl.config import rules

REAL_CONFIGS = [REPO / "examples" / "math" / name for name in
                ("smollm2_add_m2po_cpu.yaml", "smollm2_add_grpo_cpu.yaml", "smollm2_add_m2po_cpu_bf16.yaml")]
_real_find_spec = importlib.util.find_spec


def _vllm_present(monkeypatch, version: str = "0.32.0") -> None:
    """vLLM 'installed' at ``version`` as far as the auto check can tell (find_spec and package metadata)."""
    import recipe.versions

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: object() if name == "vllm" else _real_find_spec(name, *a, **k))
    monkeypatch.setattr(recipe.versions, "installed_version", lambda key: version if key == "vllm" else None)


@pytest.mark.parametrize("path", REAL_CONFIGS, ids=lambda p: p.name)
def test_real_model_configs_resolve_to_hf_here_and_the_line_says_why(path):
    if _real_find_spec("vllm") is not None:
        pytest.skip("vLLM is importable in this environment; tests/integration/test_vllm_auto.py covers it")
    cfg = load_config(["--config", str(path)])
    assert cfg.rollout.backend == "auto:d1"
    lines: list[str] = []
    line = rules.resolve_rollout_backend(cfg, log=lines.append)
    assert lines == [line] and cfg.rollout.backend == "hf:d1"
    assert line.startswith("stalerl: rollout.backend=auto:d1 -> hf:d1: vLLM is not installed")
    assert "scripts/setup_vllm.sh" in line  # how to get the faster engine


@pytest.mark.parametrize("path", REAL_CONFIGS, ids=lambda p: p.name)
def test_real_model_configs_resolve_to_vllm_cpu_when_a_supported_vllm_is_installed(path, monkeypatch):
    _vllm_present(monkeypatch, "0.32.0")
    cfg = load_config(["--config", str(path)])
    line = rules.resolve_rollout_backend(cfg, log=None)
    assert cfg.rollout.backend == "vllm:d1"  # and the CPU checks (no tp, no fp16, the lengths) passed
    assert line == "stalerl: rollout.backend=auto:d1 -> vllm:d1: vllm 0.32.0 is installed and supported"
    assert cfg.cluster.n_gpus_per_node == 0 and cfg.rollout.vllm.max_model_len is None  # planned from the data


def test_an_unsupported_vllm_leaves_the_real_model_config_on_hf_naming_the_range(monkeypatch):
    _vllm_present(monkeypatch, "0.31.1")
    monkeypatch.delenv("STALERL_ALLOW_UNTESTED_FRAMEWORKS", raising=False)
    cfg = load_config(["--config", str(REAL_CONFIGS[0])])
    line = rules.resolve_rollout_backend(cfg, log=None)
    assert cfg.rollout.backend == "hf:d1"
    assert "vllm 0.31.1 is installed, but stalerl's vLLM engine supports vllm" in line


# ------------------------------------------------------------------------------------------------ planned length
def _planned_reference(train_cap, valid_cap, longest_prompt, new_train, new_eval, explicit, model_len) -> int:
    """Literally: the prompt bound is the smallest known of (cap over both splits, measured prompt), else the
    model's length; add the longest completion; count up to the next whole 16-token block; clip at the limit."""
    limit = explicit if explicit is not None else model_len
    known = []
    if train_cap is not None and valid_cap is not None:
        known.append(max(train_cap, valid_cap))
    if longest_prompt is not None:
        known.append(longest_prompt)
    prompt = min(known) if known else limit
    total = prompt + max(new_train, new_eval)
    while total % 16:
        total += 1
    return min(limit, total)


def test_planned_length_equals_the_literal_reference_on_random_settings():
    from stalerl.rollout.vllm_memory import planned_seq_len

    rng = random.Random(0)
    for _ in range(500):
        train_cap, valid_cap, longest = (rng.choice([None, rng.randint(1, 3000)]) for _ in range(3))
        new_train, new_eval = rng.randint(1, 1024), rng.randint(1, 1024)
        explicit = rng.choice([None, rng.randint(1025, 9000)])
        model_len = rng.choice([2048, 8192, 32_768])
        cfg = SimpleNamespace(rollout=SimpleNamespace(vllm=SimpleNamespace(max_model_len=explicit)),
                              train_dataset=SimpleNamespace(max_length=train_cap),
                              valid_dataset=SimpleNamespace(max_length=valid_cap),
                              gconfig=SimpleNamespace(max_new_tokens=new_train),
                              eval_gconfig=SimpleNamespace(max_new_tokens=new_eval))
        got = planned_seq_len(cfg, model_len, longest)
        assert got == _planned_reference(train_cap, valid_cap, longest, new_train, new_eval, explicit, model_len)


def test_longest_prompt_is_the_literal_maximum_over_both_splits_in_generates_tokens():
    from stalerl.core.model import PromptFormatter, load_policy_from_config
    from stalerl.data import load_examples
    from stalerl.training.prompt_lengths import longest_prompt_tokens

    cfg = load_config(["--config", str(REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"),
                       "train_dataset.synthetic.train_size=300", "valid_dataset.synthetic.test_size=64",
                       "train_dataset.synthetic.max_operand=999", "valid_dataset.synthetic.max_operand=99999"])
    _, tok = load_policy_from_config(cfg)
    fmt = PromptFormatter.from_config(tok, cfg).format
    literal = 0
    for ds in (cfg.train_dataset, cfg.valid_dataset):
        for e in load_examples(ds.path, ds.split, synthetic_task=ds.synthetic.task,
                               max_operand=ds.synthetic.max_operand, train_size=ds.synthetic.train_size,
                               test_size=ds.synthetic.test_size, seed=ds.synthetic.seed,
                               question_style=ds.synthetic.question_style, holdout=ds.synthetic.holdout):
            literal = max(literal, len(tok(fmt(e.question), add_special_tokens=False)["input_ids"]))
    assert longest_prompt_tokens(cfg, tok, fmt) == literal
    assert literal > 0


def test_unreadable_data_leaves_the_prompt_unmeasured_and_says_so(tmp_path):
    from stalerl.core.model import PromptFormatter, load_policy_from_config
    from stalerl.training.prompt_lengths import longest_prompt_tokens

    cfg = load_config(["--config", str(REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"),
                       f"valid_dataset.path={tmp_path / 'missing'}"])
    _, tok = load_policy_from_config(cfg)
    lines: list[str] = []
    assert longest_prompt_tokens(cfg, tok, PromptFormatter.from_config(tok, cfg).format, log=lines.append) is None
    assert len(lines) == 1 and "valid_dataset.path=" in lines[0] and "not readable here" in lines[0]


def test_real_model_config_plans_its_prompts_plus_16_new_tokens_not_8192(real_model_dir):
    from stalerl.core.model import PromptFormatter, load_policy_from_config
    from stalerl.training.prompt_lengths import longest_prompt_tokens
    from stalerl.rollout.vllm_memory import planned_seq_len

    cfg = load_config(["--config", str(REAL_CONFIGS[0]), f"actor.path={real_model_dir}"])
    model, tok = load_policy_from_config(cfg)
    assert model.config.max_position_embeddings == 8192
    longest = longest_prompt_tokens(cfg, tok, PromptFormatter.from_config(tok, cfg).format)
    assert 30 <= longest <= 64  # "What is a+b? Answer with just the number." in the chat template
    planned = planned_seq_len(cfg, 8192, longest)
    assert planned % 16 == 0 and longest + 16 <= planned < longest + 16 + 16
    # without the measure, the config's null prompt caps leave the model's length (what vLLM-CPU's 0.25 GiB KV
    # default cannot hold for SmolLM2 in fp32: 8192 x 45 KiB = 0.35 GiB)
    assert planned_seq_len(cfg, 8192) == 8192


def test_a_request_longer_than_the_planned_length_is_refused_naming_the_key():
    from stalerl.core.errors import UserError
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # only the length check: no vLLM here
    engine.max_model_len = 64
    engine._check_fits([[1] * 48, [1] * 10], 16)  # 48 + 16 = 64 fits exactly
    with pytest.raises(UserError, match=r"rollout.vllm.max_model_len=64 .* 49-token prompt \+ max_new_tokens=16.*"
                                        r"max_model_len>=65"):
        engine._check_fits([[1] * 49], 16)
    engine.max_model_len = None  # vLLM's own default: nothing to check here
    engine._check_fits([[1] * 10_000], 16)
