"""recipe.swift's settings: environment keys, refusals of ms-swift flags, the plugin path; no ms-swift needed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from recipe.swift import plugin_path
from recipe.swift.config import (
    CURRENT,
    ENV_KEYS,
    OLD,
    OLD_LOGPS_FALLBACK_ENV,
    ROLLOUT,
    behaviour_source,
    check_environment,
    check_swift_args,
    loss_config,
    old_logps_fallback,
)

REPO = Path(__file__).resolve().parents[2]


def _args(**overrides):
    """The ms-swift argument fields the adapter reads, at ms-swift 4.6's defaults."""
    base = dict(loss_type="m2po", use_liger_kernel=False, importance_sampling_level="token", top_entropy_quantile=1.0,
                sequence_parallel_size=1, off_policy_sequence_mask_delta=None, rollout_importance_sampling_mode=None,
                advantage_reweight=None, teacher_model=None, teacher_model_server=None, multi_turn_scheduler=None,
                sdar_loss_coef=0.0, chord_sft_dataset=None, gradient_accumulation_steps=2, steps_per_generation=4,
                fipo_decay_rate=32.0, fipo_clip_range=0.2, fipo_clip_high_only=True, fipo_safety_threshold=4.0,
                delta=None, epsilon=0.2, epsilon_high=None, deepspeed=None, fsdp="")
    base.update(overrides)
    return SimpleNamespace(**base)


