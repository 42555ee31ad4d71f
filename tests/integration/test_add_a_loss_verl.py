"""Adding a loss touches one module, verl lane (issue 37 item 3): the throwaway loss (tests/throwaway_loss.py), in a
temporary package found through the ``recipe.losses`` entry point, runs through verl with no file of this repository
edited:

- ``import verl`` alone (its ``verl.plugins`` entry point, our plugin) puts it into verl's ``POLICY_LOSS_REGISTRY``
  under its verl name, as the registry's own function;
- its config class is generated from its declaration (``recipe.verl.config.ThrowawayPolicyLossConfig``, field
  ``tl_scale`` with its default, help and bound), selected by ``policy_loss._target_`` in verl's own composed
  ``ppo_trainer`` config and built by verl's ``omega_conf_to_dataclass``;
- verl's own ``ppo_loss`` runs it: at ``tl_scale=1`` its loss and gradient equal ``no_trust_region``'s through the
  same path, at ``tl_scale=0.5`` half of them; its metrics reach verl's ``Metric`` objects, equal to the declared
  rules' reduction on a one-call step (on a split step verl's own mean reducer takes over: documented in
  recipe/verl/plugin.py, measured here);
- ``tl_scale=0`` is refused at config time, before any loss call, with one line naming
  ``actor_rollout_ref.actor.policy_loss.tl_scale``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import throwaway_loss

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import _verl_cases as C  # noqa: E402

pytestmark = C.VERL_MARKS

KEY = "actor_rollout_ref.actor.policy_loss"

SCRIPT = textwrap.dedent('''
    import json, sys
    before = sorted(m for m in sys.modules if m.startswith("throwaway_loss_pkg") or m.startswith("recipe"))
    import verl  # the verl.plugins entry point registers every stalerl loss, the plugin's included
    from verl.trainer.ppo import core_algos
    registered_by_import_verl = "throwaway" in core_algos.POLICY_LOSS_REGISTRY

    import dataclasses
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.errors import InstantiationException
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric import Metric
    from verl.workers.utils.losses import ppo_loss

    import recipe.verl
    from recipe.declaration import reduce_metrics
    from recipe.registry import get_declaration, get_policy_loss_fn
    from recipe.verl.metrics import verl_metric_name

    sys.path.insert(0, sys.argv[1])
    import _verl_cases as C

    out = {"before": before, "registered_by_import_verl": registered_by_import_verl}
    # beside the good plugin: a plugin named after verl's own gspo, and ones that fail to import or clash
    from recipe.registry import BUILTIN_POLICY_LOSSES, refusals
    out["gspo_module"] = core_algos.POLICY_LOSS_REGISTRY["gspo"].__module__
    out["builtins_in_verl"] = sorted(n for n in BUILTIN_POLICY_LOSSES
                                     if get_declaration(n).name_in("verl") in core_algos.POLICY_LOSS_REGISTRY)
    out["refused"] = refusals()
    out["same_function"] = core_algos.get_policy_loss_fn("throwaway") is recipe.verl.loss_function("throwaway")
    out["verl_names"] = recipe.verl.VERL_LOSS_NAMES
    import recipe.verl.config as vc
    cls = vc.policy_loss_config_class("throwaway")
    field = {f.name: f for f in dataclasses.fields(cls)}["tl_scale"]
    out["class"] = [vc.policy_loss_config_target("throwaway"), field.default, dict(field.metadata),
                    cls().loss_mode]

    import os
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


    def actor(loss_mode, **extra):
        overrides = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.strategy=fsdp",
                     f"{KEY}._target_=recipe.verl.config." + vc.policy_loss_config_class(loss_mode).__name__,
                     f"{KEY}.loss_mode={loss_mode}", *(f"+{KEY}.{k}={v}" for k, v in extra.items())]
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=overrides)
        return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


    KEY = "actor_rollout_ref.actor.policy_loss"
    case = C.make_case()
    rows = list(range(len(case["response_lens"])))


    def run(config, micro_batches=(rows,)):
        """verl's ppo_loss over the step's micro-batches (one rank), as the engine runs it: loss, grad, metrics."""
        flat = C.flat_for_rows(case, rows).requires_grad_(True)
        n = C.num_tokens(case)
        total, per_key, parts = 0.0, {}, []
        for mb in micro_batches:
            td = C.build_td(case, mb, "nested", dp_size=1, batch_num_tokens=n, global_batch_size=len(rows))
            lo, hi = case["offsets"][mb[0]], case["offsets"][mb[-1] + 1]
            loss, metrics = ppo_loss(config, C.model_output(flat[lo:hi], case, mb, "nested"), td)
            loss.backward()
            total = total + loss.detach()
            for key, metric in metrics.items():  # what verl's engine does across micro-batches
                per_key.setdefault(key, Metric(aggregation=metric.aggregation)).extend(metric)
            back = {verl_metric_name(k, get_declaration("throwaway").metrics): k
                    for k in get_declaration("throwaway").metrics}  # verl's name of each declared key -> the key
            parts.append(({"valid_tokens": C.num_tokens(case, mb), "rows": len(mb)},
                          {back[k]: m.values[0] for k, m in metrics.items() if k.startswith("throwaway/")}))
        logged = {k: float(Metric.aggregate_dp([m])) for k, m in per_key.items()}
        return float(total), flat.grad, logged, parts


    one, grad_one, logged_one, parts_one = run(actor("throwaway", tl_scale=1.0))
    ntr, grad_ntr, _, _ = run(actor("no_trust_region"))
    half, grad_half, _, _ = run(actor("throwaway", tl_scale=0.5))
    rules = get_declaration("throwaway").metrics
    split = [rows[:3], rows[3:5], rows[5:]]
    split_loss, split_grad, logged_split, parts_split = run(actor("throwaway", tl_scale=1.0), split)
    out["losses"] = [one, ntr, half, split_loss]
    out["grads"] = [torch.equal(grad_one, grad_ntr), torch.allclose(grad_half, 0.5 * grad_one, rtol=1e-6, atol=0),
                    torch.allclose(split_grad, grad_one, rtol=1e-6, atol=1e-9)]
    out["one_call"] = [logged_one, reduce_metrics(parts_one, rules)]
    out["split"] = [logged_split, reduce_metrics(parts_split, rules), len(split)]

    errors = []
    try:
        actor("throwaway", tl_scale=0)
    except InstantiationException as exc:
        errors.append(str(exc))
    try:
        cls(tl_scale=0)
    except ValueError as exc:
        errors.append(str(exc))
    out["errors"] = errors
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    plugin_dir = throwaway_loss.install(tmp_path_factory.mktemp("site"))
    throwaway_loss.install_clashing(plugin_dir, "gspo", "verl")  # verl's own loss name (issue 44 item 1)
    throwaway_loss.install_broken(plugin_dir)
    assert REPO not in plugin_dir.parents  # the loss lives outside the repository: nothing here is edited
    env = throwaway_loss.env_with(plugin_dir)
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(HERE)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-2000:]
    return json.loads(line[-1][len("RESULT "):])


def test_import_verl_registers_the_plugin_loss_as_the_adapters_function(result):
    assert result["before"] == []
    assert result["registered_by_import_verl"] and result["same_function"]
    assert result["verl_names"]["throwaway"] == "throwaway"
    assert result["verl_names"]["stalerl_vanilla"] == "vanilla"


def test_a_plugin_named_after_verls_own_loss_is_refused_alone(result):
    """verl's gspo stays verl's; the throwaway plugin and every built-in still register on ``import verl``; each bad
    plugin is one line naming it and the fix."""
    assert not result["gspo_module"].startswith("clash_")
    assert "gspo" in result["refused"]["verl:gspo"] and "framework_names" in result["refused"]["verl:gspo"]
    from recipe.registry import BUILTIN_POLICY_LOSSES

    assert result["builtins_in_verl"] == sorted(BUILTIN_POLICY_LOSSES)
    assert result["registered_by_import_verl"]
    assert {"broken_import", "name_thief", "clip_thief", "tau_thief"} <= set(result["refused"])
    assert all("\n" not in line and "Fix:" in line for line in result["refused"].values())


def test_config_class_is_generated_from_the_declaration(result):
    target, default, metadata, loss_mode = result["class"]
    assert target == "recipe.verl.config.ThrowawayPolicyLossConfig"
    assert default == 1.0 and metadata["gt"] == 0.0 and "scale" in metadata["help"]
    assert loss_mode == "throwaway"


def test_verl_ppo_loss_runs_the_plugin_loss_with_its_parameter(result):
    one, ntr, half, split = result["losses"]
    assert one == ntr  # tl_scale=1: no_trust_region's loss through the same verl path, bit for bit
    assert half == pytest.approx(0.5 * one, rel=1e-6)
    assert split == pytest.approx(one, rel=1e-6)  # verl's global token count: the split changes nothing
    assert result["grads"] == [True, True, True]


def test_metrics_reach_verl_and_one_call_is_reduced_by_the_declared_rules(result):
    """The SUM-declared count reaches verl as ``throwaway/num_tokens/mean_per_call`` (recipe/verl/metrics.py: verl
    averages every metric over the step's calls), the MEAN under its own name."""
    logged, declared = result["one_call"]
    assert {"throwaway/ratio_mean", "throwaway/num_tokens/mean_per_call", "actor/pg_loss"} <= set(logged)
    assert "throwaway/num_tokens" not in logged
    assert logged["throwaway/ratio_mean"] == pytest.approx(declared["throwaway/ratio_mean"], rel=1e-12)
    assert logged["throwaway/num_tokens/mean_per_call"] == pytest.approx(declared["throwaway/num_tokens"], rel=1e-12)
    # a split step: verl's own reducer (the plain mean per micro-batch) -- the SUM-declared count is the step's
    # total / the number of micro-batches, as its name says; the token-weighted mean is approximate
    logged, declared, n_micro = result["split"]
    assert declared["throwaway/num_tokens"] == result["one_call"][1]["throwaway/num_tokens"]
    assert logged["throwaway/num_tokens/mean_per_call"] == pytest.approx(declared["throwaway/num_tokens"] / n_micro)
    assert declared["throwaway/ratio_mean"] == pytest.approx(result["one_call"][1]["throwaway/ratio_mean"], rel=1e-6)


def test_bad_tl_scale_is_refused_at_config_time_naming_the_key(result):
    hydra_error, direct = result["errors"]
    assert f"{KEY}.tl_scale must be > 0.0, got 0" in hydra_error
    assert "\n" not in direct and direct.startswith(f"{KEY}.tl_scale must be > 0.0, got 0")
