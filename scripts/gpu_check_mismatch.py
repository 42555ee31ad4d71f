"""The GPU check's engine-mismatch control (scripts/gpu_check.sh, part real_model, beside the bf16 run): is the probe
that logs ``mismatch/*`` able to see a difference, and how large is the engine's?

One batch is generated with the run's HF engine (the trainer's own module under ``actor.dtype``'s autocast,
KV-cached ``generate``, the sampled tokens' log-probs recorded), then scored by the trainer's no-grad pass exactly as
``stats_logger.mismatch_freq_steps`` does (``Actor.compute_logp``: full sequences, ``use_cache=False``, the chunked
head, the config's micro-batches), and compared with :func:`stalerl.training.mismatch.engine_mismatch`, the probe's
own function. Then the *same batch* is re-scored three more times, each differing from the trainer's pass in one
thing only, and compared with it by the same function (the positive controls):

* ``float32``: the trainer's pass in float32 instead of bf16 (must differ: by a bf16 rounding of the logits and the
  residual stream, nonzero and of the bf16 mismatch's order; this is the control that must see something);
* ``micro_batch``: one row per micro-batch (other padded widths, other GEMM shapes);
* ``plain_head``: the plain logits path instead of the chunked head.

The last two are bf16 passes that compute the same values by another route: on a CPU they differ by bf16 roundings,
on CUDA they may be bit-identical (batch-invariant kernels; the plain head rounds the logits to bf16 exactly as the
chunked head does), so they are reported (nonzero or not) and bounded, not required to differ.

Entries (the numerics' format: error, tolerance, rule, passed):

* ``mismatch_control/float32_rescore``: ``MISMATCH_CONTROL_MIN <= mean |d| <= BF16_MISMATCH_MAX``;
* ``mismatch_control/micro_batch``, ``.../plain_head``: ``mean |d| <= BF16_MISMATCH_MAX``;
* ``mismatch_control/engine_vs_trainer``: the engine's mismatch, ``mean |d| <= BF16_MISMATCH_MAX`` (bf16 engines;
  float32: ``FP32_MISMATCH_TOL``); an exact 0 in bf16 is a warning (the float32 control then says whether the
  comparison could have seen a difference).

The batch's per-token figures (row, position, token id, engine and trainer log-probs, each control's) are written to
``--tokens JSON``: the raw evidence behind the mismatch figures.

    python scripts/gpu_check_mismatch.py --config CONFIG --out JSON --tokens JSON [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
# Bounds on the engine-vs-trainer mean |d| (mismatch/abs_mean). bf16: the largest measured with the HF engine is
# 0.024 (SmolLM2-135M, CPU dry mode; 0.0076 at the Qwen2.5-1.5B shape on an H200, 0 on SmolLM2 there): 4x the
# largest, rounded up. A broken engine (other weights, another temperature, a shifted token) is at 0.3 or more
# (tests/unit/test_gpu_check_mismatch.py). float32: scripts/gpu_check_report.py's FP32_MISMATCH_TOL.
BF16_MISMATCH_MAX = 0.1
FP32_MISMATCH_TOL = 1e-4
# The float32 re-scoring of a bf16 pass must differ by at least this (a bf16 rounding of logits ~10 is ~0.02; the
# measured control on CPU is ~0.02): below it the comparison is blind.
MISMATCH_CONTROL_MIN = 1e-4
CONTROLS = ("float32", "micro_batch", "plain_head")


def _entry(check: str, dtype: str, error: float, tolerance: float, rule: str, *, at_least: Optional[float] = None,
           **extra: Any) -> dict[str, Any]:
    import math

    ok = math.isfinite(error) and error <= tolerance and (at_least is None or error >= at_least)
    comparison = "<=" if at_least is None else f">= {at_least:g} and <="
    return {"check": check, "dtype": dtype, "quantity": "mismatch/abs_mean", "error": float(error),
            "tolerance": float(tolerance), "comparison": comparison, "rule": rule, "passed": bool(ok), **extra}


def control_entries(dtype: str, engine: dict[str, float], controls: dict[str, dict[str, float]]) -> list[dict]:
    """The entries of one control run (pure: the unit tests feed it figures)."""
    out = []
    bound = BF16_MISMATCH_MAX if dtype == "bfloat16" else FP32_MISMATCH_TOL
    out.append(_entry("mismatch_control/engine_vs_trainer", dtype, engine.get("mismatch/abs_mean", float("nan")),
                      bound, "the engine's log-probs against the trainer's pass (the probe's comparison); bf16: 4x "
                      "the largest measured (0.024), float32: both sides compute in float32",
                      tokens=engine.get("mismatch/tokens"), max_abs=engine.get("mismatch/max_abs")))
    if dtype != "bfloat16":
        return out
    for name in CONTROLS:
        got = controls.get(name) or {}
        err = got.get("mismatch/abs_mean", float("nan"))
        if name == "float32":
            out.append(_entry(f"mismatch_control/{name}_rescore", dtype, err, BF16_MISMATCH_MAX,
                              "the same batch re-scored in float32 against the bf16 pass must differ (nonzero, of a "
                              "bf16 rounding's size): the comparison can see a bf16-size difference",
                              at_least=MISMATCH_CONTROL_MIN, max_abs=got.get("mismatch/max_abs")))
        else:
            out.append(_entry(f"mismatch_control/{name}", dtype, err, BF16_MISMATCH_MAX,
                              "the same batch re-scored in bf16 by another route (reported; may be exactly 0 on "
                              "CUDA's batch-invariant kernels)", nonzero=bool(err > 0),
                              max_abs=got.get("mismatch/max_abs")))
    return out


def warnings_for(dtype: str, engine: dict[str, float], controls: dict[str, dict[str, float]]) -> list[str]:
    if dtype != "bfloat16" or engine.get("mismatch/abs_mean") != 0.0:
        return []
    seen = (controls.get("float32") or {}).get("mismatch/abs_mean")
    return [f"the bf16 engine-vs-trainer mismatch is exactly 0 on {engine.get('mismatch/tokens', 0):.0f} tokens: the "
            f"KV-cached engine and the full forward gave bit-identical log-probs; the float32 control differs by "
            f"{seen if seen is not None else 'nothing measured'} on the same batch, so the comparison "
            f"{'could' if seen and seen >= MISMATCH_CONTROL_MIN else 'could NOT'} see a difference"]


def run_control(overrides: list[str], config: Optional[str] = None, *, seed: int = 0) -> dict[str, Any]:
    """Generate one batch with the config's HF engine, score it as the probe does and re-score it as the controls
    do. Returns the figures, the entries and the per-token table."""
    import torch

    from stalerl.config import load_config
    from stalerl.core.model import PromptFormatter, load_policy_from_config
    from stalerl.core.reward import gsm8k_reward
    from stalerl.data import load_examples
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.training.actor import Actor
    from stalerl.training.mismatch import engine_mismatch

    cfg = load_config((["--config", config] if config else []) + list(overrides))
    torch.manual_seed(seed)
    model, tok = load_policy_from_config(cfg)
    fmt = PromptFormatter.from_config(tok, cfg)
    ds = cfg.train_dataset
    examples = load_examples(ds.path, ds.split, synthetic_task=ds.synthetic.task,
                             max_operand=ds.synthetic.max_operand, train_size=ds.synthetic.train_size,
                             test_size=ds.synthetic.test_size, seed=ds.synthetic.seed,
                             question_style=ds.synthetic.question_style, holdout=ds.synthetic.holdout)[:ds.batch_size]
    device = next(model.parameters()).device
    dtype = cfg.actor.dtype
    engine = HFRolloutEngine(model, tok, fmt.format, gsm8k_reward, device=device, compute_dtype=dtype)
    g = cfg.gconfig
    start = time.perf_counter()
    batch = engine.generate([e.question for e in examples], [e.final for e in examples], n_samples=g.n_samples,
                            max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)
    gen_s = time.perf_counter() - start
    actor = Actor(model, cfg.actor, temperature=g.temperature, total_updates=1)
    mask = batch.response_mask
    trainer = actor.compute_logp(batch)  # the probe's pass (MismatchProbe.probe)
    figures = {"engine_vs_trainer": engine_mismatch(trainer, batch.behavior_logp, mask)}
    rescored: dict[str, torch.Tensor] = {}
    if dtype == "bfloat16":
        saved = (actor.compute_dtype, actor.max_tokens_per_mb, actor.chunked_logprobs)
        for name in CONTROLS:
            actor.compute_dtype, actor.max_tokens_per_mb, actor.chunked_logprobs = saved
            if name == "float32":
                actor.compute_dtype = torch.float32
            elif name == "micro_batch":
                actor.max_tokens_per_mb = 1  # at least one row per micro-batch: one row each
            else:
                actor.chunked_logprobs = False
            rescored[name] = actor.compute_logp(batch)
        actor.compute_dtype, actor.max_tokens_per_mb, actor.chunked_logprobs = saved
    controls = {name: engine_mismatch(lp, trainer, mask) for name, lp in rescored.items()}
    rows, cols = mask.nonzero(as_tuple=True)
    table = {"columns": ["row", "position", "token_id", "engine_logp", "trainer_logp",
                         *[f"{n}_logp" for n in rescored]],
             "rows": [[int(r), int(c), int(batch.response_ids[r, c]), float(batch.behavior_logp[r, c]),
                       float(trainer[r, c]), *[float(lp[r, c]) for lp in rescored.values()]]
                      for r, c in zip(rows.tolist(), cols.tolist())]}
    return {"dtype": dtype, "device": str(device), "rows": batch.num_rows, "tokens": int(mask.sum()),
            "generation_s": gen_s, "chunked_logprobs": bool(actor.chunked_logprobs),
            "max_tokens_per_mb": actor.max_tokens_per_mb, "engine_vs_trainer": figures["engine_vs_trainer"],
            "controls": controls, "entries": control_entries(dtype, figures["engine_vs_trainer"], controls),
            "warnings": warnings_for(dtype, figures["engine_vs_trainer"], controls), "table": table}


def format_control(result: dict[str, Any]) -> list[str]:
    ev = result.get("engine_vs_trainer") or {}
    lines = [f"mismatch control ({result.get('dtype')}, {result.get('rows')} rows, {result.get('tokens')} tokens): "
             f"engine vs trainer mean |d| {ev.get('mismatch/abs_mean', float('nan')):.3g}, max "
             f"{ev.get('mismatch/max_abs', float('nan')):.3g}"]
    for name, c in (result.get("controls") or {}).items():
        lines.append(f"  control {name}: mean |d| {c.get('mismatch/abs_mean', float('nan')):.3g}, max "
                     f"{c.get('mismatch/max_abs', float('nan')):.3g}")
    for e in result.get("entries", []):
        lines.append(f"  {'ok  ' if e['passed'] else 'FAIL'} {e['check']} [{e['dtype']}]: {e['error']:.3g} "
                     f"{e['comparison']} {e['tolerance']:.3g}")
    lines += [f"  WARNING: {w}" for w in result.get("warnings", [])]
    return lines


def _write_json(path: Path, data: Any, indent: Optional[int] = 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, separators=None if indent else (",", ":")) + "\n")
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", type=Path, required=True, help="the figures and entries (JSON)")
    ap.add_argument("--tokens", type=Path, required=True, help="the batch's per-token log-probs (JSON)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (the real_model run's)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    result = run_control(args.overrides, args.config)
    table = result.pop("table")
    _write_json(args.tokens, {"dtype": result["dtype"], "device": result["device"], **table}, indent=None)  # ~8k rows
    result["tokens_file"] = args.tokens.name
    result["ok"] = all(e["passed"] for e in result["entries"])
    _write_json(args.out, result)
    print("\n".join(format_control(result)))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
