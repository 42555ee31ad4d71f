"""One training step of the runtime at Qwen2's vocabulary: peak resident memory and train time with the chunked
training log-probs (stalerl.core.chunked_logprob, the default) against the plain logits path.

The issue-18 case: a from-scratch Qwen2 with the 151,936-token vocabulary and hidden size 64 (``scripts/smoke_assets.py
--size cpu``, built locally, nothing downloaded), 16 prompts x 4 samples = 64 rows x 64 new tokens, the CPU
config's default micro-batch size (``actor.mb_spec.max_tokens_per_mb``), M2PO (so a no-grad selection pass runs
before the training pass), no warm start, no evaluation. Each variant runs in its own process (peak RSS is a
per-process figure: ``ru_maxrss``); "plain" is the same command with the chunked path switched off in that process
(``Actor.chunked_logprobs = False``). Printed: peak RSS, the step's train time (``timing/train_s``: log-prob passes,
backward, optimizer) and generation time, and their ratios against plain.

Measured on the shared 2-core machine (torch 2.13.0+cpu, load average 7-20 from other jobs, so times are rough):
chunked 0.91 GiB peak RSS, train 63 s; plain 4.23 GiB, train 169 s (0.22x memory, 0.37x train time; 2
micro-batches at the default 8,192 tokens). The issue measured 7.7 GB for the plain path on another day.

The head part (``--part head``): the output head alone at the real shape of Qwen2.5-1.5B's head (hidden 1536,
vocab 151,936), forward + backward of ``chunked_token_logprobs`` against the plain ``F.linear`` + ``log_softmax`` +
gather, each variant in its own process at a small token count that fits in a few seconds on a CPU (the chunk is
the device's default, :func:`stalerl.core.chunked_logprob.default_chunk_tokens`: 27 tokens on a CPU). Printed: the
best of ``--repeats`` times and the peak RSS above the inputs (both variants allocate the 0.93 GB weight gradient),
and their ratios against plain.

    python bench/logprob_one_step.py                  # both parts; builds the assets into a temp dir
    python bench/logprob_one_step.py --assets DIR --only chunked
    python bench/logprob_one_step.py --part head --tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs inside the child: optionally force the plain path, run the CLI, report this process's peak RSS.
CHILD = r"""
import json, resource, sys
import stalerl.training.actor as actor_mod
if sys.argv[1] == "plain":
    actor_mod.chunked_logprob_check = lambda model: (False, "forced by bench/logprob_one_step.py")
