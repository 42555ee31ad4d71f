"""recipe.common: config readers, verl-exact loss aggregation, input guards, the log-ratio clamp."""

from __future__ import annotations

import dataclasses
import math
import re
from types import MappingProxyType, SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from recipe.declaration import PPO_CLIP
from recipe.common import (
    NonFiniteLogProbError,
    LOG_RATIO_CLAMP,
    LOSS_AGG_MODES,
    agg_loss,
    cfg_get,
    cfg_lookup,
    check_inputs,
    clamp_log_ratio,
    global_batch_info,
    masked_log_ratio,
)

# ----------------------------------------------------------------------------------------------------------------
# cfg_get / cfg_lookup / the PPO-clip group's reader
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Inner:
    m2_threshold: float = 0.5
    empty: object = None


@dataclasses.dataclass
class _Outer:
    policy_loss: _Inner = dataclasses.field(default_factory=_Inner)
    clip_ratio: float = 0.2


class _StrictGetattr:
    """Raises KeyError (not AttributeError) for unknown attributes, and has no .get: like some config proxies."""

    def __init__(self, **values):
        self._values = values

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(key) from None


class _GetRaises:
    def get(self, key, default=None):
        raise RuntimeError("strict config: unknown key")


def _configs(**values):
    """The same content as dict, attribute object, DictConfig and struct DictConfig."""
    struct = OmegaConf.create(values)
    OmegaConf.set_struct(struct, True)
    return [values, SimpleNamespace(**values), OmegaConf.create(values), struct, MappingProxyType(dict(values)),
            _StrictGetattr(**values)]


@pytest.mark.parametrize("config", _configs(a=1.5, b="x", none=None, zero=0, false=False))
def test_cfg_get_all_config_kinds(config):
    assert cfg_get(config, "a") == 1.5
    assert cfg_get(config, "b") == "x"
    assert cfg_get(config, "missing") is None
    assert cfg_get(config, "missing", 7) == 7
    assert cfg_get(config, "none", 7) == 7  # None counts as absent
    assert cfg_get(config, "zero", 7) == 0  # falsy values are not absent
    assert cfg_get(config, "false", 7) is False


def test_cfg_get_none_config_and_odd_objects():
    assert cfg_get(None, "a", 3) == 3
    assert cfg_get(_GetRaises(), "a", 3) == 3
    assert cfg_get(42, "a", 3) == 3
    assert cfg_get(_Outer(), "clip_ratio") == 0.2
    assert isinstance(cfg_get(_Outer(), "policy_loss"), _Inner)


@pytest.mark.parametrize("config", [
    {"policy_loss": {"m2_threshold": 0.5}, "m2_threshold": 0.1},
    SimpleNamespace(policy_loss=SimpleNamespace(m2_threshold=0.5), m2_threshold=0.1),
    OmegaConf.create({"policy_loss": {"m2_threshold": 0.5}, "m2_threshold": 0.1}),
    _Outer(),
])
def test_cfg_lookup_first_present_path(config):
    value, path = cfg_lookup(config, ("policy_loss.m2_threshold", "m2_threshold"), 0.04)
    assert (value, path) == (0.5, "policy_loss.m2_threshold")


@pytest.mark.parametrize("config", [
    {"policy_loss": {"loss_mode": "m2po"}, "m2_threshold": 0.1},
    {"policy_loss": None, "m2_threshold": 0.1},
    {"policy_loss": {"m2_threshold": None}, "m2_threshold": 0.1},
    {"policy_loss": 3.0, "m2_threshold": 0.1},  # a non-container in the middle of a path
    OmegaConf.create({"policy_loss": {"loss_mode": "m2po"}, "m2_threshold": 0.1}),
])
def test_cfg_lookup_falls_through(config):
    assert cfg_lookup(config, ("policy_loss.m2_threshold", "m2_threshold"), 0.04) == (0.1, "m2_threshold")


