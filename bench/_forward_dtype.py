"""What a process's forwards actually ran, observed rather than read from a config (bench/trl_vs_stalerl.py).

Matmul dtype: a wrap of ``nn.Linear.forward`` (a forward hook on every Linear, present or future) records the
Linear's *output* dtype. Under ``torch.autocast`` the Linear's input and weight stay float32 and the matmul runs in
the autocast dtype, so the input dtype tells nothing; the output is the matmul's own result and says which kernel
ran. Each call is weighed by its FLOPs (2 x tokens x in x out), per phase:

- ``decode``: no grad, inside a generate call, one position per row (a decode step with a KV cache);
- ``prefill``: no grad, inside a generate call, more than one position (the prompt pass, or every step of a
  generate that runs without a KV cache);
- ``nograd``: no grad, outside any generate call: an old-log-prob (behaviour) recompute, a reference-model pass, a
  diagnostics pass. "Inside generate" is transformers' ``GenerationMixin.generate`` or stalerl's
  ``HFRolloutEngine.generate`` on the stack (both are wrapped to count it);
- ``train``: grad enabled, outside backward (the training forward);
- ``recompute``: a forward run inside backward (gradient checkpointing recomputing activations).

Per phase it also counts the passes (calls of the median Linear: a decoder layer's projection, called once per
forward of the model) and the tokens those passes covered (padding included), so passes and tokens per step are
measured too.

Sampling: the logits processors transformers' ``generate`` built (``GenerationMixin._get_logits_processor``: class and
parameters, after the model's generation_config was merged in) and the arguments of stalerl's
``HFRolloutEngine.generate`` (temperature, top_k, top_p, greedy); the first prompt rows generate saw, the first
questions stalerl's engine got and the first prompts stalerl's ``PromptFormatter`` wrote.

Cost: one Python call per Linear forward (~8 us under load 10 on this machine; ~0.3% of a SmolLM2-135M step), the
same on both sides.

In a process of its own (TRL's run, stalerl's run and its worker processes) ``bench/_probe_site/sitecustomize.py``
installs all of it when ``STALERL_BENCH_PROBE_DIR`` is set, and the records go to ``<dir>/<pid>.json`` (rewritten at
most every few seconds and at exit, atomically). Only torch is needed; transformers and stalerl are patched when they
are imported.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

PROBE_DIR_ENV = "STALERL_BENCH_PROBE_DIR"
PHASES = ("decode", "prefill", "nograd", "train", "recompute")
WRITE_EVERY_S = 5.0
# processor attributes that are sampling parameters (transformers' warper classes name them so)
SAMPLING_ATTRS = ("temperature", "top_k", "top_p", "min_p", "penalty", "epsilon")
PROMPTS_KEPT = 4  # the first prompt rows / questions a process records (to compare both sides' prompts)
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}


def _in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (a forward there is a checkpoint's recompute)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


_GENERATING = [0]  # depth of generate calls on the stack (one process runs one generate at a time)


def phase_of(inputs: tuple) -> str:
    """The phase of a Linear call (module docstring), from the grad mode, whether a generate call is running, and
    the input's position count."""
    if _in_backward():
        return "recompute"
    if torch.is_grad_enabled():
        return "train"
    if not _GENERATING[0]:
        return "nograd"
    x = inputs[0] if inputs else None
    return "decode" if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[-2] == 1 else "prefill"


class generating:
    """Marks the code inside as generation (``phase_of``); nests."""

    def __enter__(self) -> None:
        _GENERATING[0] += 1

    def __exit__(self, *exc: Any) -> None:
        _GENERATING[0] -= 1


