"""recipe/declaration.py: a loss declares its parameters, step needs and metric rules once, and every built-in loss's
declaration says exactly what the loss does (its metric keys, its selector, its parameters' defaults)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe.declaration import (MAX, MEAN, PPO_CLIP, SUM, LossDeclaration, Metric, StepScope, mean_over, param,
                                reduce_metrics)
from recipe.registry import (BUILTIN_POLICY_LOSSES, declarations, get_declaration, get_policy_loss_spec,
                             registered_policy_losses)

REPO = Path(__file__).resolve().parents[2]


def test_param_check_is_the_one_validation():
    tau = param("m2_threshold", 0.04, ge=0.0, help="h")
    assert tau.check(0) == 0.0 and isinstance(tau.check(0), float)
    with pytest.raises(ValueError, match="must be a number, got '0.5' \\(str\\)"):
        tau.check("0.5")
    with pytest.raises(ValueError, match=r"^actor\.m2_threshold must be >= 0\.0, got -1\. Fix: set "
                                         r"actor\.m2_threshold=0\.04\.$"):
        tau.check(-1, "actor.m2_threshold")
    with pytest.raises(ValueError, match="must be finite"):
        tau.check(float("nan"))
    with pytest.raises(ValueError, match="must be a number, got True"):
        tau.check(True)
    flag = param("on", True, help="h")
    assert flag.kind is bool and flag.check(False) is False
    with pytest.raises(ValueError, match="on must be true or false, got 'yes'.*Fix: set on=true"):
        flag.check("yes")
    scope = param("scope", "a", choices=("a", "b"), help="h")
    with pytest.raises(ValueError, match="scope must be one of a, b, got 'c'"):
        scope.check("c")


def test_read_is_typed_prefers_verls_policy_loss_and_runs_the_rules():
    decl = LossDeclaration(name="toy", summary="s", params=(param("k", 1.0, gt=0.0, help="h"),
                                                             param("s", "x", choices=("x", "y", "z"), help="h")),
                           step="batch_selector",
                           step_scope=StepScope(param="s", group="x", local="y", planned="z", unplanned="y"),
                           rules=(lambda v, clip: [("k", f"must be < 1 + {clip[1]}")] if v["k"] >= 1 + clip[1]
                                  else [],))
    p = decl.read({"k": 0.5, "policy_loss": {"k": 0.25}})
    assert (p.k, p.s) == (0.25, "x") and dataclasses.is_dataclass(p) and type(p).__name__ == "ToyParams"
    # a loss call reads its step-scope parameter by where it runs: outside a planned step, unset, the declared
    # unplanned value (set: as set); inside one, always the planned value; a config surface: the default
    assert decl.read(None, planned=False).s == "y" and decl.read({"s": "x"}, planned=False).s == "x"
    assert decl.read({"s": "x"}, planned=True).s == "z" and decl.read(None).s == "x"
    assert decl.scope_param() is decl.param("s") and decl.is_step_scope(decl.param("s"))
    assert not decl.is_step_scope(decl.param("k"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.k = 2.0
    with pytest.raises(ValueError, match=r"^actor\.k must be < 1 \+ 0\.2$"):
        decl.read({"k": 3.0}, clip=(0.2, 0.2), where="actor.")
    with pytest.raises(ValueError, match=r"policy_loss\.k must be > 0\.0"):
        decl.read({"policy_loss": {"k": 0}})


def test_a_declaration_refuses_what_it_cannot_mean():
    with pytest.raises(ValueError, match="step must be one of"):
        LossDeclaration(name="x", summary="s", step="sometimes")
    with pytest.raises(ValueError, match="repeat"):
        LossDeclaration(name="x", summary="s", params=(param("a", 1.0, help="h"), param("a", 2.0, help="h")))
    with pytest.raises(ValueError, match="diagnostic 'x/b' is not one of its declared metrics"):
        LossDeclaration(name="x", summary="s", metrics={"x/a": MEAN}, diagnostics=("x/b",))
    with pytest.raises(ValueError, match="weighted by 'x/n'"):
        LossDeclaration(name="x", summary="s", metrics={"x/a": mean_over("x/n")})
    with pytest.raises(ValueError, match="combine"):
        Metric("median")
    scope = StepScope(param="a", group="g", local="l", planned="l", unplanned="l")
    with pytest.raises(ValueError, match="step_scope.param 'a' is not one of its parameters"):
        LossDeclaration(name="x", summary="s", step="batch_selector", step_scope=scope)
    with pytest.raises(ValueError, match="step_scope needs a step planner"):
        LossDeclaration(name="x", summary="s", params=(param("a", "g", help="h"),), step_scope=scope)


def test_reduce_metrics_pools_a_fraction_of_a_loss_count_exactly():
    parts = [({"valid_tokens": 10.0, "rows": 2.0}, {"f/frac": 0.5, "f/n": 2.0, "f/m": 1.0, "f/rows_frac": 0.5}),
             ({"valid_tokens": 30.0, "rows": 6.0}, {"f/frac": 0.25, "f/n": 8.0, "f/m": 4.0, "f/rows_frac": 0.0})]
    rules = {"f/frac": mean_over("f/n"), "f/n": SUM, "f/m": MAX, "f/rows_frac": mean_over("rows")}
    assert reduce_metrics(parts, rules) == {"f/frac": (0.5 * 2 + 0.25 * 8) / 10, "f/n": 10.0, "f/m": 4.0,
                                            "f/rows_frac": 1.0 / 8}


def _random_call(name: str, seed: int = 0, **extra):
    g = torch.Generator().manual_seed(seed)
    shape = (6, 9)
    old = -torch.rand(shape, generator=g) * 2
    new = old + 0.8 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    return get_policy_loss_spec(name).fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                         loss_agg_mode="token-mean", config={"m2_threshold": 0.04, **extra},
                                         rollout_is_weights=None)


@pytest.mark.parametrize("name", BUILTIN_POLICY_LOSSES)
def test_each_builtin_declares_exactly_the_metrics_its_loss_reports(name):
    _, metrics = _random_call(name)
    decl = get_declaration(name)
    assert set(metrics) == set(decl.metrics), (set(metrics) ^ set(decl.metrics))
    spec = get_policy_loss_spec(name)
    assert spec.declaration is decl
    assert decl.step == ("batch_selector" if spec.batch_selector else "row_selector" if spec.row_selector
                         else "nothing")


def test_builtin_names_are_the_registered_ones_and_shared_parameters_are_one_declaration():
    assert set(BUILTIN_POLICY_LOSSES) <= set(registered_policy_losses())
    decls = declarations()
    assert decls["m2po"].params is decls["m2po_authors"].params
    by_name = {}
    for decl in decls.values():
        for p in decl.params:
            assert by_name.setdefault(p.name, p) == p


def test_runtime_config_fields_are_generated_from_the_declarations():
    from stalerl.config.schema import ActorConfig

    fields = {f.name: f for f in dataclasses.fields(ActorConfig)}
    for decl in declarations().values():
        for p in decl.params:
            f = fields[p.name]
            assert f.default == p.default_in("stalerl") and dict(f.metadata) == {**p.metadata(), "param": p}, p.name
    assert fields["m2_threshold"].default == 0.04 and fields["m2_scope"].default == "dp_group"
    # the runtime's PPO clip is the shared group's: its defaults, bounds and check
    for p in PPO_CLIP.params:
        assert fields[p.name].default == p.default and fields[p.name].metadata["param"] is p
        assert {k: v for k, v in fields[p.name].metadata.items() if k in ("ge", "gt", "le")} == \
            {k: v for k, v in p.metadata().items() if k in ("ge", "gt", "le")}


@pytest.mark.parametrize("override, line", [
    ("actor.m2_threshold=-1", "invalid config: actor.m2_threshold: must be >= 0.0, got -1.0. Fix: set "
                              "actor.m2_threshold=0.04."),
    ("actor.eps_clip=-1", "invalid config: actor.eps_clip: must be >= 0.0, got -1.0. Fix: set actor.eps_clip=0.2."),
    ("actor.c_clip=1", "invalid config: actor.c_clip: must be > 1.0, got 1.0. Fix: unset actor.c_clip (default: off)."),
])
def test_one_validation_the_runtime_speaks_param_checks_form(override, line):
    """Item 3: the runtime's check of a loss parameter (and of the shared PPO clip) is Param.check itself: the same
    sentence the loss, verl's config class and the other adapters give, under the runtime's key."""
    from stalerl.config import load_config
    from stalerl.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert str(err.value) == line
    key = override.split("=")[0].split(".", 1)[1]
    group = {p.name for p in PPO_CLIP.params}
    param = PPO_CLIP.param(key) if key in group else get_declaration("m2po").param(key)
    with pytest.raises(ValueError) as direct:
        param.check(float(override.split("=")[1]), override.split("=")[0])
    assert str(direct.value) == line.replace("invalid config: ", "").replace(f"{override.split('=')[0]}: ",
                                                                              f"{override.split('=')[0]} ", 1)


def test_the_namespace_rule_refuses_each_collision_in_one_line_naming_both_owners():
    """Item 2: a parameter named like the shared PPO clip, a call key, another loss's parameter (declared
    differently) or a runtime actor field is refused at registration; reusing another loss's Param is sharing."""
    import recipe.registry as registry
    from recipe.testing import registry_state
    from stalerl.config.schema import ActorConfig  # noqa: F401 - reserves the runtime's actor fields

    def fn(**kw):  # pragma: no cover - never called
        raise AssertionError

    cases = {
        "eps_clip": "is a key of the shared PPO-clip group",
        "clip_ratio_low": "is a key of the shared PPO-clip group",
        "loss_agg_mode": "is a key of every loss call",
        "m2_threshold": "is also a parameter of loss 'm2po'",
        "ppo_n_minibatches": "is a key of the runtime's actor config",
    }
    for name, says in cases.items():
        with registry_state(), pytest.raises(ValueError) as err:
            registry.register_policy_loss(LossDeclaration(name="thief", summary="x",
                                                          params=(param(name, 0.5, help="mine"),)))(fn)
        message = str(err.value)
        assert says in message and "'thief'" in message and "Fix:" in message and "\n" not in message, message
    with registry_state():  # sharing one declaration of the parameter is fine
        registry.register_policy_loss(LossDeclaration(name="sharer", summary="x",
                                                      params=get_declaration("m2po").params, step="nothing"))(fn)
        assert registry.get_policy_loss_fn("sharer") is fn
    assert "sharer" not in declarations()


def test_actor_loss_help_names_no_loss_by_hand():
    """Item 7: the runtime's ``actor.loss`` help is generated from the registry."""
    from stalerl.config.schema import ActorConfig

    help_text = {f.name: f for f in dataclasses.fields(ActorConfig)}["loss"].metadata["help"]
    assert ", ".join(BUILTIN_POLICY_LOSSES) in help_text


def test_declarations_load_without_torch():
    code = ("import sys\nfrom recipe.registry import declarations\nfrom stalerl.config import load_config\n"
            "d = declarations()\nload_config(['--config', 'examples/math/gsm8k_m2po_cpu.yaml', 'actor.loss=fipo',"
            " 'rollout.fixed_staleness=2'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nprint(sorted(d))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "m2po" in res.stdout
