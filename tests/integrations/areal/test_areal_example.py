"""examples/areal/: the AReaL-format gsm8k_m2po.yaml loads through AReaL's own config loader (Hydra composition,
structured merge, ``__post_init__`` checks) via the example script's loader, on CPU, without starting anything."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


pytestmark = pytest.mark.areal

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "areal"


def _script():
    spec = importlib.util.spec_from_file_location("areal_gsm8k_rl_example", EXAMPLES / "gsm8k_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _argv(tmp_path: Path, *overrides: str) -> list[str]:
    return ["--config", str(EXAMPLES / "gsm8k_m2po.yaml"), f"cluster.fileroot={tmp_path}",
            f"cluster.name_resolve.nfs_record_root={tmp_path / 'name_resolve'}", *overrides]


def test_example_yaml_loads_through_areal_config_loader(tmp_path: Path) -> None:
    from recipe.areal.config import ExactLossPPOActorConfig, GRPOConfig
    from recipe.areal.trainer import PPOTrainer

    script = _script()
    assert script.GRPOConfig is GRPOConfig and script.PPOTrainer is PPOTrainer
    config = script.load_config(_argv(tmp_path))
    assert isinstance(config, GRPOConfig) and isinstance(config.actor, ExactLossPPOActorConfig)
    assert config.actor.loss == "m2po" and config.actor.m2_threshold == 0.04
    assert config.actor.use_decoupled_loss and config.actor.rejection_sampling is None
    assert config.actor.backend == "fsdp:d4p1t1" and config.ref.path == config.actor.path  # interpolations resolved
    saved = list(tmp_path.rglob("config.yaml"))
    assert saved and "loss: m2po" in saved[0].read_text()  # AReaL saved the resolved config, our keys included


def test_example_switches_to_fipo_or_back_to_areal_with_overrides(tmp_path: Path) -> None:
    script = _script()
    fipo = script.load_config(_argv(tmp_path, "actor.loss=fipo", "actor.m2_threshold=null",
                                    "actor.fipo_decay_rate=16"))
    assert fipo.actor.loss == "fipo" and fipo.actor.fipo_decay_rate == 16.0
    areal_own = script.load_config(_argv(tmp_path, "actor.loss=null"))
    assert areal_own.actor.loss is None and areal_own.actor.m2_threshold == 0.04  # AReaL's own M2PO variant
    with pytest.raises(ValueError, match=r"actor\.m2_threshold=null"):
        script.load_config(_argv(tmp_path, "actor.loss=fipo"))
    with pytest.raises(Exception, match="fipo_decay_rat"):  # a misspelt key is refused by AReaL's loader, as usual
        script.load_config(_argv(tmp_path, "+actor.fipo_decay_rat=16"))
