"""The stalerl losses as Trinity-RFT policy-loss classes (``algorithm.policy_loss_fn: recipe.trinity.<Class>``).

Trinity (0.6.0) builds a loss as ``POLICY_LOSS_FN.get(name)(backend="verl", **policy_loss_fn_args)`` and calls it
once per micro-batch as ``fn(logprob=..., **inputs)``; its metaclass passes only the keyword names that ``__call__``
declares, translated from verl's names by ``KeyMapper`` (``old_log_probs`` -> ``old_logprob``, ``response_mask`` ->
``action_mask``). Each class here is a thin shell around the function registered in :mod:`recipe.registry`, called
with verl's signature on the same tensors, so the numbers are the registry's.

Where the denominator comes from (``loss_agg_mode: token-mean``):

- verl >= 0.8 (Trinity's engine path, ``trinity/trainer/verl/losses.py``): verl's engine puts ``batch_num_tokens``
  (valid tokens of the whole optimizer mini-batch, all data-parallel ranks) and ``dp_size`` in every micro-batch, and
  back-propagates the returned loss unscaled. The classes name both in ``__call__`` and divide as verl's own
  ``ppo_loss`` does (``sum / batch_num_tokens * dp_size``), so the micro-batch losses add up to the mini-batch's
  token mean whatever the split.
- verl < 0.8 (Trinity's legacy ``dp_actor``): those keys do not exist (asking for them would be a KeyError in
  ``DataProto.select``), so the classes do not ask; the loss divides by the micro-batch's valid tokens and
  Trinity's ``fix_actor_microbatch_loss_scale: true`` rescales it to the mini-batch's token mean.

Which of the two is decided once, at construction, by Trinity's own rule (``is_verl_legacy``: verl < 0.8); the
argument ``batch_num_tokens_from_data`` overrides it.

What stays per micro-batch: M2PO's token selection (Algorithm 1) sees one micro-batch (``m2_scope: local``) or the
same-index micro-batches of all data-parallel ranks (``m2_scope: dp_group``); a loss object never sees the rest of
the mini-batch. It is Algorithm 1 over the whole mini-batch when each rank's mini-batch is a single micro-batch. FIPO
decides per row, so it is exact at the mini-batch level on the engine path. See docs/integrations/trinity.md.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import sys
from typing import Any, Dict, Optional, Tuple, Union

import torch
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn

from recipe.fipo.algorithm import fipo_params_from_config
from recipe.m2po.algorithm import m2_scope_from_config, m2_threshold_from_config
from recipe.optimizer_batch import with_global_batch_info
from recipe.registry import LOSS_AGG_MODES, get_policy_loss_fn

# The keyword names (Trinity's) that carry verl's global batch information on the engine path.
GLOBAL_COUNT_KEYS = ("batch_num_tokens", "dp_size")
# Where a user sets the arguments in a Trinity config; error messages name the key by this path.
ARGS_PATH = "algorithm.policy_loss_fn_args"
SUPPORTED_BACKENDS = ("verl",)
# Trinity's rule for its verl backend (trinity.trainer.trainer.is_verl_legacy): verl older than this runs the legacy
# dp_actor, which has no global token count in the data.
ENGINE_PATH_MIN_VERL = (0, 8)


def _verl_version_tuple() -> Optional[Tuple[int, ...]]:
    """verl's version as Trinity reads it (``verl.__version__``), without importing verl when it is not loaded yet
    (installed metadata then); None when verl is absent."""
    module = sys.modules.get("verl")
    text = getattr(module, "__version__", None) if module is not None else None
    if text is None:
        try:
            text = importlib.metadata.version("verl")
        except importlib.metadata.PackageNotFoundError:
            return None
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def engine_path_passes_global_counts() -> bool:
    """True when Trinity will run its verl engine path (verl >= 0.8), whose micro-batches carry
    ``batch_num_tokens`` and ``dp_size``; False for the legacy dp_actor (verl < 0.8). Without verl, Trinity's rule
    also answers "not legacy", but no verl backend can run then; False keeps a stray call usable."""
    version = _verl_version_tuple()
    return version is not None and version >= ENGINE_PATH_MIN_VERL


def _check_backend(cls_name: str, backend: str) -> None:
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"{cls_name}: backend {backend!r} is not supported; expected one of "
                         f"{', '.join(SUPPORTED_BACKENDS)} (trainer.trainer_type: verl). The tinker backend is not "
                         "covered by these losses.")


def _check_agg_mode(cls_name: str, loss_agg_mode: str) -> str:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"{cls_name}: {ARGS_PATH}.loss_agg_mode (set from algorithm.loss_agg_mode) must be one of "
                         f"{', '.join(LOSS_AGG_MODES)}, got {loss_agg_mode!r}. Fix: algorithm.loss_agg_mode: "
                         "token-mean.")
    return loss_agg_mode


def _check_flag(cls_name: str, key: str, value: Any) -> Optional[bool]:
    if value == "auto" or value is None:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"{cls_name}: {ARGS_PATH}.{key} must be true, false or 'auto', got {value!r}")
    return value


# Trinity's own PPO loss names the clip differently; these classes take stalerl's names.
TRINITY_ALIASES = {"clip_range": "eps_clip", "clip_range_low": "eps_clip", "clip_range_high": "eps_clip_higher",
                   "clip_ratio_c": "fipo_clip_ratio_c"}


def _refuse_unknown(cls_name: str, unknown: Dict[str, Any], known: Tuple[str, ...]) -> None:
    if not unknown:
        return
    hints = []
    for key in sorted(unknown):
        alias = TRINITY_ALIASES.get(key)
        close = [alias] if alias in known else difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(f"{cls_name}: unknown {ARGS_PATH} key(s) {', '.join(hints)}; accepted keys: "
                     f"{', '.join(known)}")


def _with_key_path(cls_name: str, exc: ValueError) -> ValueError:
    """The recipe's message names the bare key (``m2_threshold must be ...``); say where it is set in Trinity."""
    return ValueError(f"{cls_name}: {ARGS_PATH}.{exc}")


