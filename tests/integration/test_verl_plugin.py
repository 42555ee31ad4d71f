"""recipe.m2po inside verl's PPO actor, through the verl plugin (recipe/verl). Needs the `verl` extra.

Run: ``pytest -m verl tests/integration``. What is covered, against the real verl package:

1. Registration in every process: a fresh interpreter where ``import verl`` alone registers the losses (entry point
   ``verl.plugins``); one with plugins disabled where the config class (``policy_loss._target_``) registers them;
   a Ray worker process. The function verl hands out is the very object in ``recipe.registry``.
2. verl's own ``ppo_loss`` on TensorDict micro-batches (padded and nested layouts) gives exactly the loss and the
   gradient of the algorithm on the same tensors; micro-batch and data-parallel normalisation through verl's global
   batch info reproduce the global token mean; ``m2_scope: dp_group`` over two gloo ranks is exactly Algorithm 1
   over the whole batch; metrics reach the trainer as ``actor/m2po/...``.
3. The packaged Hydra config composes through ``python -m verl.trainer.main_ppo ... --cfg job`` from any working
   directory, ``m2_threshold`` is overridable without ``+``, and verl's ``omega_conf_to_dataclass`` carries it to the
   loss.
4. Bad ``m2_threshold`` / ``m2_scope`` values fail at config time with a message naming the key; a plugin that
   cannot register fails loudly.

``import verl`` costs 5-16 s, so the subprocesses (two ranks, the main_ppo composition) start together once per
module, while this process imports verl once.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _verl_cases as C  # noqa: E402
from _ports import held_store  # noqa: E402

pytestmark = C.VERL_MARKS

TAU = 0.03
NAMES = {"m2po": "m2po", "stalerl_vanilla": "vanilla", "no_trust_region": "no_trust_region", "fipo": "fipo"}
KEY = "actor_rollout_ref.actor.policy_loss"
SUBPROCESS_TIMEOUT = 420


def _child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    env.update(extra)
    return env


def _config_dir_from_cli() -> str:
    """The directory printed by the console script ``stalerl-verl-config-path`` (or its module, if the script is
    not on PATH)."""
    exe = shutil.which("stalerl-verl-config-path")
    cmd = [exe] if exe else [sys.executable, "-m", "recipe.verl.cli"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_child_env())
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


class _Launched:
    """Subprocesses started together at module start: two gloo ranks and the main_ppo composition."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.config_dir = _config_dir_from_cli()
        # the ranks' store, held by this process until they are done: no rank binds a port (tests/_ports.py)
        self.store = held_store(timeout_s=SUBPROCESS_TIMEOUT)
        port = self.store.port
        self.rank_out = [tmp / f"rank{r}.pt" for r in range(2)]
        self.ranks = []
        for r in range(2):
            # rank 1 runs with verl's plugin discovery off: the config class must register the loss on its own
            env = _child_env(**({"VERL_USE_EXTERNAL_PLUGINS": "none"} if r == 1 else {}))
            cmd = [sys.executable, str(HERE / "_verl_rank_worker.py"), str(r), "2", str(port), str(TAU),
                   str(self.rank_out[r])]
            self.ranks.append(subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True))
        # from a directory with no verl/ in it: the pkg:// search path must find verl's ppo_trainer.yaml
        compose_cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", self.config_dir,
                       "--config-name", "m2po_trainer", "--cfg", "job",
                       f"{KEY}.m2_threshold=0.02", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
        self.compose = subprocess.Popen(compose_cmd, cwd=tmp, env=_child_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        # the async example script, composed only (DRY_RUN=1 appends --cfg job)
        script = HERE.parents[1] / "examples" / "verl" / "run_m2po_async.sh"
        self.script = None
        if script.is_file() and shutil.which("bash") and shutil.which("stalerl-verl-config-path"):
            self.script = subprocess.Popen(["bash", str(script)], cwd=tmp, env=_child_env(DRY_RUN="1"),
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._rank_results = None
        self._compose_result = None
        self._script_result = None

    @staticmethod
    def _finish(proc: subprocess.Popen, what: str) -> str:
        try:
            out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{what} timed out after {SUBPROCESS_TIMEOUT}s; stderr tail:\n{err[-4000:]}")
        if proc.returncode != 0:
            pytest.fail(f"{what} exited {proc.returncode}; stderr tail:\n{err[-6000:]}")
        return out

    def rank_results(self) -> list[dict]:
        if self._rank_results is None:
            for r, proc in enumerate(self.ranks):
                self._finish(proc, f"rank worker {r}")
            self._rank_results = [torch.load(p, weights_only=False) for p in self.rank_out]
        return self._rank_results

    def composed(self):
        if self._compose_result is None:
            from omegaconf import OmegaConf

            out = self._finish(self.compose, "python -m verl.trainer.main_ppo --cfg job")
            self._compose_result = OmegaConf.create(out)
        return self._compose_result

    def script_composed(self):
        if self.script is None:
            pytest.skip("examples/verl/run_m2po_async.sh, bash or the stalerl-verl-config-path script is missing")
        if self._script_result is None:
            from omegaconf import OmegaConf

            out = self._finish(self.script, "DRY_RUN=1 bash examples/verl/run_m2po_async.sh")
            self._script_result = OmegaConf.create(out)
        return self._script_result

    def close(self) -> None:
        for proc in [*self.ranks, self.compose, self.script]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    handle = _Launched(tmp_path_factory.mktemp("verl_plugin"))
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def verl_env(launched):
    """verl imported in this process (once), after the subprocesses were started."""
    import verl  # noqa: F401
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric import AggregationType, Metric
    from verl.utils.py_functional import rename_dict
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    import recipe.m2po.algorithm as algorithm
    import recipe.registry as registry
    from recipe.verl import config_dir
    from recipe.verl.config import M2POPolicyLossConfig, policy_loss_config_class
    from recipe.verl.metrics import verl_metric_name

    m2po_rules = registry.get_declaration("m2po").metrics
    return SimpleNamespace(core_algos=core_algos, ppo_loss=ppo_loss, ActorConfig=ActorConfig, Metric=Metric,
                           AggregationType=AggregationType, rename_dict=rename_dict,
                           omega_conf_to_dataclass=omega_conf_to_dataclass, M2POPolicyLossConfig=M2POPolicyLossConfig,
                           algorithm=algorithm, registry=registry, config_dir=config_dir,
                           policy_loss_config_class=policy_loss_config_class,
                           verl_name=lambda key, rules=m2po_rules: verl_metric_name(key, rules))


def _actor_config(env, **policy_loss):
    return env.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                           policy_loss=env.M2POPolicyLossConfig(**policy_loss))


def _reference(env, case, rows, tau):
    """The algorithm called directly on the same tensors (no verl): loss, gradient w.r.t. the flat output, metrics."""
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    width = max(case["response_lens"][i] for i in rows)
    lp = C.log_prob_from_flat(flat, case, rows, width)
    loss, metrics = env.algorithm.compute_policy_loss_m2po(
        old_log_prob=case["old"][rows, :width], log_prob=lp, advantages=case["adv"][rows, :width],
        response_mask=case["mask"][rows, :width], loss_agg_mode="token-mean",
        config={"policy_loss": {"m2_threshold": tau}})
    loss.backward()
    return loss.detach(), flat.grad, metrics


# --------------------------------------------------------------------------------------------------------------
# 1. registration in every process


def test_import_verl_alone_registers_in_a_fresh_interpreter(verl_env, launched):
    rank0 = launched.rank_results()[0]
    assert rank0["plugins_policy"] == "auto"
    assert rank0["recipe_before"] == [], "the worker imported recipe before verl; the check would prove nothing"
    assert rank0["plugin_loaded_by_verl"], "import verl did not load the verl.plugins entry point"
    assert rank0["registered_after_import"] == sorted(NAMES)
    assert rank0["identity_after_config"] == {n: True for n in NAMES}


def test_config_target_registers_when_plugin_discovery_is_off(verl_env, launched):
    rank1 = launched.rank_results()[1]
    assert rank1["plugins_policy"] == "none"
    assert not rank1["plugin_loaded_by_verl"]
    assert rank1["registered_after_import"] == []
    assert rank1["identity_after_config"] == {n: True for n in NAMES}


def test_verl_hands_out_the_adapters_function_of_each_registry_loss(verl_env):
    """One function per loss (recipe.verl.losses.verl_loss: the registry's loss, its SUM/MAX metrics renamed for
    verl's mean), the same object however it is looked up."""
    import recipe.verl
    from recipe.verl.losses import compute_policy_loss_fipo_verl, verl_loss

    for verl_name, recipe_name in NAMES.items():
        expected = verl_loss(recipe_name)
        assert verl_env.core_algos.get_policy_loss_fn(verl_name) is expected is recipe.verl.loss_function(verl_name)
        assert expected.__qualname__ == f"compute_policy_loss_{recipe_name}_verl"
    assert verl_env.core_algos.get_policy_loss_fn("fipo") is compute_policy_loss_fipo_verl
    # verl's own losses are untouched
    assert verl_env.core_algos.get_policy_loss_fn("vanilla").__module__ == "verl.trainer.ppo.core_algos"


def test_ray_worker_process_registers_on_import_verl(verl_env):
    ray = pytest.importorskip("ray")

    def probe():
        import os
        import sys

        before = sorted(m for m in sys.modules if m == "recipe" or m.startswith("recipe."))
        import verl  # noqa: F401
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        import recipe.verl

        names = ("m2po", "stalerl_vanilla", "no_trust_region", "fipo")
        return {"pid": os.getpid(), "recipe_before": before,
                "identity": {n: get_policy_loss_fn(n) is recipe.verl.loss_function(n) for n in names}}

    assert not ray.is_initialized()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "auto"}})
    try:
        out = ray.get(ray.remote(num_cpus=1)(probe).remote(), timeout=SUBPROCESS_TIMEOUT)
    finally:
        ray.shutdown()
    assert out["pid"] != os.getpid()
    assert out["recipe_before"] == []
    assert out["identity"] == {n: True for n in NAMES}


