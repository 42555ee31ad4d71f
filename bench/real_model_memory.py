"""Peak RSS per phase of the real-model run (SmolLM2-135M, examples/math/smollm2_add_m2po_cpu.yaml), in one process.

    python bench/real_model_memory.py [--steps 3] [--config FILE] [--activations] [key=value ...]
    python bench/real_model_memory.py --compare baseline,arena2,trim      # each variant in its own child process

The shipped config runs for ``--steps`` train steps (default 3; batch shape, staleness, evaluation at start and at the
last step, checkpoint at the last step unchanged) with wrappers around the runtime's phases: model load, the rest of
the trainer's construction, generation (train batches), evaluation, the no-grad log-prob pass (the mismatch probe's
recompute; the planner's, when a step has several micro-batches), the last-step snapshot (stalerl.training.last_step),
the grad forward and the backward of each micro-batch, gradient clipping + optimizer step, checkpoint save. Nothing in
the runtime is edited. Phases nest (a phase's peak includes its inner phases'); "run" is the whole process.

Peak RSS is the kernel's high-water mark VmHWM, reset at every phase boundary through /proc/self/clear_refs (Linux
>= 4.0), folded into every open phase first: a spike between two samples cannot be missed, as it could be by a
sampling thread (one, every 5 ms, is the fallback where clear_refs is refused). Per phase: the peak, the peak minus
the RSS after the model load, the RSS at its end, and glibc's view at its end (mallinfo2: bytes in use in malloc's
arenas, free bytes held by them, bytes in mmapped chunks): free-but-held arena bytes are fragmentation.

The analytical budget: weights W (unique parameter storage), gradients W, AdamW's two moments 2W, and one
micro-batch's activations A, estimated per token and layer from the model's config for the largest micro-batch the
run trained (``activation_bytes_estimate``); with ``--activations`` also measured: the bytes of every distinct tensor
storage autograd saved during the grad forward (saved-tensors hooks; parameters excluded). The runtime's own RSS
(Python, torch, transformers, tokenizer: measured after the imports) is printed beside it.

Variants (``--compare``; ``--variant`` runs one in this process): ``baseline``; ``arena2`` (MALLOC_ARENA_MAX=2 in the
child's environment, read by glibc at start); ``mmap`` (MALLOC_MMAP_THRESHOLD_=131072: every tensor buffer of 128 KiB
or more is its own mmap, given back to the kernel when freed, and glibc's dynamic threshold, which otherwise climbs
to 32 MiB after the first large free, is off); ``trim`` (malloc_trim(0) through ctypes at the end of every phase);
``launch_env`` (stalerl.core.launch_env.configure_allocator, what the launcher does).

The resets also reset ``ru_maxrss``, so the run's own ``memory/peak_rss_gib`` metric is a per-phase figure here.
RSS is this process's own: the machine's load changes the timings, not the figures (to a few MB).

Measured (2-core AMD EPYC, AVX512, under load 10-28 from other jobs; torch 2.13, 2 threads, float32; the shipped
shape: 8 prompts x 8 samples, 64 rows x 56-61 tokens in one micro-batch; ``rollout.fixed_staleness=0
evaluator.at_start=false`` to shorten the run, which changes no buffer of the update):

    python bench/real_model_memory.py --steps 2 rollout.fixed_staleness=0 evaluator.at_start=false
    python bench/real_model_memory.py --steps 1 rollout.fixed_staleness=0 evaluator.at_start=false \
        evaluator.n_prompts=8 actor.gradient_checkpointing=true
    python bench/real_model_memory.py --steps 2 --variant launch_env rollout.fixed_staleness=0 \
        evaluator.at_start=false evaluator.n_prompts=8 actor.gradient_checkpointing=true

Peak RSS (MiB; run = the whole process; end = RSS after the step; "free held" = glibc arena bytes free but kept):

    variant (all: the same 41 metrics of step 1, bit for bit)     step 1 peak  step 2 peak  end of step 1 (free held)
    as shipped (glibc default, no checkpointing)                        7998        >=9520       5003 (n/a)
    actor.gradient_checkpointing=true                                   4575             -       4261 (1683)
    + launch_env malloc (--variant launch_env)                          3623          3626       2621 (41)

The as-shipped figures are the kernel's VmHWM read every 10 s from outside (that run was cut by its timeout in step
2's evaluation, before its table). Where the rest goes, from the last run's table: runtime 254, weights 513 (the
trainer built: 928), a 64-row generation +275, the grad forward +337, the backward +711 (gradients 513 + the
recomputed layer), the optimizer step +512 over its start (AdamW's multi-tensor temporaries, one weight-sized list).
Step 2 kept no last-step snapshot (the checkpoint of step 1 was on disk): with one (weights + both moments, 1.5 GB,
stalerl.training.last_step) a step's peak is ~1 GB higher (~4.6 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # the bench scripts' shared helpers

from rollout_memory import _status_kib  # noqa: E402  /proc/self/status fields in KiB

MIB = 2**20
VARIANTS = ("baseline", "arena2", "mmap", "trim", "launch_env")
VARIANT_ENV = {"arena2": {"MALLOC_ARENA_MAX": "2"}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


# ----------------------------------------------------------------------------------------------- process memory
def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def malloc_view() -> Optional[dict[str, int]]:
    """glibc's totals over all arenas (mallinfo2, glibc >= 2.33): in use, free but held, mmapped; None elsewhere."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    _LIBC.mallinfo2.restype = _Mallinfo2
    info = _LIBC.mallinfo2()
    return {"in_use": int(info.uordblks), "free_held": int(info.fordblks), "mmapped": int(info.hblkhd)}


