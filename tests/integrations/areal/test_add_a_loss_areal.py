"""Adding a loss touches no file of the AReaL adapter (issue 37): a throwaway loss installed beside the project (one
module plus its ``recipe.losses`` entry point, tests/throwaway_loss.py) runs through AReaL's own code path.

In a subprocess with the throwaway package on PYTHONPATH: its parameter ``actor.tl_scale`` is a field of the adapter's
AReaL config (generated from its declaration) that AReaL's own loader (the example script's ``load_config``: Hydra,
structured merge, ``__post_init__``) reads; a real ``FSDPPPOActor`` update (AReaL's ``_ppo_update``, its packed
micro-batches, its optimizer step) with ``actor.loss: throwaway`` computes the same loss and update as
``no_trust_region`` at ``tl_scale = 1`` and twice them at ``tl_scale = 2``; its metrics reach AReaL's stats export
reduced by their declared rules (``throwaway/num_tokens`` summed, ``throwaway/ratio_mean`` the valid-token mean);
``actor.tl_scale: 0`` is refused by the loader with one line naming the key, before any update.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import throwaway_loss

pytestmark = pytest.mark.areal

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

SCRIPT = textwrap.dedent('''
    import json, os, sys, importlib.util
    from pathlib import Path

    HERE, REPO, TMP = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    sys.path[:0] = [str(HERE), str(REPO / "tests" / "unit")]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0", "AREAL_SPMD_MODE": "1"}.items():
        os.environ.setdefault(key, value)
    import torch

    from recipe.registry import registered_policy_losses
    from stalerl.core.model import build_char_tokenizer, build_tiny_model
    import test_areal_actor as T
    from _varlen_attention import varlen_sdpa_installed

    out = {"registered": "throwaway" in registered_policy_losses()}
    # AReaL's own config loader, with the generated key
    spec = importlib.util.spec_from_file_location("areal_example", REPO / "examples" / "areal" / "gsm8k_rl.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--config", str(REPO / "examples" / "areal" / "gsm8k_m2po.yaml"), f"cluster.fileroot={TMP}",
            f"cluster.name_resolve.nfs_record_root={TMP / 'name_resolve'}", "actor.loss=throwaway",
            "actor.m2_threshold=null"]
    loaded = script.load_config(argv + ["+actor.tl_scale=2.5"])  # not in the yaml: Hydra appends it
    out["loaded_tl_scale"] = loaded.actor.tl_scale
    out["default_tl_scale"] = script.load_config(argv).actor.tl_scale
    try:
        script.load_config(argv + ["+actor.tl_scale=0"])
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)

    model_dir = TMP / "tiny-qwen2"
    tokenizer = build_char_tokenizer()
    build_tiny_model("qwen2", tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, seed=3).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with varlen_sdpa_installed():
        batch = T._batch(model_dir, seed=21)
        mask = batch["loss_mask"].bool()
        out["n_valid"] = int(mask.sum())
        out["ratio_mean"] = float(torch.exp(batch["prox_logp"] - batch["logprobs"])[mask].mean())
        runs = {}
        for label, loss, extra in (("no_trust_region", "no_trust_region", {}), ("t1", "throwaway", {"tl_scale": 1.0}),
                                   ("t2", "throwaway", {"tl_scale": 2.0})):
            T._exported()
            recorder, before, after = T._update(model_dir, loss, n_mbs=3, batch=batch, **extra)
            stats = T._exported()
            runs[label] = (torch.stack(recorder.scaled_losses).sum(), {k: before[k] - after[k] for k in before})
            out[label] = {"loss": float(runs[label][0]), "micro_batches": len(recorder.micro_batches),
                          "stats": {k: v for k, v in stats.items() if k.startswith(("throwaway/", "no_trust_region/"))}}
        for a, b, factor in (("t1", "no_trust_region", 1.0), ("t2", "t1", 2.0)):
            out[f"{a}_vs_{b}"] = max(float((runs[a][1][k] - factor * runs[b][1][k]).abs().max()) for k in runs[a][1])
        out["moved"] = max(float(d.abs().max()) for d in runs["t1"][1].values())
    print("RESULT " + json.dumps(out))
''')


def test_a_throwaway_loss_runs_through_arealss_own_update(tmp_path: Path) -> None:
    pkg = throwaway_loss.install(tmp_path / "pkg")
    throwaway_loss.install_broken(pkg)  # beside the good plugin, each refused alone (issue 44 item 1)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(HERE), str(REPO), str(tmp_path)], cwd=REPO,
                         env=throwaway_loss.env_with(pkg), capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-6000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["registered"]
    # the generated key, read by AReaL's own loader; 0 refused there, in one line naming the key and the fix
    assert out["loaded_tl_scale"] == 2.5 and out["default_tl_scale"] == 1.0
    refusal = out["refusal"]
    assert refusal is not None and "\n" not in refusal, refusal
    assert "actor.tl_scale must be > 0" in refusal and "Fix: set actor.tl_scale=1.0" in refusal, refusal
    # AReaL really ran it: at tl_scale 1 the loss and the update are no_trust_region's, at 2 twice them
    assert out["t1"]["micro_batches"] == 3
    assert out["t1"]["loss"] == pytest.approx(out["no_trust_region"]["loss"], rel=1e-6, abs=1e-8)
    assert out["t2"]["loss"] == pytest.approx(2 * out["t1"]["loss"], rel=1e-6, abs=1e-8)
    assert out["moved"] > 0 and out["t1_vs_no_trust_region"] <= 1e-6 and out["t2_vs_t1"] <= 1e-6
    # its metrics, reduced by the declared rules over AReaL's 3 micro-batches: the count summed, the ratio's
    # valid-token mean (the whole mini-batch's)
    for label in ("t1", "t2"):
        stats = out[label]["stats"]
        assert stats["throwaway/num_tokens"] == out["n_valid"], stats
        assert stats["throwaway/ratio_mean"] == pytest.approx(out["ratio_mean"], rel=1e-4), stats
    ntr = out["no_trust_region"]["stats"]
    assert ntr["no_trust_region/ratio_mean"] == pytest.approx(out["ratio_mean"], rel=1e-4), ntr
    assert ntr["no_trust_region/ratio_max"] >= ntr["no_trust_region/ratio_mean"]