# --------------------------------------------------------------------------------------------------------------
# 2. verl's ppo_loss


@pytest.mark.parametrize("layout", ["padded", "nested"])
def test_ppo_loss_gives_exactly_the_algorithm(verl_env, layout):
    case = C.make_case()
    rows = list(range(len(case["response_lens"])))
    config = _actor_config(verl_env, m2_threshold=TAU)
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    td = C.build_td(case, rows, layout, dp_size=1, batch_num_tokens=C.num_tokens(case), global_batch_size=len(rows))
    loss, metrics = verl_env.ppo_loss(config, C.model_output(flat, case, rows, layout), td)
    loss.backward()

    ref_loss, ref_grad, ref_metrics = _reference(verl_env, case, rows, TAU)
    assert ref_metrics["m2po/num_masked_tokens"] > 0, "the case must exercise the mask"
    assert torch.equal(loss.detach(), ref_loss)
    assert torch.equal(flat.grad, ref_grad)
    # the policy loss reported to the trainer, and the recipe's metrics, unchanged
    assert float(metrics["actor/pg_loss"].aggregate()) == float(ref_loss)
    # the loss's metrics, values unchanged, a SUM-declared count under the name of what verl makes of it
    assert set(metrics) == {verl_env.verl_name(k) for k in verl_env.algorithm.METRIC_KEYS} | {"actor/pg_loss"}
    assert "m2po/num_masked_tokens/mean_per_call" in metrics and "m2po/num_masked_tokens" not in metrics
    for key, value in ref_metrics.items():
        assert metrics[verl_env.verl_name(key)].values == [value]


