"""A policy loss declares itself once: its parameters, what its step needs, and how its metrics combine.

Torch-free, so that a config can be validated (and a ``--help`` printed) without importing torch. Every surface
that names a loss parameter is generated from its :class:`LossDeclaration`:

- the runtime's ``actor.<param>`` config fields (``stalerl/config/schema.py``) and the dict the actor hands the loss;
- verl's ``PolicyLossConfig`` subclass, TRL's ``GRPOConfig`` fields, ms-swift's arguments, AReaL's actor config,
  Trinity-RFT's policy-loss class (``recipe/<framework>/``);
- the run summary's diagnostic metrics and the step's metric reduction (:func:`reduce_metrics`).

A loss function receives the typed parameter object :meth:`LossDeclaration.read` builds from whatever config its
caller passes (verl's ``policy_loss.<name>`` first, then ``<name>``); an adapter that names a parameter differently
maps it at its edge with :attr:`Param.names`. One name, one default, one validation (:meth:`Param.check` and the
declaration's cross-parameter ``rules``).

Adding a loss: ``docs/adding-a-loss.md``.
"""

from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

#: What one optimizer step of a loss needs before its first micro-batch's loss call.
STEP_NEEDS = ("nothing", "batch_selector", "row_selector")
#: How a metric of several micro-batches (or ranks) combines into the step's value.
COMBINE = ("mean", "sum", "max")
#: The counts every caller knows per micro-batch, by which a ``mean`` metric may be weighted.
CALLER_WEIGHTS = ("valid_tokens", "rows")
#: The two trust-region quadrants whose tokens a clip (or M2PO's mask) acts on, as metric-key suffixes: A > 0 with
#: r > 1, and A < 0 with r < 1. Defined once; the losses' declarations name their per-quadrant metrics with them.
TRUST_REGION_QUADRANTS = ("pos_r_gt_1", "neg_r_lt_1")

_MISSING = object()


@dataclass(frozen=True)
class Param:
    """One parameter of a loss: its name, default, bounds, help, and the names each framework uses.

    ``names``: a framework's name for the key where it differs from ``name`` (an alias lives here, at the adapter's
    edge, never in the loss). ``defaults``: a framework whose default must differ, with the reason in ``help``.
    """

    name: str
    default: Any
    help: str
    kind: type = float
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    choices: Optional[tuple] = None
    names: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def name_in(self, framework: str) -> str:
        return self.names.get(framework, self.name)

    def default_in(self, framework: str) -> Any:
        return self.defaults.get(framework, self.default)

    def metadata(self) -> dict[str, Any]:
        """``dataclasses.field`` metadata: help, choices and bounds (the runtime's and HF's argument parsers)."""
        out: dict[str, Any] = {"help": self.help}
        if self.choices is not None:
            out["choices"] = tuple(self.choices)
        for key in ("ge", "gt", "le"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def bounds_text(self) -> str:
        parts = [f"{op} {getattr(self, key)}" for key, op in (("ge", ">="), ("gt", ">"), ("le", "<="))
                 if getattr(self, key) is not None]
        return " and ".join(parts)

    def check(self, value: Any, key: Optional[str] = None, *, framework: str = "stalerl") -> Any:
        """``value`` normalised to :attr:`kind`, or ValueError naming ``key``, what was expected and the fix (the
        ``framework``'s default)."""
        key = key or self.name
        default = self.default_in(framework)
        fix = (f"Fix: unset {key} (default: off)" if default is None else
               f"Fix: set {key}={str(default).lower()}" if isinstance(default, bool) else f"Fix: set {key}={default!r}")
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r} ({type(value).__name__}). {fix}.")
            return value
        if self.kind is str:
            if not isinstance(value, str) or (self.choices is not None and value not in self.choices):
                expected = f"one of {', '.join(self.choices)}" if self.choices is not None else "a string"
                raise ValueError(f"{key} must be {expected}, got {value!r}. {fix}.")
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # strict: "0.04" is a typo'd config
            raise ValueError(f"{key} must be a number, got {value!r} ({type(value).__name__}). {fix}.")
        number = self.kind(value)
        if not math.isfinite(float(number)):
            raise ValueError(f"{key} must be finite, got {value!r}. {fix}.")
        if (self.ge is not None and number < self.ge) or (self.gt is not None and number <= self.gt) or \
                (self.le is not None and number > self.le):
            raise ValueError(f"{key} must be {self.bounds_text()}, got {value!r}. {fix}.")
        return number