def test_cfg_lookup_default_names_last_path():
    assert cfg_lookup({}, ("a.b", "c"), 9) == (9, "c")
    assert cfg_lookup(None, ("a.b", "c"), 9) == (9, "c")
    assert cfg_lookup(_Outer(), ("policy_loss.empty", "x"), 1) == (1, "x")


@pytest.mark.parametrize("config", _configs(clip_ratio_low=0.3, eps_clip_higher=2, c_clip=3))
def test_the_ppo_clip_group_reads_every_config_form(config):
    """The one reader of the shared PPO clip (recipe.declaration.PPO_CLIP): verl's names first, then the runtime's;
    numbers normalised to float; an absent upper side is the lower one."""
    low, high, dual = PPO_CLIP.read(config)
    assert (low, high, dual) == (0.3, 2.0, 3.0) and type(high) is float
    assert PPO_CLIP.read({}) == (0.2, 0.2, None)
    assert PPO_CLIP.read({"eps_clip": 0.1}) == (0.1, 0.1, None)


@pytest.mark.parametrize("bad, message", [
    ("abc", "must be a number"),
    (True, "must be a number"),
    ([0.1], "must be a number"),
    (float("nan"), "must be finite"),
    (-float("inf"), "must be finite"),
    (-0.5, "must be >= 0.0"),
])
def test_the_ppo_clip_group_refuses_in_param_checks_one_form(bad, message):
    """One validation: the group's keys are checked by Param.check, naming the key that was read and the fix."""
    with pytest.raises(ValueError, match=r"^clip_ratio_low " + re.escape(message) + r".*Fix: set clip_ratio_low=0\.2"):
        PPO_CLIP.read({"clip_ratio_low": bad})
    with pytest.raises(ValueError, match=r"^c_clip must be > 1\.0, got 1\.0\. Fix: unset c_clip"):
        PPO_CLIP.read({"c_clip": 1.0})


# ----------------------------------------------------------------------------------------------------------------
# global_batch_info
# ----------------------------------------------------------------------------------------------------------------


def test_global_batch_info_kinds():
    info = {"dp_size": 2, "batch_num_tokens": 100, "global_batch_size": 8, "loss_scale_factor": None, "extra": 1}
    expected = {"dp_size": 2, "batch_num_tokens": 100, "global_batch_size": 8}
    assert global_batch_info({"global_batch_info": info}) == expected
    assert global_batch_info(SimpleNamespace(global_batch_info=info)) == expected
    assert global_batch_info(OmegaConf.create({"global_batch_info": info})) == expected
    assert global_batch_info(None) == {}
    assert global_batch_info({}) == {}
    assert global_batch_info({"global_batch_info": {}}) == {}
    assert global_batch_info({"global_batch_info": None}) == {}
    assert global_batch_info({"global_batch_info": {"loss_scale_factor": 4}}) == {"loss_scale_factor": 4}


# ----------------------------------------------------------------------------------------------------------------
# agg_loss
# ----------------------------------------------------------------------------------------------------------------


def _batch(seed=0, rows=6, cols=9):
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 4, 0, 7, 1, 9])[:rows]
    mask = torch.arange(cols).unsqueeze(0) < lengths.unsqueeze(1)
    return loss_mat, mask