@pytest.mark.parametrize("tau", [TAU, 1e9], ids=["masking", "no-masking"])
def test_micro_batches_and_dp_ranks_reproduce_the_global_token_mean(verl_env, tau):
    """Two simulated DP ranks x two micro-batches each (nested layout: each micro-batch padded to its own longest
    response), m2_scope local: selection per micro-batch, normalisation global (verl's global batch info)."""
    case = C.make_case(seed=1)
    bsz = len(case["response_lens"])
    ranks = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    n_global = C.num_tokens(case)
    config = _actor_config(verl_env, m2_threshold=tau)
    flat = C.flat_for_rows(case, range(bsz)).requires_grad_(True)
    offsets = case["offsets"]
    rank_losses, rank_metrics = [], []
    for micro_batches in ranks:
        losses, per_key = [], {}
        for rows in micro_batches:
            td = C.build_td(case, rows, "nested", dp_size=2, batch_num_tokens=n_global, global_batch_size=bsz)
            lo, hi = offsets[rows[0]], offsets[rows[-1] + 1]
            loss, metrics = verl_env.ppo_loss(config, C.model_output(flat[lo:hi], case, rows, "nested"), td)
            losses.append(loss)
            for key, metric in metrics.items():  # what the engine does across micro-batches
                per_key.setdefault(key, verl_env.Metric(aggregation=metric.aggregation)).extend(metric)
        rank_losses.append(torch.stack(losses).sum())  # gradient accumulation sums micro-batch gradients
        rank_metrics.append(per_key)
    total = torch.stack(rank_losses).mean()  # FSDP/DDP average gradients over the DP ranks
    total.backward()

    # reference: the same per-micro-batch selection, the objective normalised by ALL valid tokens of the batch
    keep = torch.zeros_like(case["mask"])
    for micro_batches in ranks:
        for rows in micro_batches:
            w = max(case["response_lens"][i] for i in rows)
            d = (case["new"] - case["old"])[rows, :w]
            sel = verl_env.algorithm.select_m2po(d, case["adv"][rows, :w], case["mask"][rows, :w], tau)
            keep[rows, :w] = sel.keep_mask
    # written out by hand: -sum(keep * A * r) / (all valid tokens of the batch)
    ref_flat = C.flat_for_rows(case, range(bsz)).requires_grad_(True)
    lp = C.log_prob_from_flat(ref_flat, case, range(bsz))
    valid = case["mask"]
    ratio = torch.exp(torch.where(valid, lp - torch.where(valid, case["old"], 0.0), 0.0))
    ref_loss = torch.where(keep & valid, -case["adv"] * ratio, 0.0).sum() / n_global
    ref_loss.backward()
    ref_loss, ref_grad = ref_loss.detach(), ref_flat.grad
    torch.testing.assert_close(total.detach(), ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(flat.grad, ref_grad, rtol=1e-6, atol=1e-8)
    if tau > 1:  # nothing masked: the plain global token mean of -A * r, written out independently
        m = case["mask"]
        plain = -(case["adv"][m] * torch.exp(case["new"][m] - case["old"][m])).sum() / n_global
        torch.testing.assert_close(total.detach(), plain, rtol=1e-6, atol=1e-7)
    else:
        assert int(keep.sum()) < n_global

    # metrics: same keys and counts on every rank (verl's aggregate_dp requires it); the trainer logs actor/m2po/*
    assert rank_metrics[0].keys() == rank_metrics[1].keys()
    reduced = {key: verl_env.Metric.aggregate_dp([rm[key] for rm in rank_metrics]) for key in rank_metrics[0]}
    logged = verl_env.rename_dict(reduced, "actor/")
    assert {k for k in logged if k.startswith("actor/m2po/")} == {f"actor/{verl_env.verl_name(k)}" for k in
                                                                verl_env.algorithm.METRIC_KEYS}
    assert all(isinstance(float(v), float) and math.isfinite(float(v)) for v in logged.values())
    assert float(logged["actor/pg_loss"]) == pytest.approx(float(total.detach()), rel=1e-6)
    assert float(logged["actor/m2po/threshold"]) == pytest.approx(tau)


def _engine_step(env, config, case, ranks):
    """verl's ppo_loss over ``ranks`` (per rank, the rows of each of its micro-batches) and verl's own reduction of
    the metrics as the trainer logs them: per rank, the micro-batches' values extended into one Metric (the engine),
    then ``Metric.aggregate_dp`` over the ranks, prefixed ``actor/``."""
    bsz, n_global = len(case["response_lens"]), C.num_tokens(case)
    flat = C.flat_for_rows(case, range(bsz))
    rank_metrics = []
    for micro_batches in ranks:
        per_key = {}
        for rows in micro_batches:
            td = C.build_td(case, rows, "nested", dp_size=len(ranks), batch_num_tokens=n_global,
                            global_batch_size=bsz)
            lo, hi = case["offsets"][rows[0]], case["offsets"][rows[-1] + 1]
            _, metrics = env.ppo_loss(config, C.model_output(flat[lo:hi], case, rows, "nested"), td)
            for key, metric in metrics.items():
                per_key.setdefault(key, env.Metric(aggregation=metric.aggregation)).extend(metric)
        rank_metrics.append(per_key)
    reduced = {key: env.Metric.aggregate_dp([rm[key] for rm in rank_metrics]) for key in rank_metrics[0]}
    return {key: float(value) for key, value in env.rename_dict(reduced, "actor/").items()}


RANKS = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # 2 ranks x 2 micro-batches of unequal token counts


def test_sum_and_max_metrics_are_logged_under_names_that_say_what_verl_makes_of_them(verl_env):
    """verl averages every policy-loss metric over the step's calls (it cannot be told a rule), so a SUM-declared
    count is logged as ``<key>/mean_per_call`` and a MAX-declared maximum as ``<key>/mean_of_call_max``
    (recipe/verl/metrics.py): their values through verl's own ppo_loss and Metric reduction equal those literal
    reductions over 2 ranks x 2 micro-batches, written out here by hand; a MEAN keeps its name."""
    case = C.make_case(seed=1)
    calls = [rows for rank in RANKS for rows in rank]
    mask = case["mask"]

    # MAX: no_trust_region's ratio_max
    ntr = verl_env.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                               policy_loss=verl_env.policy_loss_config_class("no_trust_region")())
    logged = _engine_step(verl_env, ntr, case, RANKS)
    call_max = []
    for rows in calls:
        d = torch.where(mask[rows], case["new"][rows] - case["old"][rows], 0.0)
        call_max.append(max(math.exp(float(x)) for x in d[mask[rows]]))
    assert "actor/no_trust_region/ratio_max" not in logged
    assert logged["actor/no_trust_region/ratio_max/mean_of_call_max"] == pytest.approx(
        sum(call_max) / len(call_max), rel=1e-6)
    assert max(call_max) > logged["actor/no_trust_region/ratio_max/mean_of_call_max"]  # not the step's max
    assert "actor/no_trust_region/ratio_mean" in logged  # MEAN: its own name (verl's unweighted mean of the calls)

    # SUM: m2po's counts (verl's m2_scope default local: one selection per call)
    logged = _engine_step(verl_env, _actor_config(verl_env, m2_threshold=TAU), case, RANKS)
    valid, masked = [], []
    for rows in calls:
        w = max(case["response_lens"][i] for i in rows)
        valid.append(sum(case["response_lens"][i] for i in rows))
        masked.append(int(verl_env.algorithm.select_m2po((case["new"] - case["old"])[rows, :w],
                                                         case["adv"][rows, :w], mask[rows, :w], TAU).num_masked))
    assert sum(masked) > 0 and len(set(valid)) > 1
    assert "actor/m2po/num_valid_tokens" not in logged and "actor/m2po/num_masked_tokens" not in logged
    assert logged["actor/m2po/num_valid_tokens/mean_per_call"] == pytest.approx(sum(valid) / len(calls))
    assert logged["actor/m2po/num_masked_tokens/mean_per_call"] == pytest.approx(sum(masked) / len(calls))
    assert "actor/m2po/masked_fraction" in logged and "actor/m2po/threshold" in logged


