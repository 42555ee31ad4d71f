"""A rollout worker: its own copy of the policy, weights installed by version, tasks generated in batches.

Weight updates never interrupt a generation: a ``load_weights`` command is served between two ``generate`` calls,
so every token of a sample carries the version its generation started with (no partial rollouts, so the sample's
head version is its only version). The controller queues the weights before any task admitted afterwards, so a
task is always generated with weights at least as new as its admission version.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import numpy as np
import torch

from stalerl.core.model import PromptFormatter, load_policy_from_config
from stalerl.core.reward import gsm8k_reward
from stalerl.rollout.batch import RolloutBatch
from stalerl.rollout.engine import HFRolloutEngine, evaluate_engine, generation_seed

# Test hook: STALERL_TEST_SLOW_EVAL_S=<seconds> makes every evaluation take at least that long, so a test can show
# that training steps go on while an evaluation runs.
SLOW_EVAL_ENV = "STALERL_TEST_SLOW_EVAL_S"


def to_wire(state: dict[str, Any]) -> dict[str, Any]:
    """Tensors as numpy arrays, so a batch crosses a process boundary by value (no shared-memory handles to leak)."""
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def from_wire(state: dict[str, Any]) -> RolloutBatch:
    return RolloutBatch.from_state({k: (torch.from_numpy(v if v.flags.writeable else v.copy())
                                    if isinstance(v, np.ndarray) else v)
                                    for k, v in state.items()})


class RolloutWorker:
    def __init__(self, cfg: Any, index: int = 0):
        torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.index = index
        self.is_vllm = cfg.rollout.backend.split(":", 1)[0] == "vllm"
        if self.is_vllm and cfg.actor.behavior_logp != "recompute":
            # vLLM holds the weights it generates with; this process only needs the architecture, the tokenizer and
            # the start-up checkpoint it writes (in the engine's dtype), so the HF model stays on the host instead
            # of a second fp32 copy on the worker's GPU.
            import dataclasses

            model, tokenizer = load_policy_from_config(
                dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, device="cpu")))
        else:
            model, tokenizer = load_policy_from_config(cfg)
        self.model = model
        if self.is_vllm:
            from stalerl.config import run_dir
            from stalerl.rollout.vllm_engine import build_vllm_engine

            # Started from this process's initial weights (the architecture); the controller's weights arrive
            # through load_weights before any task, so nothing is generated with these.
            fmt = PromptFormatter.from_config(tokenizer, cfg).format
            from stalerl.training.prompt_lengths import longest_prompt_tokens

            self.engine = build_vllm_engine(cfg, model, tokenizer, fmt, gsm8k_reward,
                                            work_dir=run_dir(cfg) / "vllm" / f"rollout-{index}", track_source=False,
                                            longest_prompt=longest_prompt_tokens(cfg, tokenizer, fmt))
        else:
            fmt = PromptFormatter.from_config(tokenizer, cfg).format
            self.engine = HFRolloutEngine(model, tokenizer, fmt, gsm8k_reward, version=-1, compute_dtype=cfg.actor.dtype)
        # behavior_logp=recompute: a training-engine forward at the generating weights, done here where those
        # weights live (the trainer has moved on by the time it consumes the batch).
        self.recompute = None
        if cfg.actor.behavior_logp == "recompute":
            from stalerl.training.actor import Actor

            self.recompute = Actor(model, cfg.actor, temperature=cfg.gconfig.temperature, total_updates=1)
        print(f"rollout worker {index} ready (pid {os.getpid()})", flush=True)

    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
        start = time.perf_counter()
        self._install(state_dict, version)
        return {"version": version, "seconds": time.perf_counter() - start}

    def load_weights_from_file(self, version: int, path: str) -> dict[str, float]:
        start = time.perf_counter()
        self._install(torch.load(path, map_location="cpu", weights_only=True), version)
        return {"version": version, "seconds": time.perf_counter() - start}

    def init_weight_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """vLLM with weight sync nccl: join the controller's weight-transfer group (it joins as rank 0 meanwhile)."""
        self.engine.init_weight_transfer(init_info)
        return {"weight_transfer": "nccl"}

    def receive_weights(self, version: int, update_info: dict[str, Any],
                        host: Optional[tuple[str, Any]] = None) -> dict[str, float]:
        """vLLM with weight sync nccl: receive the version the controller broadcasts (queued like load_weights,
        so it is served between two generations and before the tasks admitted after it). ``host``: the same
        version as a state dict (load_weights' or load_weights_from_file's payload) for this process's HF model,
        sent only when it recomputes behaviour log-probs."""
        start = time.perf_counter()
        if host is not None:
            method, payload = host
            state = payload if method == "load_weights" else torch.load(payload, map_location="cpu", weights_only=True)
            self.model.load_state_dict(state)
        self.engine.receive_weights(update_info, version)
        return {"version": version, "seconds": time.perf_counter() - start}

    def _install(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.is_vllm and self.recompute is not None:
            self.model.load_state_dict(state_dict)  # the recompute forward needs the generating weights too
        self.engine.load_weights(state_dict, version)

    def evaluate(self, version: int, examples: list[tuple[str, str]], settings: dict[str, Any],
                 batch_size: int) -> dict[str, Any]:
        """The evaluation the synchronous trainer runs (stalerl.rollout.engine.evaluate_engine), here on this
        worker's engine at weights ``version`` (the controller queued them just before this call)."""
        if self.engine.version != version:
            raise RuntimeError(f"evaluate(version={version}) but this worker holds version {self.engine.version}; "
                               "the controller queues the weights before the evaluation")
        from types import SimpleNamespace

        start = time.perf_counter()
        if not settings["greedy"]:  # sampled evaluation: seeded by its version, apart from every training task's
            torch.manual_seed(generation_seed(self.cfg.seed, -1 - version))
        out = evaluate_engine(self.engine, examples, SimpleNamespace(**settings), batch_size)
        delay = float(os.environ.get(SLOW_EVAL_ENV, "0") or 0)
        if delay > 0:
            time.sleep(max(0.0, delay - (time.perf_counter() - start)))
        out.update(version=version, seconds=time.perf_counter() - start)
        return {"eval": out, "version": version}

    def generate(self, tasks: list[tuple[int, str, str]]) -> dict[str, Any]:
        """One batched generate call over ``tasks`` = [(task_id, question, answer)]; returns each task's batch."""
        if self.engine.version < 0:
            raise RuntimeError("generate before any weights were loaded")
        g = self.cfg.gconfig
        torch.manual_seed(generation_seed(self.cfg.seed, tasks[0][0]))
        seeds = {}
        if self.is_vllm:  # rollout.vllm.seeded_requests: per task, so it samples the same tokens in any batch
            from stalerl.rollout.vllm_engine import generate_kwargs

            seeds = generate_kwargs(self.cfg, [t for t, _, _ in tasks], g.n_samples)
        batch = self.engine.generate([q for _, q, _ in tasks], [a for _, _, a in tasks], n_samples=g.n_samples,
                                     max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                                     top_k=g.top_k, **seeds)
        if self.recompute is not None:
            batch.set_trainer_logp(self.recompute.compute_logp(batch))  # the engine's stay in engine_logp
        out = []
        for i, (task_id, _, _) in enumerate(tasks):
            rows = (batch.group_ids == i).nonzero().squeeze(1).tolist()
            out.append((task_id, to_wire(batch.select(rows).state())))
        return {"results": out, "version": self.engine.version, "seconds": self.engine.last_generate_seconds,
                "tokens": batch.num_response_tokens, "worker": self.index}