def _literal(loss_mat, mask, mode, *, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    """verl's agg_loss written out per sequence in plain Python."""
    rows = loss_mat.tolist()
    masks = mask.tolist()
    token_sums = [sum(v for v, m in zip(r, mr) if m) for r, mr in zip(rows, masks)]
    counts = [sum(mr) for mr in masks]
    if mode == "token-mean":
        n = batch_num_tokens if batch_num_tokens is not None else sum(counts)
        return sum(token_sums) / max(n, 1) * dp_size
    if mode == "token-sum":
        return sum(token_sums) * dp_size
    nonempty = [i for i, c in enumerate(counts) if c > 0]
    g = global_batch_size if global_batch_size is not None else len(nonempty)
    if mode == "seq-mean-token-mean":
        total = sum(token_sums[i] / (counts[i] + 1e-8) for i in nonempty)
    else:
        total = sum(token_sums[i] for i in nonempty)
    loss = total / max(g, 1) * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss /= loss_scale_factor if loss_scale_factor is not None else mask.shape[-1]
    return loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_literal_single_process(mode):
    loss_mat, mask = _batch()
    assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(_literal(loss_mat, mask, mode), rel=1e-12)


def test_agg_loss_known_values():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(loss_mat, mask, "token-sum").item() == pytest.approx(7.0)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2, rel=1e-6)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 4) / 2 / 3)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.35)
    # explicit global denominators
    assert agg_loss(loss_mat, mask, "token-mean", batch_num_tokens=14).item() == pytest.approx(0.5)
    assert agg_loss(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=14).item() == pytest.approx(1.0)
    assert agg_loss(loss_mat, mask, "token-sum", dp_size=3).item() == pytest.approx(21.0)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum", dp_size=2, global_batch_size=4).item() == pytest.approx(3.5)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean", dp_size=2,
                    global_batch_size=11).item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batches_sum_to_the_mini_batch(mode):
    """Gradient accumulation: per-micro-batch losses with the global denominators sum to the full loss."""
    loss_mat, mask = _batch(1)
    leaf_full = loss_mat.clone().requires_grad_()
    full = agg_loss(leaf_full, mask, mode, loss_scale_factor=9)
    full.backward()
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(1) > 0).sum()),
                loss_scale_factor=9)
    leaf = loss_mat.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part = agg_loss(leaf[rows], mask[rows], mode, **info)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(leaf.grad, leaf_full.grad)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_dp_ranks_average_to_the_global_loss(mode):
    """Two data-parallel ranks with dp_size=2 and global denominators: the mean of their losses (and gradients, as
    DDP averages them) equals the single-process loss over the whole batch."""
    loss_mat, mask = _batch(2)
    leaf_full = loss_mat.clone().requires_grad_()
    full = agg_loss(leaf_full, mask, mode, loss_scale_factor=9)
    full.backward()
    info = dict(dp_size=2, batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(1) > 0).sum()),
                loss_scale_factor=9)
    leaf = loss_mat.clone().requires_grad_()
    rank_losses = []
    for rows in (slice(0, 2), slice(2, 6)):  # uneven ranks, rank 0 holds an empty sequence's neighbour
        loss = agg_loss(leaf[rows], mask[rows], mode, **info)
        (loss / 2).backward()  # DDP: mean over ranks
        rank_losses.append(loss.item())
    assert sum(rank_losses) / 2 == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(leaf.grad, leaf_full.grad)


def test_agg_loss_local_means_differ_without_global_info():
    # why batch_num_tokens exists: the mean of per-micro-batch means is not the mini-batch mean
    loss_mat, mask = _batch(3)
    full = agg_loss(loss_mat, mask, "token-mean").item()
    parts = [agg_loss(loss_mat[r], mask[r], "token-mean").item() for r in (slice(0, 1), slice(1, 6))]
    assert sum(parts) / 2 != pytest.approx(full, rel=1e-3)


def test_agg_loss_dp_without_global_counts_raises():
    loss_mat, mask = _batch()
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(loss_mat, mask, "token-mean", dp_size=2)
    for mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        with pytest.raises(ValueError, match="global_batch_size"):
            agg_loss(loss_mat, mask, mode, dp_size=2)
    # token-sum needs no denominator
    assert agg_loss(loss_mat, mask, "token-sum", dp_size=2).item() == pytest.approx(
        2 * _literal(loss_mat, mask, "token-sum"))


def test_agg_loss_unknown_mode():
    loss_mat, mask = _batch()
    with pytest.raises(ValueError, match="token-mean, token-sum"):
        agg_loss(loss_mat, mask, "seq-mean")