def test_the_verl_metric_names_follow_the_declared_rule_or_the_naming_convention():
    from recipe.declaration import MAX, MEAN, SUM
    from recipe.verl.metrics import verl_metric_name, verl_metrics

    rules = {"x/count": SUM, "x/peak": MAX, "x/frac": MEAN}
    assert [verl_metric_name(k, rules) for k in rules] == ["x/count/mean_per_call", "x/peak/mean_of_call_max",
                                                           "x/frac"]
    # undeclared: recipe.declaration.rule_for's convention (num_* a sum, *_max a max, else a mean)
    assert verl_metrics({"x/num_rows": 3.0, "x/ratio_max": 2.0, "x/other": 1.0}, rules) == {
        "x/num_rows/mean_per_call": 3.0, "x/ratio_max/mean_of_call_max": 2.0, "x/other": 1.0}


def test_dp_group_scope_over_two_ranks_is_algorithm_1_on_the_whole_batch(verl_env, launched):
    """Each of two gloo ranks runs verl's ppo_loss on its half (one micro-batch per rank), m2_scope dp_group: the
    averaged loss and the gradients equal the algorithm on the whole batch (exact whole-mini-batch Algorithm 1)."""
    results = launched.rank_results()
    case = C.make_case()
    rows = list(range(len(case["response_lens"])))
    ref_loss, ref_grad, ref_metrics = _reference(verl_env, case, rows, TAU)
    assert ref_metrics["m2po/num_masked_tokens"] > 0
    assert [r["rows"] for r in results] == [rows[:4], rows[4:]]
    torch.testing.assert_close((results[0]["loss"] + results[1]["loss"]) / 2, ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results]) / 2, ref_grad, rtol=1e-6, atol=1e-8)
    # the selection is group-wide, so every rank reports the whole batch's statistics
    for r in results:
        for key, value in ref_metrics.items():
            assert r["metrics"][verl_env.verl_name(key)] == [pytest.approx(value, rel=1e-9, abs=1e-12)], key
    # and a local selection per half would have been different (the test is not vacuous)
    local = [verl_env.algorithm.select_m2po((case["new"] - case["old"])[h], case["adv"][h], case["mask"][h], TAU)
             for h in (rows[:4], rows[4:])]
    assert sum(s.num_masked for s in local) != ref_metrics["m2po/num_masked_tokens"]