def malloc_trim() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class PeakMeter:
    """Peak RSS since the last :meth:`reset`: VmHWM after writing 5 to /proc/self/clear_refs where the kernel allows
    it, else the maximum of a 5 ms sampling thread (which can miss a spike shorter than that)."""

    def __init__(self) -> None:
        self.kernel = self._try_clear()
        self._sampled = rss_bytes()
        self._lock = threading.Lock()
        if not self.kernel:
            threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def _try_clear() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def _sample(self) -> None:
        while True:
            now = rss_bytes()
            with self._lock:
                self._sampled = max(self._sampled, now)
            time.sleep(0.005)

    def peak(self) -> int:
        if self.kernel:
            return _status_kib("VmHWM") * 1024
        with self._lock:
            return max(self._sampled, rss_bytes())

    def reset(self) -> None:
        if self.kernel:
            self._try_clear()
        else:
            with self._lock:
                self._sampled = rss_bytes()


class Phases:
    """Named, nestable phases; each records its peak RSS (max over its calls), calls, seconds and end state."""

    def __init__(self, trim: bool = False) -> None:
        self.meter = PeakMeter()
        self.trim = trim
        self.open: list[str] = []
        self.rows: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []

    def _fold(self) -> None:
        peak = self.meter.peak()
        for name in self.open:
            self.rows[name]["peak"] = max(self.rows[name]["peak"], peak)

    @contextlib.contextmanager
    def phase(self, name: str):
        if name not in self.rows:
            self.rows[name] = {"peak": 0, "calls": 0, "seconds": 0.0, "end_rss": 0, "malloc": None,
                               "depth": len(self.open)}
            self.order.append(name)
        self._fold()
        self.meter.reset()
        self.open.append(name)
        self.rows[name]["peak"] = max(self.rows[name]["peak"], rss_bytes())
        start = time.perf_counter()
        try:
            yield
        finally:
            self._fold()
            self.open.remove(name)
            row = self.rows[name]
            row["calls"] += 1
            row["seconds"] += time.perf_counter() - start
            if self.trim:
                malloc_trim()
            row["end_rss"] = rss_bytes()
            row["malloc"] = malloc_view()
            self.meter.reset()


