"""Adding a loss touches no file of the Trinity-RFT adapter (issue 37): a throwaway loss installed beside the project
(one module plus its ``recipe.losses`` entry point, tests/throwaway_loss.py) runs through Trinity's own code path.

In a subprocess with the throwaway package on PYTHONPATH: Trinity's registry resolves
``recipe.trinity.ThrowawayPolicyLossFn`` (a class made from the loss's declaration), Trinity's config validator fills
in its default arguments (``tl_scale: 1.0``, from the declaration), Trinity builds the loss from its
``AlgorithmConfig`` (``policy_loss_fn_args: {tl_scale: ...}``) and verl's engine loop (``forward_backward_batch``)
calls it per micro-batch. At ``tl_scale = 1`` its loss and gradient are ``no_trust_region``'s, at 2 twice them, also
across a split mini-batch; its metrics are the step's, reduced by their declared rules (``throwaway/num_tokens`` =
the valid tokens, ``throwaway/ratio_mean`` their mean ratio); ``tl_scale: 0`` is refused when Trinity builds the
loss, in one line naming the key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import throwaway_loss

pytestmark = pytest.mark.trinity

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

SCRIPT = textwrap.dedent('''
    import json, sys
    from pathlib import Path

    HERE, TMP = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, str(HERE))
    import torch
    import torch.distributed as dist

    import _trinity_cases as C
    from trinity.algorithm import POLICY_LOSS_FN
    from trinity.trainer.verl.losses import build_trinity_loss

    dist.init_process_group("gloo", init_method=f"file://{TMP / 'store'}", rank=0, world_size=1)
    C.PATHS.update(throwaway="recipe.trinity.ThrowawayPolicyLossFn",
                   no_trust_region="recipe.trinity.NoTrustRegionPolicyLossFn")
    C.ARGS.update(throwaway={"tl_scale": 1.0}, no_trust_region={})
    out = {"resolved": POLICY_LOSS_FN.get(C.PATHS["throwaway"]).__name__}
    out["default_args"] = C.validated_algorithm(C.PATHS["throwaway"], None).policy_loss_fn_args
    try:
        build_trinity_loss(C.validated_algorithm(C.PATHS["throwaway"], {"tl_scale": 0}))
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)

    rows = C.mini_batch(3)
    mask = rows["response_mask"].bool()
    out["n_valid"] = int(mask.sum())
    out["ratio_mean"] = float(torch.exp(rows["table"] - rows["old_log_probs"])[mask].mean())
    one = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 8}
    split = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2}
    with C.torch_padding_kernels():
        runs = {}
        for label, name, args, batching in (("ntr", "no_trust_region", {}, one), ("t1", "throwaway", None, one),
                                            ("t2", "throwaway", {"tl_scale": 2.0}, one),
                                            ("ntr_split", "no_trust_region", {}, split),
                                            ("t2_split", "throwaway", {"tl_scale": 2.0}, split)):
            grad, seen = C.run_engine(name, rows, batching, args=args)
            runs[label] = grad
            out[label] = {"loss": sum(float(s["loss"]) for s in seen), "calls": len(seen),
                          "metrics": [{k: float(v) for k, v in s["metrics"].items() if "throwaway/" in k}
                                      for s in seen]}
        for a, b, factor in (("t1", "ntr", 1.0), ("t2", "t1", 2.0), ("t2_split", "ntr_split", 2.0),
                             ("ntr_split", "ntr", 1.0)):
            out[f"{a}_vs_{b}"] = float((runs[a] - factor * runs[b]).abs().max())
        out["moved"] = float(runs["t1"].abs().max())
    print("RESULT " + json.dumps(out))
''')


def test_a_throwaway_loss_runs_through_trinitys_own_loss_path(tmp_path: Path) -> None:
    pkg = throwaway_loss.install(tmp_path / "pkg")
    throwaway_loss.install_broken(pkg)  # beside the good plugin, each refused alone (issue 44 item 1)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(HERE), str(tmp_path)], cwd=REPO,
                         env=throwaway_loss.env_with(pkg), capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-6000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["resolved"] == "ThrowawayPolicyLossFn"
    assert out["default_args"] == {"tl_scale": 1.0, "loss_agg_mode": "token-mean"}
    refusal = out["refusal"]
    assert refusal is not None and "\n" not in refusal, refusal
    assert "algorithm.policy_loss_fn_args.tl_scale must be > 0" in refusal, refusal
    # Trinity really ran it: no_trust_region's loss and gradient at tl_scale 1, twice them at 2, split or not
    assert out["t1"]["calls"] == 1 and out["t2_split"]["calls"] > 1
    assert out["t1"]["loss"] == pytest.approx(out["ntr"]["loss"], rel=1e-6, abs=1e-8)
    assert out["t2"]["loss"] == pytest.approx(2 * out["t1"]["loss"], rel=1e-6, abs=1e-8)
    assert out["t2_split"]["loss"] == pytest.approx(out["t2"]["loss"], rel=1e-6, abs=1e-8)
    assert out["moved"] > 0
    for key in ("t1_vs_ntr", "t2_vs_t1", "t2_split_vs_ntr_split", "ntr_split_vs_ntr"):
        assert out[key] <= 1e-7, (key, out[key])
    # its metrics, by their declared rules: over the one micro-batch (the step), and over the split's micro-batches
    (whole,) = out["t1"]["metrics"]
    assert whole["actor/throwaway/num_tokens"] == out["n_valid"]
    assert whole["actor/throwaway/ratio_mean"] == pytest.approx(out["ratio_mean"], rel=1e-5)
    parts = out["t2_split"]["metrics"]
    assert sum(m["actor/throwaway/num_tokens"] for m in parts) == out["n_valid"]
    pooled = sum(m["actor/throwaway/ratio_mean"] * m["actor/throwaway/num_tokens"] for m in parts) / out["n_valid"]
    assert pooled == pytest.approx(out["ratio_mean"], rel=1e-5)
