"""recipe.fipo inside verl's PPO actor, through the verl plugin (recipe/verl). Needs the `verl` extra.

Run: ``pytest -m verl tests/integration -k fipo``. Against the real verl package:

1. Registration: ``import verl`` alone registers ``fipo`` in a fresh interpreter and in a Ray worker; verl hands out
   ``recipe.verl.losses.compute_policy_loss_fipo_verl`` (the registry's FIPO behind the whole-step check).
2. verl's own ``ppo_loss`` (padded and nested layouts) on a step that is one call gives bit-identically the loss, the
   gradient and the metrics of the reference (a direct one-call FIPO: dropped rows leave numerator and
   denominator), on a case where the weights, the clip and the sequence drop all act. A split step (micro-batches,
   simulated DP ranks) is refused with one line before any update; with ``fipo_allow_split_step`` it runs with
   verl's all-valid-token denominator, logs ``fipo/split_step_approximate`` = 1, and the difference from the
   reference is measured (docs/algorithms/fipo.md).
3. The packaged ``fipo_trainer.yaml`` composes, its keys are overridable without ``+`` and reach the loss; bad values
   fail at config time naming the key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _verl_cases as C  # noqa: E402

pytestmark = C.VERL_MARKS

KEY = "actor_rollout_ref.actor.policy_loss"
TIMEOUT = 420


def _child_env() -> dict:
    env = dict(os.environ)
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    return env


@pytest.fixture(scope="module")
def fresh_interpreter():
    """Started first, so that its `import verl` overlaps this process's."""
    code = ("import sys\n"
            "before = sorted(m for m in sys.modules if m == 'recipe' or m.startswith('recipe.'))\n"
            "import verl\n"
            "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "loaded = 'recipe.verl.plugin' in sys.modules\n"
            "import recipe.verl, recipe.verl.losses as v\n"
            "fn = get_policy_loss_fn('fipo')\n"
            "same = fn is recipe.verl.loss_function('fipo')\n"
            "print(before, loaded, same, fn is v.compute_policy_loss_fipo_verl)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=_child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def verl_env(fresh_interpreter):
    import verl  # noqa: F401
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    import recipe.fipo.algorithm as algorithm
    import recipe.verl.losses as losses
    from recipe.verl import config_dir
    from recipe.verl.config import FIPOPolicyLossConfig

    return SimpleNamespace(core_algos=core_algos, ppo_loss=ppo_loss, ActorConfig=ActorConfig,
                           omega_conf_to_dataclass=omega_conf_to_dataclass, algorithm=algorithm, losses=losses,
                           FIPOPolicyLossConfig=FIPOPolicyLossConfig, config_dir=config_dir)


def _fipo_case(seed: int = 0) -> dict:
    """The shared synthetic case with two tokens of ratio > c in an A < 0 row (dropped) and one in another A < 0 row
    (kept, dual-clipped)."""
    case = C.make_case(seed)
    adv = case["adv"]
    neg = [i for i in range(len(case["response_lens"])) if adv[i, 0] < 0 and case["response_lens"][i] >= 3]
    assert len(neg) >= 2, "the case needs two A < 0 rows"
    for row, cols in ((neg[0], (0, 2)), (neg[1], (1,))):
        for j in cols:
            case["new"][row, j] = case["old"][row, j] + 3.0
            p = case["prompt_lens"][row]
            case["flat"][case["offsets"][row] + p - 1 + j] = case["new"][row, j]
    return case


def _actor(env, **policy_loss):
    return env.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio_high=0.28,
                           policy_loss=env.FIPOPolicyLossConfig(**policy_loss))


