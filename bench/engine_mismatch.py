"""The engine-vs-trainer per-token log-prob difference of a real model, per compute dtype (and engine), on fresh
batches: what rollout correction and M2PO's tau act on when behaviour log-probs come from the engine.

    python bench/engine_mismatch.py [--model smollm2-135m-instruct|DIR] [--dtypes float32,bfloat16]
                                    [--engines hf,vllm] [--batches 2] [--threads 2] [key=value ...]

For each (engine, dtype; vLLM's copy in that dtype too): the config's training batches (examples/math/smollm2_add_m2po_cpu.yaml by default: 8
prompts x 8 samples, T 0.7, 16 new tokens) generated at the initial weights, then the trainer's no-grad forward of
the same tokens at the same weights (stalerl.training.mismatch.engine_mismatch): d = trainer - engine log-prob per
valid token; printed: tokens, mean d, mean |d|, p99 |d|, max |d|, the share with |d| > 0.1, and M2 = mean d^2 (the
part of M2PO's second moment that is engine mismatch, not staleness). vLLM rows need the vLLM environment
(scripts/setup_vllm.sh); without it they are skipped with the reason. Figures only, nothing asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FIELDS = ("mismatch/tokens", "mismatch/mean", "mismatch/abs_mean", "mismatch/abs_p99", "mismatch/max_abs",
          "mismatch/frac_gt_0.1", "mismatch/m2")


def measure(config: str, model: str, engine: str, dtype: str, batches: int, threads: int,
            overrides: list[str]) -> dict[str, float]:
    from stalerl.config import load_config
    from stalerl.training.mismatch import engine_mismatch
    from stalerl.training.trainer import Trainer

    work = tempfile.mkdtemp(prefix="stalerl-mismatch-")
    cfg = load_config(["--config", config, f"actor.path={model}", f"actor.dtype={dtype}", f"torch_threads={threads}",
                       f"rollout.backend={engine}:d1", f"cluster.fileroot={work}", "rollout.fixed_staleness=0",
                       "recover.mode=disabled", "stats_logger.mismatch_freq_steps=null",
                       "stats_logger.tensorboard=false",
                       # vLLM's own copy in the same dtype as the trainer (its CPU default is float32 whatever
                       # actor.dtype says), so a row is one dtype end to end
                       *([f"rollout.vllm.dtype={dtype}"] if engine == "vllm" else []), *overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.warm_start_done = True
    trainer_logps, engine_logps, masks = [], [], []
    for _ in range(batches):
        batch = trainer.generate_batch()
        trainer_logps.append(trainer.actor.compute_logp(batch))
        engine_logps.append(batch.behavior_logp)
        masks.append(batch.response_mask)
    width = max(m.shape[1] for m in masks)

    def pad(ts):
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in ts])

    return engine_mismatch(pad(trainer_logps), pad(engine_logps), pad(masks).bool())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--config", default=str(REPO / "examples" / "math" / "smollm2_add_m2po_cpu.yaml"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--engines", default="hf")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    print(f"model {args.model}, config {Path(args.config).name}, {args.batches} batches each, torch "
          f"{torch.__version__}, {args.threads} threads")
    print("engine dtype     " + " ".join(f"{f.split('/', 1)[1]:>12}" for f in FIELDS))
    for engine in args.engines.split(","):
        if engine == "vllm":
            from stalerl.rollout.vllm_engine import vllm_available

            if not vllm_available():
                print("vllm   (skipped: vLLM is not installed in this environment; run from scripts/setup_vllm.sh's)")
                continue
        for dtype in args.dtypes.split(","):
            out = measure(args.config, args.model, engine, dtype, args.batches, args.threads, args.overrides)
            print(f"{engine:<6} {dtype:<9}" + " ".join(f"{out.get(f, float('nan')):>12.4g}" for f in FIELDS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