def param(name: str, default: Any, help: str, **kw: Any) -> Param:
    """A :class:`Param`; its ``kind`` is the default's type unless given."""
    kw.setdefault("kind", type(default) if not isinstance(default, int) or isinstance(default, bool) else float)
    return Param(name=name, default=default, help=help, **kw)


@dataclass(frozen=True)
class Metric:
    """How one metric combines over the step's micro-batches and ranks.

    ``mean``: weighted by ``weight`` per part: a caller's count (``valid_tokens``, ``rows``) or another metric of the
    same loss (a count such as ``fipo/num_kept_tokens``); a fraction of that count combines exactly. ``sum``: counts.
    ``max``: maxima.
    """

    combine: str = "mean"
    weight: str = "valid_tokens"

    def __post_init__(self) -> None:
        if self.combine not in COMBINE:
            raise ValueError(f"Metric.combine must be one of {', '.join(COMBINE)}, got {self.combine!r}")


MEAN = Metric("mean")
SUM = Metric("sum")
MAX = Metric("max")


def mean_over(weight: str) -> Metric:
    return Metric("mean", weight)


@dataclass(frozen=True)
class SharedParams:
    """Parameters several losses read under one name each: a group a loss opts into (``LossDeclaration.ppo_clip``),
    declared once here, so no loss and no adapter keeps its own lookup of them.

    ``keys``: per parameter, the config keys read, first found wins (verl's name first, then the runtime's); a
    parameter whose default is None with ``fallback`` set defaults to that other parameter's value.
    """

    name: str
    params: tuple[Param, ...]
    keys: Mapping[str, tuple[str, ...]]
    fallback: Mapping[str, str] = field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"the {self.name} group has no parameter {name!r}")

    def read(self, config: Any) -> dict[str, Any]:
        """{parameter: value} from ``config``, each checked by its :meth:`Param.check` under the key it was read
        from; an absent key is its default (or its ``fallback``'s value)."""
        out: dict[str, Any] = {}
        for p in self.params:
            value, path = _lookup(config, self.keys[p.name])
            if value is _MISSING:
                out[p.name] = out[self.fallback[p.name]] if p.name in self.fallback else p.default
            else:
                out[p.name] = p.check(value, path)
        return out


class PPOClip(tuple):
    """``(eps_low, eps_high, dual_clip)``: the PPO clip a loss reads (``dual_clip`` None: no dual clip)."""

    __slots__ = ()

    def __new__(cls, low: float, high: float, dual: Optional[float]) -> "PPOClip":
        return super().__new__(cls, (low, high, dual))

    low = property(lambda self: self[0])
    high = property(lambda self: self[1])
    dual = property(lambda self: self[2])


class _PPOClipGroup(SharedParams):
    def read(self, config: Any) -> PPOClip:  # type: ignore[override]
        values = super().read(config)
        return PPOClip(values["eps_clip"], values["eps_clip_higher"], values["c_clip"])


#: The PPO clip, shared by every loss that clips (``LossDeclaration.ppo_clip`` says which of its keys a loss reads):
#: the runtime's ``actor.eps_clip`` / ``eps_clip_higher`` / ``c_clip``, verl's ``clip_ratio_low`` / ``clip_ratio_high``
#: / ``clip_ratio_c`` (and its older ``clip_ratio``), TRL's and ms-swift's ``epsilon`` / ``epsilon_high``.
PPO_CLIP = _PPOClipGroup(
    name="ppo_clip",
    params=(
        Param("eps_clip", 0.2, "PPO clip range (lower side; also the upper side unless eps_clip_higher is set).",
              ge=0.0, names={"verl": "clip_ratio_low", "trl": "epsilon", "swift": "epsilon"}),
        Param("eps_clip_higher", None, "Upper PPO clip range (clip-higher); null = eps_clip.", ge=0.0,
              names={"verl": "clip_ratio_high", "trl": "epsilon_high", "swift": "epsilon_high"}),
        Param("c_clip", None, "Dual-clip constant (> 1) for negative advantages; null = off.", gt=1.0,
              names={"verl": "clip_ratio_c"}),
    ),
    keys={"eps_clip": ("clip_ratio_low", "clip_ratio", "eps_clip"),
          "eps_clip_higher": ("clip_ratio_high", "eps_clip_higher", "clip_ratio", "eps_clip"),
          "c_clip": ("clip_ratio_c", "c_clip")},
    fallback={"eps_clip_higher": "eps_clip"},
)


