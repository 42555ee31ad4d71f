"""cluster.share_gpu (asynchronous dX+dY on one device): the config rules, the memory estimate and fractions, the fit
refusal, the weight-sync choice, the per-process caps and the scheduler's placement. CUDA paths run through mocks;
the real CPU dry-mode run is tests/integration/test_share_gpu_async.py."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stalerl.config import ConfigError, load_config
from stalerl.config.share_gpu import MAX_FRACTION_SUM, share_gpu_problems
from stalerl.core.errors import UserError
from stalerl.training import share_gpu as sg

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "math" / "one_gpu_async.yaml"
CPU = ["actor.device=cpu", "actor.dtype=float32", "actor.path=tiny:qwen2"]


def cfg_of(*overrides: str):
    return load_config(["--config", str(YAML), *CPU, *overrides])


# ------------------------------------------------------------------------------------------------ config rules
def test_the_shipped_config_has_no_share_gpu_problem():
    cfg = cfg_of()
    assert cfg.cluster.share_gpu and cfg.experiment_name == "one-gpu-async"
    assert share_gpu_problems(cfg) == []
    assert share_gpu_problems(load_config(["--config", str(YAML)])) == []  # the GPU form (actor.device=cuda)


@pytest.mark.parametrize("overrides, key, words", [
    (["rollout.mode=sync", "rollout.max_head_offpolicyness=0"], "cluster.share_gpu", "synchronous"),
    (["rollout.mode=auto", "rollout.max_head_offpolicyness=0"], "cluster.share_gpu", "max_head_offpolicyness"),
    (["rollout.backend=vllm:d1"], "rollout.backend", "hf:d1"),
    (["rollout.backend=auto:d1"], "rollout.backend", "hf engine only"),
    (["actor.backend=fsdp:d2"], "actor.backend", "NCCL"),
    (["scheduler.type=ray"], "scheduler.type", "scheduler.type=local"),
    (["cluster.share_gpu_train_fraction=0.6", "cluster.share_gpu_rollout_fraction=0.4"],
     "cluster.share_gpu_train_fraction", "0.95"),
])
def test_unsupported_combinations_are_named_with_their_fix(overrides, key, words):
    problems = share_gpu_problems(_unvalidated(*overrides))
    assert [k for k, _ in problems] == [key], problems
    msg = problems[0][1]
    assert words in msg and "Fix:" in msg and "\n" not in msg


def _unvalidated(*overrides):
    """The shipped config with ``overrides`` set after validation (config validation refuses them itself, with
    other rules' problems too on a CPU config: here the share_gpu rule alone is what is tested)."""
    import yaml

    cfg = cfg_of()
    for o in overrides:
        key, value = o.split("=", 1)
        *path, name = key.split(".")
        section = cfg
        for part in path:
            section = getattr(section, part)
        setattr(section, name, yaml.safe_load(value))
    return cfg


def test_torch_dy_and_hf_dx_are_allowed_fsdp_d1_too():
    assert share_gpu_problems(cfg_of("actor.backend=torch:d2", "rollout.backend=hf:d2")) == []
    assert share_gpu_problems(cfg_of("actor.backend=fsdp:d1")) == []


def test_cluster_section_refuses_more_than_one_node_and_fractions_without_share_gpu():
    with pytest.raises(ConfigError, match=r"cluster.share_gpu: got true with cluster.n_nodes=2.*Fix"):
        cfg_of("cluster.n_nodes=2")
    with pytest.raises(ConfigError, match=r"share_gpu_rollout_fraction: got 0.3 but cluster.share_gpu=false"):
        cfg_of("cluster.share_gpu=false", "cluster.share_gpu_rollout_fraction=0.3")
    with pytest.raises(ConfigError, match=r"share_gpu_train_fraction: got 1.5; expected < 1.0"):
        cfg_of("cluster.share_gpu_train_fraction=1.5")
    assert share_gpu_problems(cfg_of("cluster.share_gpu=false")) == []


# ------------------------------------------------------------------------------------------------ estimates
DIMS = sg.ModelDims(n_params=1_000_000, hidden=64, layers=2, vocab=100, kv_dim=32)


def test_estimates_follow_the_stated_formulas():
    cfg = cfg_of()  # batch 8 x 8 samples, 1 mini-batch, max_length 128 + 16 new tokens, 4096 per mb, float32
    seq = 128 + 16
    assert sg.sequence_tokens(cfg) == seq
    tokens = min(4096, 64 * seq)  # actor.mb_spec.max_tokens_per_mb caps it
    assert sg.train_tokens_per_micro_batch(cfg, 1) == tokens
    assert sg.train_tokens_per_micro_batch(cfg, 4) == 16 * seq  # a quarter of the rows per rank
    train = 1.25 * (1_000_000 * 4 * 6 + tokens * 2 * 64 * 34 * 2 + tokens * 100 * 4)  # fp32: 68 bytes per h
    assert sg.train_bytes(DIMS, cfg, 1) == int(train)
    rows = 8 * 8  # max_concurrent_rollouts null = consumer_batch_size, times n_samples
    rollout = 1.25 * (1_000_000 * 4 + rows * seq * 2 * 2 * 32 * 4 + rows * 100 * 4)
    assert sg.rollout_bytes(DIMS, cfg) == int(rollout)
    bf16 = cfg_of("actor.dtype=bfloat16")
    assert sg.rollout_bytes(DIMS, bf16) < sg.rollout_bytes(DIMS, cfg)  # the KV cache halves
    assert sg.rollout_bytes(DIMS, cfg_of("rollout.max_concurrent_rollouts=16")) > sg.rollout_bytes(DIMS, cfg)


def test_model_dims_read_the_hf_config():
    from stalerl.core.model import load_policy_from_config

    model, _ = load_policy_from_config(cfg_of())
    d = sg.ModelDims.of(model)
    c = model.config
    assert d.n_params == sum(p.numel() for p in model.parameters())
    assert (d.hidden, d.layers, d.vocab) == (c.hidden_size, c.num_hidden_layers, c.vocab_size)
    assert d.kv_dim == c.num_key_value_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


# ------------------------------------------------------------------------------------------------ fractions
def _reference_split(tneed, rneed, nt, nr, total):
    """Literal: usable = 1 - contexts (at most MAX_FRACTION_SUM), shared out in proportion to the needs."""
    usable = 1.0 - (nt + nr) * sg.CONTEXT_BYTES / total
    if usable > MAX_FRACTION_SUM:
        usable = MAX_FRACTION_SUM
    all_needs = [tneed] * nt + [rneed] * nr
    return usable * tneed / sum(all_needs), usable * rneed / sum(all_needs), usable


def test_derived_fractions_match_the_literal_split_on_random_inputs():
    rng = random.Random(0)
    for _ in range(200):
        nt, nr = rng.randint(1, 4), rng.randint(1, 4)
        tneed, rneed = rng.randint(1, 40) * sg.GIB, rng.randint(1, 40) * sg.GIB
        total = rng.choice([16, 24, 80, 141]) * sg.GIB
        got = sg.split_fractions(tneed, rneed, nt, nr, total)
        want = _reference_split(tneed, rneed, nt, nr, total)
        assert got == pytest.approx(want, rel=1e-12)
        ft, fr, usable = got
        assert nt * ft + nr * fr == pytest.approx(usable)
        assert ft / fr == pytest.approx(tneed / rneed)


def test_a_given_fraction_is_kept_and_the_other_gets_the_rest():
    total = 80 * sg.GIB
    ft, fr, usable = sg.split_fractions(1, 1, 1, 2, total, train_fraction=0.5)
    assert ft == 0.5 and fr == pytest.approx((usable - 0.5) / 2)
    ft, fr, usable = sg.split_fractions(1, 1, 2, 1, total, rollout_fraction=0.2)
    assert fr == 0.2 and ft == pytest.approx((usable - 0.2) / 2)
    assert sg.split_fractions(1, 1, 1, 1, total, train_fraction=0.7, rollout_fraction=0.1)[:2] == (0.7, 0.1)


# ------------------------------------------------------------------------------------------------ the fit check
def test_the_plan_fits_an_h100_and_logs_its_split():
    cfg = load_config(["--config", str(YAML)])
    smollm2 = sg.ModelDims(n_params=134_515_008, hidden=576, layers=30, vocab=49152, kv_dim=3 * 64)
    plan = sg.make_plan(cfg, smollm2, 1, 1, "cuda", total=80 * 10**9, ipc_available=lambda: (True, "mock"))
    assert not plan.dry and plan.sync == ("cuda_ipc", "mock")
    assert plan.train_fraction * plan.total >= plan.train_need
    assert plan.rollout_fraction * plan.total >= plan.rollout_need
    lines = plan.lines()
    assert "1 rollout + 1 train processes on the one CUDA device" in lines[0]
    assert lines[-1] == "share_gpu weight sync: cuda_ipc (mock)"
    assert plan.roles() == {"train/0": plan.train_fraction, "rollout/0": plan.rollout_fraction}


def test_a_split_that_cannot_fit_is_refused_in_one_line_naming_the_keys():
    cfg = load_config(["--config", str(YAML)])
    smollm2 = sg.ModelDims(n_params=134_515_008, hidden=576, layers=30, vocab=49152, kv_dim=3 * 64)
    with pytest.raises(UserError) as err:  # a 4 GiB device
        sg.make_plan(cfg, smollm2, 1, 1, "cuda", total=4 * sg.GIB, ipc_available=lambda: (True, "mock"))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cluster.share_gpu=true: the memory split cannot fit on the CUDA device")
    assert "a train process needs ~" in msg and "Fix:" in msg and "cluster.share_gpu=false" in msg
    assert "actor.mb_spec.max_tokens_per_mb" in msg and "rollout.max_concurrent_rollouts" in msg
    # fractions given too small for the rollout side: refused for that side only
    tight = load_config(["--config", str(YAML), "cluster.share_gpu_rollout_fraction=0.001"])
    with pytest.raises(UserError, match=r"a rollout worker needs ~[\d.]+ GiB but gets 0.001") as err:
        sg.make_plan(tight, smollm2, 1, 1, "cuda", total=80 * 10**9, ipc_available=lambda: (True, "mock"))
    assert "a train process needs" not in str(err.value)


def test_cpu_dry_mode_checks_against_the_stated_host_figure_or_says_it_skipped(monkeypatch):
    cfg = cfg_of()
    plan = sg.make_plan(cfg, DIMS, 1, 1, "cpu", total=8 * sg.GIB)
    assert plan.dry and plan.sync[0] == "host_shared_memory"
    assert "CPU dry mode" in plan.lines()[0] and "8.00 GiB" in plan.lines()[0]
    with pytest.raises(UserError, match="this host .CPU dry mode: MemTotal"):
        sg.make_plan(cfg, DIMS, 1, 1, "cpu", total=10 * 2**20)
    monkeypatch.setattr(sg, "host_memory_bytes", lambda: None)
    plan = sg.make_plan(cfg, DIMS, 1, 1, "cpu")
    assert plan.total is None and any("fit check skipped" in line for line in plan.lines())
    assert sg.host_memory_bytes.__module__  # (patched) the real one reads /proc/meminfo:
    monkeypatch.undo()
    if Path("/proc/meminfo").exists():
        assert sg.host_memory_bytes() > 0


# ------------------------------------------------------------------------------------------------ weight sync
def test_weight_sync_choice():
    ok = lambda: (True, "same device")  # noqa: E731
    assert sg.choose_weight_sync("cuda", "shared_memory", ok) == ("cuda_ipc", "same device")
    path, why = sg.choose_weight_sync("cuda", "disk", lambda: (False, "no CUDA device"))
    assert path == "host_disk" and "CUDA IPC unavailable: no CUDA device" in why
    assert sg.choose_weight_sync("cpu", "shared_memory", ok)[0] == "host_shared_memory"  # dry mode: never IPC
    assert sg.choose_weight_sync("cpu", "disk", ok)[0] == "host_disk"


def test_cuda_ipc_availability(monkeypatch):
    monkeypatch.setenv(sg.SYNC_ENV, "host")
    assert sg.cuda_ipc_available() == (False, f"{sg.SYNC_ENV}=host")
    monkeypatch.delenv(sg.SYNC_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sg.cuda_ipc_available() == (False, "no CUDA device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sg.cuda_ipc_available()[0] is True


def test_device_snapshot_is_a_fresh_copy_per_version():
    model = torch.nn.Linear(3, 2)
    snap = sg.device_snapshot(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(snap["weight"], model.weight)  # a worker reading it never sees the next version
    assert snap["weight"].data_ptr() != model.weight.data_ptr()


# ------------------------------------------------------------------------------------------------ per-process caps
def test_memory_fraction_is_set_on_cuda_and_only_logged_in_dry_mode(monkeypatch):
    calls, lines = [], []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sg, "cuda_total_bytes", lambda index=0: 80 * sg.GIB)
    sg.apply_memory_fraction(0.25, "cuda", lines.append)
    assert calls == [(0.25, 0)] and "20.00 GiB" in lines[-1]
    sg.apply_memory_fraction(0.5, "cpu", lines.append)
    assert calls == [(0.25, 0)] and lines[-1] == "share_gpu: memory fraction 0.500 (CPU dry mode: not enforced)"
    monkeypatch.setenv(sg.FRACTION_ENV, "0.125:cuda")
    sg.apply_fraction_from_env(lines.append)
    assert calls[-1] == (0.125, 0)
    monkeypatch.delenv(sg.FRACTION_ENV)
    sg.apply_fraction_from_env(lines.append)  # not a share_gpu worker: nothing
    assert len(calls) == 2


# ------------------------------------------------------------------------------------------------ placement
def test_share_gpu_gives_no_process_a_device_of_its_own_and_passes_each_cap(tmp_path, monkeypatch):
    from stalerl.training.async_source import AdmissionSource
    from stalerl.training.workers.hosting import LocalHosting, Resources

    src = AdmissionSource.__new__(AdmissionSource)
    src.hosting = LocalHosting(tmp_path)
    src.n_train, src.n_rollout = 2, 3
    src.actor_cfg = SimpleNamespace(backend="torch:d2")
    src.rollout = SimpleNamespace(backend="hf:d3")
    src.share_plan = sg.SharePlan("cuda", 2, 3, 0.2, 0.1, 1, 1, 80 * sg.GIB, ("cuda_ipc", "mock"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert src._local_gpu_plan(Resources(gpus=1.0)) == {}  # one device is enough: nothing refused
    assert src._share_env("train/1") == {sg.FRACTION_ENV: "0.2:cuda"}
    assert src._share_env("rollout/2") == {sg.FRACTION_ENV: "0.1:cuda"}
    src.share_plan = None  # without share_gpu: one device per process, refused when short
    with pytest.raises(RuntimeError, match="need 5 GPUs on this machine .one per process., 1 visible"):
        src._local_gpu_plan(Resources(gpus=1.0))
    assert src._share_env("train/1") is None


def test_local_spawn_merges_the_cap_with_the_device_choice(tmp_path, monkeypatch):
    from stalerl.training.workers import hosting

    seen = {}
    monkeypatch.setattr(hosting, "WorkerProcess", lambda role, m, c, kw, q, d, env=None: seen.setdefault(role, env))
    h = hosting.LocalHosting(tmp_path)
    h.spawn("rollout/0", "m", "C", {}, hosting.Resources(), gpu=None, env={sg.FRACTION_ENV: "0.1:cuda"})
    h.spawn("rollout/1", "m", "C", {}, hosting.Resources(), gpu=3)
    assert seen == {"rollout/0": {sg.FRACTION_ENV: "0.1:cuda"}, "rollout/1": {"CUDA_VISIBLE_DEVICES": "3"}}


def test_train_ranks_on_one_device_use_gloo(monkeypatch):
    from stalerl.training.workers import train_worker

    backends = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train_worker.dist, "init_process_group", lambda backend, **kw: backends.append(backend))
    train_worker.init_group(1, 2, "tcp://127.0.0.1:1", 1.0)
    train_worker.init_group(1, 2, "tcp://127.0.0.1:1", 1.0, share_gpu=True)
    assert backends == ["cpu:gloo,cuda:nccl", "gloo"]


def test_a_worker_error_keeps_its_exception_type(tmp_path):
    import threading

    from stalerl.training.async_source import AdmissionSource, FAILURE_GRACE_S  # noqa: F401

    src = AdmissionSource.__new__(AdmissionSource)
    src.cond, src.failure, src.stop_event = threading.Condition(), None, threading.Event()
    src.stop_event.set()  # no watchdog exit in a test
    src.rollout_workers, src.train_workers = [], []
    src._handle(("train/1", "error", None, "NonFiniteLogProbError: log-probs are nan\nTraceback ..."))
    assert src.failure.exc_type == "NonFiniteLogProbError" and src.failure.role == "train/1"
    src.failure = None
    src._handle(("train/1", "error", None, "no type here\nat all"))
    assert src.failure.exc_type is None


# ------------------------------------------------------------------------------------------------ before the run
def test_preflight_fit_check_reads_the_model_size_without_its_weights():
    from stalerl.core.model import load_policy_from_config

    cfg = cfg_of()
    model, _ = load_policy_from_config(cfg)
    assert sg.model_dims_from_config(cfg) == sg.ModelDims.of(model)
    assert sg.device_type_of(cfg) == "cpu"
    assert sg.preflight_problems(cfg) == []
    assert sg.preflight_problems(cfg_of("cluster.share_gpu=false", "rollout.mode=sync")) == []
    (line,) = sg.preflight_problems(cfg_of("cluster.share_gpu_train_fraction=0.0000001"))
    assert line.startswith("cluster.share_gpu=true: the memory split cannot fit on this host (CPU dry mode")
    assert "a train process needs" in line and "\n" not in line


def test_config_validation_refuses_share_gpu_with_a_synchronous_run():
    # Needs stalerl/config/rules.py's _cross_field_problems to add share_gpu_problems (the one-line hook).
    with pytest.raises(ConfigError, match=r"cluster.share_gpu: got true but this run is synchronous.*Fix:"):
        cfg_of("rollout.mode=sync", "rollout.max_head_offpolicyness=0")
    with pytest.raises(ConfigError, match=r"rollout.backend: got 'auto:d1' with cluster.share_gpu=true"):
        cfg_of("rollout.backend=auto:d1")
    # one device is enough for every process: the GPU count rule counts 1, not one per process
    gpu = load_config(["--config", str(YAML), "actor.backend=torch:d2", "rollout.backend=hf:d2"])
    assert gpu.cluster.n_gpus_per_node == 1 and share_gpu_problems(gpu) == []