def test_agg_loss_tensor_denominators():
    loss_mat, mask = _batch()
    a = agg_loss(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=torch.tensor(50))
    b = agg_loss(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=50)
    assert a.item() == pytest.approx(b.item())
    c = agg_loss(loss_mat, mask, "seq-mean-token-sum", dp_size=2, global_batch_size=torch.tensor(12.0))
    assert c.item() == pytest.approx(_literal(loss_mat, mask, "seq-mean-token-sum", dp_size=2, global_batch_size=12))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("shape", [(3, 5), (0, 5), (3, 0), (0, 0)])
def test_agg_loss_empty_is_zero_connected_to_graph(mode, shape):
    leaf = torch.randn(shape).requires_grad_() if all(shape) else torch.zeros(shape, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    loss = agg_loss(leaf * 2.0, mask, mode)
    assert loss.shape == () and loss.item() == 0.0
    assert loss.requires_grad and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(leaf.grad, torch.zeros(shape))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_empty_rank_with_global_counts(mode):
    # a DP rank without tokens still returns a zero that can be backpropagated (every rank must call backward)
    leaf = torch.randn(2, 4).requires_grad_()
    loss = agg_loss(leaf, torch.zeros(2, 4, dtype=torch.bool), mode, dp_size=4, batch_num_tokens=0,
                    global_batch_size=0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_garbage_on_padding_does_not_leak(mode):
    loss_mat, mask = _batch(4)
    dirty = loss_mat.clone()
    dirty[~mask] = float("nan")
    dirty[0, -1] = float("inf") if not mask[0, -1] else dirty[0, -1]
    leaf = dirty.clone().requires_grad_()
    loss = agg_loss(leaf, mask, mode)
    assert loss.item() == pytest.approx(agg_loss(loss_mat, mask, mode).item(), rel=1e-12)
    loss.backward()
    assert torch.isfinite(leaf.grad).all()
    assert leaf.grad[~mask].eq(0).all()


def test_agg_loss_float_mask_accepted():
    loss_mat, mask = _batch(5)
    assert agg_loss(loss_mat, mask.double(), "token-mean").item() == pytest.approx(
        agg_loss(loss_mat, mask, "token-mean").item())


# ----------------------------------------------------------------------------------------------------------------
# check_inputs / clamp_log_ratio / masked_log_ratio
# ----------------------------------------------------------------------------------------------------------------


def _inputs(rows=2, cols=3):
    z = torch.zeros(rows, cols)
    return z, z.clone(), z.clone(), torch.ones(rows, cols, dtype=torch.bool)


def test_check_inputs_returns_bool_valid_mask():
    old, lp, adv, mask = _inputs()
    maskf = mask.float()
    maskf[0, 0] = 0
    valid = check_inputs("x", old, lp, adv, maskf)
    assert valid.dtype == torch.bool and valid.tolist() == [[False, True, True], [True, True, True]]


@pytest.mark.parametrize("label", ["old_log_prob", "log_prob", "advantages", "rollout_is_weights"])
def test_check_inputs_shape_mismatch_names_tensor(label):
    old, lp, adv, mask = _inputs()
    tensors = {"old_log_prob": old, "log_prob": lp, "advantages": adv, "rollout_is_weights": None}
    tensors[label] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=rf"myloss: {label} has shape \(2, 4\), expected \(2, 3\)"):
        check_inputs("myloss", tensors["old_log_prob"], tensors["log_prob"], tensors["advantages"], mask,
                     tensors["rollout_is_weights"])


def test_check_inputs_rejects_non_2d_mask():
    with pytest.raises(ValueError, match=r"response_mask must be \(batch, response_len\)"):
        check_inputs("x", torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))


def test_check_inputs_non_finite_counts_and_first_position():
    old, lp, adv, mask = _inputs(3, 4)
    lp[1, 2] = float("nan")
    lp[2, 0] = float("inf")
    old[2, 3] = -float("inf")
    adv[0, 1] = float("nan")
    adv[2, 2] = float("nan")
    adv[0, 0] = float("nan")
    mask[0, 0] = False  # padding: ignored
    with pytest.raises(NonFiniteLogProbError) as exc:  # a ValueError subclass: divergence is told by its type
        check_inputs("m2po", old, lp, adv, mask)
    assert isinstance(exc.value, ValueError)
    msg = str(exc.value)
    assert msg.startswith("m2po: non-finite values on valid tokens")
    assert re.search(r"(?<!old_)log_prob: 2 \(first at row 1, token 2\)", msg), msg
    assert "old_log_prob: 1 (first at row 2, token 3)" in msg
    assert "advantages: 2 (first at row 0, token 1)" in msg
    assert "top_k" in msg  # the hint


