"""The GPU check's measurements beyond the real-scale run (scripts/gpu_check.sh, part 3), one JSON object:

* ``logprob``: the training log-prob pass (forward + backward) at Qwen2.5-1.5B's head shape (hidden 1536, vocab
  151,936) over one micro-batch of tokens (``examples/math/gsm8k_m2po.yaml``'s ``actor.mb_spec.max_tokens_per_mb``,
  8,192), chunked (``stalerl.core.chunked_logprob``, the device's chunk) against plain (``F.linear`` +
  ``stalerl.training.actor.token_logprobs``), in the run's compute dtype (bf16 autocast on CUDA); best of a few
  passes, and the peak memory each adds (CUDA allocator). On CUDA the memory ratio is a checked entry:
  ``chunked_peak / plain_peak <= MEMORY_RATIO_MAX``: the plain pass holds the (tokens x vocab) bf16 logits, their
  float32 copy and its gradient (>= 10 bytes per logit: 12.4 GB at 8,192 x 151,936), the chunked one a chunk's
  temporaries (3 x 2^28 x 4 bytes at the cap) and the weight gradient (0.9 GiB); measured 3.6 vs 36.6 GiB at 16,384
  tokens on an H200. CPU dry mode: hidden 64, 64 tokens, no memory figure (recorded as not measured).
* ``vllm``: generation tokens/s of stalerl's vLLM engine with CUDA graphs (``enforce_eager=false``, the CUDA
  default) and without (``enforce_eager=true``), each engine in its own process; the weight-sync path it chose
  (``ipc`` colocated on CUDA, ``reload`` on the CPU build) and that path's time per sync. Skipped, and said so, where
  vLLM is not importable (the bare CUDA image has none) or ``STALERL_CHECK_VLLM=0``.
* ``nccl``: the path of asynchronous rollout workers on their own GPUs (stalerl.rollout.vllm_nccl): a worker
  process's engine on GPU 1 joins this process's group on GPU 0, receives two versions and generates; time per
  sync. Needs vLLM and two GPUs; skipped, and said so, otherwise.

    python scripts/gpu_check_bench.py --device cuda|cpu --model DIR --out JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
HEAD_SHAPE = {"cuda": dict(hidden=1536, vocab=151_936),  # tokens: the shipped config's micro-batch (config_tokens)
              "cpu": dict(hidden=64, vocab=151_936, tokens=64)}
MEMORY_RATIO_MAX = 0.5  # chunked peak / plain peak on CUDA (the docstring's sizes give ~0.3 at 8,192 tokens)


def config_tokens(config: Path = REPO / "examples/math/gsm8k_m2po.yaml") -> int:
    """Tokens of one training micro-batch in the shipped GPU config (actor.mb_spec.max_tokens_per_mb)."""
    from stalerl.config import load_config

    return int(load_config(["--config", str(config)]).actor.mb_spec.max_tokens_per_mb)


def memory_entry(chunked_gib: Optional[float], plain_gib: Optional[float]) -> dict[str, Any]:
    """The checked memory ratio (CUDA): a missing figure fails it too."""
    ratio = chunked_gib / plain_gib if chunked_gib is not None and plain_gib else float("nan")
    ok = ratio == ratio and ratio <= MEMORY_RATIO_MAX
    return {"check": "bench/logprob_memory", "dtype": "bfloat16", "quantity": "chunked peak / plain peak",
            "error": ratio, "tolerance": MEMORY_RATIO_MAX, "comparison": "<=", "passed": bool(ok),
            "rule": "the plain head's (tokens x vocab) logits, their float32 copy and gradient against one chunk's "
                    "temporaries and the weight gradient: at most half"}
GEN = {"cuda": dict(prompts=64, n=1, max_new_tokens=128), "cpu": dict(prompts=2, n=1, max_new_tokens=4)}
CHILD_TIMEOUT_S = 100  # one engine: start (CUDA graph capture included), two generations, two syncs


def _recv(conn, what: str, timeout_s: float = CHILD_TIMEOUT_S):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the nccl worker process sent no {what} within {timeout_s:.0f}s")
    return conn.recv()


# ------------------------------------------------------------------------------------------------ log-probs
def _timed(fn: Callable[[], Any], device: str, repeats: int) -> tuple[float, Optional[float]]:
    """Best wall time of ``repeats`` calls after one warm-up, and the CUDA peak memory one call adds (GiB)."""
    import torch

    fn()
    best = float("inf")
    peak = None
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        best = min(best, time.perf_counter() - start)
    return best, peak


def logprob_bench(device: str, repeats: int = 3) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from stalerl.core.chunked_logprob import chunked_token_logprobs, default_chunk_tokens
    from stalerl.core.model import autocast_context
    from stalerl.training.actor import token_logprobs

    shape = dict(HEAD_SHAPE[device])
    shape.setdefault("tokens", config_tokens())
    dev = torch.device(device)
    dtype = "bfloat16" if device == "cuda" else "float32"
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(shape["tokens"], shape["hidden"], device=dev, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(shape["vocab"], shape["hidden"], device=dev, generator=g) * 0.02).requires_grad_()
    ids = torch.randint(0, shape["vocab"], (shape["tokens"],), device=dev, generator=g)

    def step(chunked: bool) -> Callable[[], None]:
        def run() -> None:
            h.grad = w.grad = None
            with autocast_context(dev, dtype):
                if chunked:
                    lp = chunked_token_logprobs(h, w, ids)
                else:
                    lp = token_logprobs(F.linear(h, w).unsqueeze(0), ids.unsqueeze(0)).squeeze(0)
            lp.sum().backward()
        return run

    chunked_s, chunked_peak = _timed(step(True), device, repeats)
    plain_s, plain_peak = _timed(step(False), device, repeats)
    out = {"run": True, "device": device, "dtype": dtype, **shape,
           "chunk_tokens": default_chunk_tokens(dev, shape["vocab"]), "chunked_s": chunked_s, "plain_s": plain_s,
           "time_ratio": chunked_s / plain_s if plain_s > 0 else None}
    if chunked_peak is not None:
        out.update(chunked_peak_gib=chunked_peak, plain_peak_gib=plain_peak)
    if device == "cuda":
        out["entries"] = [memory_entry(chunked_peak, plain_peak)]
        out["ok"] = out["entries"][0]["passed"]
        if not out["ok"]:
            out["why"] = (f"chunked / plain peak memory {out['entries'][0]['error']:.3g} > {MEMORY_RATIO_MAX} "
                          "(or not measured)")
    else:
        out["memory"] = "not measured on CPU (the CUDA allocator's peaks)"
    return out


# ------------------------------------------------------------------------------------------------ vLLM
def vllm_skip_reason(device: str, n_gpus: int, need_gpus: int = 1) -> Optional[str]:
    """Why a vLLM measurement does not run here (None: it runs)."""
    import importlib.util

    if os.environ.get("STALERL_CHECK_VLLM", "1") == "0":
        return "STALERL_CHECK_VLLM=0"
    if importlib.util.find_spec("vllm") is None:
        import torch

        return (f"vLLM is not importable here: this image has torch {torch.__version__} and no vLLM; vLLM 0.32-0.34 "
                "pin torch 2.13 / 2.14 (several GB of wheels) and the GPU machine has no package registry, so it "
                "cannot be installed there; the GPU vLLM path is tested on CPU only (docs/gpu.md, 'vLLM on the GPU': "
                "the commands to run where a registry is reachable)")
    if device == "cuda" and n_gpus < need_gpus:
        return f"needs {need_gpus} GPUs, {n_gpus} visible"
    return None


def _options(enforce_eager: Optional[bool]):
    import dataclasses

    from stalerl.config import load_config

    o = load_config(["--config", str(REPO / "examples/math/gsm8k_m2po.yaml"), "rollout.backend=vllm:d1"]).rollout.vllm
    return dataclasses.replace(o, enforce_eager=enforce_eager, gpu_memory_utilization=0.3, max_model_len=512)


def _policy(model_dir: Path, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(device)
    return model, AutoTokenizer.from_pretrained(model_dir)


def _engine(model, tok, work: Path, options, *, track_source: bool):
    from stalerl.core.model import PromptFormatter
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward, options=options, work_dir=work,
                             seed=0, max_num_seqs=64, track_source=track_source, actor_dtype="bfloat16",
                             max_seq_len=512)


def _generate_rate(engine, device: str) -> tuple[float, int]:
    g = GEN[device]
    questions = [f"What is {i} + {i + 1}?" for i in range(g["prompts"])]
    start = time.perf_counter()
    batch = engine.generate(questions, ["0"] * len(questions), n_samples=g["n"], max_new_tokens=g["max_new_tokens"],
                            temperature=1.0, seeds=list(range(len(questions))))
    seconds = time.perf_counter() - start
    return batch.num_response_tokens / seconds, int(batch.num_response_tokens)


def vllm_variant(device: str, model_dir: Path, work: Path, enforce_eager: bool) -> dict[str, Any]:
    """One engine in this process: start (synchronous loop's engine, track_source), tokens/s, two weight syncs."""
    import torch

    model, tok = _policy(model_dir, device)
    engine = _engine(model, tok, work, _options(enforce_eager), track_source=True)
    start = time.perf_counter()
    engine.set_version(0)  # starts vLLM from the module's weights
    start_s = time.perf_counter() - start
    _generate_rate(engine, device)  # warm-up (first-call compilation)
    rate, tokens = _generate_rate(engine, device)
    syncs = []
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0 + 1e-3)  # new weights, as after an optimizer step
        engine.set_version(version)
        syncs.append(engine.last_sync_seconds)
    engine.close()
    return {"enforce_eager": engine.options.enforce_eager, "start_s": start_s, "tokens": tokens,
            "tokens_per_s": rate, "weight_sync": engine.weight_sync, "sync_s": syncs}