@dataclass(frozen=True)
class StepScope:
    """The parameter of a loss whose step planner decides over a scope of ranks (M2PO's ``m2_scope``), and what its
    values mean; a loss-level fact (``LossDeclaration.step_scope``), so the generic :class:`Param` knows nothing of it.

    - ``param``: the parameter's name (one of the loss's ``params``; its ``choices`` include ``group`` and ``local``).
    - ``group``: the value that plans one decision over all data-parallel ranks; ``local``: over each rank's share.
    - ``planned``: the value a loss call inside a planned step sees (the plan already covered the scope, so the call
      must not decide again over ranks); ``unplanned``: the value a loss call outside a planned step takes when its
      config leaves the parameter unset (a loss call cannot know the data-parallel group).
      Both are read with :meth:`LossDeclaration.read`'s ``planned``.
    """

    param: str
    group: Any
    local: Any
    planned: Any
    unplanned: Any


@dataclass(frozen=True)
class NamesakeFlag:
    """A framework flag that configures the framework's *own* loss of the same name as this loss (ms-swift's
    ``--fipo_decay_rate`` for its ``fipo``): with this loss it would be silently ignored, so the adapter refuses any
    value but the framework's ``default`` and names the loss's ``param`` to set instead
    (``LossDeclaration.namesake_flags``)."""

    flag: str
    default: Any
    param: str


# A cross-parameter rule: (the loss's parameter values, the PPO clip (eps_low, eps_high)) -> [(param, problem)].
Rule = Callable[[Mapping[str, Any], tuple[float, float]], list[tuple[str, str]]]