def _direct(env, case, rows, config, global_batch_info=None, planned=False):
    """The registry's FIPO, one call on ``rows`` (``planned``: with its row selector's ``row_keep_mask``, so that
    ``global_batch_info``'s count is used as given)."""
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    width = max(case["response_lens"][i] for i in rows)
    lp = C.log_prob_from_flat(flat, case, rows, width)
    cfg = {"clip_ratio_low": config.clip_ratio_low, "clip_ratio_high": config.clip_ratio_high,
           "policy_loss": {k: getattr(config.policy_loss, k) for k in (
               "fipo_decay_rate", "fipo_clip_ratio_c", "fipo_influence_clip_ratio", "fipo_influence_clip_high_only",
               "fipo_safety_threshold")}, "global_batch_info": global_batch_info or {}}
    inputs = dict(old_log_prob=case["old"][rows, :width], log_prob=lp, advantages=case["adv"][rows, :width],
                  response_mask=case["mask"][rows, :width])
    extra = {}
    if planned:
        extra["row_keep_mask"] = env.algorithm.fipo_row_selector(
            **{k: v.detach() for k, v in inputs.items()}, config=cfg)["row_keep_mask"]
    loss, metrics = env.algorithm.compute_policy_loss_fipo(**inputs, loss_agg_mode="token-mean", config=cfg, **extra)
    loss.backward()
    return loss.detach(), flat.grad, metrics


def test_fipo_registered_by_import_verl_in_a_fresh_interpreter(fresh_interpreter):
    out, err = fresh_interpreter.communicate(timeout=TIMEOUT)
    assert fresh_interpreter.returncode == 0, err[-4000:]
    assert out.strip() == "[] True True True"


def test_fipo_registered_in_a_ray_worker(verl_env):
    ray = pytest.importorskip("ray")

    def probe():
        import os
        import sys

        before = sorted(m for m in sys.modules if m == "recipe" or m.startswith("recipe."))
        import verl  # noqa: F401
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        import recipe.verl

        return os.getpid(), before, get_policy_loss_fn("fipo") is recipe.verl.loss_function("fipo")

    assert not ray.is_initialized()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "auto"}})
    try:
        pid, before, same = ray.get(ray.remote(num_cpus=1)(probe).remote(), timeout=TIMEOUT)
    finally:
        ray.shutdown()
    assert pid != os.getpid() and before == [] and same


def test_verl_hands_out_the_fipo_function(verl_env):
    assert verl_env.core_algos.get_policy_loss_fn("fipo") is verl_env.losses.compute_policy_loss_fipo_verl


@pytest.mark.parametrize("layout", ["padded", "nested"])
def test_fipo_through_ppo_loss_on_a_one_call_step_is_bit_identical_to_the_reference(verl_env, layout):
    case = _fipo_case()
    rows = list(range(len(case["response_lens"])))
    config = _actor(verl_env, fipo_decay_rate=8.0)
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    n_tokens = C.num_tokens(case)
    td = C.build_td(case, rows, layout, dp_size=1, batch_num_tokens=n_tokens, global_batch_size=len(rows))
    loss, metrics = verl_env.ppo_loss(config, C.model_output(flat, case, rows, layout), td)
    loss.backward()
    ref_loss, ref_grad, ref_metrics = _direct(verl_env, case, rows, config)  # one call, its own kept tokens
    # the case exercises the drop and both clip bounds
    assert ref_metrics["fipo/sequence_drop_ratio"] == 1 / 8
    assert ref_metrics["fipo/influence_weight_clip_ratio_upper"] > 0
    assert ref_metrics["fipo/influence_weight_clip_ratio_lower"] > 0
    assert ref_metrics["fipo/dual_clip_fraction"] > 0 and ref_metrics["fipo/clip_fraction"] > 0
    assert torch.equal(loss.detach(), ref_loss)
    assert torch.equal(flat.grad, ref_grad)
    approx = verl_env.losses.APPROXIMATE_METRIC
    # FIPO's metrics, values unchanged; its SUM-declared count under the name of what verl makes of it
    from recipe.verl.metrics import verl_metric_name

    rules = verl_env.algorithm.DECLARATION.metrics
    assert set(metrics) == {verl_metric_name(k, rules) for k in verl_env.algorithm.METRIC_KEYS} | \
        {approx, "actor/pg_loss"}
    assert "fipo/num_kept_tokens/mean_per_call" in metrics
    assert metrics[approx].values == [0.0]
    for key, value in ref_metrics.items():
        assert metrics[verl_metric_name(key, rules)].values == [value]


