"""examples/minimal/m2po_one_step.py is the runtime's step, not a sketch of it (issue 37, item 7).

The synchronous Trainer on the embedded CPU config (after a short warm start, so that rewards vary within groups)
takes its first step; the minimal file's functions, given the batch the runtime sampled (prompts, tokens, masks),
must reproduce its behaviour log-probs, rewards, advantages, loss, gradients and weights after the optimizer step.
With rollout.fixed_staleness=1 the runtime's second step trains on a batch one version old, where M2PO masks tokens:
the minimal update, started from the runtime's weights and optimizer state, must reproduce that step too. The M2PO
loss alone is compared with recipe.m2po on random tensors (ties and clamped ratios included), and the file must run
as a script.

Tolerances. Both sides compute in float32 but not identically: the runtime's behaviour log-probs come from
transformers' KV-cache generate and its training log-probs from the chunked head (stalerl.core.chunked_logprob), the
minimal file's from one plain forward and log_softmax. Log-probs agree to ~1e-6, gradients to ~1e-7.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import subprocess
import sys

import pytest
import torch

from recipe.m2po import compute_policy_loss_m2po
from conftest import CPU_CONFIG, REPO, small_overrides

EXAMPLE = REPO / "examples" / "minimal" / "m2po_one_step.py"
TAU = 1e-5  # small enough that the stale step's d (one update at lr 1e-4) is masked; the on-policy step's d is ~1e-7
LOGP_ATOL = 1e-5
GRAD_ATOL = 1e-6
PARAM_ATOL = 1e-6


def _load_example():
    spec = importlib.util.spec_from_file_location("m2po_one_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mini = _load_example()


def _capture_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer, into: list) -> None:
    """Before every optimizer step: the (clipped) gradients it is about to apply, by parameter name."""
    def hook(opt, args, kwargs):
        into.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    optimizer.register_step_pre_hook(hook)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """Two runtime steps at fixed staleness 1: step 1 on-policy, step 2 on a batch of the starting weights."""
    from stalerl.config import load_config
    from stalerl.training.trainer import Trainer

    tmp = tmp_path_factory.mktemp("minimal")
    overrides = small_overrides(tmp, **{
        "warm_start.steps": 100, "warm_start.batch_size": 32, "rollout.fixed_staleness": 1, "actor.loss": "m2po",
        "actor.m2_threshold": TAU, "total_train_steps": 2, "train_dataset.batch_size": 4, "gconfig.n_samples": 4,
        "gconfig.max_new_tokens": 10, "gconfig.temperature": 0.8, "train_dataset.synthetic.max_operand": 12,
        "train_dataset.synthetic.train_size": 2000, "train_dataset.synthetic.test_size": 16,
        "valid_dataset.synthetic.max_operand": 12, "valid_dataset.synthetic.test_size": 16,
        "evaluator.n_prompts": 16})
    cfg = load_config(["--config", str(CPU_CONFIG), *overrides])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.run_warm_start()  # 100 supervised steps: ~10% of the samples are right, so some groups differ
    trainer.warm_start_done = True
    generated, grads = [], []
    generate = trainer.source.generate_batch
    trainer.source.generate_batch = lambda: generated.append(generate()) or generated[-1]
    _capture_grads(trainer.model, trainer.actor.optimizer, grads)

    v0 = copy.deepcopy(trainer.model)
    step1 = trainer.train_step()
    v1 = copy.deepcopy(trainer.model)
    v1_params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    v1_optimizer = copy.deepcopy(trainer.actor.optimizer.state_dict())
    step2 = trainer.train_step()
    v2_params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return dict(cfg=cfg, trainer=trainer, batches=generated, grads=grads, v0=v0, v1=v1, v1_params=v1_params,
                v1_optimizer=v1_optimizer, v2_params=v2_params, metrics=[step1, step2])


def _rollout(batch) -> "mini.Rollout":
    return mini.Rollout(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, batch.group_ids)


def _minimal_step(rt: dict, batch, behaviour_model, model, optimizer_state, step: int):
    """The minimal file's pipeline on the runtime's batch: behaviour log-probs, rewards, advantages, one update."""
    cfg = rt["cfg"]
    rollout = _rollout(batch)
    t = cfg.gconfig.temperature
    old_logp = mini.behaviour_logprobs(behaviour_model, rollout, t)
    rewards = mini.compute_rewards(rt["trainer"].tokenizer, rollout, batch.answers[::cfg.gconfig.n_samples])
    advantages = mini.grpo_advantages(rewards, rollout.group_ids, rollout.response_mask, cfg.actor.adv_norm.eps)
    opt = cfg.actor.optimizer
    assert (mini.LR, mini.BETAS, mini.ADAM_EPS, mini.WEIGHT_DECAY, mini.GRAD_CLIP) == (
        opt.lr, (opt.beta1, opt.beta2), opt.eps, opt.weight_decay, opt.gradient_clipping)
    optimizer = mini.build_optimizer(model)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    for group in optimizer.param_groups:
        group["lr"] = opt.lr * mini.lr_factor(step, rt["trainer"].total_steps, opt.warmup_steps_proportion,
                                              opt.lr_scheduler_type)
    grads: list = []
    _capture_grads(model, optimizer, grads)
    stats = mini.update(model, optimizer, rollout, old_logp, advantages, temperature=t, tau=cfg.actor.m2_threshold,
                        grad_clip=opt.gradient_clipping)
    return old_logp, rewards, advantages, stats, grads[0], optimizer.param_groups[0]["lr"]


def _assert_same_update(model, runtime_params: dict, grads: dict, runtime_grads: dict, lr: float) -> None:
    """Gradients within GRAD_ATOL; weights within PARAM_ATOL. Adam's step is ~lr * g / (|g| + eps), whose slope at
    g ~ 0 is lr / eps = 1e4: a gradient of ~0 that the two float paths round differently (1e-10 apart) moves its
    weight by up to ~1e-6 differently. So the weights of gradients below 1e-6 get the bound that slope allows,
    2 * lr * |g - g_runtime| / eps (twice the first step's slope covers the later steps' bias corrections); all
    others must agree to PARAM_ATOL (they do to ~1e-8)."""
    assert grads.keys() == runtime_grads.keys()
    for name, p in model.named_parameters():
        g, g_rt = grads[name], runtime_grads[name]
        torch.testing.assert_close(g, g_rt, rtol=0, atol=GRAD_ATOL, msg=lambda m: f"gradient of {name}: {m}")
        diff = (p.detach() - runtime_params[name]).abs()
        bound = torch.where(g_rt.abs() >= 1e-6, torch.full_like(diff, PARAM_ATOL),
                            PARAM_ATOL + 2 * lr * (g - g_rt).abs() / mini.ADAM_EPS)
        assert bool((diff <= bound).all()), f"{name}: weights differ by {float(diff.max()):.3g} after the step"


def test_first_step_equals_the_runtime(runtime):
    rt = runtime
    batch = rt["batches"][0]  # the FIFO generated two batches with the starting weights; step 1 consumed the first
    metrics = rt["metrics"][0]
    assert metrics["staleness/max"] == 0
    model = copy.deepcopy(rt["v0"])
    old_logp, rewards, advantages, stats, grads, lr = _minimal_step(rt, batch, rt["v0"], model, None, step=0)

    assert not bool(batch.prompt_mask.all()), "no left padding: position ids would go untested"
    assert not bool(batch.response_mask.all()), "no response ended at eos: its masking would go untested"
    tok = rt["trainer"].tokenizer
    n = rt["cfg"].gconfig.n_samples
    texts = [tok.decode(ids[m]) for ids, m in zip(batch.prompt_ids[::n], batch.prompt_mask[::n])]
    assert all(t.startswith("Q: ") and t.endswith(" A:") for t in texts), texts
    prompt_ids, prompt_mask = mini.encode_prompts(tok, [t[3:-3] for t in texts])
    assert torch.equal(prompt_ids.repeat_interleave(n, 0), batch.prompt_ids)
    assert torch.equal(prompt_mask.repeat_interleave(n, 0), batch.prompt_mask)
    assert torch.equal(mini.mask_through_first_eos(batch.response_ids, tok.eos_token_id), batch.response_mask)
    torch.testing.assert_close(old_logp, batch.behavior_logp, rtol=0, atol=LOGP_ATOL)
    assert torch.equal(rewards, batch.rewards)
    _, inv = torch.unique(batch.group_ids, return_inverse=True)
    assert any(rewards[inv == g].unique().numel() > 1 for g in inv.unique()), "no group with a reward signal"
    torch.testing.assert_close(advantages, rt["trainer"].advantages(batch), rtol=0, atol=1e-6)
    # On-policy: the minimal d is exactly 0 (the same forward twice), the runtime's ~1e-7 (KV cache vs full
    # forward); neither is anywhere near tau, so neither masks.
    assert metrics["actor/m2po/masked_fraction"] == 0.0
    _assert_same_step(stats, metrics, lr, model, rt["v1_params"], grads, rt["grads"][0])


def _assert_same_step(stats, metrics, lr, model, runtime_params, grads, runtime_grads) -> None:
    """The minimal step's masked share, learning rate, loss, grad norm, gradients and weights are the runtime's."""
    assert stats["masked_fraction"] == metrics["actor/m2po/masked_fraction"]
    assert lr == metrics["actor/lr"]
    assert stats["loss"] == pytest.approx(metrics["actor/loss"], abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    _assert_same_update(model, runtime_params, grads, runtime_grads, lr)


def test_stale_step_where_m2po_masks_equals_the_runtime(runtime):
    rt = runtime
    batch = rt["batches"][1]  # sampled by the starting weights, trained at version 1
    metrics = rt["metrics"][1]
    assert metrics["staleness/max"] == 1 and metrics["actor/m2po/num_masked_tokens"] > 0
    model = copy.deepcopy(rt["v1"])
    old_logp, _, _, stats, grads, lr = _minimal_step(rt, batch, rt["v0"], model, rt["v1_optimizer"], step=1)

    torch.testing.assert_close(old_logp, batch.behavior_logp, rtol=0, atol=LOGP_ATOL)
    # The same tokens masked (their count, and the loss and gradients below, which depend on which ones). M2 before
    # and after are not compared: tokens whose probability is ~1 under both policies have d ~ 1e-7 of either sign,
    # so float noise decides whether they count in T's mean (they can never be masked: their d^2 is ~1e-14).
    _assert_same_step(stats, metrics, lr, model, rt["v2_params"], grads, rt["grads"][1])


def test_sample_keeps_the_first_eos_and_pads_after_it(runtime):
    rt = runtime
    tok, batch, n = rt["trainer"].tokenizer, rt["batches"][0], rt["cfg"].gconfig.n_samples
    max_new = rt["cfg"].gconfig.max_new_tokens
    out = mini.sample(rt["v0"], batch.prompt_ids[::n], batch.prompt_mask[::n], n=n, max_new_tokens=max_new,
                      temperature=rt["cfg"].gconfig.temperature, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                      generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.prompt_ids, batch.prompt_ids) and torch.equal(out.group_ids, batch.group_ids)
    lengths = out.response_mask.sum(dim=1)
    for row in range(out.response_ids.shape[0]):
        ids = out.response_ids[row][out.response_mask[row]].tolist()
        assert tok.eos_token_id not in ids[:-1] and (ids[-1] == tok.eos_token_id or len(ids) == max_new)
        assert bool((out.response_ids[row][int(lengths[row]):] == tok.pad_token_id).all())
    assert any(out.response_ids[r][int(lengths[r]) - 1] == tok.eos_token_id for r in range(len(lengths)))
    # the trained model answers in the format it was warm-started on
    assert sum(t.startswith(" #### ") for t in tok.batch_decode(out.response_ids, skip_special_tokens=True)) > 8


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.0, 0.01, 0.04, 0.3])
def test_m2po_loss_equals_the_recipe_on_random_tensors(seed, tau):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 6, 12
    old = -torch.rand(rows, width, generator=gen) * 3
    d = torch.randn(rows, width, generator=gen) * 0.3
    old[0, :4] = -1.0  # so that (old + d) - old is d exactly for the ties below
    d[0, :4] = torch.tensor([0.5, -0.5, 0.5, -0.5])  # equal d^2: the tie rule decides which goes first
    d[1, 2], d[2, 5] = 25.0, -30.0  # beyond the +-20 clamp
    d[3, :3] = 0.0  # on-policy tokens: never in T
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[0] = width
    valid = torch.arange(width)[None, :] < lengths[:, None]
    adv = torch.randn(rows, 1, generator=gen).expand(rows, width).clone()  # GRPO: one advantage per row
    adv[0] = torch.tensor([1.0, -1.0, 2.0, -2.0] * 3)  # the tied tokens all in T, with different advantages
    adv[4] = 0.0  # a group with no signal
    adv = torch.where(valid, adv, torch.zeros(()))

    logp_mini = (old + d).requires_grad_(True)
    logp_ref = (old + d).requires_grad_(True)
    loss_mini, stats = mini.m2po_loss(logp_mini, old, adv, valid, tau)
    loss_ref, metrics = compute_policy_loss_m2po(old, logp_ref, adv, valid, "token-mean",
                                                 config={"m2_threshold": tau, "m2_scope": "local"})
    loss_mini.backward()
    loss_ref.backward()
    assert metrics["m2po/num_masked_tokens"] > 0 or tau >= 0.3
    assert stats["masked_fraction"] == metrics["m2po/masked_fraction"]
    assert stats["m2_before"] == pytest.approx(metrics["m2po/m2_before"], rel=1e-6)
    assert stats["m2_after"] == pytest.approx(metrics["m2po/m2_after"], rel=1e-6, abs=1e-12)
    torch.testing.assert_close(loss_mini, loss_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logp_mini.grad, logp_ref.grad, rtol=1e-6, atol=1e-8)


def test_m2po_tie_rule_masks_the_later_token_first():
    valid = torch.ones(1, 5, dtype=torch.bool)
    d = torch.tensor([[0.5, -0.5, 0.5, -0.5, 0.1]])
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0, 1.0]])  # all five in T
    # mean d^2 over T: 1.01 / 5 = 0.202, then 0.76 / 4 = 0.19, then 0.51 / 3 = 0.17 <= tau: two of the four equal
    # d^2 are masked, the later ones (their advantages differ, so the loss tells which)
    keep = mini.m2po_keep_mask(d, adv, valid, tau=0.18)
    assert keep.tolist() == [[True, True, False, False, True]]
    old = torch.full((1, 5), -1.0)
    loss, _ = mini.m2po_loss(old + d, old, adv, valid, tau=0.18)
    loss_ref, _ = compute_policy_loss_m2po(old, old + d, adv, valid, "token-mean",
                                           config={"m2_threshold": 0.18, "m2_scope": "local"})
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7)


def test_example_imports_only_torch_transformers_and_the_building_blocks():
    allowed = {"stalerl.core.model": {"load_policy"}, "stalerl.core.reward": {"gsm8k_reward"},
               "stalerl.data": None}
    tree = ast.parse(EXAMPLE.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = {a.name.split(".")[0] for a in node.names}
            assert roots <= {"torch", "transformers", "copy", "math", "dataclasses", "typing"}, roots
        elif isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("stalerl", "recipe"):
            assert node.module in allowed, node.module
            names = {a.name for a in node.names}
            assert allowed[node.module] is None or names <= allowed[node.module], names


def test_example_runs_as_a_script():
    res = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "reward" in res.stdout and "masked" in res.stdout and "loss" in res.stdout