sys.argv = ["gsm8k_rl.py", *sys.argv[2:]]
from stalerl.launch.cli import main
code = main()
print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def run(variant: str, assets: Path, work: Path, extra: list[str]) -> dict:
    runs = work / variant
    args = ["--config", str(REPO / "examples/math/gsm8k_m2po_cpu.yaml"), f"actor.path={assets / 'model'}",
            f"train_dataset.path={assets / 'data'}", f"valid_dataset.path={assets / 'data'}",
            "train_dataset.batch_size=16", "gconfig.n_samples=4", "gconfig.max_new_tokens=64",
            "total_train_steps=1", "warm_start.steps=0", "rollout.fixed_staleness=0", "evaluator.freq_steps=1000",
            "recover.mode=disabled", "torch_threads=1", "stats_logger.tensorboard=false",
            "stats_logger.progress_bar=false", "actor.adv_norm=null", "actor.reward_bias=-0.5",
            f"cluster.fileroot={runs}", f"trial_name={variant}", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, "-c", CHILD, variant, *args], cwd=REPO, env=env, capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"{variant} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    peak = int(res.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0]) * 1024
    metrics_file = next(runs.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    step = [r for r in rows if r.get("step") == 1][-1]
    return {"peak": peak, "train_s": step["timing/train_s"], "gen_s": step["timing/gen_s"],
            "micro": step.get("actor/num_micro_batches")}


# The head part's child: one variant's forward + backward at (tokens, hidden) x (vocab, hidden); prints JSON.
HEAD_CHILD = r"""
import json, resource, sys, time
import torch
from stalerl.core.chunked_logprob import chunked_token_logprobs, default_chunk_tokens
variant, dtype = sys.argv[1], sys.argv[5]
tokens, hidden, vocab, repeats, threads, chunk = map(int, sys.argv[2:5] + sys.argv[6:9])
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
w = torch.empty(vocab, hidden).normal_(0.0, 0.02, generator=g).requires_grad_()  # in place: no freed temporary
h = torch.empty(tokens, hidden).normal_(generator=g).requires_grad_()  # to hide the peak above the inputs
ids = torch.randint(0, vocab, (tokens,), generator=g)
go = torch.randn(tokens, generator=g)
cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

def plain():
    logits = torch.nn.functional.linear(h, w)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

chunk = chunk or default_chunk_tokens(h.device, vocab)
fn = plain if variant == "plain" else (lambda: chunked_token_logprobs(h, w, ids, chunk_tokens=chunk))
times = []
for _ in range(repeats):
    h.grad = w.grad = None
    start = time.perf_counter()
    with cast:
        lp = fn()
    (lp * go).sum().backward()
    times.append(time.perf_counter() - start)
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
print("HEAD_RESULT", json.dumps({"s": min(times), "peak": peak, "chunk": chunk}))
"""


def run_head(variant: str, tokens: int, hidden: int, vocab: int, dtype: str, repeats: int, threads: int,
             chunk: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", HEAD_CHILD, variant, str(tokens), str(hidden), str(vocab), dtype,
                          str(repeats), str(threads), str(chunk)], cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"head {variant} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.rsplit("HEAD_RESULT", 1)[1])


def head_part(args) -> None:
    results = {v: run_head(v, args.tokens, 1536, 151_936, args.dtype, args.repeats, args.threads, args.chunk_tokens)
               for v in ("chunked", "plain")}
    c, p = results["chunked"], results["plain"]
    print(f"output head alone, hidden 1536 x vocab 151,936, {args.tokens} tokens, {args.dtype}, forward + backward, "
          f"{args.threads} thread(s), best of {args.repeats}; chunk {c['chunk']} tokens")
    for v, r in results.items():
        print(f"  {v:8s} time {r['s']:7.3f} s  peak RSS above inputs {r['peak'] / 2**30:5.2f} GiB")
    print(f"  chunked/plain: time {c['s'] / p['s']:.2f}x, peak memory above inputs {c['peak'] / p['peak']:.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["step", "head", "both"], default="both",
                        help="step: one training step at hidden 64; head: the output head at hidden 1536")
    parser.add_argument("--assets", type=Path, help="a scripts/smoke_assets.py --size cpu output (built if absent)")
    parser.add_argument("--only", choices=["chunked", "plain"], help="run one variant (step part)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the head part")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="head part's compute")
    parser.add_argument("--repeats", type=int, default=3, help="head part: best of this many passes")
    parser.add_argument("--threads", type=int, default=1, help="head part: torch threads")
    parser.add_argument("--chunk-tokens", type=int, default=0, help="head part: tokens per chunk (0: the device's)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs (step part)")
    args = parser.parse_args(argv)
    if args.part in ("head", "both"):
        head_part(args)
    if args.part == "head":
        return
    work = Path(tempfile.mkdtemp(prefix="stalerl-logprob-bench-"))
    assets = args.assets or work / "assets"
    if not (assets / "model" / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts/smoke_assets.py"), str(assets), "--size", "cpu"],
                       check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    variants = [args.only] if args.only else ["chunked", "plain"]
    results = {v: run(v, assets, work, args.overrides) for v in variants}
    print(f"one step, vocab 151,936, hidden 64, 64 rows x 64 new tokens, M2PO, overrides {args.overrides or 'none'}")
    for v, r in results.items():
        ratio = ""
        if v != "plain" and "plain" in results:
            p = results["plain"]
            ratio = f"   peak {r['peak'] / p['peak']:.2f}x, train time {r['train_s'] / p['train_s']:.2f}x of plain"
        print(f"  {v:8s} peak RSS {r['peak'] / 2**30:5.2f} GiB  train {r['train_s']:7.2f} s  generation "
              f"{r['gen_s']:6.2f} s  micro-batches {r['micro']}{ratio}")


if __name__ == "__main__":
    main()