def _split_step(env, case, config):
    """Two simulated DP ranks x two micro-batches (nested: each padded to its own width), verl's global info."""
    bsz = len(case["response_lens"])
    n_global = C.num_tokens(case)
    flat = C.flat_for_rows(case, range(bsz)).requires_grad_(True)
    offsets = case["offsets"]
    rank_losses, metrics = [], []
    for micro_batches in ([[0, 1], [2, 3]], [[4, 5], [6, 7]]):
        losses = []
        for rows in micro_batches:
            td = C.build_td(case, rows, "nested", dp_size=2, batch_num_tokens=n_global, global_batch_size=bsz)
            lo, hi = offsets[rows[0]], offsets[rows[-1] + 1]
            loss, m = env.ppo_loss(config, C.model_output(flat[lo:hi], case, rows, "nested"), td)
            losses.append(loss)
            metrics.append(m)
        rank_losses.append(torch.stack(losses).sum())
    total = torch.stack(rank_losses).mean()
    total.backward()
    return total.detach(), flat.grad, metrics


def test_fipo_split_step_is_refused_before_any_update(verl_env):
    case = _fipo_case(seed=1)
    with pytest.raises(ValueError) as info:
        _split_step(verl_env, case, _actor(verl_env))
    message = str(info.value)
    assert "\n" not in message and "fipo in verl: this optimizer step is split" in message
    for setting in ("ppo_micro_batch_size_per_gpu = ppo_mini_batch_size x rollout.n", "use_dynamic_bsz=false",
                    "trainer.n_gpus_per_node=1", "policy_loss.fipo_allow_split_step=true"):
        assert setting in message
    # one rank, two micro-batches: split too
    rows = [0, 1]
    td = C.build_td(case, rows, "nested", dp_size=1, batch_num_tokens=C.num_tokens(case), global_batch_size=8)
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    with pytest.raises(ValueError, match="this optimizer step is split"):
        verl_env.ppo_loss(_actor(verl_env), C.model_output(flat, case, rows, "nested"), td)


def test_fipo_split_step_opt_in_runs_logs_itself_and_measures_the_difference(verl_env):
    """With fipo_allow_split_step the split step keeps the dropped rows in verl's denominator: the loss and gradient
    are the one call with its drop (row_keep_mask) and the all-valid-token count as given (exactly), and differ from
    the reference by kept / valid."""
    case = _fipo_case(seed=1)
    bsz = len(case["response_lens"])
    n_global = C.num_tokens(case)
    config = _actor(verl_env, fipo_allow_split_step=True)
    total, grad, metrics = _split_step(verl_env, case, config)
    assert all(m[verl_env.losses.APPROXIMATE_METRIC].values == [1.0] for m in metrics)
    as_given, as_given_grad, _ = _direct(verl_env, case, list(range(bsz)), config,
                                         {"dp_size": 1, "batch_num_tokens": n_global, "global_batch_size": bsz},
                                         planned=True)
    torch.testing.assert_close(total, as_given, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, as_given_grad, rtol=1e-6, atol=1e-8)
    ref_loss, _, ref_metrics = _direct(verl_env, case, list(range(bsz)), config)
    assert ref_metrics["fipo/sequence_drop_ratio"] > 0
    dropped = sum(case["response_lens"][i] for i in range(bsz)
                  if _direct(verl_env, case, [i], config)[2]["fipo/sequence_drop_ratio"] == 1.0)
    assert dropped > 0
    assert total.item() == pytest.approx(ref_loss.item() * (n_global - dropped) / n_global, rel=1e-5)
    print(f"\nverl split step with drops (fipo_allow_split_step): loss {total.item():.4f} vs reference "
          f"{ref_loss.item():.4f} (x {(n_global - dropped) / n_global:.4f} = kept {n_global - dropped} / valid "
          f"{n_global} tokens; {ref_metrics['fipo/sequence_drop_ratio'] * bsz:.0f} of {bsz} rows dropped)")