class _RecipeLoss:
    """What the two classes share: the config dict for the registry call and the call itself.

    Not a PolicyLossFn: Trinity's metaclass needs ``__call__`` in each class body (it reads its signature there), so
    every loss class below declares its own ``__call__`` and hands over to :meth:`_compute`.
    """

    loss_name: str
    _recipe_config: Dict[str, Any]
    loss_agg_mode: str
    uses_global_counts: bool
    _init_args: Dict[str, Any]  # the constructor's arguments, for pickling and repr

    def _init_common(self, loss_agg_mode: str, batch_num_tokens_from_data: Union[bool, str, None]) -> None:
        cls_name = type(self).__name__
        self.loss_agg_mode = _check_agg_mode(cls_name, loss_agg_mode)
        flag = _check_flag(cls_name, "batch_num_tokens_from_data", batch_num_tokens_from_data)
        self.uses_global_counts = engine_path_passes_global_counts() if flag is None else flag
        base_keys = [key for key in type(self)._select_keys if key not in GLOBAL_COUNT_KEYS]
        # The instance's key list shadows the class's: Trinity selects exactly these from its data (select_keys)
        # and its wrapper forwards only these to __call__, so the legacy path never asks for keys it lacks.
        self._select_keys = base_keys + (list(GLOBAL_COUNT_KEYS) if self.uses_global_counts else [])

    def _config(self, valid: torch.Tensor, batch_num_tokens: Optional[int], dp_size: Optional[int]) -> Dict[str, Any]:
        if self.loss_agg_mode != "token-mean":
            # Per micro-batch, as Trinity's built-in losses aggregate (verl's other modes need a global sequence
            # count, which Trinity does not pass in a form this loss can trust).
            return dict(self._recipe_config)
        if self.uses_global_counts:
            if batch_num_tokens is None or dp_size is None:
                raise ValueError(f"{type(self).__name__}: the micro-batch has no batch_num_tokens/dp_size although "
                                 "the verl engine path (verl >= 0.8) puts them there; set "
                                 f"{ARGS_PATH}.batch_num_tokens_from_data: false to divide per micro-batch")
            return with_global_batch_info(self._recipe_config, num_tokens=int(batch_num_tokens), dp_size=int(dp_size))
        # Legacy path: every valid token of the micro-batch (FIPO's dropped rows included), so that Trinity's
        # fix_actor_microbatch_loss_scale (x micro-batch tokens / mini-batch tokens x world size) makes it exact.
        return with_global_batch_info(self._recipe_config, num_tokens=int(valid.sum()), dp_size=1)

    def _compute(self, logprob: torch.Tensor, old_logprob: torch.Tensor, action_mask: torch.Tensor,
                 advantages: torch.Tensor, batch_num_tokens: Optional[int], dp_size: Optional[int],
                 ) -> Tuple[torch.Tensor, Dict[str, float]]:
        valid = action_mask.bool()
        config = self._config(valid, batch_num_tokens, dp_size)
        self._check_scope(dp_size)
        loss, metrics = get_policy_loss_fn(self.loss_name)(
            old_log_prob=old_logprob, log_prob=logprob, advantages=advantages, response_mask=valid,
            loss_agg_mode=self.loss_agg_mode, config=config)
        out = dict(metrics)
        # Trinity's built-in losses report pg_loss; on the engine path its sum over micro-batches (averaged over
        # ranks) is the mini-batch loss.
        out["pg_loss"] = float(loss.detach().item())
        return loss, out

    def _check_scope(self, dp_size: Optional[int]) -> None:
        """Overridden by M2PO (the dp_group scope needs the data-parallel group to be the whole world)."""

    def __reduce__(self):
        # Rebuild from the constructor arguments in the receiving process (Ray pickles the loss), so the instance's
        # select keys are decided there, by the verl that process will run.
        return (_rebuild, (type(self), self._init_args))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._init_args.items())})"