@dataclass(frozen=True)
class LossDeclaration:
    """Everything about a loss that is not its arithmetic. See the module docstring and docs/adding-a-loss.md.

    - ``params``: the loss's own parameters (the PPO clip is the framework's: ``uses_ppo_clip``).
    - ``step``: ``nothing`` (the step needs only its token count), ``batch_selector`` (one decision over the whole
      step: M2PO) or ``row_selector`` (one decision per row: FIPO); the function is registered beside the loss.
    - ``metrics``: every key the loss (and its selector) reports, with its :class:`Metric` rule.
    - ``diagnostics``: the metrics a run summary keeps for this loss (without the ``actor/`` prefix).
    - ``rules``: cross-parameter checks, run by every surface before the first update.
    - ``framework_names``: the loss's name in a framework's registry where it differs (verl: ``stalerl_vanilla``).
    - ``ppo_clip``: the keys of the shared PPO-clip group (:data:`PPO_CLIP`) the loss reads (``uses_ppo_clip=True``
      means ``eps_clip`` and ``eps_clip_higher``); read with :meth:`read_clip`, named per framework by the group.
    - ``algorithm``: the module that registers the loss's function, imported on first use (a plugin's entry point
      names its torch-free declaration module; the arithmetic loads when the loss is first looked up).
    - ``without_drift``: for a loss that acts only through the drift between the behaviour and the current policy
      (FIPO), what it reduces to when a run has none; the runtime then warns with this text.
    - ``namesake_flags``: per framework that ships a loss of the same name (see ``framework_names``), the
      :class:`NamesakeFlag` s of that framework loss, refused by the adapter at any value but their default.
    - ``step_scope``: a :class:`StepScope` when one of ``params`` picks the ranks the step's planner decides over
      (M2PO's ``m2_scope``); adapters plan the step themselves and hand the call :attr:`StepScope.planned`.
    - ``split_probe``: on first use of a plugin's loss (one whose step needs nothing but its token count), the
      registry checks once, on a small random batch, that its step's loss and gradient do not change when the step
      is split (``recipe.split_probe``), and logs a warning if they do; ``False`` opts out.
    """

    name: str
    summary: str
    params: tuple[Param, ...] = ()
    step: str = "nothing"
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    diagnostics: tuple[str, ...] = ()
    uses_ppo_clip: bool = False
    rules: tuple[Rule, ...] = ()
    framework_names: Mapping[str, str] = field(default_factory=dict)
    ppo_clip: tuple[str, ...] = ()
    algorithm: str = ""
    split_probe: bool = True
    without_drift: str = ""
    step_scope: Optional[StepScope] = None
    namesake_flags: Mapping[str, tuple[NamesakeFlag, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"LossDeclaration.name must be a non-empty string, got {self.name!r}")
        if self.uses_ppo_clip and not self.ppo_clip:
            object.__setattr__(self, "ppo_clip", ("eps_clip", "eps_clip_higher"))
        object.__setattr__(self, "uses_ppo_clip", bool(self.ppo_clip))
        unknown = [k for k in self.ppo_clip if k not in PPO_CLIP.names()]
        if unknown:
            raise ValueError(f"loss {self.name!r}: ppo_clip keys {unknown} are not in the PPO-clip group; expected "
                             f"some of {', '.join(PPO_CLIP.names())}")
        if self.step not in STEP_NEEDS:
            raise ValueError(f"loss {self.name!r}: step must be one of {', '.join(STEP_NEEDS)}, got {self.step!r}")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"loss {self.name!r}: parameter names repeat: {names}")
        if self.step_scope is not None:
            if self.step_scope.param not in names:
                raise ValueError(f"loss {self.name!r}: step_scope.param {self.step_scope.param!r} is not one of its "
                                 f"parameters ({', '.join(names) or 'none'})")
            if self.step == "nothing":
                raise ValueError(f"loss {self.name!r}: step_scope needs a step planner; set step to batch_selector or "
                                 "row_selector, or drop step_scope")
        for framework, flags in self.namesake_flags.items():
            for flag in flags:
                if flag.param not in names:
                    raise ValueError(f"loss {self.name!r}: namesake flag {framework} --{flag.flag} names "
                                     f"{flag.param!r}, which is not one of its parameters "
                                     f"({', '.join(names) or 'none'})")
        for key in self.diagnostics:
            if key not in self.metrics:
                raise ValueError(f"loss {self.name!r}: diagnostic {key!r} is not one of its declared metrics")
        for key, rule in self.metrics.items():
            if rule.combine == "mean" and rule.weight not in CALLER_WEIGHTS and rule.weight not in self.metrics:
                raise ValueError(f"loss {self.name!r}: metric {key!r} is weighted by {rule.weight!r}, which is "
                                 f"neither a caller's count ({', '.join(CALLER_WEIGHTS)}) nor one of its metrics")
        object.__setattr__(self, "_params_cls", make_dataclass(
            _class_name(self.name), [(p.name, p.kind, field(default=p.default)) for p in self.params], frozen=True))

    # ------------------------------------------------------------------ parameters
    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"loss {self.name!r} has no parameter {name!r}")

    def name_in(self, framework: str) -> str:
        return self.framework_names.get(framework, self.name)

    def scope_param(self) -> Optional[Param]:
        """The parameter that picks the step planner's scope (:attr:`step_scope`), or None."""
        return None if self.step_scope is None else self.param(self.step_scope.param)

    def is_step_scope(self, p: Param) -> bool:
        """Whether ``p`` is this loss's step-scope parameter (an adapter that plans the step itself handles it)."""
        return self.step_scope is not None and p.name == self.step_scope.param

    def clip_params(self) -> tuple[Param, ...]:
        """The PPO-clip group's parameters this loss reads (empty when it uses no PPO clip)."""
        return tuple(p for p in PPO_CLIP.params if p.name in self.ppo_clip)

    def read_clip(self, config: Any) -> "PPOClip":
        """The PPO clip this loss reads from ``config`` (:meth:`SharedParams.read` of :data:`PPO_CLIP`)."""
        return PPO_CLIP.read(config)

    def defaults(self, framework: str = "stalerl") -> dict[str, Any]:
        return {p.name: p.default_in(framework) for p in self.params}

    def read(self, config: Any, *, clip: Optional[tuple[float, float]] = None, where: str = "",
             framework: str = "stalerl", planned: Optional[bool] = None) -> Any:
        """The typed parameter object from ``config`` (dict, dataclass, DictConfig, object or None): each parameter
        from ``policy_loss.<name>`` (verl), else ``<name>``, else its default; checked, and the rules run when the
        PPO ``clip`` (eps_low, eps_high) is given. ``where`` prefixes the key in messages (``actor.``);
        ``framework`` picks the defaults.

        ``planned`` is for a loss call reading its own config (:attr:`step_scope`): True inside a planned step (the
        step-scope parameter is :attr:`StepScope.planned` whatever the config says: the plan covered the scope),
        False outside one (unset, it is :attr:`StepScope.unplanned`); None (a config surface) reads it like any
        other parameter."""
        scope = self.step_scope if planned is not None else None
        values = {}
        for p in self.params:
            if scope is not None and p.name == scope.param and planned:
                values[p.name] = scope.planned
                continue
            value, path = _lookup(config, (f"policy_loss.{p.name}", p.name))
            if value is not _MISSING:
                values[p.name] = p.check(value, f"{where}{path}")
            elif scope is not None and p.name == scope.param:
                values[p.name] = scope.unplanned
            else:
                values[p.name] = p.default_in(framework)
        if clip is not None:
            self.raise_problems(values, clip, where=where)
        return self._params_cls(**values)  # type: ignore[attr-defined]

    def problems(self, values: Mapping[str, Any], clip: tuple[float, float] = (0.2, 0.2)) -> list[tuple[str, str]]:
        """(parameter, problem) pairs from the cross-parameter rules; each problem names the fix."""
        return [problem for rule in self.rules for problem in rule(values, clip)]

    def raise_problems(self, values: Mapping[str, Any], clip: tuple[float, float], *, where: str = "") -> None:
        problems = self.problems(values, clip)
        if problems:
            raise ValueError("; ".join(f"{where}{key} {msg}" for key, msg in problems))


