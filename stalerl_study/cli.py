"""``stalerl-study``: one command per results table. A study spec (YAML) names a grid; the runner runs it as a
sweep on any scheduler, collects the run summaries next to the docs and regenerates the doc's results block.

    stalerl-study run examples/math/study/staleness.yaml            # the full grid, then the report
    stalerl-study run examples/math/study/staleness.yaml --seeds 1,2 --losses m2po,vanilla \\
        --settings "fixed_staleness 0,fixed_staleness 4" --set total_train_steps=20 \\
        --results /tmp/tiny --doc /tmp/tiny.md                      # a tiny validation grid, outside the docs
    stalerl-study run SPEC --dry-run                                 # list the runs, validate every config

Spec keys (see examples/math/study/*.yaml): ``name``, ``title``, ``config`` (base YAML), ``overrides`` (for every
run), ``losses`` (``actor.loss`` values: adding a loss to the table is one line), ``variants`` (optional mapping
name -> overrides, e.g. behaviour log-prob rollout vs recompute), ``settings`` (mapping: setting name -> overrides;
the name must be what the run reports, i.e. ``fixed_staleness S`` or AReaL's ``stale S dX+dY rollout R``, and is
checked), ``seeds``, ``method_keys`` (summary fields naming a method), ``parallel`` (runs at once under the local
scheduler), ``warm_start_cache`` (default true), ``results`` (where summaries are collected), ``doc``,
``figure_metrics``, ``claims`` (a mapping of pre-registered claims, tested with Holm-adjusted one-sided tests, see
stalerl_study.prereg; a claim may state ``expected_sd``, and ``stalerl-study run`` prints every claim's power at the
spec's seeds before anything runs and refuses an equivalence claim that could not pass at a true difference of 0
unless it says ``accept_low_power``; ``stalerl-study power SPEC`` prints the same without running; the legacy
``staleness`` / ``async`` strings check the published claims the old way, see stalerl_study.claims),
``setting_losses`` (optional mapping setting -> the losses run there, e.g. on-policy once), ``variant_losses``
(optional mapping variant -> the losses run with it, e.g. a tau variant for m2po only; a variant not listed runs
with every loss), ``pilot`` (a pilot's decision rule, see stalerl_study.pilot: validated, copied into study.json and
applied in the block; ``stalerl-study pilot RESULTS --spec SPEC`` prints it). ``stalerl-study registration RESULTS
--spec SPEC`` checks that every collected run ran from a clean commit already holding the registered spec
(stalerl_study.registration).
Paths in a spec are relative to the working directory: run the shipped specs from the repository root.

Cost on small machines: with ``warm_start_cache`` the supervised warm start is run once per seed (in this
process's machine, under ``<fileroot>/warm_start/``, shared by studies) and every RL run of that seed starts from the
saved model (``actor.path=<cache> warm_start.steps=0``; the weights are saved exactly, so the RL runs are those of
an in-run warm start up to the RNG use of the warm start itself). Under Slurm the cache and the run directories must
be on a shared filesystem (``cluster.fileroot``).

Reuse: a run is not rerun when a summary of it (in its run directory, else collected in ``results``) says
``finished`` or ``diverged`` and was written by the same run of the same code (:func:`reuse_refusal`): the same
``config_digest_stable`` (the resolved config without names and machine-local paths, see
stalerl.results.run_summary), a recorded commit equal to this checkout's HEAD, and the same uncommitted changes
(``code.dirty`` and ``code.dirty_digest`` equal: a clean tree reuses only runs of a clean tree, a dirty one only runs
of exactly the same changes; ``docs/``, where studies write, does not count). A summary without a recorded commit
(written before commits were recorded, or outside a git checkout) is never reused, and outside a git checkout nothing
is. So an interrupted study resumes where it stopped, in this checkout or a fresh clone at the same commit, and a
study run again after the code changed reruns everything (``--force`` reruns everything anyway). study.json records,
per reused run, the summary it came from and that summary's commit (``reused``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from stalerl.core.errors import refuse_unknown_keys
from stalerl.core.io import atomic_write_text
from stalerl.results.run_summary import (SUMMARY_FILE, WARM_START_MARKER, build_summary, digest, identity_fields,
                                         machine_description, read_summary, setting_of, write_summary)
from stalerl_study.report import STUDY_FILE, make_set_aside_dir, read_summary_file

SPEC_KEYS = {"name", "title", "config", "overrides", "losses", "variants", "settings", "seeds", "method_keys",
             "parallel", "warm_start_cache", "results", "doc", "experiment_name", "figure_metrics",
             "claims", "setting_losses", "pilot", "variant_losses"}


class StudyError(ValueError):
    pass


def load_spec(path: os.PathLike) -> dict[str, Any]:
    p = Path(path)
    spec = yaml.safe_load(p.read_text()) or {}
    refuse_unknown_keys(str(p), spec, SPEC_KEYS, StudyError)
    for key in ("name", "config", "losses", "settings", "seeds"):
        if not spec.get(key):
            raise StudyError(f"{p}: '{key}' is required (see stalerl_study/cli.py for the format)")
    claims = spec.get("claims")
    if isinstance(claims, dict):  # pre-registered claims (stalerl_study.prereg): checked before anything runs
        from stalerl_study.prereg import ClaimSpecError, parse_claims

        try:
            parse_claims(claims)
        except ClaimSpecError as exc:
            raise StudyError(f"{p}: {exc}") from exc
    elif claims not in (None, "staleness", "async"):
        raise StudyError(f"{p}: claims={claims!r}; expected a mapping of pre-registered claims (see "
                         "stalerl_study/prereg.py), or the legacy staleness / async (or leave it out)")
    if not isinstance(spec["settings"], dict):
        raise StudyError(f"{p}: 'settings' must map a setting name to its list of overrides")
    spec.setdefault("title", spec["name"])
    spec.setdefault("overrides", [])
    spec.setdefault("variants", {})
    spec.setdefault("method_keys", ["loss"] + (["behavior_logp"] if spec["variants"] else []))
    spec.setdefault("parallel", 1)
    spec.setdefault("warm_start_cache", True)
    spec.setdefault("results", f"docs/algorithms/results/{spec['name']}")
    spec.setdefault("doc", "docs/algorithms/m2po.md")
    spec.setdefault("experiment_name", f"study-{spec['name']}")
    spec["seeds"] = [int(s) for s in spec["seeds"]]
    # The whole grid as registered: study.json and the block describe it, and the claims' power is stated for its
    # seeds, whichever --seeds/--losses/--settings cut one invocation runs
    spec["registered"] = {"seeds": list(spec["seeds"]), "losses": list(spec["losses"]),
                          "settings": dict(spec["settings"])}
    _check_loss_map(spec, p, "variant_losses", "variants", "a variant name to the losses run with it")
    _check_loss_map(spec, p, "setting_losses", "settings", "a setting name to the losses run there (e.g. the "
                    "on-policy setting run once: {{fixed_staleness 0: [vanilla]}})")
    # Every run the spec lists (--seeds/--losses/--settings may cut what one invocation runs, never what it keeps)
    spec["registered_trials"] = [r["trial"] for r in expand(spec)]
    if isinstance(claims, dict):
        _check_claim_cells(spec, p)
    if spec.get("pilot") is not None:
        from stalerl_study.pilot import check_pilot

        try:
            check_pilot(spec["pilot"])
        except ValueError as exc:
            raise StudyError(f"{p}: {exc}") from exc
    return spec



def _check_loss_map(spec: dict[str, Any], p: Any, key: str, names_key: str, what: str) -> None:
    """``spec[key]`` (default {}) maps names from ``spec[names_key]`` to non-empty lists of the spec's losses: the
    runs of those variants / settings use only those losses (``variant_losses``, ``setting_losses``)."""
    mapping = spec.setdefault(key, {})
    if not isinstance(mapping, dict):
        raise StudyError(f"{p}: '{key}' must map {what}")
    for name, losses in mapping.items():
        if name not in spec[names_key]:
            raise StudyError(f"{p}: {key} names {name!r}, which is not in '{names_key}' "
                             f"({', '.join(spec[names_key]) or 'none'})")
        bad = [x for x in (losses or []) if x not in spec["losses"]]
        if not losses or bad:
            raise StudyError(f"{p}: {key}[{name!r}]={losses!r}: expected a non-empty list of losses "
                             f"from 'losses' ({', '.join(spec['losses'])})")

def _check_claim_cells(spec: dict[str, Any], p: Path) -> None:
    """Every cell a pre-registered claim names must be in the grid (a typo would make a claim untestable)."""
    from stalerl_study.prereg import parse_claims

    grid = {tuple(x) for x in _grid(spec)}
    claim_set = parse_claims(spec["claims"])
    cells = [("baseline", claim_set.baseline)] if claim_set.baseline else []
    cells += [(f"{c.id}.{k}", getattr(c, k)) for c in claim_set.claims for k in ("a", "b")]
    for where, cell in cells:
        if cell not in grid:
            raise StudyError(f"{p}: claims {where} names '{cell[0]} @ {cell[1]}', which the grid does not run; "
                             f"expected one of {', '.join(f'{m} @ {st}' for m, st in sorted(grid))}")


def _losses_at(spec: dict[str, Any], setting: str) -> list[str]:
    """The losses run at a setting: setting_losses' list (within a --losses subset), else every loss."""
    only = (spec.get("setting_losses") or {}).get(setting)
    return [x for x in spec["losses"] if x in only] if only else list(spec["losses"])