# --------------------------------------------------------------------------------------------------------------
# 3. the packaged config through verl's main_ppo


def test_console_script_prints_the_packaged_config_dir(verl_env, launched):
    path = Path(launched.config_dir)
    assert path == verl_env.config_dir()
    assert (path / "m2po_trainer.yaml").is_file()


def test_packaged_config_composes_through_main_ppo(verl_env, launched):
    cfg = launched.composed()
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss._target_ == "recipe.verl.config.M2POPolicyLossConfig"
    assert actor.policy_loss.loss_mode == "m2po"
    assert actor.policy_loss.m2_threshold == 0.02  # overridden on the command line, no '+'
    assert actor.policy_loss.m2_scope == "local"
    assert actor.loss_agg_mode == "token-mean"
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    # everything else is verl's ppo_trainer.yaml, found through pkg://verl.trainer.config
    assert actor.policy_loss.clip_cov_ratio == 0.0002
    assert "v1" in cfg.trainer and cfg.actor_rollout_ref.actor.strategy


def test_composed_actor_config_carries_the_threshold_to_the_loss(verl_env, launched):
    cfg = launched.composed()
    actor = verl_env.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # what verl's driver and workers do
    assert isinstance(actor.policy_loss, verl_env.M2POPolicyLossConfig)
    assert actor.policy_loss.m2_threshold == 0.02
    case = C.make_case()
    rows = list(range(len(case["response_lens"])))
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    td = C.build_td(case, rows, "padded", dp_size=1, batch_num_tokens=C.num_tokens(case), global_batch_size=8)
    loss, metrics = verl_env.ppo_loss(actor, C.model_output(flat, case, rows, "padded"), td)
    assert metrics["m2po/threshold"].values == [0.02]
    ref_loss, _, _ = _reference(verl_env, case, rows, 0.02)
    assert torch.equal(loss.detach(), ref_loss)