def _class_name(loss: str) -> str:
    return "".join(part.capitalize() for part in loss.replace("-", "_").split("_")) + "Params"


def _get(config: Any, key: str) -> Any:
    if config is None:
        return _MISSING
    if isinstance(config, Mapping):
        value = config.get(key, _MISSING)
    else:
        try:
            value = getattr(config, key)
        except (AttributeError, KeyError):
            try:
                getter = getattr(config, "get", None)
            except (AttributeError, KeyError):  # a __getattr__ that raises KeyError for "get" too
                getter = None
            try:
                value = getter(key, _MISSING) if callable(getter) else _MISSING
            except Exception:  # noqa: BLE001 - strict configs may raise on unknown keys
                value = _MISSING
    return _MISSING if value is None else value


def _lookup(config: Any, paths: Sequence[str]) -> tuple[Any, str]:
    for path in paths:
        node = config
        for part in path.split("."):
            node = _get(node, part)
            if node is _MISSING:
                break
        if node is not _MISSING:
            return node, path
    return _MISSING, paths[-1]


def reduce_metrics(parts: Sequence[tuple[Mapping[str, float], Mapping[str, float]]],
                   rules: Mapping[str, Metric]) -> dict[str, float]:
    """One value per key from the metrics of a step's parts (micro-batches, ranks): ``parts = [(counts, metrics)]``
    with ``counts`` the caller's ``valid_tokens`` and ``rows`` of that part.

    A declared key combines by its rule. An undeclared key (a loss registered without declaring it) follows the
    naming convention: ``*_max`` the max, ``num_*`` the sum, else the mean weighted by valid tokens. A mean whose
    weights are all zero is the plain mean.
    """
    keys = sorted(set().union(*(m for _, m in parts))) if parts else []
    out: dict[str, float] = {}
    for key in keys:
        rule = rule_for(key, rules)
        vals = [(counts, m) for counts, m in parts if key in m]
        if rule.combine == "max":
            out[key] = max(m[key] for _, m in vals)
        elif rule.combine == "sum":
            out[key] = sum(m[key] for _, m in vals)
        else:
            weights = [float(counts[rule.weight]) if rule.weight in counts else float(m.get(rule.weight, 0.0))
                       for counts, m in vals]
            total = sum(weights)
            out[key] = (sum(w * m[key] for w, (_, m) in zip(weights, vals)) / total if total > 0
                        else sum(m[key] for _, m in vals) / len(vals))
    return out


def rule_for(key: str, rules: Mapping[str, Metric]) -> Metric:
    """The rule of metric ``key``: its declared one, else the naming convention (``*_max`` max, ``num_*`` sum,
    else the valid-token-weighted mean)."""
    return rules.get(key) or _conventional_rule(key)


def _conventional_rule(key: str) -> Metric:
    leaf = key.rsplit("/", 1)[-1]
    if leaf.endswith("_max"):
        return MAX
    if leaf.startswith("num_"):
        return SUM
    return MEAN


def lazy_attributes(package: str, module: str = "algorithm") -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that serves attributes from ``<package>.<module>`` on first use: the
    loss packages stay torch-free on import (their declaration), and the arithmetic loads, and registers, on
    demand."""

    def __getattr__(name: str) -> Any:
        target = importlib.import_module(f"{package}.{module}")
        try:
            return getattr(target, name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__


__all__ = ["CALLER_WEIGHTS", "COMBINE", "LossDeclaration", "MAX", "MEAN", "Metric", "NamesakeFlag", "PPOClip",
           "PPO_CLIP", "Param", "STEP_NEEDS", "SUM", "SharedParams", "StepScope", "TRUST_REGION_QUADRANTS",
           "lazy_attributes", "mean_over", "param", "reduce_metrics", "rule_for"]