def _variants_of(spec: dict[str, Any], loss: str) -> dict[str, list[str]]:
    """The variants run with ``loss``: all of them, except those variant_losses gives to other losses only."""
    only = spec.get("variant_losses") or {}
    return {name: ovr for name, ovr in (spec["variants"] or {"": []}).items()
            if name not in only or loss in only[name]}


def _grid(spec: dict[str, Any]) -> list[list[str]]:
    """[method label, setting] of every cell the spec runs (setting_losses restricts a setting's losses,
    variant_losses a variant's)."""
    labels = dict(zip(spec["losses"], _labels_per_loss(spec)))
    out = []
    for setting in spec["settings"]:
        for loss in _losses_at(spec, setting):
            out += [[m, setting] for m in labels[loss]]
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", text).strip("_")


def expand(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The grid in (setting, loss, variant, seed) order: [{trial, seed, setting, overrides}]."""
    runs = []
    for setting, s_ovr in spec["settings"].items():
        for loss in _losses_at(spec, setting):
            for variant, v_ovr in _variants_of(spec, loss).items():
                for seed in spec["seeds"]:
                    trial = "-".join(x for x in (_slug(loss), _slug(variant), _slug(setting), f"seed{seed}") if x)
                    runs.append({"trial": trial, "seed": seed, "setting": setting,
                                 "method": _label(spec, loss, v_ovr), "overrides": [
                        *spec["overrides"], f"experiment_name={spec['experiment_name']}", f"actor.loss={loss}",
                        *(v_ovr or []), *(s_ovr or []), f"seed={seed}", f"trial_name={trial}",
                        *tracker_overrides(spec)]})
    return runs


_TRACKER_OVERRIDES: dict[tuple, list[str]] = {}


def tracker_overrides(spec: dict[str, Any]) -> list[str]:
    """The study's name as the W&B group and the MLflow experiment (docs/tracking.md), for a tracker the study's
    config enables and leaves unnamed. Only then: an added key changes every run's config digest, and a collected
    run is reused only under the same digest, so studies without trackers keep theirs."""
    key = (spec["config"], tuple(spec["overrides"]), spec["name"])
    if key not in _TRACKER_OVERRIDES:
        try:
            cfg = _load(spec["config"], spec["overrides"])
        except Exception:  # noqa: BLE001 - check_settings loads every run's config and says what is wrong
            return []
        out = []
        if cfg.stats_logger.wandb.mode != "disabled" and cfg.stats_logger.wandb.group is None:
            out.append(f"stats_logger.wandb.group={spec['name']}")
        if cfg.stats_logger.mlflow.enabled and cfg.stats_logger.mlflow.experiment is None:
            out.append(f"stats_logger.mlflow.experiment={spec['name']}")
        _TRACKER_OVERRIDES[key] = out
    return _TRACKER_OVERRIDES[key]


def _load(config: str, overrides: Sequence[str]):
    from stalerl.config import load_config

    return load_config(["--config", config, *overrides])


def check_settings(spec: dict[str, Any], runs: list[dict[str, Any]]) -> list[Any]:
    """Load (validate) every run's config before anything starts; a setting's name must be what its runs report."""
    from stalerl.results.run_summary import _config_dict

    configs = []
    for r in runs:
        cfg = _load(spec["config"], r["overrides"])
        d = _config_dict(cfg)
        got = setting_of(d)["setting"]
        if got != r["setting"]:
            raise StudyError(f"setting {r['setting']!r} runs as {got!r}; rename it to {got!r} in the spec (the report "
                             "groups by the name a run reports)")
        from stalerl_study.report import method_label

        reported = method_label(identity_fields(cfg), spec["method_keys"])
        if r.get("method") is not None and reported != r["method"]:
            raise StudyError(f"run {r['trial']} reports method {reported!r}, the spec calls it {r['method']!r}; "
                             "write the variant's values as the run records them (e.g. 0.0003, 1.0)")
        configs.append(cfg)
    return configs


# ------------------------------------------------------------------------------------------------ warm start
def warm_start_dir(cfg) -> Path:
    """Cache key: everything the warm-started weights depend on (model, data, warm-start config, seed)."""
    from stalerl.results.run_summary import _config_dict

    d = _config_dict(cfg)
    parts = {"actor": {k: d["actor"][k] for k in ("path", "tiny", "dtype")}, "tokenizer": d.get("tokenizer_path"),
             "train_dataset": d["train_dataset"], "warm_start": d["warm_start"], "seed": d["seed"],
             "torch_threads": d["torch_threads"]}
    if cfg.warm_start.target_accuracy > 0:  # the adaptive check's generation settings decide where it stops
        parts["check"] = {"max_new_tokens": d["eval_gconfig"]["max_new_tokens"],
                          "batch_size": d["valid_dataset"]["batch_size"]}
    key = digest(parts)
    # Under the file root, not the experiment: studies sharing a warm start (same key) share the cache.
    return Path(cfg.cluster.fileroot).expanduser() / "warm_start" / f"seed{cfg.seed}-{key}"


def warm_start_to(cfg, out: Path) -> Path:
    """Run the config's warm start once and save the model atomically (a temp directory renamed into place)."""
    import torch

    from stalerl.results.run_summary import _config_dict
    from stalerl.training.trainer import Trainer

    if (out / WARM_START_MARKER).is_file():
        return out
    trainer = Trainer(cfg)
    info = trainer.run_warm_start()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.save_model(tmp)
    marker = {"base_path": cfg.actor.path, "seed": cfg.seed, "torch": torch.__version__,
              "warm_start": _config_dict(cfg)["warm_start"],  # as an in-run warm start's config has it
              "final_loss": info.get("warm_start/final_loss"),
              # what happened: steps done, and for an adaptive warm start its check (see stalerl.training.warm_start)
              "result": {k.split("/", 1)[1]: v for k, v in info.items() if k != "warm_start/seconds"}}
    atomic_write_text(tmp / WARM_START_MARKER, json.dumps(marker, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _pool(commands: list[tuple[str, list[str]]], parallel: int) -> dict[str, int]:
    """Run commands ``parallel`` at a time (each in its own process); returns exit code per started name. Under
    :func:`run_study`'s ``StopRequests`` a SIGTERM/SIGINT is passed on to the commands running (a run stops as it does
    alone: summary ``interrupted``, its one line) and no further command starts."""
    from stalerl.core.interrupt import signals_received, stop_requested

    pending, running, codes = list(commands), {}, {}
    forwarded, _ = signals_received()
    while pending or running:
        while pending and len(running) < max(1, parallel) and stop_requested() is None:
            name, argv = pending.pop(0)
            print(f"start {name}", flush=True)
            running[name] = (subprocess.Popen(argv), time.perf_counter())
        received, signum = signals_received()
        if received > forwarded:  # each new signal once to each running command (Ctrl-C reached them already)
            forwarded = received
            for proc, _ in running.values():
                proc.send_signal(signum)
        for name, (proc, t0) in list(running.items()):
            code = proc.poll()
            if code is not None:
                codes[name] = code
                del running[name]
                print(f"done  {name}: {'ok' if code == 0 else f'failed ({code})'} in {time.perf_counter() - t0:.0f}s",
                      flush=True)
        if not running and stop_requested() is not None:
            break  # the pending ones are not started
        time.sleep(0.2)
    return codes


# ------------------------------------------------------------------------------------------------ run
def run_study(spec: dict[str, Any], *, spec_path: str, dry_run: bool = False, force: bool = False,
              scheduler: Optional[str] = None, report: bool = True, command: Optional[str] = None,
              invocation: Optional[str] = None) -> int:
    """Warm starts, the grid, the collected summaries, the report. A SIGTERM/SIGINT (a Slurm time limit, Ctrl-C, a
    session ending) is passed on to the runs in flight, which stop as runs do; no further run starts, the finished
    runs' summaries are collected with the wall time so far, the report is left as it was, and the process exits
    128 + signal. The same command resumes, in this checkout or a fresh one (``collected_summary``)."""
    from stalerl.core.interrupt import StopRequests, polled

    with StopRequests(), polled():  # a signal is only recorded here; the loops below poll it and act
        return _run_study(spec, spec_path=spec_path, dry_run=dry_run, force=force, scheduler=scheduler,
                          report=report, command=command, invocation=invocation)


def _run_study(spec: dict[str, Any], *, spec_path: str, dry_run: bool, force: bool, scheduler: Optional[str],
               report: bool, command: Optional[str], invocation: Optional[str] = None) -> int:
    """The steps of :func:`run_study`, in order; each stops the study (an exit code) or hands its result on."""
    start = time.time()
    grid = _plan_runs(spec, scheduler)
    check_power(spec)  # prints every claim's power; refuses an underpowered equivalence claim before any work
    print(f"study {spec['name']}: {len(grid.runs)} runs (scheduler.type={grid.kind}, parallel={spec['parallel']})")
    for r in grid.runs:
        print(f"  {r['trial']}")
    if dry_run:
        return 0
    _use_warm_start_cache(spec, grid)
    reuse = _find_reusable_runs(spec, grid, force)
    code = _warm_start_seeds(spec, grid, reuse)
    if code is not None:
        return code
    codes, sweep_signum = _run_remaining(spec, grid, reuse)
    statuses, signum = _collect_summaries(spec, grid, reuse, codes, sweep_signum)
    wall = _write_study_file(spec, grid, reuse, start=start, spec_path=spec_path, command=command,
                             invocation=invocation)
    return _finish(spec, grid, statuses, codes, signum=signum, wall=wall, report=report)


@dataclass
class _Grid:
    """The runs of one invocation in grid order, ``configs[i]`` the loaded config of ``runs[i]``."""
    runs: list[dict[str, Any]]
    configs: list[Any]
    kind: str  # scheduler.type of the runs
    cached: bool = False  # the warm-start cache is used: every RL run starts from its seed's saved model
    warm_cmds: dict[str, list[str]] = field(default_factory=dict)  # trial -> [cache dir, *its warm start's argv]


@dataclass
class _Reuse:
    """What the runs of a :class:`_Grid` need: which are done already and which are to run."""
    here: dict[str, Any]  # this checkout's code (stalerl.results.run_summary.code_state)
    reused: dict[str, tuple[Path, dict[str, Any]]]  # trial -> (the summary file it came from, the summary)
    refused: dict[str, int]  # why finished summaries were not reused -> how many
    todo: list[tuple[dict[str, Any], Any]]  # (run, config) of each run to do
    stale: dict[str, Optional[int]]  # trial to do -> mtime of the summary its run directory holds now, if any
    kept: list[dict[str, Any]]  # reused summaries found only in ``results`` (their run directory is not here)


def _plan_runs(spec: dict[str, Any], scheduler: Optional[str]) -> _Grid:
    """Expand the grid and load (validate) every run's config before anything starts: a bad override or a setting
    named otherwise than its runs report fails in seconds, not after hours of runs."""
    runs = expand(spec)
    if scheduler:
        for r in runs:
            r["overrides"].append(f"scheduler.type={scheduler}")
    configs = check_settings(spec, runs)
    return _Grid(runs=runs, configs=configs, kind=configs[0].scheduler.type)


def _use_warm_start_cache(spec: dict[str, Any], grid: _Grid) -> None:
    """With the warm-start cache every RL run starts from its seed's saved model (``actor.path=<cache>
    warm_start.steps=0``), so the supervised warm start runs once per seed, not once per run. The cache's path is part
    of each run's config, so it is set (and the configs reloaded) before the reuse check compares configs."""
    grid.cached = bool(spec["warm_start_cache"] and grid.configs[0].warm_start.steps > 0)
    if not grid.cached:
        return
    for r, cfg in zip(grid.runs, grid.configs):
        d = warm_start_dir(cfg)
        grid.warm_cmds[r["trial"]] = [str(d), sys.executable, "-m", "stalerl_study.cli", "warm-start", "--out",
                                      str(d), "--config", spec["config"], *r["overrides"]]
        r["overrides"] += [f"actor.path={d}", "warm_start.steps=0"]
    grid.configs = [_load(spec["config"], r["overrides"]) for r in grid.runs]


def _find_reusable_runs(spec: dict[str, Any], grid: _Grid, force: bool) -> _Reuse:
    """Which runs are already done, so an interrupted study resumes instead of starting over: finished (or diverged)
    in their run directory, or (a study resumed in a fresh checkout, whose run directories are gone) collected in
    ``results``, from the same config and the same code (:func:`reuse_refusal`). Refuses (before any warm start) to
    add runs to collected ones that used other kernels, which would not pair with them."""
    from stalerl.config import run_dir
    from stalerl.results.run_summary import code_state

    results = Path(spec["results"])
    here = code_state()
    reused: dict[str, tuple[Path, dict[str, Any]]] = {}
    refused: dict[str, int] = {}
    if not force:
        for r, c in zip(grid.runs, grid.configs):
            found = find_reusable(r["trial"], c, results, here)
            if isinstance(found, tuple):
                reused[r["trial"]] = found
            elif found:
                refused[found] = refused.get(found, 0) + 1
    todo = [(r, c) for r, c in zip(grid.runs, grid.configs) if r["trial"] not in reused]
    # A run to do may hold an earlier run's summary (other code or config): collected only if the run rewrites it
    stale = {r["trial"]: _mtime(run_dir(c) / SUMMARY_FILE) for r, c in todo}
    kept = [s for path, s in reused.values() if path.parent == results]  # no run directory here: maybe another machine
    if todo and kept:
        check_same_kernels(spec["name"], kept)
    return _Reuse(here=here, reused=reused, refused=refused, todo=todo, stale=stale, kept=kept)


def _warm_start_seeds(spec: dict[str, Any], grid: _Grid, reuse: _Reuse) -> Optional[int]:
    """Warm start once per seed that still has a run to do and no saved model yet, before the grid: the RL runs load
    the saved model. Returns the exit code to stop the study with (a signal, a failed warm start), else None."""
    from stalerl.core.interrupt import signal_name, stop_requested

    if not grid.cached:
        return None
    jobs: dict[str, list[str]] = {}
    for r, _ in reuse.todo:
        d, *argv = grid.warm_cmds[r["trial"]]
        if not (Path(d) / WARM_START_MARKER).is_file():
            jobs.setdefault(d, argv)
    t0 = time.time()
    codes = _pool([(f"warm start {Path(k).name}", v) for k, v in jobs.items()], spec["parallel"])
    if (signum := stop_requested()) is not None:
        print(f"study {spec['name']}: interrupted by {signal_name(signum)} during the warm starts; the finished "
              "ones are kept (each is saved whole or not at all); the same command resumes", file=sys.stderr)
        return 128 + signum
    if any(codes.values()):
        print("a warm start failed; see its output above", file=sys.stderr)
        return 1
    if jobs:
        print(f"warm starts: {len(jobs)} in {time.time() - t0:.0f}s")
    return None


def _run_remaining(spec: dict[str, Any], grid: _Grid, reuse: _Reuse) -> tuple[dict[str, int], Optional[int]]:
    """Say what is reused and why finished runs are not, then run the runs still to do: ``parallel`` at a time under
    the local scheduler, else as one sweep on the cluster scheduler. Returns (exit code per run started, the signal
    a cluster sweep was stopped by or None)."""
    results = Path(spec["results"])
    for why, n in sorted(reuse.refused.items()):
        print(f"study {spec['name']}: not reusing {n} finished run{'s' if n > 1 else ''}: {why}")
    here, kept, todo = reuse.here, reuse.kept, reuse.todo
    code_now = "no git checkout" if not here["commit"] else f"commit {here['commit'][:12]}" + (
        f" with uncommitted changes {here['dirty_digest']}" if here["dirty"] else "")
    print(f"{len(reuse.reused)} runs already finished with this config and code ({code_now})"
          f"{f'; {len(kept)} of them only in {results}' if kept else ''}; running {len(todo)}")
    codes: dict[str, int] = {}
    sweep_signum = None  # a cluster sweep takes the signal itself (stalerl.launch.cli.run_sweep_on) and says which
    if todo and grid.kind == "local":
        codes = _pool([(r["trial"], [sys.executable, "-m", "stalerl.launch.cli", "--config", spec["config"],
                                     *r["overrides"]]) for r, _ in todo], spec["parallel"])
    elif todo:
        from stalerl.launch.cli import run_sweep_on

        statuses, sweep_signum = run_sweep_on(grid.kind, spec["config"],
                                              [(r["trial"], r["overrides"]) for r, _ in todo],
                                              [c for _, c in todo])  # an interrupted run has no finished summary
        codes = {r["trial"]: 0 if s == "ok" else 1 for (r, _), s in zip(todo, statuses)}
    return codes, sweep_signum


def _collect_summaries(spec: dict[str, Any], grid: _Grid, reuse: _Reuse, codes: dict[str, int],
                       sweep_signum: Optional[int]) -> tuple[dict[str, Optional[str]], Optional[int]]:
    """Copy each run's summary into ``results``, where the report reads them and where they are committed (a run that
    died without one gets a failed summary from its config; after a signal, only finished or diverged runs are
    collected, so the resumed study runs the others). Summaries of runs this spec no longer lists (an earlier cut of
    the grid) are moved aside, so the block shows this spec; those of its runs that a --seeds/--losses/--settings cut
    did not run now stay. Returns (status per collected run, the signal the study was stopped by or None)."""
    from stalerl.config import run_dir
    from stalerl.core.interrupt import stop_requested

    results = Path(spec["results"])
    results.mkdir(parents=True, exist_ok=True)
    moved = set_aside_other_summaries(results, {*spec.get("registered_trials", ()), *(r["trial"] for r in grid.runs)})
    if moved:
        print(f"study {spec['name']}: {len(moved)} summaries in {results} are of runs this spec does not list "
              f"({', '.join(p.stem for p in moved[:5])}{', ...' if len(moved) > 5 else ''}); moved to "
              f"{moved[0].parent} so the report shows only this spec's runs")
    signum = stop_requested() or sweep_signum
    statuses: dict[str, Optional[str]] = {}
    for r, cfg in zip(grid.runs, grid.configs):
        path = run_dir(cfg) / SUMMARY_FILE
        if r["trial"] in reuse.reused:  # from its run directory, or collected earlier (its run directory is gone)
            summary = reuse.reused[r["trial"]][1]
        else:  # run now (a summary it did not write, e.g. one that never started after a signal, is not its own)
            fresh = r["trial"] in codes and _mtime(path) not in (None, reuse.stale.get(r["trial"]))
            summary = read_summary(path) if fresh else None
        if signum is not None and (summary or {}).get("status") not in ("finished", "diverged"):
            summary = None  # stopped, or never started: collected when the resumed study has run it
        if summary is not None:
            pass
        elif signum is not None:
            continue
        else:
            summary = build_summary(cfg, status="failed", wall_s=0.0,
                                    error=f"no summary written (exit code {codes.get(r['trial'])})")
        write_summary(results / f"{r['trial']}.json", summary)
        statuses[r["trial"]] = summary.get("status")
    return statuses, signum


def _write_study_file(spec: dict[str, Any], grid: _Grid, reuse: _Reuse, *, start: float, spec_path: str,
                      command: Optional[str], invocation: Optional[str]) -> float:
    """Write ``results/study.json``: what the report needs besides the summaries (the registered grid, methods,
    claims, the pilot's rule, how to reproduce and regenerate the block), the wall time over every invocation that ran
    part of the table, and where each reused run's summary came from. Returns that wall time (seconds)."""
    results = Path(spec["results"])
    todo = reuse.todo
    own = time.time() - start if todo else 0.0  # an invocation with nothing to run adds no time to the table
    wall = own
    # The table's time includes earlier invocations whose summaries this one kept: a resumed study, or the other
    # parts of a grid run as --seeds/--losses/--settings cuts (not when everything was re-run: --force, all todo).
    ran_now = {r["trial"] for r, _ in todo}
    earlier = [t for t in spec.get("registered_trials", [r["trial"] for r in grid.runs])
               if t not in ran_now and (results / f"{t}.json").is_file()]
    previous_meta = _read_study_file(results / STUDY_FILE) if earlier else {}
    wall += float(previous_meta.get("wall_s") or 0.0)
    full = {**spec, **spec.get("registered", {})}  # the registered grid, not this invocation's cut
    meta = {
        "name": spec["name"], "title": spec["title"], "method_keys": spec["method_keys"], "seeds": full["seeds"],
        "settings": list(full["settings"]),
        "methods": _method_labels(full),
        "command": command or f"stalerl-study run {spec_path}",
        "regenerate": f"stalerl-report {spec['results']} --update-doc {spec['doc']}",
        "wall_s": round(wall, 1), "runs": len(expand(full)), "parallel": spec["parallel"], "scheduler": grid.kind,
        "machine": machine_description(),
        # each invocation that ran part of this table: its command, runs and wall time (the sum is wall_s)
        "invocations": _invocations(previous_meta) + ([{
            "command": invocation or command or f"stalerl-study run {spec_path}", "runs": len(todo),
            "wall_s": round(own, 1)}] if todo else []),
    }
    # What was reused, from where: this invocation's reuses, and an earlier invocation's for runs it did not list
    listed = {r["trial"] for r in grid.runs}
    earlier_reused = {t: v for t, v in (_read_study_file(results / STUDY_FILE).get("reused") or {}).items()
                      if t not in listed and (results / f"{t}.json").is_file()}
    meta["reused"] = {**earlier_reused, **{t: reuse_record(p, s) for t, (p, s) in reuse.reused.items()}}
    for key in ("figure_metrics", "claims", "pilot"):  # optional: figures, claims to check, a pilot's rule
        if spec.get(key):
            meta[key] = spec[key]
    if full.get("setting_losses"):  # not the full loss x setting product: the report shows only these cells
        meta["grid"] = _grid(full)
    atomic_write_text(results / STUDY_FILE, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return wall


def _finish(spec: dict[str, Any], grid: _Grid, statuses: dict[str, Optional[str]], codes: dict[str, int], *,
            signum: Optional[int], wall: float, report: bool) -> int:
    """The study's exit: after a signal, say what was collected and how to resume (128 + signal, the doc block left
    as it was: it would show a partial grid); else regenerate the doc's block with ``stalerl-report``, and exit 0
    unless a run failed (a diverged run exits with an error but is a result, not a failed study)."""
    from stalerl.core.interrupt import signal_name

    results = Path(spec["results"])
    if signum is not None:
        done = sum(1 for v in statuses.values() if v in ("finished", "diverged"))
        print(f"study {spec['name']}: interrupted by {signal_name(signum)}: {done} of {len(grid.runs)} runs finished, "
              f"their summaries collected in {results} (wall time so far {wall / 60:.1f} min); the report was not "
              "updated; the same command resumes (in a fresh checkout at the same commit too: runs whose collected "
              "summary has their config and code are not re-run)", file=sys.stderr)
        return 128 + signum
    print(f"study {spec['name']}: {len(grid.runs)} runs, wall time {wall / 60:.1f} min; summaries in {results}")
    if report:
        from stalerl_study.report import main as report_main

        code = report_main([str(results), "--update-doc", spec["doc"]])
        if code:
            return code
    return 0 if all(c == 0 or statuses.get(t) == "diverged" for t, c in codes.items()) else 1


def check_power(spec: dict[str, Any], *, out=print) -> None:
    """Print each pre-registered claim's minimum detectable effect / equivalence power at the registered seeds, then
    refuse (StudyError, one line per claim) an equivalence claim that cannot pass at a true difference of 0 (or that
    states no expected_sd) unless it says accept_low_power; with ``claims.power: holm`` also a primary claim below
    power 0.8 at Holm's strictest level (see stalerl_study.prereg.power_report)."""
    claims = spec.get("claims")
    if not isinstance(claims, dict):
        return
    from stalerl_study.prereg import parse_claims, power_report

    n = len(spec.get("registered", spec)["seeds"])
    report = power_report(parse_claims(claims), n)
    out(f"study {spec['name']}: power of the pre-registered claims at the spec's {n} seeds (paired normal "
        "differences with the stated SD; Holm can only lower it):")
    for p in report:
        out(f"  {p.line}")
    if len(spec["seeds"]) != n:
        out(f"  (this invocation runs {len(spec['seeds'])} of the {n} registered seeds: a validation grid, not the "
            "registered study)")
    refusals = [p.refusal for p in report if p.refusal]
    if refusals:
        raise StudyError("; ".join(refusals))


def paired_sd(results: str, a: str, b: str, metric: str, metric_b: Optional[str], method_keys: Sequence[str]) -> str:
    """Mean and SD of the per-seed differences a - b in committed summaries (for a later spec's expected_sd)."""
    from stalerl_study.report import ReportError, group, load_study, load_summaries
    from stalerl_study.metrics import CollapseRule
    from stalerl_study.prereg import ClaimSpecError, paired_values, parse_cell

    try:
        meta = load_study([results])
        cells = group(load_summaries([results]), method_keys=meta.get("method_keys") or method_keys,
                      grid=meta.get("grid"))
        pairs = paired_values(cells, parse_cell(a, "--a"), parse_cell(b, "--b"), metric, metric_b, CollapseRule())
    except (ReportError, ClaimSpecError) as exc:
        raise StudyError(str(exc)) from exc
    diffs = [x - y for _, x, y in pairs]
    if len(diffs) < 2:
        raise StudyError(f"{results}: {len(diffs)} paired seed(s) of {a!r} and {b!r} with {metric}; need >= 2")
    mean = sum(diffs) / len(diffs)
    sd = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
    return f"{a} - {b}, {metric}{f' vs {metric_b}' if metric_b else ''}: n={len(diffs)} mean {mean:+.4f} sd {sd:.4f}"


def set_aside_other_summaries(results: Path, trials: set[str]) -> list[Path]:
    """Move the run summaries directly in ``results`` whose trial is not in ``trials`` to
    ``results/superseded/<UTC time>/`` (never deleted: they may be the only copy); returns their new paths. Other
    files (study.json, figures, anything that is not a summary) stay where they are."""
    others = sorted(f for f in results.glob("*.json")
                    if f.name != STUDY_FILE and f.stem not in trials and read_summary_file(f) is not None)
    if not others:
        return []
    dest = make_set_aside_dir(results)
    moved = []
    for f in others:
        os.replace(f, dest / f.name)  # same file system: atomic, nothing half-copied
        moved.append(dest / f.name)
    return moved


def _label(spec: dict[str, Any], loss: str, overrides: Optional[Sequence[str]]) -> str:
    """The method label a run of ``loss`` with a variant's overrides will report (checked against the config by
    check_settings, so a value written differently from how the summary records it is caught before any run)."""
    from stalerl_study.report import method_label

    fields = {"loss": loss}
    for o in overrides or []:
        k, _, v = o.partition("=")
        fields[k.rsplit(".", 1)[-1]] = v
    return method_label(fields, spec["method_keys"])


def _labels_per_loss(spec: dict[str, Any]) -> list[list[str]]:
    """Per loss (in spec order), the method labels of its variants as the report names them."""
    return [[_label(spec, loss, ovr) for ovr in _variants_of(spec, loss).values()] for loss in spec["losses"]]


def _invocations(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """An earlier study.json's invocations (one written before they were recorded counts as one)."""
    if "invocations" in meta:
        return list(meta["invocations"])
    return [{"command": meta["command"], "runs": meta.get("runs"), "wall_s": meta["wall_s"]}] \
        if meta.get("command") and meta.get("wall_s") is not None else []


def _read_study_file(path: Path) -> dict[str, Any]:
    """An earlier invocation's study.json, or {} (none, or unreadable: its time is then not counted)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _method_labels(spec: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(m for labels in _labels_per_loss(spec) for m in labels))


def reuse_refusal(summary: Optional[dict[str, Any]], stable: str, here: dict[str, Any]) -> Optional[str]:
    """Why a run's existing summary may not stand for a run of the config whose ``config_digest_stable`` is ``stable``
    under the code ``here`` (stalerl.results.run_summary.code_state), or None when it may: it finished or diverged
    (a divergence is a result), with the same stable digest, a recorded commit equal to ``here``'s, and the same
    uncommitted changes (both clean, or both dirty with the same ``dirty_digest``)."""
    if not summary:
        return "no summary"
    if summary.get("status") not in ("finished", "diverged"):
        return f"status {summary.get('status')}"
    if "config_digest_stable" not in summary:
        return "no stable config digest recorded (a summary from before provenance was recorded)"
    if summary["config_digest_stable"] != stable:
        return "another config (config_digest_stable differs)"
    code = summary.get("code") or {}
    if not code.get("commit"):
        return "no commit recorded (written outside a git checkout)"
    if not here.get("commit"):
        return "this process does not run from a git checkout, so no recorded commit can be checked"
    if code["commit"] != here["commit"]:
        return f"written at commit {code['commit'][:12]}, HEAD is {here['commit'][:12]}"
    if code.get("dirty") is None or here.get("dirty") is None:
        return "the uncommitted changes could not be determined"
    if (code["dirty"], code.get("dirty_digest")) != (here["dirty"], here.get("dirty_digest")):
        def state(c: dict[str, Any]) -> str:
            return f"uncommitted changes {c.get('dirty_digest')}" if c["dirty"] else "a clean tree"
        return f"written with {state(code)}, this checkout has {state(here)}"
    return None


def find_reusable(trial: str, cfg: Any, results: Path, here: dict[str, Any]):
    """(path, summary) of a summary that may stand for this run (its run directory's first, then the one collected
    in ``results``: run directories are machine-local and not committed, the collected summaries are, so a study cut
    short in one session goes on in the next), else the reason the finished one found was not reused, or None when
    there is no finished summary at all."""
    from stalerl.config import run_dir
    from stalerl.results.run_summary import stable_digest

    stable = stable_digest(cfg)
    why = None
    for path in (run_dir(cfg) / SUMMARY_FILE, results / f"{trial}.json"):
        summary = read_summary_file(path) if path.is_file() else None
        if summary is None or summary.get("status") not in ("finished", "diverged"):
            continue
        why = reuse_refusal(summary, stable, here)
        if why is None:
            return path, summary
    return why


def collected_summary(results: Path, trial: str, cfg: Any,
                      here: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The summary already collected in ``results`` for ``trial`` if it may stand for this run (:func:`reuse_refusal`
    with this checkout's code, or ``here``), else None."""
    from stalerl.results.run_summary import code_state, stable_digest

    summary = read_summary_file(results / f"{trial}.json")
    ok = reuse_refusal(summary, stable_digest(cfg), code_state() if here is None else here) is None
    return summary if ok else None


def reuse_record(path: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """study.json's record of a reused run: the summary file it came from and the code that wrote it."""
    code = summary.get("code") or {}
    return {"summary": str(path), "commit": code.get("commit"), "dirty": code.get("dirty"),
            "dirty_digest": code.get("dirty_digest"), "config_digest_stable": summary.get("config_digest_stable"),
            "status": summary.get("status")}


def run_kernels(machine: dict[str, Any]) -> str:
    """The CPU kernels a run's machine description says ATen used, and the torch build: the same config trains to
    other numbers under AVX2 and AVX512 kernels (the warm start already differs), so a study's seeds pair across cells
    only if every run used the same."""
    cap = str(machine.get("aten_cpu_capability") or "default").lower()
    if cap == "default":
        isa = machine.get("cpu_isa")
        if isa is None:  # summaries written before the ISA was recorded: nothing to compare
            return f"unrecorded kernels, torch {machine.get('torch')}"
        cap = "avx512" if "avx512f" in isa else "avx2" if "avx2" in isa else "default"
    return f"{cap} kernels, torch {machine.get('torch')}"


def check_same_kernels(name: str, kept: list[dict[str, Any]]) -> None:
    """Refuse (one line, before any warm start) to add runs to a study whose collected runs used other kernels or
    another torch: the new runs would start from other warm-started models and not pair with the kept ones."""
    here = run_kernels(machine_description())
    theirs = sorted({run_kernels(s.get("machine") or {}) for s in kept} - {here})
    theirs = [t for t in theirs if not t.startswith("unrecorded")]
    if theirs:
        hint = next((f"ATEN_CPU_CAPABILITY={t.split()[0]} " for t in theirs if t.split()[0] in ("avx2", "avx512")), "")
        raise StudyError(f"study {name}: its collected runs used {', '.join(theirs)}; this process would use {here}, "
                         "so the runs it adds would not pair with them (other warm starts, other trajectories); run "
                         f"it as `{hint}stalerl-study run ...` with the same torch, or add --force to re-run every run")


def _mtime(path: Path) -> Optional[int]:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


# Provenance, not outcome: left out when a re-run is compared with a collected summary.
_PROVENANCE_FIELDS = ("run", "experiment", "config_digest", "setting_digest", "wall_s", "wall_s_total",
                      "step_seconds", "machine", "warm_start_cached", "config_digest_stable", "code", "started_utc",
                      "ended_utc", "versions")


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{path or '/'}: {type(new).__name__} instead of a mapping"]
        out = []
        for k, v in old.items():
            if not path and k in _PROVENANCE_FIELDS:
                continue
            out += [f"{path}/{k}: missing"] if k not in new else _differences(v, new[k], f"{path}/{k}")
        return out
    return [] if old == new else [f"{path}: {str(old)[:40]} vs {str(new)[:40]}"]


def compare_collected(old_dir: str, new_dir: str, renames: Sequence[str]) -> tuple[list[str], int]:
    """A reuse check: each summary in ``old_dir`` whose run name starts with a renamed prefix (``OLD=NEW``) against
    the summary of the same run in ``new_dir`` (a re-run), over every field the old one has but provenance (names,
    digests, wall times, machine). Returns one line per compared run and the number that differ; runs with no
    re-run are listed as such."""
    pairs = []
    for item in renames:
        if "=" not in item:
            raise StudyError(f"--rename {item!r}: expected OLD_PREFIX=NEW_PREFIX, e.g. "
                             "vanilla-fixed_staleness_64=vanilla-tau0.04-fixed_staleness_64")
        pairs.append(tuple(item.split("=", 1)))
    lines, differ = [], 0
    for f in sorted(Path(old_dir).glob("*.json")):
        old = read_summary_file(f)
        match = next(((a, b) for a, b in pairs if f.stem.startswith(a + "-")), None) if old else None
        if match is None:
            continue
        name = match[1] + f.stem[len(match[0]):]
        new = read_summary_file(Path(new_dir) / f"{name}.json")
        if new is None:
            lines.append(f"{f.stem} -> {name}: not re-run")
            continue
        diff = _differences(old, new)
        compared = len([k for k in old if k not in _PROVENANCE_FIELDS])
        differ += bool(diff)
        lines.append(f"{f.stem} -> {name}: " + (f"identical in all {compared} outcome fields" if not diff else
                                                 f"{len(diff)} differ: {'; '.join(diff[:3])}"))
    if not lines:
        raise StudyError(f"{old_dir}: no summary whose run name starts with {', '.join(a for a, _ in pairs)}")
    return lines, differ


def pilot_decision(results: str, spec_path: str) -> int:
    """Print the pilot's decision table (stalerl_study.pilot) from its collected summaries."""
    from stalerl_study.pilot import render_pilot
    from stalerl_study.report import ReportError, group, load_study, load_summaries

    spec = load_spec(spec_path)
    if not isinstance(spec.get("pilot"), dict):
        raise StudyError(f"{spec_path}: no 'pilot' mapping (stale_loss, on_policy, prosper, collapse); add the rule")
    try:
        meta = load_study([results])
        cells = group(load_summaries([results]), method_keys=spec["method_keys"], grid=meta.get("grid"))
    except ReportError as exc:
        raise StudyError(str(exc)) from exc
    print(render_pilot(cells, spec["pilot"]))
    return 0


def apply_cli(spec: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Restrict or redirect a spec from the command line (tiny validation grids never touch the docs)."""
    def subset(key: str, text: Optional[str], cast=str):
        if not text:
            return
        want = [cast(x) for x in text.split(",")]
        have = list(spec[key])
        bad = [w for w in want if w not in have]
        if bad:
            raise StudyError(f"--{key} {text!r}: {bad} not in the spec's {key} {have}")
        spec[key] = {k: spec[key][k] for k in want} if isinstance(spec[key], dict) else want

    subset("seeds", a.seeds, int)
    subset("losses", a.losses)
    subset("settings", a.settings)
    spec["overrides"] = [*spec["overrides"], *a.set]
    for key in ("results", "doc", "parallel", "experiment_name"):
        if getattr(a, key) is not None:
            spec[key] = getattr(a, key)
    return spec


def registration_report(results: str, spec: str, *, out=print) -> int:
    """``stalerl-study registration``: exit 0 when every collected run ran from a clean commit holding the registered
    spec byte for byte (stalerl_study.registration), else 1 with one line per run that does not."""
    from stalerl_study.registration import check_runs
    from stalerl_study.report import ReportError, load_summaries

    try:
        summaries = load_summaries([results])
        added, ok, bad = check_runs(summaries, Path(spec))
    except (ReportError, ValueError) as exc:
        raise StudyError(str(exc)) from exc
    if added is None:
        raise StudyError(f"{spec}: git has never held this spec; commit the registration before any run")
    commit, when = added.split(" ", 1)
    out(f"registration: {spec} first committed in {commit[:12]} ({when})")
    for line in (*ok, *bad):
        out(f"  {line}")
    if not summaries:
        out("  no runs collected yet")
    out(f"{len(ok)} of {len(summaries)} runs ran from a clean commit holding the registered spec")
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="stalerl-study", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a study spec, collect its summaries, regenerate its doc block")
    r.add_argument("spec")
    r.add_argument("--seeds", help="only these seeds (comma-separated)")
    r.add_argument("--losses", help="only these losses")
    r.add_argument("--settings", help="only these settings (names, comma-separated)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable), e.g. total_train_steps=20")
    r.add_argument("--results", help="collect summaries here instead of the spec's results directory")
    r.add_argument("--doc", help="update this document instead of the spec's")
    r.add_argument("--experiment-name", dest="experiment_name", help="run directory group (default study-<name>)")
    r.add_argument("--parallel", type=int, help="runs at once under the local scheduler")
    r.add_argument("--scheduler", choices=("local", "ray", "slurm"), help="override scheduler.type")
    r.add_argument("--force", action="store_true", help="rerun runs that already finished")
    r.add_argument("--no-report", action="store_true", help="collect summaries, do not touch the doc")
    r.add_argument("--dry-run", action="store_true", help="list and validate the runs only")
    pl = sub.add_parser("pilot", help="apply a pilot spec's decision rule to its collected summaries")
    pl.add_argument("results", help="the pilot's results directory (collected summaries and study.json)")
    pl.add_argument("--spec", required=True, help="the pilot's study spec (its 'pilot' mapping)")
    pw = sub.add_parser("power", help="print the pre-registered claims' power at the spec's seeds (and whether "
                                      "`run` would refuse them); runs nothing")
    pw.add_argument("spec")
    sd = sub.add_parser("paired-sd", help="mean and SD of per-seed differences in collected summaries (for a "
                                          "claim's expected_sd)")
    sd.add_argument("results", help="a study's results directory (summaries and study.json)")
    sd.add_argument("--a", required=True, help="cell 'method @ setting'")
    sd.add_argument("--b", required=True, help="cell 'method @ setting'")
    sd.add_argument("--metric", default="last3", help="last3, auc, final, peak_drop or a summary field path")
    sd.add_argument("--metric-b", dest="metric_b", help="b's metric when it differs")
    c = sub.add_parser("compare", help="reuse check: re-run summaries against collected ones, field by field "
                                       "(exit 1 if any differs)")
    c.add_argument("old", help="results directory of the collected summaries (e.g. an earlier study's)")
    c.add_argument("new", help="results directory of the re-runs")
    c.add_argument("--rename", action="append", required=True, metavar="OLD_PREFIX=NEW_PREFIX",
                   help="run-name prefix in OLD and the same runs' prefix in NEW (repeatable)")
    w = sub.add_parser("warm-start", help="(internal) warm-start one seed and save the model")
    w.add_argument("--out", required=True)
    w.add_argument("--config", required=True)
    w.add_argument("overrides", nargs="*")
    rg = sub.add_parser("registration", help="check that every collected run ran from a clean commit holding the "
                                             "registered spec (the registration preceded it)")
    rg.add_argument("results", help="the study's results directory (collected summaries)")
    rg.add_argument("--spec", required=True, help="the registered study spec, as committed")
    a = p.parse_args(argv)
    try:
        if a.cmd == "registration":
            return registration_report(a.results, a.spec)
        if a.cmd == "pilot":
            return pilot_decision(a.results, a.spec)
        if a.cmd == "power":
            check_power(load_spec(a.spec))
            return 0
        if a.cmd == "paired-sd":
            print(paired_sd(a.results, a.a, a.b, a.metric, a.metric_b, ["loss"]))
            return 0
        if a.cmd == "compare":
            lines, differ = compare_collected(a.old, a.new, a.rename)
            print("\n".join(lines))
            print(f"{len(lines) - differ - sum('not re-run' in x for x in lines)} identical, {differ} differ")
            return 1 if differ else 0
        if a.cmd == "warm-start":
            warm_start_to(_load(a.config, a.overrides), Path(a.out))
            return 0
        spec = apply_cli(load_spec(a.spec), a)
        argv = list(sys.argv[1:] if argv is None else argv)
        typed = [x for x in argv if x not in ("--force", "--no-report")]
        invocation = "stalerl-study " + " ".join(shlex.quote(x) for x in typed)
        # The block's "Reproduce" command runs the whole table: a --seeds/--losses/--settings cut is one part of it
        cut, whole = ("--seeds", "--losses", "--settings"), []
        for i, x in enumerate(typed):
            if x in cut or x.split("=", 1)[0] in cut or (i and typed[i - 1] in cut):
                continue
            whole.append(x)
        command = "stalerl-study " + " ".join(shlex.quote(x) for x in whole)
        return run_study(spec, spec_path=a.spec, dry_run=a.dry_run, force=a.force, scheduler=a.scheduler,
                         report=not a.no_report, command=command, invocation=invocation)
    except StudyError as exc:
        print(f"stalerl-study: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