class ForwardRecorder:
    """FLOPs per (phase, output dtype) of every nn.Linear call, and calls/tokens per (phase, module)."""

    def __init__(self) -> None:
        self.flops: dict[str, dict[str, float]] = {}
        self.modules: dict[str, dict[int, list[int]]] = {}  # phase -> id(module) -> [calls, tokens]
        self._handle: Any = None

    def observe(self, module: torch.nn.Module, inputs: tuple, output: Any) -> None:
        if not isinstance(module, torch.nn.Linear) or not isinstance(output, torch.Tensor):
            return
        phase = phase_of(inputs)
        tokens = output.numel() // max(1, module.out_features)
        per_dtype = self.flops.setdefault(phase, {})
        name = str(output.dtype).removeprefix("torch.")
        per_dtype[name] = per_dtype.get(name, 0.0) + 2.0 * tokens * module.in_features * module.out_features
        slot = self.modules.setdefault(phase, {}).setdefault(id(module), [0, 0])
        slot[0] += 1
        slot[1] += tokens

    def install(self, after: Optional[Callable[[], None]] = None) -> "ForwardRecorder":
        """Wraps ``nn.Linear.forward`` (every Linear of every model in the process, present or future); ``after``
        runs after each recorded call. A class-level wrap rather than ``register_module_forward_hook``: a global
        hook sends every module call (norms, activations, containers) through the slow hook path, which cost ~10x
        more per step here; wrapping the Linear's forward costs only the Linear calls, the same on both sides."""
        if self._handle is not None:
            raise RuntimeError("ForwardRecorder is installed already")
        forward = torch.nn.Linear.forward
        observe = self.observe

        @functools.wraps(forward)
        def recorded_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            out = forward(module, x)
            observe(module, (x,), out)
            if after is not None:
                after()
            return out

        torch.nn.Linear.forward = recorded_forward
        self._handle = forward
        return self

    def remove(self) -> None:
        if self._handle is not None:
            torch.nn.Linear.forward = self._handle
            self._handle = None

    def summary(self) -> dict:
        """JSON-able: {"flops": {phase: {dtype: flops}}, "passes": {phase: n}, "tokens": {phase: n}}."""
        passes, tokens = {}, {}
        for phase, mods in self.modules.items():
            # the median Linear: a model's layers outnumber the odd one out (an lm_head called in chunks for the
            # log-probs, or on the kept positions only), so the median is a decoder layer's projection: one call
            # per forward of the model, over all of that forward's positions
            ordered = sorted(mods.values())
            passes[phase], tokens[phase] = ordered[len(ordered) // 2]
        return {"flops": {p: dict(d) for p, d in self.flops.items()}, "passes": passes, "tokens": tokens}


class SamplingRecorder:
    """The sampling each generate call applied (counted per distinct setting) and the first prompts it saw."""

    def __init__(self) -> None:
        self.hf_processors: dict[str, int] = {}  # json of [[class, {param: value}], ...] -> calls
        self.engine_calls: dict[str, int] = {}  # json of stalerl engine.generate's sampling kwargs -> calls
        self.first_prompts: list[list[int]] = []
        self.first_questions: list[str] = []
        self.first_prompt_texts: list[str] = []

    def record_processors(self, processors: Iterable[Any], generation_config: Any = None) -> None:
        items = [[type(p).__name__, {a: _plain(getattr(p, a)) for a in SAMPLING_ATTRS if hasattr(p, a)}]
                 for p in processors]
        if generation_config is not None:
            items.insert(0, ["do_sample", {"value": bool(getattr(generation_config, "do_sample", False))}])
        key = json.dumps(items, sort_keys=True)
        self.hf_processors[key] = self.hf_processors.get(key, 0) + 1

    def record_engine(self, kwargs: dict, questions: Any = None) -> None:
        if not self.first_questions and questions is not None:
            self.first_questions = [str(q) for q in list(questions)[:PROMPTS_KEPT]]
        picked = {k: _plain(kwargs.get(k, d)) for k, d in
                  (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("greedy", False))}
        key = json.dumps(picked, sort_keys=True)
        self.engine_calls[key] = self.engine_calls.get(key, 0) + 1

    def record_prompt_text(self, text: Any) -> None:
        kept = self.first_prompt_texts
        if len(kept) < PROMPTS_KEPT and isinstance(text, str) and text not in kept:
            kept.append(text)

    def record_prompts(self, input_ids: Any, attention_mask: Any) -> None:
        if self.first_prompts or not isinstance(input_ids, torch.Tensor):
            return
        for i in range(input_ids.shape[0]):  # the first distinct rows (a group repeats its prompt)
            row = input_ids[i]
            if isinstance(attention_mask, torch.Tensor):
                row = row[attention_mask[i].bool()]
            ids = [int(t) for t in row]
            if ids not in self.first_prompts:
                self.first_prompts.append(ids)
            if len(self.first_prompts) == PROMPTS_KEPT:
                break

    def summary(self) -> dict:
        return {"hf_processors": dict(self.hf_processors), "engine_calls": dict(self.engine_calls),
                "first_prompts": self.first_prompts, "first_questions": self.first_questions,
                "first_prompt_texts": self.first_prompt_texts}


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, float) and v == float("-inf"):
        return "-inf"
    return v if isinstance(v, (int, float, bool, str, type(None), list)) else repr(v)