def test_async_example_script_composes(verl_env, launched):
    """examples/verl/run_m2po_async.sh (default MODE=separate_async) composes through main_ppo, and its actor config
    is M2PO with the exact whole-mini-batch setting: dp_group, one micro-batch per mini-batch per GPU."""
    cfg = launched.script_composed()
    assert cfg.trainer.v1.trainer_mode == "separate_async"
    assert cfg.trainer.v1.sampler.max_off_policy_threshold == 4
    assert cfg.data.train_batch_size == cfg.trainer.v1.separate_async.parameter_sync_step * \
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    actor = verl_env.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, verl_env.M2POPolicyLossConfig)
    assert (actor.policy_loss.loss_mode, actor.policy_loss.m2_scope) == ("m2po", "dp_group")
    assert not actor.use_dynamic_bsz
    per_gpu = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n // (cfg.trainer.nnodes *
                                                                              cfg.trainer.n_gpus_per_node)
    assert actor.ppo_micro_batch_size_per_gpu == per_gpu
    assert cfg.algorithm.rollout_correction.bypass_mode is True


def _compose_in_process(env, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(env.config_dir()), version_base=None):
        return compose(config_name="m2po_trainer",
                       overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides])


def test_packaged_defaults(verl_env):
    cfg = _compose_in_process(verl_env, [])
    actor = verl_env.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert (actor.policy_loss.loss_mode, actor.policy_loss.m2_threshold, actor.policy_loss.m2_scope) == \
        ("m2po", 0.04, "local")