class M2POPolicyLossFn(_RecipeLoss, PolicyLossFn):
    """M2PO (Algorithm 1 of arXiv 2510.01161): ``recipe.registry`` loss ``m2po`` inside Trinity-RFT.

    ``policy_loss_fn_args``: ``m2_threshold`` (tau, default 0.04), ``m2_scope`` (``local`` = each rank's micro-batch;
    ``dp_group`` = the same micro-batch index on all data-parallel ranks, one selection), ``loss_agg_mode`` (Trinity
    overwrites it with ``algorithm.loss_agg_mode``), ``batch_num_tokens_from_data`` (``auto``).
    """

    loss_name = "m2po"
    ARG_KEYS = ("m2_threshold", "m2_scope", "loss_agg_mode", "batch_num_tokens_from_data")

    def __init__(self, backend: str = "verl", m2_threshold: float = 0.04, m2_scope: str = "local",
                 loss_agg_mode: str = "token-mean", batch_num_tokens_from_data: Union[bool, str] = "auto",
                 **unknown: Any) -> None:
        name = type(self).__name__
        _refuse_unknown(name, unknown, self.ARG_KEYS)
        _check_backend(name, backend)
        super().__init__(backend=backend)
        self._init_args = {"backend": backend, "m2_threshold": m2_threshold, "m2_scope": m2_scope,
                           "loss_agg_mode": loss_agg_mode, "batch_num_tokens_from_data": batch_num_tokens_from_data}
        config = {"m2_threshold": m2_threshold, "m2_scope": m2_scope}
        try:
            self.m2_threshold = m2_threshold_from_config(config)
            self.m2_scope = m2_scope_from_config(config)
        except ValueError as exc:
            raise _with_key_path(name, exc) from None
        self._recipe_config = {"m2_threshold": self.m2_threshold, "m2_scope": self.m2_scope}
        self._init_common(loss_agg_mode, batch_num_tokens_from_data)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        batch_num_tokens: Optional[int] = None,
        dp_size: Optional[int] = None,
        **kwargs: Any,
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        return self._compute(logprob, old_logprob, action_mask, advantages, batch_num_tokens, dp_size)

    def _check_scope(self, dp_size: Optional[int]) -> None:
        if self.m2_scope != "dp_group" or dp_size is None:
            return
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != int(dp_size):
            raise ValueError(f"{type(self).__name__}: {ARGS_PATH}.m2_scope=dp_group selects across the whole "
                             f"torch.distributed world ({world} ranks), but the data-parallel size is {dp_size} "
                             "(sequence parallelism duplicates tokens across ranks); set m2_scope: local or "
                             "ulysses_sequence_parallel_size: 1")

    @classmethod
    def default_args(cls) -> Dict[str, Any]:
        return {"m2_threshold": 0.04, "m2_scope": "local", "loss_agg_mode": "token-mean"}