# ---------------------------------------------------------------------------------------------------------------------
# installing in a process: the hook, the patches applied when transformers / stalerl are imported, the record file


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after one of the named modules is executed (a post-import hook)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]):
        self.patches = patches

    def find_spec(self, name, path, target=None):  # noqa: ANN001 (importlib's protocol)
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # this loader instance belongs to this module only
        return spec


def patch_transformers(module: Any, sampling: SamplingRecorder) -> None:
    mixin = module.GenerationMixin
    build, generate = mixin._get_logits_processor, mixin.generate

    @functools.wraps(build)
    def _get_logits_processor(self, generation_config, *args, **kwargs):  # noqa: ANN001
        out = build(self, generation_config, *args, **kwargs)
        sampling.record_processors(out, generation_config)
        return out

    @functools.wraps(generate)
    def generate_(self, *args, **kwargs):  # noqa: ANN001
        sampling.record_prompts(kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask"))
        with generating():
            return generate(self, *args, **kwargs)

    mixin._get_logits_processor = _get_logits_processor
    mixin.generate = generate_


def patch_stalerl_prompts(module: Any, sampling: SamplingRecorder) -> None:
    cls = getattr(module, "PromptFormatter", None)
    if cls is None:
        return
    fmt = cls.format

    @functools.wraps(fmt)
    def format_(self, question, *args, **kwargs):  # noqa: ANN001
        out = fmt(self, question, *args, **kwargs)
        sampling.record_prompt_text(out)
        return out

    cls.format = format_


def patch_stalerl_engine(module: Any, sampling: SamplingRecorder) -> None:
    cls = getattr(module, "HFRolloutEngine", None)
    if cls is None:
        return
    generate = cls.generate

    @functools.wraps(generate)
    def generate_(self, *args, **kwargs):  # noqa: ANN001
        sampling.record_engine(kwargs, kwargs.get("questions", args[0] if args else None))
        with generating():
            return generate(self, *args, **kwargs)

    cls.generate = generate_


class ProcessProbe:
    """Forward and sampling records of this process, written to ``<out_dir>/<pid>.json``."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.path = Path(out_dir) / f"{os.getpid()}.json"
        self.forward = ForwardRecorder()
        self.sampling = SamplingRecorder()
        self._last_write = 0.0

    def install(self) -> "ProcessProbe":
        patches = {"transformers.generation.utils": lambda m: patch_transformers(m, self.sampling),
                   "stalerl.rollout.engine": lambda m: patch_stalerl_engine(m, self.sampling),
                   "stalerl.core.model": lambda m: patch_stalerl_prompts(m, self.sampling)}
        for name, patch in list(patches.items()):
            if name in sys.modules:  # already imported: patch now
                patch(sys.modules[name])
                patches.pop(name)
        sys.meta_path.insert(0, _PatchOnImport(patches))
        self.forward.install(after=self._maybe_write)
        atexit.register(self.write)
        return self

    def _maybe_write(self) -> None:
        now = time.monotonic()
        if now - self._last_write > WRITE_EVERY_S:  # a worker may be killed rather than exit: keep the file fresh
            self._last_write = now
            self.write()

    def write(self) -> None:
        data = {"pid": os.getpid(), "argv": sys.argv[:3], **self.forward.summary(), **self.sampling.summary()}
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:  # the bench's directory is gone (it finished): nothing to keep
            pass


def install_from_env() -> Optional[ProcessProbe]:
    out = os.environ.get(PROBE_DIR_ENV)
    return ProcessProbe(out).install() if out else None


# ---------------------------------------------------------------------------------------------------------------------
# reading the records of one run (all its processes) and checking them


def merge_records(records: list[dict]) -> dict:
    """One run's processes added up: FLOPs, passes and tokens per phase are sums (processes do different work:
    async's rollout worker generates, its trainer trains); sampling settings are counted over all."""
    out: dict = {"flops": {}, "passes": {}, "tokens": {}, "hf_processors": {}, "engine_calls": {},
                 "first_prompts": [], "first_questions": [], "first_prompt_texts": []}
    for r in records:
        for phase, per_dtype in r.get("flops", {}).items():
            acc = out["flops"].setdefault(phase, {})
            for dtype, f in per_dtype.items():
                acc[dtype] = acc.get(dtype, 0.0) + f
        for key in ("passes", "tokens"):
            for phase, n in r.get(key, {}).items():
                out[key][phase] = out[key].get(phase, 0) + n
        for key in ("hf_processors", "engine_calls"):
            for k, n in r.get(key, {}).items():
                out[key][k] = out[key].get(k, 0) + n
        for key in ("first_prompts", "first_questions", "first_prompt_texts"):
            if not out[key] and r.get(key):
                out[key] = r[key]
    return out


def read_records(directory: str | os.PathLike) -> dict:
    return merge_records([json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))])


