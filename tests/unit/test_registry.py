"""recipe.registry: lookup by name, the batch selector, clash detection, verl's signature, torch-only recipes."""

from __future__ import annotations

import ast
import inspect
import math
import pathlib
import subprocess
import sys

import pytest
import torch

import recipe
import recipe.registry as registry
from recipe.testing import registry_state
from recipe.registry import (
    PolicyLossSpec,
    get_batch_selector,
    get_policy_loss_fn,
    get_policy_loss_spec,
    register_policy_loss,
    registered_policy_losses,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILTINS = ("fipo", "m2po", "no_trust_region", "vanilla")
VERL_PARAMS = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config",
               "rollout_is_weights"]


@pytest.fixture
def scratch_registry():
    """The registry's whole state (recipe.registry.RegistryState) saved and put back: the test may change it."""
    registry._load_builtins()
    with registry_state():
        yield registry._STATE


def test_builtins_registered():
    names = registered_policy_losses()
    assert names == sorted(names)
    for name in BUILTINS:
        assert name in names


def test_lookup_returns_the_recipe_functions():
    from recipe.baselines import compute_policy_loss_no_trust_region, compute_policy_loss_vanilla
    from recipe.m2po import compute_policy_loss_m2po, m2po_batch_selector

    assert get_policy_loss_fn("m2po") is compute_policy_loss_m2po
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
    assert get_policy_loss_fn("no_trust_region") is compute_policy_loss_no_trust_region
    assert get_batch_selector("m2po") is m2po_batch_selector
    assert get_batch_selector("vanilla") is None
    assert get_batch_selector("no_trust_region") is None
    spec = get_policy_loss_spec("m2po")
    assert isinstance(spec, PolicyLossSpec) and spec.name == "m2po"


def test_package_reexports():
    assert recipe.get_policy_loss_fn is get_policy_loss_fn
    assert recipe.register_policy_loss is register_policy_loss


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError) as exc:
        get_policy_loss_fn("m2p0")
    msg = str(exc.value)
    assert "'m2p0'" in msg
    for name in BUILTINS:
        assert name in msg
    with pytest.raises(ValueError, match="unknown policy loss"):
        get_batch_selector("nope")


def test_register_new_loss_and_selector(scratch_registry):
    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        return (log_prob * 0).sum(), {}

    def my_selector(*args, **kwargs):
        return {}

    returned = register_policy_loss("test_only_loss", batch_selector=my_selector)(my_loss)
    assert returned is my_loss  # usable as a decorator
    assert get_policy_loss_fn("test_only_loss") is my_loss
    assert get_batch_selector("test_only_loss") is my_selector
    assert "test_only_loss" in registered_policy_losses()


def test_fipo_registers_a_row_selector_and_every_selecting_loss_needs_the_steps_log_probs(scratch_registry):
    from recipe.fipo import fipo_row_selector

    assert registry.get_row_selector("fipo") is fipo_row_selector and get_batch_selector("fipo") is None
    assert registry.get_row_selector("m2po") is None
    assert {n: registry.needs_step_log_probs(n) for n in BUILTINS} == {
        "fipo": True, "m2po": True, "no_trust_region": False, "vanilla": False}
    with pytest.raises(ValueError, match="not both"):
        register_policy_loss("test_both", batch_selector=fipo_row_selector, row_selector=fipo_row_selector)


def test_registry_fixture_did_not_leak():
    assert "test_only_loss" not in registered_policy_losses()


def test_clash_with_a_different_function_raises(scratch_registry):
    def compute_policy_loss_m2po(**kwargs):  # same __qualname__, different module: a plugin clash
        return None

    compute_policy_loss_m2po.__module__ = "someone_else.plugin"
    with pytest.raises(ValueError, match=r"'m2po' is already registered by recipe\.m2po\.algorithm"):
        register_policy_loss("m2po")(compute_policy_loss_m2po)
    assert get_policy_loss_fn("m2po").__module__ == "recipe.m2po.algorithm"


def test_reregistering_the_same_function_is_idempotent(scratch_registry):
    from recipe.m2po import compute_policy_loss_m2po, m2po_batch_selector

    register_policy_loss("m2po", batch_selector=m2po_batch_selector)(compute_policy_loss_m2po)
    assert get_policy_loss_fn("m2po") is compute_policy_loss_m2po
    # a module reload produces a new function object with the same qualified name: accepted, not a clash
    def twin(**kwargs):
        return None

    twin.__module__ = compute_policy_loss_m2po.__module__
    twin.__qualname__ = compute_policy_loss_m2po.__qualname__
    register_policy_loss("m2po")(twin)
    assert get_policy_loss_fn("m2po") is twin


