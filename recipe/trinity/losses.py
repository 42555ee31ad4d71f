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

Every registered loss has a class here (:func:`policy_loss_class`; ``recipe.trinity.<Name>PolicyLossFn``, e.g.
``FIPOPolicyLossFn``, a plugin's ``ThrowawayPolicyLossFn``): its ``policy_loss_fn_args`` are the loss's declared
parameters (``recipe/<loss>/declaration.py``, checked there), the PPO clip when the loss uses it, and the adapter's
own. A loss whose step needs a decision (M2PO's selection, FIPO's sequence drop) is planned by
``recipe.optimizer_batch.plan_optimizer_batch`` over the call and every rank of the group.

Metrics: the loss's keys (``m2po/*``, ``fipo/*``, ...) of the whole optimizer mini-batch (all ranks: a batch
selector's step-wide diagnostics, or every rank's metrics combined by ``recipe.declaration.reduce_metrics`` with the
loss's declared rules, one all-gather), identical on every micro-batch and rank of an exact step, so whatever mean
Trinity/verl take over micro-batches and ranks logs the step's value.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any, Dict, Optional, Tuple, Union

import torch
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn

from recipe.declaration import PPO_CLIP, LossDeclaration, Param, reduce_metrics
from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch, with_global_batch_info
from recipe.registry import get_declaration, get_policy_loss_spec, refusals, usable_declarations
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


#: The framework name under which the loss declarations name and default Trinity's keys (``Param.name_in``).
FRAMEWORK = "trinity"
#: A step-scope parameter's Trinity value (M2PO's ``m2_scope``) that picks the scope from the data-parallel size:
#: ``dp_group`` (one decision over all ranks) with more than one rank, else ``local``. Trinity's default.
AUTO = "auto"
#: The arguments of every class besides the loss's own parameters (and the PPO clip of a loss that uses it).
COMMON_KEYS = ("loss_agg_mode", "allow_split_mini_batch", "assume_one_micro_batch", "batch_num_tokens_from_data")
#: The PPO clip under stalerl's names, for a loss that declares ``uses_ppo_clip``.
CLIP_KEYS = ("eps_clip", "eps_clip_higher")


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _world_group() -> Optional[Any]:
    return torch.distributed.group.WORLD if _world_size() > 1 else None


def _pooled_over_ranks(metrics: Dict[str, float], counts: Dict[str, float], rules: Any,
                       like: torch.Tensor) -> Dict[str, float]:
    """This rank's metrics combined with every rank's by the loss's declared rules (``reduce_metrics``): one
    all-gather of ``[valid_tokens, rows, *values]`` (the same keys on every rank: the registry's contract)."""
    world = _world_size()
    if world == 1:
        return dict(metrics)
    keys = sorted(metrics)
    mine = torch.tensor([counts["valid_tokens"], counts["rows"], *(float(metrics[k]) for k in keys)],
                        dtype=torch.float64, device=like.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(every, mine)
    parts = [({"valid_tokens": v[0], "rows": v[1]}, dict(zip(keys, v[2:]))) for v in (t.tolist() for t in every)]
    return reduce_metrics(parts, rules)


class _RecipeLoss:
    """What every class shares: the arguments (generated from the loss's declaration), the engine/legacy decision
    and the call itself, by what the loss's step needs (its declaration's ``step``).

    Not a PolicyLossFn: Trinity's metaclass needs ``__call__`` in each class body (it reads its signature there), so
    every loss class declares its own ``__call__`` and hands over to :meth:`_compute`.
    """

    loss_name: str
    _recipe_config: Dict[str, Any]
    loss_agg_mode: str
    uses_global_counts: bool
    allow_split_mini_batch: bool
    assume_one_micro_batch: bool
    _init_args: Dict[str, Any]  # the constructor's arguments, for pickling and repr

    # ------------------------------------------------------------------------------------- generated arguments

    @classmethod
    def declaration(cls) -> LossDeclaration:
        return get_declaration(cls.loss_name)

    @classmethod
    def arg_keys(cls) -> Tuple[str, ...]:
        """The accepted ``policy_loss_fn_args``: the loss's parameters (their Trinity names), the PPO clip when the
        loss uses it, and the adapter's own."""
        decl = cls.declaration()
        return (*(p.name_in(FRAMEWORK) for p in decl.params), *(CLIP_KEYS if decl.uses_ppo_clip else ()),
                *COMMON_KEYS)

    @classmethod
    def default_args(cls) -> Dict[str, Any]:
        """What Trinity fills in when the config gives no arguments: the declared defaults (``auto`` for a
        step-scope parameter), the PPO clip and token-mean."""
        decl = cls.declaration()
        out: Dict[str, Any] = {p.name_in(FRAMEWORK): (AUTO if decl.is_step_scope(p) else p.default_in(FRAMEWORK))
                               for p in decl.params}
        if decl.uses_ppo_clip:
            out["eps_clip"] = 0.2
        out["loss_agg_mode"] = "token-mean"
        return out

    def __init__(self, backend: str = "verl", **args: Any) -> None:
        name = type(self).__name__
        known = self.arg_keys()
        _refuse_unknown(name, {k: v for k, v in args.items() if k not in known}, known)
        _check_backend(name, backend)
        super().__init__(backend=backend)  # type: ignore[call-arg] - PolicyLossFn's
        decl = self.declaration()
        defaults = {**self.default_args(), "eps_clip_higher": None, "allow_split_mini_batch": False,
                    "assume_one_micro_batch": False, "batch_num_tokens_from_data": AUTO}
        given = {key: args.get(key, defaults.get(key)) for key in known}
        self._init_args = {"backend": backend, **given}
        config: Dict[str, Any] = {}
        self.scope_choice: Optional[str] = None  # the step-scope parameter's value (auto or one of its choices)
        for p in decl.params:
            key = p.name_in(FRAMEWORK)
            config[p.name] = self._check_param(p, key, given[key])
        if decl.uses_ppo_clip:
            low = self._check_clip("eps_clip", given["eps_clip"])
            high = None if given["eps_clip_higher"] is None else self._check_clip("eps_clip_higher",
                                                                                  given["eps_clip_higher"])
            config.update(eps_clip=low, eps_clip_higher=high)
            clip = (low, low if high is None else high)
        else:
            clip = (0.2, 0.2)
        try:  # the declaration's cross-parameter rules (one validation)
            decl.raise_problems({p.name: config[p.name] for p in decl.params}, clip, where=f"{ARGS_PATH}.")
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        self._recipe_config = {k: v for k, v in config.items() if v is not None}
        self._init_common(given["loss_agg_mode"], given["batch_num_tokens_from_data"],
                          given["allow_split_mini_batch"], given["assume_one_micro_batch"])

    def _check_param(self, p: Param, key: str, value: Any) -> Any:
        name = type(self).__name__
        if self.declaration().is_step_scope(p):
            if value != AUTO and (not isinstance(value, str) or value not in (p.choices or ())):
                choices = ", ".join((AUTO, *(p.choices or ())))
                raise ValueError(f"{name}: {ARGS_PATH}.{key} must be one of {choices}, got {value!r}; {AUTO} (the "
                                 "default) is the exact one")
            self.scope_choice = value
            return None  # the in-call value is the plan's (module doc); the scope is resolved per call
        try:  # the declaration's check of the key (one validation)
            return p.check(value, f"{ARGS_PATH}.{key}")
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    def _check_clip(self, key: str, value: Any) -> float:
        """A PPO-clip key, checked by the shared group's Param (one validation, one message form)."""
        try:
            return PPO_CLIP.param(key).check(value, f"{ARGS_PATH}.{key}")
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None

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

    def _registry(self, logprob, old_logprob, valid, advantages, config, **extras) -> Tuple[torch.Tensor, Dict]:
        loss, metrics = get_policy_loss_spec(self.loss_name).fn(
            old_log_prob=old_logprob, log_prob=logprob, advantages=advantages, response_mask=valid,
            loss_agg_mode=self.loss_agg_mode, config=config, **extras)
        return loss, {k: float(v) for k, v in metrics.items()}

    def _check_behaviour(self, old_logprob, rollout_log_probs, valid) -> None:
        """Overridden by M2PO (its ratio needs the behaviour log-probs)."""

    def _check_world(self, dp_size: int, what: str) -> None:
        world = _world_size()
        if dp_size > 1 and world != dp_size:
            raise ValueError(f"{type(self).__name__}: {what} reduces over the whole torch.distributed world "
                             f"({world} ranks), but the data-parallel size is {dp_size} (sequence parallelism "
                             "duplicates tokens across ranks), so no exact cross-rank reduction is available; set "
                             "trainer.ulysses_sequence_parallel_size: 1")

    def plans_over_group(self, dp_size: int) -> bool:
        """Whether the step's plan spans the data-parallel group for ``dp_size`` ranks: a loss without a step-scope
        parameter always does; with one (``StepScope``, M2PO's ``m2_scope``), unless it is set to the declaration's
        ``local`` value; ``auto`` plans over the group with more than one rank."""
        scope = self.declaration().step_scope
        if scope is None or self.scope_choice is None:
            return True
        if self.scope_choice == AUTO:
            return dp_size > 1
        if self.scope_choice == scope.local and dp_size > 1 and not self.allow_split_mini_batch:
            key = self.declaration().param(scope.param).name_in(FRAMEWORK)
            raise ValueError(f"{type(self).__name__}: {ARGS_PATH}.{key}={scope.local} selects over one rank's "
                             f"tokens, but the optimizer mini-batch spans {dp_size} data-parallel ranks. Fix: {key}: "
                             f"{AUTO} (or {scope.group}); or allow_split_mini_batch: true to accept per-rank "
                             "selections (logged)")
        return self.scope_choice != scope.local

    def _engine_call(self, logprob, old_logprob, valid, advantages, batch_num_tokens: int, dp_size: int):
        """verl's engine path: ``batch_num_tokens`` (all ranks) and ``dp_size`` in the data. A loss whose step needs a
        decision is planned by ``recipe.optimizer_batch`` over this call (one micro-batch per rank: the whole
        mini-batch) and every rank of the group; the metrics are the step's, the same on every rank."""
        decl = self.declaration()
        counts = {"valid_tokens": float(valid.sum()), "rows": float(valid.shape[0])}
        flags: Dict[str, float] = {}
        if decl.step == "nothing":  # token-mean over verl's count is exact whatever the split
            config = with_global_batch_info(self._recipe_config, num_tokens=batch_num_tokens, dp_size=dp_size)
            loss, metrics = self._registry(logprob, old_logprob, valid, advantages, config)
            pooled = _world_size() == dp_size
            return loss, (_pooled_over_ranks(metrics, counts, decl.metrics, valid) if pooled else metrics)
        what = ("the step's decision" if decl.step == "batch_selector" else "the tokens of the rows it drops") + \
            f" ({self.loss_name})"
        if decl.step == "batch_selector":
            group = None
            if self.plans_over_group(dp_size):
                scope = decl.step_scope
                self._check_world(dp_size, f"{decl.param(scope.param).name_in(FRAMEWORK)}={scope.group}"
                                  if scope is not None else f"{self.loss_name}'s step decision")
                group = _world_group()
            elif dp_size == 1 and int(counts["valid_tokens"]) != batch_num_tokens and not self.allow_split_mini_batch:
                raise self._split_error(int(counts["valid_tokens"]), batch_num_tokens, dp_size, what)  # before work
        else:  # row_selector: the rows never span micro-batches; the kept-token count spans all ranks
            self._check_world(dp_size, f"{self.loss_name}'s step-wide token count")
            group = _world_group()
        step = MicroBatch(old_log_prob=old_logprob, log_prob=logprob.detach(), advantages=advantages,
                          response_mask=valid)
        plan = plan_optimizer_batch(self.loss_name, [step], self._recipe_config, group=group)
        covered = plan.row_drops.num_valid_tokens if plan.row_drops is not None else plan.num_tokens
        split = covered != batch_num_tokens
        if split and not self.allow_split_mini_batch:
            raise self._split_error(covered, batch_num_tokens, dp_size, what)
        if self.allow_split_mini_batch:
            flags[f"{self.loss_name}/split_mini_batch"] = float(split)
        # exact: the plan's count of the mini-batch (FIPO: its kept tokens); opted in and split: verl's count
        num_tokens = batch_num_tokens if split else plan.num_tokens
        config = with_global_batch_info(self._recipe_config, num_tokens=num_tokens, dp_size=dp_size)
        loss, metrics = self._registry(logprob, old_logprob, valid, advantages, config, **plan.extras[0])
        group_wide = plan.selection is not None and group is not None
        if plan.selection is not None:  # the step's diagnostics, over the group (the loss's are this call's)
            metrics = {**metrics, **plan.selection.metrics()}
        if not group_wide and _world_size() == dp_size:  # this rank's: combined with every rank's
            metrics = _pooled_over_ranks(metrics, counts, decl.metrics, valid)
        return loss, {**metrics, **flags}

    def _legacy_call(self, logprob, old_logprob, valid, advantages):
        flags = self._legacy_preamble()
        # Every valid token of the (single) micro-batch: Trinity's fix_actor_microbatch_loss_scale then is a no-op.
        # A loss whose step needs a decision decides on this call, which is the step (one micro-batch, one rank).
        config = dict(self._recipe_config)
        if self.declaration().step == "batch_selector":
            config = with_global_batch_info({**config, **self._in_call_scope()}, num_tokens=int(valid.sum()),
                                            dp_size=1)
        loss, metrics = self._registry(logprob, old_logprob, valid, advantages, config)
        return loss, {**metrics, **flags}

    def _in_call_scope(self) -> Dict[str, Any]:
        """The step-scope parameter at its local value: the legacy call is the whole step on one rank."""
        scope = self.declaration().step_scope
        return {} if scope is None else {scope.param: scope.local}

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
    ``assume_one_micro_batch`` (legacy path only), ``batch_num_tokens_from_data`` (``auto``). The keys, defaults and
    checks of the loss's own parameters come from its declaration (recipe/m2po/declaration.py).
    """

    loss_name = "m2po"

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


def _call(self, logprob: torch.Tensor, old_logprob: torch.Tensor, action_mask: torch.Tensor,
          advantages: torch.Tensor, batch_num_tokens: Optional[int] = None, dp_size: Optional[int] = None,
          **kwargs: Any) -> Tuple[torch.Tensor, Dict[str, float]]:
    return self._compute(logprob, old_logprob, action_mask, advantages, batch_num_tokens, dp_size)


def _declarations() -> Dict[str, LossDeclaration]:
    """The losses Trinity can take: Trinity finds each class by its dotted path (no loss name of Trinity's can clash),
    so only a parameter named like one of the adapter's own arguments is refused."""
    return usable_declarations(FRAMEWORK, own_fields=COMMON_KEYS + CLIP_KEYS, field_name=lambda p: p.name_in(FRAMEWORK))


def _class_name(loss_name: str) -> str:
    return "".join(part.capitalize() for part in loss_name.replace("-", "_").split("_")) + "PolicyLossFn"


#: Class names that differ from :func:`_class_name` (kept as they were: the dotted paths users put in configs).
_NAMED = {"m2po": "M2POPolicyLossFn", "fipo": "FIPOPolicyLossFn"}
_CLASSES: Dict[str, type] = {"m2po": M2POPolicyLossFn}


def policy_loss_class(loss_name: str) -> type:
    """The Trinity policy-loss class of a registered loss (``recipe.trinity.<Name>PolicyLossFn``: a built-in's or a
    ``recipe.losses`` plugin's), made once from its declaration: its arguments are the loss's parameters."""
    cls = _CLASSES.get(loss_name)
    if cls is None:
        get_policy_loss_spec(loss_name)  # an unknown name: one line listing the registered losses
        if loss_name not in _declarations():  # refused here (the clash check every adapter shares): its one line
            raise ValueError(refusals().get(f"{FRAMEWORK}:{loss_name}", f"policy loss {loss_name!r} is refused"))
        decl = get_declaration(loss_name)
        name = _NAMED.get(loss_name, _class_name(loss_name))
        cls = type(name, (_RecipeLoss, PolicyLossFn), {"loss_name": loss_name, "__call__": _call,
                                                      "__module__": __name__, "__qualname__": name})
        cls.__doc__ = (f"{decl.summary}\n\n``recipe.registry`` loss ``{loss_name}`` inside Trinity-RFT. "
                       f"``policy_loss_fn_args``: {', '.join(cls.arg_keys())}; the loss's own from its declaration.")
        _CLASSES[loss_name] = cls
    return cls


FIPOPolicyLossFn = policy_loss_class("fipo")


def __getattr__(name: str) -> Any:
    """``recipe.trinity.losses.<Name>PolicyLossFn`` for every registered loss (Trinity's dotted path, pickling)."""
    for loss_name in _declarations():
        if _NAMED.get(loss_name, _class_name(loss_name)) == name:
            return policy_loss_class(loss_name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rebuild(cls: type, init_args: Dict[str, Any]) -> Any:
    """Unpickling: construct again from the user's arguments (see ``_RecipeLoss.__reduce__``)."""
    return cls(**init_args)


__all__ = ["FIPOPolicyLossFn", "M2POPolicyLossFn", "engine_path_passes_global_counts", "policy_loss_class"]