# --------------------------------------------------------------------------------------------------------------
# 4. failing early and loudly


@pytest.mark.parametrize("override, message", [
    ("m2_threshold=-0.1", "m2_threshold must be >= 0.0, got -0.1"),
    ("m2_threshold=nan", "m2_threshold must be finite, got nan"),
    ("m2_threshold=inf", "m2_threshold must be finite, got inf"),
    ("m2_threshold=abc", "m2_threshold must be a number, got 'abc' (str)"),
    ("m2_threshold=true", "got True (bool)"),
    ("m2_scope=global", "m2_scope must be one of local, dp_group, got 'global'"),
])
def test_bad_values_fail_at_config_time(verl_env, override, message):
    from hydra.errors import InstantiationException

    cfg = _compose_in_process(verl_env, [f"{KEY}.{override}"])  # composing accepts it; instantiating must not
    with pytest.raises(InstantiationException) as info:
        verl_env.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert f"{KEY}.{override.split('=')[0]}" in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "0.04", None, True])
def test_bad_threshold_fails_in_the_dataclass(verl_env, value):
    with pytest.raises(ValueError, match=rf"{KEY}\.m2_threshold must be "):
        verl_env.M2POPolicyLossConfig(m2_threshold=value)


def test_int_threshold_is_normalised_and_zero_is_allowed(verl_env):
    cfg = verl_env.M2POPolicyLossConfig(m2_threshold=0)
    assert cfg.m2_threshold == 0.0 and isinstance(cfg.m2_threshold, float)