def _compose(env, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(env.config_dir()), version_base=None):
        return compose(config_name="fipo_trainer",
                       overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides])


def test_fipo_trainer_yaml_composes_and_carries_the_keys_to_the_loss(verl_env):
    cfg = _compose(verl_env, [f"{KEY}.fipo_decay_rate=8", f"{KEY}.fipo_influence_clip_high_only=false"])
    actor = verl_env.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    pl = actor.policy_loss
    assert isinstance(pl, verl_env.FIPOPolicyLossConfig) and pl.loss_mode == "fipo"
    assert (pl.fipo_decay_rate, pl.fipo_clip_ratio_c, pl.fipo_influence_clip_ratio, pl.fipo_influence_clip_high_only,
            pl.fipo_safety_threshold) == (8.0, 10.0, 0.2, False, 10.0)
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    params = verl_env.algorithm.fipo_params_from_config(actor)  # what the loss reads from verl's ActorConfig
    assert (params.decay_rate, params.influence_clip_high_only, params.eps_high) == (8.0, False, 0.28)
    case = _fipo_case()
    rows = list(range(len(case["response_lens"])))
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    td = C.build_td(case, rows, "padded", dp_size=1, batch_num_tokens=C.num_tokens(case), global_batch_size=8)
    loss, _ = verl_env.ppo_loss(actor, C.model_output(flat, case, rows, "padded"), td)
    ref_loss, _, _ = _direct(verl_env, case, rows, actor)
    assert torch.equal(loss.detach(), ref_loss)
    assert pl.fipo_allow_split_step is False


@pytest.mark.parametrize("override, message", [
    ("fipo_decay_rate=0", "fipo_decay_rate must be > 0.0, got 0"),
    ("fipo_clip_ratio_c=1", "fipo_clip_ratio_c must be > 1.0, got 1"),
    ("fipo_influence_clip_ratio=-1", "fipo_influence_clip_ratio must be >= 0.0, got -1"),
    ("fipo_safety_threshold=nan", "fipo_safety_threshold must be finite, got nan"),
    ("fipo_influence_clip_high_only=maybe", "fipo_influence_clip_high_only must be true or false"),
    ("fipo_allow_split_step=1", "fipo_allow_split_step must be true or false"),
    ("fipo_influence_clip_high_only=false", "fipo_influence_clip_ratio must be < 1 in symmetric mode"),
])
def test_fipo_bad_values_fail_at_config_time(verl_env, override, message):
    from hydra.errors import InstantiationException

    extra = [f"{KEY}.fipo_influence_clip_ratio=1.5"] if override == "fipo_influence_clip_high_only=false" else []
    cfg = _compose(verl_env, [f"{KEY}.{override}", *extra])
    with pytest.raises(InstantiationException) as info:
        verl_env.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert f"{KEY}.{message}" in str(info.value)


def test_fipo_c_below_the_ppo_clip_fails_at_the_first_loss_call(verl_env):
    case = _fipo_case()
    rows = [0, 1]
    config = _actor(verl_env, fipo_clip_ratio_c=1.2)  # clip_ratio_high = 0.28
    flat = C.flat_for_rows(case, rows).requires_grad_(True)
    td = C.build_td(case, rows, "padded", dp_size=1, batch_num_tokens=C.num_tokens(case, rows), global_batch_size=2)
    with pytest.raises(ValueError, match=r"fipo_clip_ratio_c must be > 1 \+ eps_high = 1.28"):
        verl_env.ppo_loss(config, C.model_output(flat, case, rows, "padded"), td)
