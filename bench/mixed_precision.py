"""Do bf16 runs train? Fraction of weights that change over 10 AdamW steps at lr 1e-6, on CPU.

One 4096x1024 linear weight (std 0.02, as a 1.5B model's projections), the same random inputs and loss gradients for
every variant, 10 AdamW steps at lr 1e-6 (the runtime's optimizer from ``stalerl.training.actor.build_optimizer``):

* before: pure bf16 parameters stepped in bf16 (what ``actor.dtype=bfloat16`` did: the model was loaded in bf16);
* after (ours): float32 master parameters, forward/backward under ``stalerl.core.model.autocast_context(bf16)`` (bf16
  matmuls), the optimizer stepping the float32 parameters. Also reported: the fraction of the bf16 *copy* of the
  weights (what a bf16 rollout engine would hold) that differs from the initial bf16 copy;
* fp32: float32 parameters and compute, the reference.

An update of ~lr = 1e-6 is far below half a bf16 ulp of a weight of ~0.02 (ulp 2^-13 ~ 1.2e-4 at 0.02), so bf16
parameters round straight back; fp32 masters accumulate it.

    python bench/mixed_precision.py
    python bench/mixed_precision.py --steps 100 --lr 1e-6
"""

from __future__ import annotations

import argparse

import torch

from stalerl.training.actor import build_optimizer
from stalerl.config import load_config
from stalerl.core.model import autocast_context


def run(kind: str, w0: torch.Tensor, inputs: list[torch.Tensor], grads_out: list[torch.Tensor], lr: float,
        ) -> tuple[float, float]:
    """(fraction of parameter elements changed, fraction of the parameters' bf16 view changed)."""
    opt_cfg = load_config([f"actor.optimizer.lr={lr}"]).actor.optimizer
    param_dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    layer = torch.nn.Linear(w0.shape[1], w0.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(w0.to(param_dtype).float())
    layer = layer.to(param_dtype)
    opt = build_optimizer(layer, opt_cfg)
    compute = "float32" if kind == "fp32" else "bfloat16"
    start = layer.weight.detach().clone()
    for x, g in zip(inputs, grads_out):
        with autocast_context(torch.device("cpu"), compute):
            y = layer(x.to(param_dtype))
        # loss = <y, g>: a fixed, nonzero output gradient per step, the same for every variant
        (y.float() * g).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    w = layer.weight.detach()
    changed = float((w != start).float().mean())
    changed_bf16_view = float((w.bfloat16() != start.bfloat16()).float().mean())
    return changed, changed_bf16_view


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(args.rows, args.cols, generator=gen) * 0.02
    inputs = [torch.randn(args.batch, args.cols, generator=gen) for _ in range(args.steps)]
    grads_out = [torch.randn(args.batch, args.rows, generator=gen) for _ in range(args.steps)]
    print(f"torch {torch.__version__}, weight {args.rows}x{args.cols} std 0.02, {args.steps} AdamW steps at lr "
          f"{args.lr:g}")
    before, _ = run("bf16", w0, inputs, grads_out, args.lr)
    after, after_view = run("ours", w0, inputs, grads_out, args.lr)
    ref, _ = run("fp32", w0, inputs, grads_out, args.lr)
    print(f"  before (bf16 parameters, bf16 compute):          {before:8.4%} of weights changed")
    print(f"  after  (fp32 master parameters, bf16 autocast):  {after:8.4%} of weights changed "
          f"(bf16 copy of them: {after_view:.4%})")
    print(f"  fp32 reference (fp32 parameters and compute):    {ref:8.4%} of weights changed")
    print(f"  after/before = {after / before:.1f}x" if before > 0 else "  before: no weight changed")


if __name__ == "__main__":
    main()