def test_a_verl_name_taken_by_another_function_refuses_that_loss_alone(verl_env, caplog, monkeypatch):
    """A verl name held by another function (another plugin's, verl's own) refuses that loss alone: one ERROR line
    naming it and the fix; the other losses still register; its config class (the packaged config's _target_) then
    fails at config time with the same line instead of the run failing later with 'Unsupported loss mode'."""
    import recipe.registry as registry
    import recipe.verl as adapter
    from hydra.errors import InstantiationException
    from omegaconf import OmegaConf

    from recipe.testing import registry_state

    def impostor(**kwargs):  # pragma: no cover - never called
        raise AssertionError

    monkeypatch.setitem(verl_env.core_algos.POLICY_LOSS_REGISTRY, "m2po", impostor)
    for name in ("recipe.verl.plugin", "recipe.verl.config"):
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(adapter, name.rsplit(".", 1)[1])
    with registry_state(), caplog.at_level(logging.ERROR, logger="recipe.registry"):
        plugin = importlib.import_module("recipe.verl.plugin")
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("'m2po'" in line and "verl has its own loss 'm2po'" in line and "framework_names" in line
                   and "\n" not in line for line in lines), lines
        assert "m2po" not in plugin.REGISTERED
        assert {"stalerl_vanilla", "fipo", "no_trust_region", "m2po_authors"} <= set(plugin.REGISTERED)
        config = importlib.import_module("recipe.verl.config")
        assert config.FIPOPolicyLossConfig().loss_mode == "fipo"
        with pytest.raises(InstantiationException, match="M2POPolicyLossConfig"):
            verl_env.omega_conf_to_dataclass(OmegaConf.create({"_target_": "recipe.verl.config.M2POPolicyLossConfig",
                                                               "loss_mode": "m2po"}))
        assert "verl:m2po" in registry.refusals()
    assert verl_env.core_algos.POLICY_LOSS_REGISTRY["m2po"] is impostor  # never silently replaced


def test_untested_verl_version_is_refused_at_import_unless_allowed(verl_env, caplog, monkeypatch):
    """The plugin checks the installed verl against recipe.versions' tested range before registering: a faked 0.11.0
    makes `import recipe.verl.plugin` (what verl's entry point runs) fail loudly with one line naming the range and
    the override, and the config class refuses too; with STALERL_ALLOW_UNTESTED_FRAMEWORKS=verl it warns and
    registers."""
    import warnings

    import recipe.verl as adapter
    import recipe.versions as versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda key: "0.11.0" if key == "verl" else real(key))
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    for name in ("recipe.verl.plugin", "recipe.verl.config"):
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(adapter, name.rsplit(".", 1)[1])
    with caplog.at_level(logging.ERROR, logger="recipe.verl.plugin"):
        with pytest.raises(versions.UntestedFrameworkVersion) as info:
            importlib.import_module("recipe.verl.plugin")
    message = str(info.value)
    assert "\n" not in message and message.startswith("recipe.verl: verl 0.11.0 is installed")
    assert versions.FRAMEWORKS["verl"].tested in message and f"{versions.ALLOW_ENV}=verl" in message
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    with pytest.raises(versions.UntestedFrameworkVersion):
        importlib.import_module("recipe.verl.config")

    monkeypatch.setenv(versions.ALLOW_ENV, "verl")
    monkeypatch.setattr(versions, "_warned", set())
    sys.modules.pop("recipe.verl.plugin", None)
    sys.modules.pop("recipe.verl.config", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = importlib.import_module("recipe.verl.plugin")
    assert any("outside the tested range" in str(w.message) for w in caught)
    assert plugin.REGISTERED["m2po"] is verl_env.core_algos.get_policy_loss_fn("m2po")