def wrap(owner: Any, attr: str, phases: Phases, name: Callable[[], str] | str,
         before: Optional[Callable[..., Any]] = None) -> None:
    """Replace ``owner.attr`` (a class or instance attribute) by a call inside the phase ``name`` (a string or a
    function giving it at call time); ``before(*args, **kwargs)`` may return a context manager entered inside."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        label = name() if callable(name) else name
        if label is None:
            return original(*args, **kwargs)
        with phases.phase(label):
            ctx = before(*args, **kwargs) if before is not None else contextlib.nullcontext()
            with ctx:
                return original(*args, **kwargs)

    setattr(owner, attr, wrapper)


# ------------------------------------------------------------------------------------------------ the budget
def unique_parameter_bytes(model) -> int:
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def activation_bytes_estimate(config, rows: int, width: int, kept_columns: int, bytes_per: int = 4) -> int:
    """What autograd keeps for one micro-batch of ``rows x width`` tokens through a Llama-type decoder (float32),
    per token and layer: each RMSNorm its input, normalised and scaled outputs (2 norms x 3 x hidden); attention's
    q, k and v after RoPE (k and v repeated to the query heads for SDPA: 3 x hidden), its output and o_proj's
    contiguous input (2 x hidden); the MLP's gate, up, silu(gate) and their product (4 x intermediate). Plus the
    embeddings' output and the final norm's (3 x hidden) per token, and the head's input for the ``kept_columns``
    positions per row. Small terms (log-sum-exps, RoPE tables, masks) are left out."""
    h = config.hidden_size
    inter = config.intermediate_size
    per_layer = 6 * h + 5 * h + 4 * inter
    tokens = rows * width
    return bytes_per * (tokens * (config.num_hidden_layers * per_layer + 4 * h) + rows * kept_columns * h)


# --------------------------------------------------------------------------------------------------- the run
def instrument(phases: Phases, measure_activations: bool) -> dict[str, Any]:
    """Wrap the runtime's phases (classes patched before the trainer is built). Returns a dict the wrappers fill
    (micro-batch shapes, measured activation bytes)."""
    import torch

    import stalerl.training.trainer as trainer_mod
    from stalerl.rollout.engine import HFRolloutEngine
    from stalerl.training.actor import Actor
    from stalerl.training.last_step import LastStep
    from stalerl.training.trainer import Trainer

    seen: dict[str, Any] = {"micro_batches": [], "activations": []}
    wrap(trainer_mod, "load_policy_from_config", phases, "model load")
    wrap(Trainer, "__init__", phases, "trainer build (data, model, optimizer)")
    wrap(Trainer, "train_step", phases, "train step")
    wrap(Trainer, "evaluate", phases, "eval")
    wrap(Trainer, "save_checkpoint", phases, "checkpoint save")
    wrap(HFRolloutEngine, "generate", phases, lambda: "  eval generate" if "eval" in phases.open else "generate")
    wrap(LastStep, "freeze", phases, "last-step snapshot (host copy)")
    wrap(Actor, "compute_logp", phases,
         lambda: "no-grad log-prob pass (planner)" if "update" in phases.open else "no-grad log-prob pass (probe)")
    wrap(Actor, "update", phases, "update")

    def forward_name() -> Optional[str]:
        return "forward (grad)" if torch.is_grad_enabled() else None

    def record(actor, mb):
        seen["micro_batches"].append((int(mb.num_rows), int(mb.prompt_ids.shape[1] + mb.response_ids.shape[1]),
                                      int(mb.response_ids.shape[1]) + 1))
        if not (measure_activations and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        params = {p.untyped_storage().data_ptr() for p in actor.model.parameters()}
        storages: dict[int, int] = {}
        seen["activations"].append(storages)

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    wrap(Actor, "_forward_logp", phases, forward_name, before=record)
    wrap(torch.Tensor, "backward", phases, lambda: "backward" if "update" in phases.open else None)
    wrap(torch.nn.utils, "clip_grad_norm_", phases, "grad clip")  # the actor looks it up at call time
    original_init = Actor.__init__

    def actor_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        wrap(self.optimizer, "step", phases, "optimizer step")

    Actor.__init__ = actor_init
    return seen


def run_variant(args) -> dict[str, Any]:
    variant = args.variant
    t0 = time.perf_counter()
    if variant == "launch_env":
        from stalerl.core.launch_env import configure_allocator

        print(f"launch_env: {configure_allocator()}")
    phases = Phases(trim=variant == "trim")
    state: dict[str, Any] = {"variant": variant, "steps": args.steps, "t0": t0, "phases": phases}
    with phases.phase("run"):
        with phases.phase("imports"):
            import torch  # noqa: F401

            import transformers  # noqa: F401

            from stalerl.config import load_config
            from stalerl.training.trainer import Trainer
        state["runtime"] = rss_bytes()
        state["seen"] = instrument(phases, args.activations)
        work = Path(tempfile.mkdtemp(prefix="stalerl-memory-"))
        cfg = load_config(["--config", args.config, f"cluster.fileroot={work}", f"total_train_steps={args.steps}",
                           "stats_logger.tensorboard=false", *args.overrides])
        state["cfg"] = cfg
        # the run's own lines on stderr, timed (the tables go to stdout)
        start = time.perf_counter()
        trainer = Trainer(cfg, log=lambda *a, **k: print(f"[{time.perf_counter() - start:6.0f} s]", *a,
                                                          file=sys.stderr, flush=True))
        state["trainer"] = trainer
        state["after_load"] = rss_bytes()
        step = trainer.train_step

        def train_step():  # a table after every step but the last (the final one follows the run)
            row = step()
            if trainer.step < trainer.total_steps:
                print(f"\n(after train step {trainer.step}: the phases so far)")
                print_report(collect(state))
            return row

        trainer.train_step = train_step
        trainer.train()
    return collect(state)


def collect(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    phases, seen, cfg = state["phases"], state["seen"], state["cfg"]
    model = state["trainer"].model
    weights = unique_parameter_bytes(model)
    trainable = sum(p.numel() * p.element_size() for p in {p.untyped_storage().data_ptr(): p
                                                            for p in model.parameters() if p.requires_grad}.values())
    biggest = max(seen["micro_batches"], key=lambda s: s[0] * s[1]) if seen["micro_batches"] else (0, 0, 0)
    estimate = activation_bytes_estimate(model.config, *biggest)
    measured = max((sum(s.values()) for s in seen["activations"]), default=None)
    rows = json.loads(json.dumps(phases.rows))
    if "run" in phases.open:  # a table mid-run: the whole run's peak so far
        rows["run"]["peak"] = max(rows["run"]["peak"], phases.meter.peak())
    return {"variant": state["variant"],
            "env": {k: os.environ.get(k) for k in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_")},
            "rows": rows, "order": list(phases.order), "runtime": state["runtime"],
            "after_load": state["after_load"], "weights": weights, "grads": trainable, "adam": 2 * trainable,
            "activations_estimate": estimate, "activations_measured": measured, "micro_batch": biggest,
            "micro_batches": len(seen["micro_batches"]), "seconds": time.perf_counter() - state["t0"],
            "threads": torch.get_num_threads(), "dtype": cfg.actor.dtype, "steps": state["steps"],
            "checkpointing": bool(cfg.actor.gradient_checkpointing),
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def print_report(r: dict[str, Any]) -> None:
    mb = lambda b: f"{b / MIB:8.0f}"  # noqa: E731
    print(f"\n== variant {r['variant']} (env {r['env']}), {r['steps']} steps, actor.dtype={r['dtype']}, "
          f"actor.gradient_checkpointing={r['checkpointing']}, "
          f"{r['threads']} threads, {r['seconds']:.0f} s")
    print(f"{'phase':44s} {'calls':>5s} {'peak MiB':>9s} {'vs load':>8s} {'end MiB':>8s} {'arena use':>9s} "
          f"{'arena free':>10s} {'mmapped':>8s} {'s':>7s}")
    for name in r["order"]:
        row = r["rows"][name]
        m = row["malloc"] or {}
        label = "  " * row["depth"] + name.strip()
        print(f"{label[:44]:44s} {row['calls']:5d} {mb(row['peak']):>9s} {mb(row['peak'] - r['after_load']):>8s} "
              f"{mb(row['end_rss']):>8s} {mb(m.get('in_use', 0)):>9s} {mb(m.get('free_held', 0)):>10s} "
              f"{mb(m.get('mmapped', 0)):>8s} {row['seconds']:7.1f}")
    w, g, a = r["weights"], r["grads"], r["adam"]
    act = r["activations_estimate"]
    budget = w + g + a + act
    rows, width, kept = r["micro_batch"]
    print(f"budget: weights {w / MIB:.0f} + grads {g / MIB:.0f} + AdamW {a / MIB:.0f} + activations of one "
          f"micro-batch ({rows} rows x {width} tokens, {r['micro_batches']} grad forwards) {act / MIB:.0f} (estimate"
          + (f"; measured saved tensors {r['activations_measured'] / MIB:.0f}" if r["activations_measured"] else "")
          + f") = {budget / MIB:.0f} MiB; runtime after imports {r['runtime'] / MIB:.0f} MiB")
    peak = r["rows"]["run"]["peak"]
    print(f"peak RSS {peak / MIB:.0f} MiB = {peak / budget:.2f}x the budget "
          f"({peak / (budget + r['runtime']):.2f}x budget + runtime); after load {r['after_load'] / MIB:.0f} MiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "math" / "smollm2_add_m2po_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variant", default="baseline", choices=VARIANTS)
    ap.add_argument("--compare", default=None, help="comma-separated variants, each in its own child process")
    ap.add_argument("--activations", action="store_true", help="also measure autograd's saved tensors")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps={args.steps}: expected >= 1 train step")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} (RSS is this process's own; other processes change its timings only)")
    if args.compare:
        names = [v.strip() for v in args.compare.split(",") if v.strip()]
        bad = [v for v in names if v not in VARIANTS]
        if bad:
            ap.error(f"--compare: unknown variant(s) {', '.join(bad)}; expected some of {', '.join(VARIANTS)}")
        results = []
        for name in names:
            env = {**os.environ, **VARIANT_ENV.get(name, {})}
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = [sys.executable, __file__, "--config", args.config, "--steps", str(args.steps), "--variant", name,
                   "--json", out, *(["--activations"] if args.activations else []), *args.overrides]
            code = subprocess.call(cmd, env=env)
            if code != 0:
                print(f"variant {name}: exit code {code}", file=sys.stderr)
                return code
            results.append(json.loads(Path(out).read_text()))
            os.unlink(out)
        print("\n== summary: peak RSS of the run (MiB)")
        for r in results:
            print(f"  {r['variant']:12s} {r['rows']['run']['peak'] / MIB:8.0f}  ({r['seconds']:.0f} s)")
        return 0
    result = run_variant(args)
    print_report(result)
    if args.json:
        tmp = args.json + ".tmp"
        Path(tmp).write_text(json.dumps(result))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