class FIPOPolicyLossFn(_RecipeLoss, PolicyLossFn):
    """FIPO (Future-KL Influenced Policy Optimization): ``recipe.registry`` loss ``fipo`` inside Trinity-RFT.

    ``policy_loss_fn_args`` (stalerl's names): ``fipo_decay_rate`` (32), ``fipo_clip_ratio_c`` (10),
    ``fipo_influence_clip_ratio`` (0.2), ``fipo_influence_clip_high_only`` (true), ``fipo_safety_threshold`` (10),
    ``eps_clip`` (0.2), ``eps_clip_higher`` (null = eps_clip), ``loss_agg_mode``, ``batch_num_tokens_from_data``.
    """

    loss_name = "fipo"
    ARG_KEYS = ("fipo_decay_rate", "fipo_clip_ratio_c", "fipo_influence_clip_ratio", "fipo_influence_clip_high_only",
                "fipo_safety_threshold", "eps_clip", "eps_clip_higher", "loss_agg_mode",
                "batch_num_tokens_from_data")

    def __init__(self, backend: str = "verl", fipo_decay_rate: float = 32.0, fipo_clip_ratio_c: float = 10.0,
                 fipo_influence_clip_ratio: float = 0.2, fipo_influence_clip_high_only: bool = True,
                 fipo_safety_threshold: float = 10.0, eps_clip: float = 0.2, eps_clip_higher: Optional[float] = None,
                 loss_agg_mode: str = "token-mean", batch_num_tokens_from_data: Union[bool, str] = "auto",
                 **unknown: Any) -> None:
        name = type(self).__name__
        _refuse_unknown(name, unknown, self.ARG_KEYS)
        _check_backend(name, backend)
        super().__init__(backend=backend)
        config = {"fipo_decay_rate": fipo_decay_rate, "fipo_clip_ratio_c": fipo_clip_ratio_c,
                  "fipo_influence_clip_ratio": fipo_influence_clip_ratio,
                  "fipo_influence_clip_high_only": fipo_influence_clip_high_only,
                  "fipo_safety_threshold": fipo_safety_threshold, "eps_clip": eps_clip,
                  "eps_clip_higher": eps_clip_higher}
        self._init_args = {"backend": backend, **config, "loss_agg_mode": loss_agg_mode,
                           "batch_num_tokens_from_data": batch_num_tokens_from_data}
        try:
            self.params = fipo_params_from_config(config)
        except ValueError as exc:
            raise _with_key_path(name, exc) from None
        self._recipe_config = {key: value for key, value in config.items() if value is not None}
        self._init_common(loss_agg_mode, batch_num_tokens_from_data)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        batch_num_tokens: Optional[int] = None,
        dp_size: Optional[int] = None,
        **kwargs: Any,
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        return self._compute(logprob, old_logprob, action_mask, advantages, batch_num_tokens, dp_size)

    @classmethod
    def default_args(cls) -> Dict[str, Any]:
        return {"fipo_decay_rate": 32.0, "fipo_clip_ratio_c": 10.0, "fipo_influence_clip_ratio": 0.2,
                "fipo_influence_clip_high_only": True, "fipo_safety_threshold": 10.0, "eps_clip": 0.2,
                "loss_agg_mode": "token-mean"}


def _rebuild(cls: type, init_args: Dict[str, Any]) -> Any:
    """Unpickling: construct again from the user's arguments (see ``_RecipeLoss.__reduce__``)."""
    return cls(**init_args)


__all__ = ["FIPOPolicyLossFn", "M2POPolicyLossFn", "engine_path_passes_global_counts"]