def vllm_bench(device: str, model_dir: Path, work: Path, n_gpus: int) -> dict[str, Any]:
    why = vllm_skip_reason(device, n_gpus)
    if why:
        return {"run": False, "why": why}
    variants = [False, True] if device == "cuda" else [True]  # the CPU build has no CUDA graphs
    out: dict[str, Any] = {"run": True, "variants": []}
    for eager in variants:
        variant = "eager" if eager else "graphs"
        out["variants"].append(_child(variant, device, model_dir, work / f"vllm-{variant}"))
    if device != "cuda":
        out["graphs"] = "not on the CPU build (no CUDA graphs there)"
    return out


def nccl_worker(device_index: int, model_dir: str, work: str, conn) -> None:
    """The rollout worker's side, in its own process on GPU ``device_index``: an engine that chose nccl."""
    # Before CUDA starts here: vLLM's in-process worker takes cuda:0 of what it sees (as a rollout worker's does)
    os.environ["CUDA_VISIBLE_DEVICES"] = str(device_index)
    model, tok = _policy(Path(model_dir), "cpu")  # the worker holds its HF model on the host (rollout_worker)
    engine = _engine(model, tok, Path(work), _options(None), track_source=False)
    conn.send(("path", engine.weight_sync))
    engine.init_weight_transfer(conn.recv())
    for _ in range(2):
        version, info = conn.recv()
        start = time.perf_counter()
        engine.receive_weights(info, version)
        conn.send(("synced", version, time.perf_counter() - start))
    rate, tokens = _generate_rate(engine, "cuda")
    conn.send(("generated", rate, tokens))