def test_check_inputs_non_finite_on_padding_is_fine():
    old, lp, adv, mask = _inputs()
    mask[:, 2] = False
    lp[:, 2] = float("nan")
    old[:, 2] = float("inf")
    adv[:, 2] = -float("inf")
    assert check_inputs("x", old, lp, adv, mask).sum().item() == 4


def test_check_inputs_empty():
    z = torch.zeros(0, 3)
    assert check_inputs("x", z, z, z, torch.zeros(0, 3, dtype=torch.bool)).numel() == 0


def test_clamp_log_ratio_forward_and_gradient_zero_beyond_bound():
    x = torch.tensor([-50.0, -20.0, -3.0, 0.0, 19.5, 20.0, 1e4], requires_grad=True)
    y = clamp_log_ratio(x)
    assert y.tolist() == [-20.0, -20.0, -3.0, 0.0, 19.5, 20.0, 20.0]
    y.sum().backward()
    # verl's torch.clamp: gradient 1 inside the bounds (bounds included), 0 beyond them
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert LOG_RATIO_CLAMP == 20.0
    x2 = torch.tensor([5.0, 1.0], requires_grad=True)
    clamp_log_ratio(x2, 2.0).backward(torch.tensor([3.0, 3.0]))
    assert x2.grad.tolist() == [0.0, 3.0]


def test_masked_log_ratio():
    lp = torch.tensor([[0.5, float("nan")], [-1.0, 2.0]], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor([[0.25, float("inf")], [0.0, 1.0]], dtype=torch.bfloat16, requires_grad=True)
    valid = torch.tensor([[True, False], [True, True]])
    d = masked_log_ratio(old, lp, valid)
    assert d.dtype == torch.float32
    assert d.tolist() == [[0.25, 0.0], [-1.0, 1.0]]
    d.sum().backward()
    assert lp.grad.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert old.grad is None  # the behaviour log-prob is a constant


def test_masked_log_ratio_squares_exactly_in_fp32():
    lp = torch.tensor([[0.2]], dtype=torch.bfloat16)
    d = masked_log_ratio(torch.zeros_like(lp), lp, torch.ones(1, 1, dtype=torch.bool))
    assert (d * d).item() == pytest.approx(0.2001953125 ** 2, rel=1e-7)
    assert not math.isclose((d * d).item(), float((lp * lp).item()), rel_tol=1e-4)


def test_check_inputs_fast_path_agrees_with_the_exact_count_on_random_batches():
    """check_inputs clears a batch by three masked sums and falls back to the exact per-token count when a sum is
    not finite: finite values whose sum overflows pass, one bad valid token anywhere fails, on random batches."""
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        old, lp, adv, mask = _inputs(5, 7)
        mask = torch.rand(5, 7, generator=g) > 0.3
        target = [old, lp, adv][trial % 3]
        kind = trial % 4
        r, c = int(torch.randint(5, (1,), generator=g)), int(torch.randint(7, (1,), generator=g))
        if kind == 0:  # finite but huge on valid tokens: the masked sum overflows to inf, the values are fine
            target[mask] = 3e38
            assert torch.equal(check_inputs("x", old, lp, adv, mask), mask)
        elif kind in (1, 2):
            target[r, c] = float("nan") if kind == 1 else -float("inf")
            if bool(mask[r, c]):
                with pytest.raises(NonFiniteLogProbError):
                    check_inputs("x", old, lp, adv, mask)
            else:
                assert torch.equal(check_inputs("x", old, lp, adv, mask), mask)
        else:
            assert torch.equal(check_inputs("x", old, lp, adv, mask), mask)
