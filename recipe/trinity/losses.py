"""The stalerl losses as Trinity-RFT policy-loss classes (``algorithm.policy_loss_fn: recipe.trinity.<Class>``).

Trinity (0.6.0) builds a loss as ``POLICY_LOSS_FN.get(name)(backend="verl", **policy_loss_fn_args)`` and calls it
once per micro-batch as ``fn(logprob=..., **inputs)``; its metaclass passes only the keyword names that ``__call__``
declares, translated from verl's names by ``KeyMapper`` (``old_log_probs`` -> ``old_logprob``, ``response_mask`` ->
``action_mask``). Each class here is a thin shell around the function registered in :mod:`recipe.registry`, called
with verl's signature on the same tensors, so the numbers are the registry's.

The rule: every call is exact at the optimizer step, or refused with one line, or runs under an explicit opt-in
(``allow_split_mini_batch`` / ``assume_one_micro_batch``) that adds a metric saying so to every call.

- verl >= 0.8 (Trinity's engine path, ``trinity/trainer/verl/losses.py``): verl's engine puts ``batch_num_tokens``
  (valid tokens of the whole optimizer mini-batch, all data-parallel ranks) and ``dp_size`` in every micro-batch, and
  back-propagates the returned loss unscaled. A loss object sees one micro-batch, so M2PO's selection and FIPO's
  sequence-drop denominator are the mini-batch's only when every rank's mini-batch is a single micro-batch. Each call
  therefore compares ``batch_num_tokens`` with the tokens it covers (this rank's micro-batch; all ranks' same-index
  micro-batches for the cross-rank scope) and refuses a split mini-batch at its first micro-batch, naming the
  settings that make it one micro-batch per rank. verl's engine gives every rank the same number of micro-batches
  (``same_micro_num_in_dp``), so the cross-rank collectives below cannot hang there, and all ranks take the same
  decision (the compared counts are all-reduced).
- verl < 0.8 (Trinity's legacy ``dp_actor``): the data carries no token count (asking for it would be a KeyError in
  ``DataProto.select``), so a loss cannot see a split, and ranks may get different micro-batch counts (a
  collective could hang). There: more than one rank is refused; one rank runs only with
  ``assume_one_micro_batch: true`` (the user's statement that the settings in docs/integrations/trinity.md hold,
  logged as ``<loss>/unverified_micro_batching``).

Which of the two is decided once, at construction, by Trinity's own rule (``is_verl_legacy``: verl < 0.8); the
argument ``batch_num_tokens_from_data`` overrides it.

M2PO's ratio must be against the behaviour (rollout) policy: the loss also reads ``rollout_log_probs`` and refuses
when ``old_log_probs`` differs from it on a valid token (``algorithm.bypass_old_logprobs: false`` recomputes them
with the trainer's weights, which hides the staleness M2PO is about).

Metrics: ``m2po/*`` and ``fipo/*`` of the whole optimizer mini-batch (all ranks; FIPO's fractions are pooled
numerators over pooled denominators, one all-reduce), identical on every micro-batch and rank of an exact step, so
whatever mean Trinity/verl take over micro-batches and ranks logs the step's value.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn

from recipe.common import masked_log_ratio
from recipe.fipo.algorithm import METRIC_DENOMINATORS, METRIC_KEYS, fipo_metric_parts, fipo_params_from_config
from recipe.m2po.algorithm import m2_scope_from_config, m2_threshold_from_config
from recipe.optimizer_batch import with_global_batch_info
from recipe.registry import get_policy_loss_fn
from recipe.versions import check_framework_version, installed_version, parse_version

# The keyword names (Trinity's) that carry verl's global batch information on the engine path.
GLOBAL_COUNT_KEYS = ("batch_num_tokens", "dp_size")
# The behaviour log-probs as the explorer recorded them (Trinity's name; bypass_old_logprobs copies them).
ROLLOUT_KEY = "rollout_log_probs"
# Where a user sets the arguments in a Trinity config; error messages name the key by this path.
ARGS_PATH = "algorithm.policy_loss_fn_args"
SUPPORTED_BACKENDS = ("verl",)
# Trinity's rule for its verl backend (trinity.trainer.trainer.is_verl_legacy): verl older than this runs the legacy
# dp_actor, which has no global token count in the data.
ENGINE_PATH_MIN_VERL = (0, 8)
# The only aggregation that is exact across micro-batches here: verl's sequence-mean modes divide per micro-batch
# (the sequence count of the mini-batch is not given to the loss), so they are refused.
EXACT_AGG_MODES = ("token-mean",)
#: How to make one micro-batch per rank, quoted by every split refusal.
ONE_MICRO_BATCH_FIX = ("make each rank's mini-batch one micro-batch: trainer.use_dynamic_bsz: true with "
                       "trainer.max_token_len_per_gpu >= the prompt+response tokens of one rank's share of "
                       "buffer.train_batch_size (Trinity's default, 2 x model.max_model_len, usually splits it)")


def _verl_version_tuple() -> Optional[Tuple[int, ...]]:
    """verl's version as Trinity reads it (``verl.__version__``), without importing verl when it is not loaded yet
    (installed metadata then); None when verl is absent."""
    module = sys.modules.get("verl")
    text = getattr(module, "__version__", None) if module is not None else None
    if text is None:
        text = installed_version("verl")
    return parse_version(text) if text is not None else None


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
    if loss_agg_mode not in EXACT_AGG_MODES:
        raise ValueError(f"{cls_name}: algorithm.loss_agg_mode={loss_agg_mode!r} is not supported: only token-mean "
                         "is exact across verl's micro-batches (the sequence-mean modes would average per "
                         "micro-batch). Fix: algorithm.loss_agg_mode: token-mean.")
    return loss_agg_mode


def _check_flag(cls_name: str, key: str, value: Any) -> Optional[bool]:
    if value == "auto" or value is None:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"{cls_name}: {ARGS_PATH}.{key} must be true, false or 'auto', got {value!r}")
    return value


def _check_bool(cls_name: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{cls_name}: {ARGS_PATH}.{key} must be true or false, got {value!r}")
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


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce_sum(values: List[float], like: torch.Tensor) -> List[float]:
    """Sum ``values`` over the default process group (a no-op in a world of one). float64: exact token counts."""
    out = torch.tensor(values, dtype=torch.float64, device=like.device)
    if _world_size() > 1:
        torch.distributed.all_reduce(out)
    return out.tolist()


class _RecipeLoss:
    """What the two classes share: argument checks, the engine/legacy decision and the call itself.

    Not a PolicyLossFn: Trinity's metaclass needs ``__call__`` in each class body (it reads its signature there), so
    every loss class below declares its own ``__call__`` and hands over to :meth:`_compute`.
    """

    loss_name: str
    _recipe_config: Dict[str, Any]
    loss_agg_mode: str
    uses_global_counts: bool
    allow_split_mini_batch: bool
    assume_one_micro_batch: bool
    _init_args: Dict[str, Any]  # the constructor's arguments, for pickling and repr

    def _init_common(self, loss_agg_mode: str, batch_num_tokens_from_data: Union[bool, str, None],
                     allow_split_mini_batch: Any, assume_one_micro_batch: Any) -> None:
        cls_name = type(self).__name__
        check_framework_version("trinity-rft", where="recipe.trinity")
        self.loss_agg_mode = _check_agg_mode(cls_name, loss_agg_mode)
        flag = _check_flag(cls_name, "batch_num_tokens_from_data", batch_num_tokens_from_data)
        self.allow_split_mini_batch = _check_bool(cls_name, "allow_split_mini_batch", allow_split_mini_batch)
        self.assume_one_micro_batch = _check_bool(cls_name, "assume_one_micro_batch", assume_one_micro_batch)
        self.uses_global_counts = engine_path_passes_global_counts() if flag is None else flag
        if self.uses_global_counts and self.assume_one_micro_batch:
            raise ValueError(f"{cls_name}: {ARGS_PATH}.assume_one_micro_batch is for Trinity's legacy path "
                             "(verl < 0.8) only; on the engine path the loss checks the micro-batching itself. Fix: "
                             "remove it (or allow_split_mini_batch: true to accept a split mini-batch)")
        base = [key for key in type(self)._select_keys if key not in GLOBAL_COUNT_KEYS]
        # The instance's key list shadows the class's: Trinity selects exactly these from its data (select_keys)
        # and its wrapper forwards only these to __call__, so the legacy path never asks for keys it lacks.
        self._select_keys = base + (list(GLOBAL_COUNT_KEYS) if self.uses_global_counts else [])

    # ------------------------------------------------------------------------------------------------ the call

    def _compute(self, logprob: torch.Tensor, old_logprob: torch.Tensor, action_mask: torch.Tensor,
                 advantages: torch.Tensor, batch_num_tokens: Optional[int], dp_size: Optional[int],
                 rollout_log_probs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
        valid = action_mask.bool()
        self._check_behaviour(old_logprob, rollout_log_probs, valid)
        if self.uses_global_counts:
            if batch_num_tokens is None or dp_size is None:
                raise ValueError(f"{type(self).__name__}: the micro-batch has no batch_num_tokens/dp_size although "
                                 "the verl engine path (verl >= 0.8) puts them there; set "
                                 f"{ARGS_PATH}.batch_num_tokens_from_data: false only for Trinity's legacy path")
            loss, metrics = self._engine_call(logprob, old_logprob, valid, advantages, int(batch_num_tokens),
                                              int(dp_size))
        else:
            loss, metrics = self._legacy_call(logprob, old_logprob, valid, advantages)
        out = dict(metrics)
        # Trinity's built-in losses report pg_loss; on the engine path its sum over micro-batches (averaged over
        # ranks) is the mini-batch loss.
        out["pg_loss"] = float(loss.detach().item())
        return loss, out

    def _registry(self, logprob, old_logprob, valid, advantages, config) -> Tuple[torch.Tensor, Dict[str, float]]:
        return get_policy_loss_fn(self.loss_name)(
            old_log_prob=old_logprob, log_prob=logprob, advantages=advantages, response_mask=valid,
            loss_agg_mode=self.loss_agg_mode, config=config)

    def _check_behaviour(self, old_logprob, rollout_log_probs, valid) -> None:
        """Overridden by M2PO (its ratio needs the behaviour log-probs)."""

    def _check_world(self, dp_size: int, what: str) -> None:
        world = _world_size()
        if dp_size > 1 and world != dp_size:
            raise ValueError(f"{type(self).__name__}: {what} reduces over the whole torch.distributed world "
                             f"({world} ranks), but the data-parallel size is {dp_size} (sequence parallelism "
                             "duplicates tokens across ranks), so no exact cross-rank reduction is available; set "
                             "trainer.ulysses_sequence_parallel_size: 1")

    def _split_error(self, covered: int, batch_num_tokens: int, dp_size: int, what: str) -> ValueError:
        ranks = f" over all {dp_size} data-parallel ranks" if dp_size > 1 else ""
        return ValueError(
            f"{type(self).__name__}: verl split this rank's optimizer mini-batch into micro-batches (this call covers "
            f"{covered} of the mini-batch's batch_num_tokens={batch_num_tokens} valid tokens{ranks}), so {what} "
            f"would not be the mini-batch's. Fix: {ONE_MICRO_BATCH_FIX}; or accept it with {ARGS_PATH}."
            f"allow_split_mini_batch: true (logged as actor/{self.loss_name}/split_mini_batch)")

    def _legacy_preamble(self) -> Dict[str, float]:
        world = _world_size()
        name = type(self).__name__
        if world > 1:
            raise ValueError(f"{name}: Trinity's legacy path (verl < 0.8) gives the loss no mini-batch token count "
                             f"and may give the {world} ranks different micro-batch counts, so {self.loss_name} "
                             "cannot be exact (nor a cross-rank selection safe) there. Fix: run Trinity with "
                             "verl >= 0.8 (its engine path), or on one rank")
        if not self.assume_one_micro_batch:
            raise ValueError(f"{name}: Trinity's legacy path (verl < 0.8) cannot show the loss whether the "
                             f"mini-batch was split into micro-batches, so {self.loss_name} is not checked exact "
                             f"there. Fix: run Trinity with verl >= 0.8, or {ONE_MICRO_BATCH_FIX} (legacy: also "
                             f"trainer.use_dynamic_bsz: false with ppo_micro_batch_size_per_gpu = the mini-batch) and "
                             f"set {ARGS_PATH}.assume_one_micro_batch: true")
        return {f"{self.loss_name}/unverified_micro_batching": 1.0}

    def __reduce__(self):
        # Rebuild from the constructor arguments in the receiving process (Ray pickles the loss), so the instance's
        # select keys are decided there, by the verl that process will run.
        return (_rebuild, (type(self), self._init_args))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._init_args.items())})"


class M2POPolicyLossFn(_RecipeLoss, PolicyLossFn):
    """M2PO (Algorithm 1 of arXiv 2510.01161): ``recipe.registry`` loss ``m2po`` inside Trinity-RFT.

    ``policy_loss_fn_args``: ``m2_threshold`` (tau, default 0.04), ``m2_scope`` (``auto``: one selection over all
    data-parallel ranks when there are several, else the rank's; ``dp_group``; ``local`` = each rank's own tokens,
    refused with more than one rank unless ``allow_split_mini_batch``), ``loss_agg_mode`` (Trinity overwrites it
    with ``algorithm.loss_agg_mode``; token-mean only), ``allow_split_mini_batch`` (false: a mini-batch that verl
    splits into micro-batches is refused; true: select per micro-batch, logged as ``m2po/split_mini_batch``),
    ``assume_one_micro_batch`` (legacy path only), ``batch_num_tokens_from_data`` (``auto``).
    """

    loss_name = "m2po"
    ARG_KEYS = ("m2_threshold", "m2_scope", "loss_agg_mode", "allow_split_mini_batch", "assume_one_micro_batch",
                "batch_num_tokens_from_data")
    SCOPES = ("auto", "local", "dp_group")

    def __init__(self, backend: str = "verl", m2_threshold: float = 0.04, m2_scope: str = "auto",
                 loss_agg_mode: str = "token-mean", allow_split_mini_batch: bool = False,
                 assume_one_micro_batch: bool = False, batch_num_tokens_from_data: Union[bool, str] = "auto",
                 **unknown: Any) -> None:
        name = type(self).__name__
        _refuse_unknown(name, unknown, self.ARG_KEYS)
        _check_backend(name, backend)
        super().__init__(backend=backend)
        self._init_args = {"backend": backend, "m2_threshold": m2_threshold, "m2_scope": m2_scope,
                           "loss_agg_mode": loss_agg_mode, "allow_split_mini_batch": allow_split_mini_batch,
                           "assume_one_micro_batch": assume_one_micro_batch,
                           "batch_num_tokens_from_data": batch_num_tokens_from_data}
        if m2_scope not in self.SCOPES:
            raise ValueError(f"{name}: {ARGS_PATH}.m2_scope must be one of {', '.join(self.SCOPES)}, got "
                             f"{m2_scope!r}; auto (the default) is the exact one")
        config = {"m2_threshold": m2_threshold, "m2_scope": "local" if m2_scope == "auto" else m2_scope}
        try:  # the recipe's own validation of its keys (one implementation)
            self.m2_threshold = m2_threshold_from_config(config)
            m2_scope_from_config(config)
        except ValueError as exc:
            raise _with_key_path(name, exc) from None
        self.m2_scope = m2_scope
        self._recipe_config = {"m2_threshold": self.m2_threshold}
        self._init_common(loss_agg_mode, batch_num_tokens_from_data, allow_split_mini_batch, assume_one_micro_batch)

    def __call__(  # type: ignore[override]
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        rollout_log_probs: torch.Tensor,
        batch_num_tokens: Optional[int] = None,
        dp_size: Optional[int] = None,
        **kwargs: Any,
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        return self._compute(logprob, old_logprob, action_mask, advantages, batch_num_tokens, dp_size,
                             rollout_log_probs)

    def _check_behaviour(self, old_logprob, rollout_log_probs, valid) -> None:
        if rollout_log_probs is None:
            raise ValueError(f"{type(self).__name__}: the micro-batch has no {ROLLOUT_KEY} (the explorer's "
                             "log-probs), which M2PO's ratio needs; make the explorer return log-probs")
        if not torch.equal(old_logprob.detach()[valid], rollout_log_probs.detach().to(old_logprob.dtype)[valid]):
            raise ValueError(f"{type(self).__name__}: old_log_probs differ from {ROLLOUT_KEY}: "
                             "algorithm.bypass_old_logprobs: false recomputes them with the trainer's current "
                             "weights, so M2PO's ratio would no longer see the rollouts' staleness. Fix: "
                             "algorithm.bypass_old_logprobs: true")

    def resolved_scope(self, dp_size: int) -> str:
        """The selection scope for ``dp_size`` ranks: ``auto`` is ``dp_group`` with more than one rank."""
        scope = self.m2_scope
        if scope == "auto":
            return "dp_group" if dp_size > 1 else "local"
        if scope == "local" and dp_size > 1 and not self.allow_split_mini_batch:
            raise ValueError(f"{type(self).__name__}: {ARGS_PATH}.m2_scope=local selects over one rank's tokens, but "
                             f"the optimizer mini-batch spans {dp_size} data-parallel ranks. Fix: m2_scope: auto (or "
                             "dp_group); or allow_split_mini_batch: true to accept per-rank selections (logged)")
        return scope

    def _engine_call(self, logprob, old_logprob, valid, advantages, batch_num_tokens: int, dp_size: int):
        scope = self.resolved_scope(dp_size)
        if scope == "dp_group":
            self._check_world(dp_size, "m2_scope=dp_group")
        local = int(valid.sum())
        what = "M2PO's selection (Algorithm 1)"
        if scope == "local" and dp_size == 1 and local != batch_num_tokens and not self.allow_split_mini_batch:
            raise self._split_error(local, batch_num_tokens, dp_size, what)  # before any work
        config = with_global_batch_info({**self._recipe_config, "m2_scope": scope}, num_tokens=batch_num_tokens,
                                        dp_size=dp_size)
        loss, metrics = self._registry(logprob, old_logprob, valid, advantages, config)
        # dp_group: the selection's count is over the same-index micro-batches of all ranks, the same on every rank
        covered = int(metrics["m2po/num_valid_tokens"])
        split = covered != batch_num_tokens
        if split and not self.allow_split_mini_batch:
            raise self._split_error(covered, batch_num_tokens, dp_size, what)
        if self.allow_split_mini_batch:
            metrics = {**metrics, "m2po/split_mini_batch": float(split)}
        return loss, metrics

    def _legacy_call(self, logprob, old_logprob, valid, advantages):
        flags = self._legacy_preamble()
        # Every valid token of the (single) micro-batch: Trinity's fix_actor_microbatch_loss_scale then is a no-op.
        config = with_global_batch_info({**self._recipe_config, "m2_scope": "local"}, num_tokens=int(valid.sum()),
                                        dp_size=1)
        loss, metrics = self._registry(logprob, old_logprob, valid, advantages, config)
        return loss, {**metrics, **flags}

    @classmethod
    def default_args(cls) -> Dict[str, Any]:
        return {"m2_threshold": 0.04, "m2_scope": "auto", "loss_agg_mode": "token-mean"}


#: The order of the denominators in FIPO's all-reduced counts (each fipo/* fraction is pooled over the step as summed
#: numerators / summed denominators, recipe.fipo.algorithm.METRIC_DENOMINATORS).
FIPO_DENOMINATORS = ("valid_tokens", "kept_tokens", "rows")


class FIPOPolicyLossFn(_RecipeLoss, PolicyLossFn):
    """FIPO (Future-KL Influenced Policy Optimization): ``recipe.registry`` loss ``fipo`` inside Trinity-RFT.

    ``policy_loss_fn_args`` (stalerl's names): ``fipo_decay_rate`` (32), ``fipo_clip_ratio_c`` (10),
    ``fipo_influence_clip_ratio`` (0.2), ``fipo_influence_clip_high_only`` (true), ``fipo_safety_threshold`` (10),
    ``eps_clip`` (0.2), ``eps_clip_higher`` (null = eps_clip), ``loss_agg_mode``, ``allow_split_mini_batch``,
    ``assume_one_micro_batch``, ``batch_num_tokens_from_data``.

    The objective is the FIPO reference's over the whole optimizer mini-batch: a dropped row leaves the numerator
    and the denominator, so the denominator is the mini-batch's valid tokens minus those of its dropped rows (all
    ranks: one all-reduce). verl's ``batch_num_tokens`` counts the dropped rows; with a split mini-batch the drops of
    the other micro-batches are unknown to this call, hence the refusal (or, opted in, verl's count).
    """

    loss_name = "fipo"
    ARG_KEYS = ("fipo_decay_rate", "fipo_clip_ratio_c", "fipo_influence_clip_ratio", "fipo_influence_clip_high_only",
                "fipo_safety_threshold", "eps_clip", "eps_clip_higher", "loss_agg_mode", "allow_split_mini_batch",
                "assume_one_micro_batch", "batch_num_tokens_from_data")

    def __init__(self, backend: str = "verl", fipo_decay_rate: float = 32.0, fipo_clip_ratio_c: float = 10.0,
                 fipo_influence_clip_ratio: float = 0.2, fipo_influence_clip_high_only: bool = True,
                 fipo_safety_threshold: float = 10.0, eps_clip: float = 0.2, eps_clip_higher: Optional[float] = None,
                 loss_agg_mode: str = "token-mean", allow_split_mini_batch: bool = False,
                 assume_one_micro_batch: bool = False, batch_num_tokens_from_data: Union[bool, str] = "auto",
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
                           "allow_split_mini_batch": allow_split_mini_batch,
                           "assume_one_micro_batch": assume_one_micro_batch,
                           "batch_num_tokens_from_data": batch_num_tokens_from_data}
        try:  # the recipe's own validation of its keys (one implementation)
            self.params = fipo_params_from_config(config)
        except ValueError as exc:
            raise _with_key_path(name, exc) from None
        self._recipe_config = {key: value for key, value in config.items() if value is not None}
        self._init_common(loss_agg_mode, batch_num_tokens_from_data, allow_split_mini_batch, assume_one_micro_batch)

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

    def _counts(self, logprob, old_logprob, valid, advantages) -> List[float]:
        """This micro-batch's [valid tokens, kept tokens (after the drop), rows, FIPO numerators...]."""
        d = masked_log_ratio(old_logprob, logprob.detach(), valid)  # the registry's FIPO sees the same d
        parts = fipo_metric_parts(d, advantages, valid, self.params)
        return [parts.denominators[k] for k in FIPO_DENOMINATORS] + [parts.numerators[k] for k in METRIC_KEYS]

    @staticmethod
    def _pooled(totals: List[float]) -> Dict[str, float]:
        denominators = dict(zip(FIPO_DENOMINATORS, totals[:len(FIPO_DENOMINATORS)]))
        numerators = dict(zip(METRIC_KEYS, totals[len(FIPO_DENOMINATORS):]))
        return {k: num / max(denominators[METRIC_DENOMINATORS[k]], 1.0) for k, num in numerators.items()}

    def _engine_call(self, logprob, old_logprob, valid, advantages, batch_num_tokens: int, dp_size: int):
        self._check_world(dp_size, "FIPO's step-wide token count")
        totals = _all_reduce_sum(self._counts(logprob, old_logprob, valid, advantages), valid)
        covered, kept = int(totals[0]), int(totals[1])
        split = covered != batch_num_tokens
        if split and not self.allow_split_mini_batch:
            raise self._split_error(covered, batch_num_tokens, dp_size, "the tokens of FIPO's dropped rows")
        # exact: the reference's denominator over the mini-batch; opted in and split: verl's count (drops kept)
        num_tokens = batch_num_tokens if split else kept
        config = with_global_batch_info(self._recipe_config, num_tokens=num_tokens, dp_size=dp_size)
        loss, metrics = self._registry(logprob, old_logprob, valid, advantages, config)
        metrics = {**metrics, **self._pooled(totals)}
        if self.allow_split_mini_batch:
            metrics["fipo/split_mini_batch"] = float(split)
        return loss, metrics

    def _legacy_call(self, logprob, old_logprob, valid, advantages):
        flags = self._legacy_preamble()
        # the registry's FIPO alone is the reference on its tensors: dropped rows leave the sum and the count
        loss, metrics = self._registry(logprob, old_logprob, valid, advantages, dict(self._recipe_config))
        return loss, {**metrics, **flags}

    @classmethod
    def default_args(cls) -> Dict[str, Any]:
        return {"fipo_decay_rate": 32.0, "fipo_clip_ratio_c": 10.0, "fipo_influence_clip_ratio": 0.2,
                "fipo_influence_clip_high_only": True, "fipo_safety_threshold": 10.0, "eps_clip": 0.2,
                "loss_agg_mode": "token-mean"}


def _rebuild(cls: type, init_args: Dict[str, Any]) -> Any:
    """Unpickling: construct again from the user's arguments (see ``_RecipeLoss.__reduce__``)."""
    return cls(**init_args)


__all__ = ["FIPOPolicyLossFn", "M2POPolicyLossFn", "engine_path_passes_global_counts"]