def nccl_bench(model_dir: Path, work: Path, n_gpus: int) -> dict[str, Any]:
    why = vllm_skip_reason("cuda", n_gpus, need_gpus=2)
    if why:
        return {"run": False, "why": why}
    import multiprocessing as mp

    import torch

    from stalerl.rollout.vllm_nccl import NCCLWeightSender, snapshot_parameters, update_info_for, worker_init_info
    from stalerl.training.async_source import free_port

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=nccl_worker, args=(1, str(model_dir), str(work), child), daemon=True)
    proc.start()
    try:
        _, path = _recv(parent, "engine start")
        if path != "nccl":
            return {"run": True, "ok": False, "why": f"the worker's engine chose {path!r}, not nccl"}
        torch.cuda.set_device(0)
        model, _ = _policy(model_dir, "cuda")
        info = worker_init_info("127.0.0.1", free_port(), 1)
        parent.send(info)
        sender = NCCLWeightSender(info, torch.device("cuda", 0))
        sender.connect()
        syncs = []
        for version in (1, 2):
            params = snapshot_parameters(model, torch.bfloat16)
            parent.send((version, update_info_for(params)))  # the receive command first, as the controller does
            sender.submit(version, params)
            _, got, seconds = _recv(parent, f"receipt of version {version}")
            syncs.append(seconds)
        _, rate, tokens = _recv(parent, "generation")
        sender.close()
        return {"run": True, "ok": True, "weight_sync": "nccl", "sync_s": syncs,
                "broadcast_s": [s for _, s in sender.sent], "tokens_per_s": rate, "tokens": tokens}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------------------------------------------ driver