def test_defaults_match_stalerl_and_the_registry():
    assert loss_config("m2po", environ={}) == {"m2_threshold": 0.04}
    cfg = loss_config("fipo_ref", epsilon_low=0.2, epsilon_high=0.28, environ={})
    assert cfg == {"fipo_decay_rate": 32.0, "fipo_clip_ratio_c": 10.0, "fipo_influence_clip_ratio": 0.2,
                   "fipo_influence_clip_high_only": True, "fipo_safety_threshold": 10.0,
                   "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    from stalerl.config.schema import ActorConfig  # the same names and defaults as stalerl's actor.*

    actor = ActorConfig()
    for spec in ENV_KEYS["m2po"] + ENV_KEYS["fipo_ref"]:
        assert getattr(actor, spec.key) == spec.default, spec.key


def test_environment_values_reach_the_config():
    env = {"STALERL_M2_THRESHOLD": "0.02"}
    assert loss_config("m2po", environ=env) == {"m2_threshold": 0.02}
    env = {"STALERL_FIPO_DECAY_RATE": "16", "STALERL_FIPO_INFLUENCE_CLIP_HIGH_ONLY": "false"}
    cfg = loss_config("fipo_ref", environ=env)
    assert cfg["fipo_decay_rate"] == 16.0 and cfg["fipo_influence_clip_high_only"] is False


@pytest.mark.parametrize("env, words", [
    ({"STALERL_M2_THRESHOLD": "abc"}, ["STALERL_M2_THRESHOLD", "not a number"]),
    ({"STALERL_M2_THRESHOLD": "-1"}, ["STALERL_M2_THRESHOLD", ">= 0.0"]),
    ({"STALERL_M2_TRESHOLD": "0.1"}, ["unknown", "Did you mean STALERL_M2_THRESHOLD"]),
    ({"STALERL_FIPO_DECAY_RATE": "0"}, ["STALERL_FIPO_DECAY_RATE", "> 0.0"]),
    ({"STALERL_FIPO_INFLUENCE_CLIP_HIGH_ONLY": "maybe"}, ["STALERL_FIPO_INFLUENCE_CLIP_HIGH_ONLY", "boolean"]),
    ({"STALERL_FIPO_CLIP_RATIO_C": "1.1"}, ["STALERL_FIPO_CLIP_RATIO_C", "1 + eps_high"]),
])
def test_bad_values_fail_with_one_line_naming_the_variable(env, words):
    loss = "m2po" if any(k.startswith("STALERL_M2") for k in env) else "fipo_ref"
    with pytest.raises(ValueError) as info:
        loss_config(loss, environ=env)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_unknown_variable_is_refused_whatever_the_loss():
    with pytest.raises(ValueError, match="STALERL_FIPO_DECAY"):
        check_environment({"STALERL_FIPO_DECAY": "3"})
    check_environment({"STALERL_OTHER": "1", "PATH": "/bin"})  # other STALERL_* variables are not ours


@pytest.mark.parametrize("overrides, flag", [
    (dict(use_liger_kernel=True), "--use_liger_kernel"),
    (dict(importance_sampling_level="sequence"), "--importance_sampling_level"),
    (dict(top_entropy_quantile=0.2), "--top_entropy_quantile"),
    (dict(sequence_parallel_size=2), "--sequence_parallel_size"),
    (dict(rollout_importance_sampling_mode="token_truncate"), "--rollout_importance_sampling_mode"),
    (dict(steps_per_generation=3), "--steps_per_generation"),
    (dict(delta=3.0), "--delta"),
    (dict(multi_turn_scheduler="x"), "--multi_turn_scheduler"),
    (dict(loss_type="fipo_ref", fipo_safety_threshold=10.0), "--fipo_safety_threshold"),
    (dict(loss_type="fipo_ref", delta=10.0), "--delta"),
    (dict(loss_type="fipo_ref", fipo_clip_range=0.3), "--fipo_clip_range"),
    (dict(padding_free=True), "--padding_free"),
    (dict(loss_type="fipo_ref", packing=True), "--packing"),
    (dict(deepspeed="zero2"), "--deepspeed"),
    (dict(loss_type="fipo_ref", fsdp="full_shard auto_wrap"), "--fsdp"),
])
def test_unsupported_swift_flags_are_refused_naming_the_flag(overrides, flag):
    with pytest.raises(ValueError) as info:
        check_swift_args(_args(**overrides))
    assert flag in str(info.value) and "Fix:" in str(info.value) and "\n" not in str(info.value)


def test_defaults_and_swift_own_losses_pass():
    check_swift_args(_args())
    check_swift_args(_args(loss_type="fipo_ref"))
    # ms-swift's own loss types are never checked by the adapter, whatever the flags
    check_swift_args(_args(loss_type="fipo", delta=3.0, steps_per_generation=3, fipo_safety_threshold=2.0))


def test_plugin_path_is_printed_by_the_module_and_is_a_file():
    out = subprocess.run([sys.executable, "-m", "recipe.swift"], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout.strip()
    assert out == plugin_path() and Path(out).is_file()
    # ms-swift puts the plugin's folder on sys.path: it must hold nothing that could shadow another module
    assert sorted(p.name for p in Path(out).parent.glob("*.py")) == ["__init__.py", "stalerl_swift_plugin.py"]


def test_adapter_imports_only_torch_recipe_and_swift():
    allowed_roots = {"torch", "recipe", "swift", "__future__", "typing", "dataclasses", "os", "math", "difflib",
                     "pathlib", "sys"}
    for path in sorted((REPO / "recipe" / "swift").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed_roots, f"{path.relative_to(REPO)} imports {sorted(roots - allowed_roots)}"


def _source(**flags):
    base = dict(every_rollout=False, any_rollout=False, every_old=True, use_vllm=False, async_generate=False,
                allow_old_fallback=False)
    base.update(flags)
    return behaviour_source("m2po", **base)


def test_one_behaviour_source_per_step():
    # rollout log-probs on every micro-batch of every rank: the sampler's, whatever else is set
    assert _source(every_rollout=True, any_rollout=True, use_vllm=True, async_generate=True) == (ROLLOUT, False)
    # HF generation (no vLLM): ms-swift's old log-probs are the generating policy's
    assert _source() == (OLD, False)
    assert _source(every_old=False) == (CURRENT, False)
    # vLLM with rollout log-probs on only part of the step: refused, or the logged opt-in for the whole step
    for flags in (dict(use_vllm=True, any_rollout=True), dict(use_vllm=True), dict(any_rollout=True)):
        with pytest.raises(RuntimeError, match=OLD_LOGPS_FALLBACK_ENV) as info:
            _source(**flags)
        assert "\n" not in str(info.value) and "--loss_type m2po" in str(info.value)
        assert _source(allow_old_fallback=True, **flags) == (OLD, True)
    with pytest.raises(RuntimeError, match="no single behaviour policy"):
        _source(use_vllm=True, any_rollout=True, every_old=False, allow_old_fallback=True)


def test_async_generate_without_rollout_log_probs_is_refused_even_with_the_opt_in():
    for fallback in (False, True):
        with pytest.raises(RuntimeError, match="--async_generate") as info:
            _source(use_vllm=True, any_rollout=True, async_generate=True, allow_old_fallback=fallback)
        assert "staleness would be invisible" in str(info.value) and "\n" not in str(info.value)


def test_old_logps_fallback_is_an_explicit_boolean():
    assert old_logps_fallback({}) is False
    assert old_logps_fallback({OLD_LOGPS_FALLBACK_ENV: "true"}) is True
    assert old_logps_fallback({OLD_LOGPS_FALLBACK_ENV: "0"}) is False
    with pytest.raises(ValueError, match=OLD_LOGPS_FALLBACK_ENV):
        old_logps_fallback({OLD_LOGPS_FALLBACK_ENV: "sometimes"})
    check_environment({OLD_LOGPS_FALLBACK_ENV: "true"})
    with pytest.raises(ValueError, match="Did you mean " + OLD_LOGPS_FALLBACK_ENV):
        check_environment({"STALERL_SWIFT_OLD_LOGP_FALLBACK": "true"})


def test_untested_swift_version_is_refused_unless_overridden(monkeypatch):
    import recipe.versions as versions

    monkeypatch.setattr(versions, "installed_version", lambda key: "4.7.0" if key == "ms-swift" else None)
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(versions.UntestedFrameworkVersion, match=r"ms-swift 4\.7\.0 .*>=4\.6,<4\.7") as info:
        check_swift_args(_args())
    assert "\n" not in str(info.value)
    check_swift_args(_args(loss_type="grpo"))  # ms-swift's own loss types: the adapter is not involved
    monkeypatch.setenv(versions.ALLOW_ENV, "ms-swift")
    with pytest.warns(RuntimeWarning, match="outside the tested range"):
        check_swift_args(_args())


def test_a_loss_named_like_swifts_own_is_refused_alone_and_the_others_stay():
    """The clash check every adapter shares (recipe.registry.usable_declarations), ms-swift's side: a loss whose
    ms-swift name is one of ms-swift's own (``sapo``) is no ``--loss_type`` of this adapter and has no variables;
    one logged line says so with the fix; every built-in stays."""
    import recipe.registry as registry
    from recipe.declaration import LossDeclaration, param
    from recipe.swift import config as swift_config
    from recipe.testing import registry_state

    with registry_state():
        registry.register_policy_loss(LossDeclaration(
            name="sapo", summary="a plugin named like ms-swift's",
            params=(param("sapo_scale", 1.0, gt=0.0, help="x"),)))(lambda **kw: None)
        types = swift_config.swift_loss_types()
        env_names = swift_config._all_env_names()
        refused = registry.refusals()
    assert "sapo" not in types and "STALERL_SAPO_SCALE" not in env_names
    assert {registry.get_declaration(n).name_in("swift") for n in registry.BUILTIN_POLICY_LOSSES} <= set(types)
    assert "swift has its own loss 'sapo'" in refused["swift:sapo"] and "framework_names" in refused["swift:sapo"]
    assert "\n" not in refused["swift:sapo"]


def test_a_plugin_with_a_swift_namesake_gets_fipos_treatment():
    """What ms-swift must know about a loss with an ms-swift namesake is a declaration field
    (``LossDeclaration.namesake_flags``), not a loss-name branch: a plugin ``sapo`` renamed ``sapo_ref`` in ms-swift
    that declares ms-swift's ``--tau_pos`` as its namesake's flag has it refused at any value but the default, naming
    its own variable; ``--delta`` is refused as for any loss (it is no namesake flag of this one)."""
    import recipe.registry as registry
    from recipe.declaration import LossDeclaration, NamesakeFlag, param
    from recipe.testing import registry_state

    with registry_state():
        registry.register_policy_loss(LossDeclaration(
            name="sapo", summary="a plugin with an ms-swift namesake",
            params=(param("sapo_temp", 1.0, gt=0.0, help="x"),), framework_names={"swift": "sapo_ref"},
            namesake_flags={"swift": (NamesakeFlag("tau_pos", 1.0, "sapo_temp"),)}))(lambda **kw: None)
        check_swift_args(_args(loss_type="sapo_ref", tau_pos=1.0))
        with pytest.raises(ValueError) as info:
            check_swift_args(_args(loss_type="sapo_ref", tau_pos=2.0))
        with pytest.raises(ValueError, match="two-sided clip"):
            check_swift_args(_args(loss_type="sapo_ref", delta=3.0))
    msg = str(info.value)
    assert msg.startswith("--loss_type sapo_ref does not support --tau_pos 2.0: that flag configures ms-swift's own "
                          "sapo; sapo_ref reads its settings from the environment")
    assert "export STALERL_SAPO_TEMP" in msg and "\n" not in msg


def test_a_namesake_flag_must_name_a_parameter_of_the_loss():
    from recipe.declaration import LossDeclaration, NamesakeFlag

    with pytest.raises(ValueError, match="namesake flag swift --x names 'y', which is not one of its parameters"):
        LossDeclaration(name="z", summary="s", namesake_flags={"swift": (NamesakeFlag("x", 1, "y"),)})
