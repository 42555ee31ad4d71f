"""The last completed step's checkpointable state, kept so that a stop which cuts the next step still saves it.

A SIGTERM/SIGINT asks the loop to stop at the end of the step in progress (:mod:`stalerl.core.interrupt`). When that
step cannot end within the grace (a real-model step takes minutes), the loop abandons it and writes the checkpoint of
the step before it from here, so a resume repeats at most the abandoned step instead of every step since the last
periodic checkpoint.

What is kept, and when (the cost is paid only while the last completed step is not on disk already):

- at each step boundary, everything but the actor (RNG states, data position, the source's queue and counters, the
  metrics rows): small, copied at once;
- the actor (weights, optimizer, learning-rate schedule) only where it is about to change: :meth:`LastStep.freeze`
  copies it to host memory just before the update. A stop during generation (most of a step) saves the actor as it
  still is, untouched; a stop during the update saves the copy. The copy reuses its buffers from step to step
  (``copy_`` into the previous step's tensors), so host memory holds one copy at most, never one per step: for a 135M
  model with AdamW that is ~1.6 GB of host memory (weights and both moments in fp32), no GPU memory.

A sharded actor (``fsdp:dY``, Y > 1) gathers its state with a collective every rank must join, which a cut step cannot
promise: such runs keep no snapshot (the stop says so, and the last periodic checkpoint is intact).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch

LIVE = "<the actor's live state>"  # the actor key of a kept state until freeze() copies it


def host_copy(obj: Any, into: Any = None) -> Any:
    """A copy of ``obj`` (nested dicts/lists/tuples of tensors and plain values) with every tensor in host memory.
    ``into``: an earlier copy of the same structure; tensors of the same shape and dtype are overwritten in place
    (``copy_``) instead of allocated again."""
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if (isinstance(into, torch.Tensor) and into.shape == src.shape and into.dtype == src.dtype
                and into.device.type == "cpu"):
            return into.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):  # a plain dict or a state_dict's OrderedDict (its _metadata kept)
        old = into if isinstance(into, dict) else {}
        out = type(obj)()
        for k, v in obj.items():
            out[k] = host_copy(v, old.get(k))
        if hasattr(obj, "_metadata"):
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, (list, tuple)):
        old = into if isinstance(into, type(obj)) and len(into) == len(obj) else [None] * len(obj)
        items = [host_copy(v, o) for v, o in zip(obj, old)]
        return items if isinstance(obj, list) else type(obj)(items)
    return copy.deepcopy(obj)


def host_copy_reference(obj: Any) -> Any:
    """The literal version of :func:`host_copy` (no buffer reuse): ``copy.deepcopy`` with tensors moved to the CPU."""
    return copy.deepcopy(_to_cpu(obj))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        out = type(obj)((k, _to_cpu(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class LastStep:
    """The state of the last completed step that is not on disk yet (or nothing)."""

    def __init__(self, copy_actor: bool = True) -> None:
        """``copy_actor`` False (``recover.last_step_copy=false``): no host copy of the actor; once the update
        starts the kept step is dropped (the live actor no longer is that step's)."""
        self.copy_actor = copy_actor
        self.dropped_for_update = False  # the last kept step was dropped because the update started without a copy
        self.step: Optional[int] = None
        self._state: Optional[dict[str, Any]] = None
        self._actor: Any = None  # the host copy; its buffers outlive clear() and are reused by the next freeze()
        self._frozen = False

    @property
    def held(self) -> bool:
        return self._state is not None

    def keep(self, step: int, state: dict[str, Any]) -> None:
        """``state``: the step's checkpoint state with ``state["actor"] is LIVE`` (the actor unchanged since)."""
        if state.get("actor") is not LIVE:
            raise ValueError("LastStep.keep: the actor's state is copied by freeze(), just before it changes")
        self.step, self._state, self._frozen = int(step), state, False
        self.dropped_for_update = False

    def clear(self) -> None:
        """The last completed step is on disk (or cannot be kept): nothing to hold."""
        self.step, self._state, self._frozen = None, None, False
        self.dropped_for_update = False

    def freeze(self, actor_state: Callable[[], dict[str, Any]]) -> None:
        """The actor is about to change (the update starts): copy its state to host memory, once per kept step."""
        if self._state is not None and not self._frozen:
            if not self.copy_actor:
                self.clear()
                self.dropped_for_update = True
                return
            self._actor = host_copy(actor_state(), self._actor)
            self._frozen = True

    def state(self, actor_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The kept step's checkpoint state: the frozen copy of the actor, or the actor's live state when it has not
        changed since the step ended."""
        if self._state is None:
            raise RuntimeError("no completed step is held")
        return {**self._state, "actor": self._actor if self._frozen else actor_state()}