def _guarded(part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A measurement's result, or its failure as a result (the other measurements still run and are reported)."""
    import traceback

    try:
        return part()
    except Exception as exc:  # noqa: BLE001 - named in the report, which then fails
        return {"run": True, "ok": False, "why": f"{type(exc).__name__}: {exc}",
                "tail": traceback.format_exc()[-1500:]}


def bench_problems(bench: dict[str, Any]) -> list[str]:
    """The measurements that ran and failed (a skipped one is not a problem: its reason is printed)."""
    out = []
    for name, part in bench.items():
        for v in (part or {}).get("variants", [part or {}]):
            if v.get("ok") is False:
                out.append(f"measurement {name} failed: {v.get('why') or v.get('tail', '')[-300:]}")
    return out


def child_argv(variant: str, device: str, model_dir: Path, out: Path) -> list[str]:
    return ["--device", device, "--model", str(model_dir), "--out", str(out), "--vllm-variant", variant]


def _child(variant: str, device: str, model_dir: Path, work: Path) -> dict[str, Any]:
    """A vLLM measurement in a fresh process (an engine's GPU memory is only given back when its process ends)."""
    work.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, __file__, *child_argv(variant, device, model_dir, work / "result.json")],
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    result = work / "result.json"
    if res.returncode != 0 or not result.is_file():
        return {"ok": False, "exit_code": res.returncode, "tail": (res.stdout + res.stderr)[-1500:]}
    return {"ok": True, **json.loads(result.read_text())}


def format_bench(bench: dict[str, Any]) -> list[str]:
    """The report's lines for these measurements (scripts/gpu_check_report.py prints them)."""
    lines = []
    lp = bench.get("logprob") or {}
    if lp.get("ok") is False:
        lines.append(f"  log-probs: FAILED: {lp.get('why')}")
    elif lp.get("run"):
        mem = (f"; peak +{lp['chunked_peak_gib']:.2f} vs +{lp['plain_peak_gib']:.2f} GiB "
               f"(ratio {lp['chunked_peak_gib'] / max(lp['plain_peak_gib'], 1e-12):.3g} <= {MEMORY_RATIO_MAX})"
               if "chunked_peak_gib" in lp else "")
        lines.append(f"  log-probs fwd+bwd, {lp['tokens']} tokens x hidden {lp['hidden']} x vocab {lp['vocab']} "
                     f"({lp['dtype']}): chunked ({lp['chunk_tokens']} tokens/chunk) {lp['chunked_s']:.4g} s, plain "
                     f"{lp['plain_s']:.4g} s ({lp['time_ratio']:.2f}x){mem}")
    for name in ("vllm", "nccl"):
        part = bench.get(name) or {}
        if not part.get("run"):
            lines.append(f"  {name}: not run: {part.get('why', 'not measured')}")
            continue
        for v in part.get("variants", [part]):
            if not v.get("ok", True):
                lines.append(f"  {name}: FAILED: {v.get('why') or v.get('tail', '')[-300:]}")
                continue
            graphs = "" if "enforce_eager" not in v else (" without CUDA graphs" if v["enforce_eager"]
                                                          else " with CUDA graphs")
            syncs = ", ".join(f"{s:.3g}" for s in v.get("sync_s", []))
            lines.append(f"  {name}{graphs}: {v['tokens_per_s']:.4g} generated tokens/s; weight sync "
                         f"{v.get('weight_sync')}: {syncs} s per sync")
        if part.get("graphs"):
            lines.append(f"  {name} with CUDA graphs: {part['graphs']}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--model", type=Path, required=True, help="the real-scale model directory (smoke_assets.py)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vllm-variant", choices=("eager", "graphs"), help=argparse.SUPPRESS)  # internal: a child
    args = ap.parse_args(argv)
    if args.vllm_variant:  # a child: one vLLM engine
        result = vllm_variant(args.device, args.model, args.out.parent, enforce_eager=args.vllm_variant == "eager")
        args.out.write_text(json.dumps(result))
        return 0
    import torch

    n_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    work = args.out.parent / "bench"
    def no_model(need_gpus: int) -> Optional[dict[str, Any]]:  # the vLLM parts' model: the real-scale part's
        if vllm_skip_reason(args.device, n_gpus, need_gpus) or (args.model / "config.json").is_file():
            return None  # the part itself says why it is skipped, or runs
        return {"run": False, "why": f"no model at {args.model} (the real-scale part, which builds it, was skipped "
                                     "or cut)"}

    bench = {"logprob": _guarded(lambda: logprob_bench(args.device)),
             "vllm": no_model(1) or _guarded(lambda: vllm_bench(args.device, args.model, work, n_gpus)),
             "nccl": ((no_model(2) or _guarded(lambda: nccl_bench(args.model, work / "nccl", n_gpus)))
                      if args.device == "cuda" else {"run": False, "why": "CUDA only (NCCL between two GPUs)"})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(bench, indent=2))
    print("\n".join(["gpu_check bench:"] + format_bench(bench)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