@pytest.mark.parametrize("bad", ["", None, 3, ("m2po",)])
def test_bad_names_rejected(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        register_policy_loss(bad)


@pytest.mark.parametrize("name", BUILTINS)
def test_signature_is_verls(name):
    params = inspect.signature(get_policy_loss_fn(name)).parameters
    assert list(params)[:7] == VERL_PARAMS
    assert params["loss_agg_mode"].default == "token-mean"
    assert params["config"].default is None
    assert params["rollout_is_weights"].default is None


@pytest.mark.parametrize("name", BUILTINS)
def test_called_as_verl_calls_it(name):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 6, generator=g)
    lp = (old + torch.randn(3, 6, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(3, 1, generator=g).expand(3, 6).clone()
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([[6], [2], [4]])
    fn = get_policy_loss_fn(name)
    keys = None
    for agg in ("token-mean", "seq-mean-token-mean"):
        for m in (mask, torch.zeros_like(mask)):
            loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=m,
                               loss_agg_mode=agg, config={"global_batch_info": {}}, rollout_is_weights=None)
            assert loss.shape == () and loss.requires_grad
            assert math.isfinite(loss.item())
            loss.backward()
            assert all(type(v) is float for v in metrics.values())
            keys = keys or list(metrics)
            assert list(metrics) == keys  # the same keys on every call


def test_import_registry_alone_finds_builtins():
    code = ("import sys; import recipe.registry as r; "
            "assert 'recipe.m2po.algorithm' not in sys.modules and 'torch' not in sys.modules, "
            "'the losses (torch) should load lazily; the declarations are torch-free'; "
            "print(r.get_policy_loss_fn('m2po').__module__, r.registered_policy_losses())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("recipe.m2po.algorithm [")
    for name in BUILTINS:
        assert repr(name) in out.stdout


def _top_level_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("relpath", ["recipe/common.py", "recipe/registry.py", "recipe/m2po/algorithm.py",
                                     "recipe/baselines/algorithm.py", "recipe/fipo/algorithm.py"])
def test_recipe_modules_import_only_torch_and_stdlib(relpath):
    imported = _top_level_imports(ROOT / relpath)
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "__future__"}
    assert third_party <= {"torch", "recipe"}, third_party


# ------------------------------------------------------------------------------------------ issue 44 items 1, 7, 8


def test_the_state_fixture_restores_the_whole_registry(scratch_registry):
    """One state object: a registration, a refusal, a reserved name and a probe flag all go back on restore."""
    before = registry.snapshot()

    def fn(**kw):  # pragma: no cover - never called
        raise AssertionError

    from recipe.declaration import LossDeclaration, param

    with registry_state():
        register_policy_loss(LossDeclaration(name="scratch_loss", summary="x",
                                             params=(param("scratch_p", 1.0, help="x"),)))(fn)
        registry.reserve_param_names(["scratch_field"], "a test config")
        registry._refuse("scratch_plugin", "plugin 'scratch_plugin' refused. Fix: none")
        assert "scratch_loss" in registry.declarations() and "scratch_plugin" in registry.refusals()
    after = registry.snapshot()
    assert vars(after) == vars(before)
    assert "scratch_loss" not in registry.declarations() and "scratch_field" not in registry._STATE.reserved


def _aggregated_per_micro_batch(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """A loss that ignores global_batch_info: each micro-batch divides by its own tokens (the mistake)."""
    from recipe.common import agg_loss, check_inputs, clamp_log_ratio, masked_log_ratio

    valid = check_inputs("per_mb", old_log_prob, log_prob, advantages, response_mask)
    ratio = torch.exp(clamp_log_ratio(masked_log_ratio(old_log_prob, log_prob, valid)))
    adv = torch.where(valid, advantages.float(), torch.zeros(()))
    return agg_loss(-adv * ratio, valid, loss_agg_mode), {}


def _multiplies_padding(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                        rollout_is_weights=None):
    """A loss that multiplies by the mask instead of masking: NaN on padding reaches the gradient."""
    from recipe.common import agg_loss, global_batch_info

    mask = response_mask.float()
    per_token = -advantages * torch.exp(log_prob - old_log_prob) * mask
    return agg_loss(per_token, response_mask, loss_agg_mode, **global_batch_info(config)), {}


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_is_split_invariant_by_the_public_helper(name):
    from recipe.testing import assert_split_invariant

    assert_split_invariant(name, splits=(1, 2, 4))


def test_the_split_helper_and_the_registry_probe_catch_the_two_classic_mistakes(scratch_registry, caplog):
    import logging

    from recipe.declaration import LossDeclaration
    from recipe.testing import assert_split_invariant

    register_policy_loss(LossDeclaration(name="per_mb", summary="x"))(_aggregated_per_micro_batch)
    register_policy_loss(LossDeclaration(name="nan_pad", summary="x"))(_multiplies_padding)
    register_policy_loss(LossDeclaration(name="opted_out", summary="x", split_probe=False))(
        _aggregated_per_micro_batch)
    register_policy_loss(LossDeclaration(name="in_process", summary="x"))(_aggregated_per_micro_batch)
    for name in ("per_mb", "nan_pad", "opted_out"):  # as load_plugins records an entry point's losses
        registry._STATE.owner[name] = f"plugin {name!r} (test)"
    with pytest.raises(AssertionError, match="not split-invariant.*agg_loss"):
        assert_split_invariant("per_mb")
    with pytest.raises(AssertionError, match="not finite: mask padding with torch.where"):
        assert_split_invariant("nan_pad")
    with caplog.at_level(logging.WARNING, logger="recipe.registry"):
        for name in ("per_mb", "nan_pad", "opted_out", "per_mb", "in_process"):
            get_policy_loss_fn(name)
    flags = registry.split_flags()
    assert set(flags) == {"per_mb", "nan_pad"} and "Fix:" in flags["per_mb"] and "\n" not in flags["per_mb"]
    warned = [r.getMessage() for r in caplog.records if "split-invariant" in r.getMessage()]
    # once per plugin loss; never for the one that opted out, nor for a loss registered in-process (the probe calls
    # the loss: user code, maybe with side effects, is run only for the plugins the registry loads itself)
    assert len(warned) == 2