def dtype_shares(flops: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per phase: each dtype's share of that phase's matmul FLOPs."""
    out = {}
    for phase, per_dtype in flops.items():
        total = sum(per_dtype.values())
        if total > 0:
            out[phase] = {d: f / total for d, f in sorted(per_dtype.items())}
    return out


def check_forward_dtype(flops: dict[str, dict[str, float]], claimed: str, min_share: float = 0.75) -> list[str]:
    """Problems (empty: the claim holds): a phase whose matmul FLOPs are less than ``min_share`` in the claimed dtype,
    or no forward observed at all. ``min_share`` < 1 lets a model keep a small part in float32 (an lm_head cast up,
    ~20% of SmolLM2-135M's FLOPs) while a whole forward in the wrong dtype fails."""
    shares = dtype_shares(flops)
    if not shares:
        return [f"no nn.Linear forward was observed (claimed {claimed}): the probe did not run in this process"]
    problems = []
    for phase, per_dtype in shares.items():
        got = per_dtype.get(claimed, 0.0)
        if got < min_share:
            seen = ", ".join(f"{d} {s:.0%}" for d, s in per_dtype.items())
            problems.append(f"{phase} forward: {got:.0%} of the matmul FLOPs in {claimed} (claimed), need >= "
                            f"{min_share:.0%}; observed {seen}")
    return problems


def format_shares(flops: dict[str, dict[str, float]]) -> str:
    shares = dtype_shares(flops)
    return "; ".join(f"{phase} " + "/".join(f"{d} {s:.0%}" for d, s in shares[phase].items())
                     for phase in PHASES if phase in shares)


# ---------------------------------------------------------------------------------------------------------------------
# sampling: the model's generation_config made explicit, and what a run actually applied


def resolve_sampling(model_generation_config: dict, temperature: Optional[float] = None,
                     top_k: Optional[int] = None, top_p: Optional[float] = None) -> dict:
    """The sampling both systems are given explicitly: a value passed here, else the model's
    ``generation_config.json`` (transformers merges it into every ``generate`` that does not override it), else
    the neutral value (no truncation, temperature 1). transformers' own global default ``top_k=50`` is NOT a
    fallback: a system that passes ``top_k`` explicitly never gets it, so neither side may depend on it."""
    gc = model_generation_config or {}
    chosen = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": None, "repetition_penalty": None}
    out = {}
    for key, neutral in NEUTRAL_SAMPLING.items():
        value = chosen[key]
        if value is None:
            value = gc.get(key)
        out[key] = neutral if value is None else value
    out["top_k"] = int(out["top_k"] or 0)
    return out


def sampling_from_processors(items: list) -> dict:
    """The effective sampling of one ``_get_logits_processor`` record (``SamplingRecorder.record_processors``)."""
    out = dict(NEUTRAL_SAMPLING)
    out["greedy"] = False
    for name, params in items:
        if name == "do_sample":
            out["greedy"] = not params["value"]
        elif name == "TemperatureLogitsWarper":
            out["temperature"] = float(params["temperature"])
        elif name == "TopKLogitsWarper":
            out["top_k"] = int(params["top_k"])
        elif name == "TopPLogitsWarper":
            out["top_p"] = float(params["top_p"])
        elif name == "MinPLogitsWarper":
            out["min_p"] = float(params["min_p"])
        elif name == "RepetitionPenaltyLogitsProcessor":
            out["repetition_penalty"] = float(params["penalty"])
        else:  # any other processor changes what is sampled: keep it visible
            out.setdefault("other", []).append(name)
    return out


def effective_sampling(record: dict) -> list[dict]:
    """Every distinct sampling a run applied. stalerl's engine asks transformers for plain sampling (temperature 1,
    no truncation) and applies its own warpers from its generate arguments, so for an engine call the effective
    setting is those arguments plus whatever transformers added (a processor there is an extra one)."""
    hf = [sampling_from_processors(json.loads(k)) for k in record.get("hf_processors", {})]
    if not record.get("engine_calls"):
        return _distinct(hf)
    extra = [h for h in hf if any(h[k] != v for k, v in NEUTRAL_SAMPLING.items()) or h.get("other")]
    out = []
    for key in record["engine_calls"]:
        e = json.loads(key)
        s = {**NEUTRAL_SAMPLING, "temperature": float(e["temperature"]), "top_k": int(e["top_k"] or 0),
             "top_p": float(e["top_p"]), "greedy": bool(e["greedy"])}
        if extra:
            s["other"] = [f"transformers also applied {x}" for x in extra]
        out.append(s)
    return _distinct(out)


def _distinct(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for s in items:
        key = json.dumps(s, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def sampled_settings(record: dict) -> list[dict]:
    """The sampled (non-greedy) settings of a run: the ones that generated its training batches."""
    return [s for s in effective_sampling(record) if not s.get("greedy")]


def check_sampling(record: dict, expected: dict, who: str) -> list[str]:
    """Problems: the run sampled with anything other than ``expected`` (resolve_sampling's), or never sampled."""
    got = sampled_settings(record)
    if not got:
        return [f"{who}: no sampled generate call was observed"]
    want = {k: expected[k] for k in NEUTRAL_SAMPLING}
    return [f"{who} sampled with {format_sampling(s)}, expected {format_sampling(want)}" for s in got
            if {k: s.get(k) for k in NEUTRAL_SAMPLING} != want or s.get("other")]


def format_sampling(s: dict) -> str:
    text = (f"temperature {s['temperature']:g}, top_k {s['top_k']}, top_p {s['top_p']:g}, min_p {s['min_p']}, "
            f"repetition_penalty {s['repetition_penalty']:g}")
    return text + (f" + {s['other']}" if s.get("other") else "")
