"""The asynchronous rollout source: X rollout workers generate while Y data-parallel train ranks train ("dX+dY").

:class:`AdmissionSource` is the training loop's (:class:`stalerl.training.trainer.Trainer`) source when the launcher
picks asynchronous rollouts. It owns the worker runtime: the hosting, the rollout workers, the Y - 1 extra train
ranks (they share its hosting, results queue and failure watch; the loop's update reaches them through
:meth:`AdmissionSource.update`), the dispatcher thread, weight publishing and evaluations on rollout workers.

Threads of the controller process (which is also train rank 0):
- the trainer thread (the loop): waits for a batch the staleness manager allows, trains on it with all ranks,
  publishes the new weights, advances the version, logs, evaluates, checkpoints;
- the dispatcher thread: admits prompt groups while the manager has capacity, hands them to the least loaded
  rollout worker, collects results, and watches every worker process.

Strictness: see :class:`stalerl.training.staleness.StalenessManager` (a consumed sample is never more than
``rollout.max_head_offpolicyness`` versions behind; ``consume`` asserts it). Weights are queued to every rollout
worker before any task admitted at the new version, and are installed between generations (never half-written).

Failure: a worker that raises or dies stops the run with its exit code and the tail of its log; if the trainer
thread is stuck in a collective with a dead rank, the watchdog ends the process after a grace period. Checkpoints
are atomic, so the last one stays valid.
"""

from __future__ import annotations

import os
import queue
import traceback
import socket
import threading
import time
from collections import deque
from typing import Any, Optional

import torch

from stalerl.training.actor import DataParallel
from stalerl.config import ROLLOUT_ENGINES, TRAIN_ENGINES, parse_backend
from stalerl.core import interrupt
from stalerl.core.io import atomic_torch_save
from stalerl.rollout.batch import RolloutBatch, concat_batches
from stalerl.training.mismatch import fresh_rows
from stalerl.training.sources import EvalPlan, MismatchProbe, RolloutSource, StepTimes, copied_except_actor
from stalerl.training.staleness import StalenessManager, staleness_stats
from stalerl.training.workers.hosting import make_hosting, worker_resources
from stalerl.training.workers.process import WorkerFailure, WorkerProcess, failure_exit_code
from stalerl.training.workers.rollout_worker import from_wire, to_wire
from stalerl.training.workers.train_worker import broadcast_parameters, init_group, master_store

FAILURE_GRACE_S = 10.0
# Test hook: with STALERL_TEST_SLOW_TRAINER=1 the trainer takes a batch only once the rollouts have filled the whole
# staleness window (nothing running, nothing more admissible), as a trainer far slower than its rollouts would. The
# staleness of every step is then fixed by the bound alone, not by how the OS schedules the processes.
SLOW_TRAINER_ENV = "STALERL_TEST_SLOW_TRAINER"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EvalMergingLogger:
    """The asynchronous source's metrics logger: a step's row is held back while the evaluation of that step runs
    on a rollout worker (training goes on meanwhile), then written with the evaluation merged in; rows behind it
    wait too, so metrics.jsonl keeps one row per step in step order, exactly as the synchronous loop writes it.
    Held rows are saved with a checkpoint (AdmissionSource.state_dict), so a resume loses none of them."""

    def __init__(self, inner, held=None):
        self.inner = inner
        self.held: list[tuple[int, dict[str, Any]]] = list(held or [])

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def log(self, step: int, metrics) -> None:
        self.held.append((int(step), dict(metrics)))

    def merge(self, step: int, metrics) -> None:
        for s, row in self.held:
            if s == step:
                row.update(metrics)
                return
        self.inner.log(step, metrics)  # its row was written already (cannot happen while it is held; never lost)

    def write_ready(self, pending) -> None:
        """Write held rows from the front while their step has no pending evaluation."""
        while self.held and self.held[0][0] not in pending:
            step, row = self.held.pop(0)
            self.inner.log(step, row)

    def close(self) -> None:
        self.write_ready(set())  # e.g. a diverged run: what is held is written, without the missing evaluation
        self.inner.close()


class AdmissionSource(RolloutSource):
    """Rollouts from worker processes, admitted under rollout.max_head_offpolicyness / max_concurrent_rollouts /
    queue_size (StalenessManager). Reads ``rollout`` and ``actor`` (backend, dtype, ppo_n_minibatches); ``worker_cfg``
    is the whole config, handed on: the worker processes build their model and engine from it, worker_resources
    sizes them by it (torch_threads, actor.device) and host_copy_needed reads its actor.behavior_logp."""

    in_process = False  # rollouts and evaluations come from the workers' engines (the controller's: warm start only)

    def __init__(self, rollout: Any, *, worker_cfg: Any, actor_cfg: Any, temperature: float, model: Any,
                 pad_token_id: int, actor: Any, dataset: Any, total_steps: int, run_dir: Any, probe: MismatchProbe,
                 eval_plan: EvalPlan, eval_gconfig: Any, eval_batch_size: int, log=print):
        self.rollout, self.worker_cfg, self.actor_cfg, self.temperature = rollout, worker_cfg, actor_cfg, temperature
        self.model, self.pad_token_id, self.actor, self.dataset = model, pad_token_id, actor, dataset
        self.total_steps, self.run_dir, self.probe, self.log = total_steps, run_dir, probe, log
        self.eval_plan, self.eval_gconfig, self.eval_batch_size = eval_plan, eval_gconfig, eval_batch_size
        self.version = 0
        self.n_rollout = parse_backend(rollout.backend, engines=ROLLOUT_ENGINES).dp
        train_backend = parse_backend(actor_cfg.backend, engines=TRAIN_ENGINES)
        self.n_train = train_backend.dp
        # fsdp:dY, Y > 1: the train ranks shard the model (stalerl.training.fsdp); rank 0 keeps self.model unsharded as the
        # copy it evaluates, publishes and saves. fsdp:d1 has nothing to shard over and runs the plain engine.
        self.fsdp = train_backend.engine == "fsdp" and self.n_train > 1
        b = rollout.consumer_batch_size
        self.manager = StalenessManager(b, rollout.max_head_offpolicyness,
                                        rollout.max_concurrent_rollouts or b, queue_size=rollout.queue_size)
        self.cond = threading.Condition()
        self.prompts: deque = deque()  # drawn from the dataset, not yet admitted
        # cluster.share_gpu: every process on this process's device, each capped at its fraction (refused here, one
        # line, when the split cannot fit: before the hosting and any worker exist)
        self.share_plan = self._share_gpu_plan() if worker_cfg.cluster.share_gpu else None
        self.hosting = make_hosting(worker_cfg.scheduler, run_dir / "logs")
        # vLLM rollout workers' weight-sync path (the one their engines choose at start), None for HF workers
        from stalerl.rollout.vllm_engine import host_copy_needed, rollout_worker_weight_sync

        self.worker_sync: Optional[tuple[str, str]] = None
        if rollout.backend.split(":", 1)[0] == "vllm":
            self.worker_sync = rollout_worker_weight_sync()
        self.host_copy = host_copy_needed(self.worker_sync and self.worker_sync[0], worker_cfg)
        if self.share_plan is not None and self.share_plan.sync[0] == "cuda_ipc":
            self.host_copy = False  # a device copy per version, sent as an IPC handle (publish_weights)
        if (self.host_copy and rollout.weight_sync == "shared_memory"
                and hasattr(self.hosting, "check_shared_memory")):  # nccl alone needs no /dev/shm
            self.hosting.check_shared_memory(self.model.state_dict())  # before the warm start and the workers
        self.results = self.hosting.results
        self.rollout_workers: list[WorkerProcess] = []
        self.train_workers: list[WorkerProcess] = []
        self.outstanding: dict[str, int] = {}  # tasks queued per rollout worker
        self.train_replies: dict[str, Any] = {}
        self.ready: set[str] = set()
        self.failure: Optional[WorkerFailure] = None
        self.stop_event = threading.Event()
        self.dispatcher: Optional[threading.Thread] = None
        self.counters = {"gen_tokens": 0, "gen_seconds": 0.0, "sync_seconds": 0.0, "admission_wait_s": 0.0,
                         "gen_reward_sum": 0.0, "gen_reward_n": 0}
        self.tasks_to_resubmit: list = []
        self.weights_published = False  # nothing is admitted before the version-0 weights exist
        self.latest_weights: Any = None  # (version, worker method, shared state or file path)
        self.sent_version: dict[str, int] = {}
        self.loaded_version: dict[str, int] = {}
        self.weight_files: dict[int, Any] = {}
        self.slow_trainer = os.environ.get(SLOW_TRAINER_ENV, "") not in ("", "0")
        self.interrupted = False
        # Evaluation runs on a rollout worker (see evaluate): versions requested, in order; sent; finished results
        self.eval_requested: list[int] = []
        self.eval_sent: dict[int, tuple[str, float]] = {}  # version -> (worker role, time sent)
        self.eval_done: dict[int, dict[str, Any]] = {}
        self.eval_logger: Optional[EvalMergingLogger] = None
        self._restored_rows: Optional[list] = None
        self._probe_actor = None  # fsdp:dY: an unsharded actor on rank 0's copy for the mismatch probe
        self.nccl_senders: dict[str, Any] = {}  # rollout role -> NCCLWeightSender (vLLM workers, weight sync nccl)
        self._step: dict[str, Any] = {}  # what next_batch and after_update measured for this step's row

    def _share_gpu_plan(self):
        """cluster.share_gpu: the config rules again (a config built around the validated schema must not slip
        through), then the plan with its fit check, logged; this process (train rank 0) takes its cap now."""
        from stalerl.config.checks import _format_problems
        from stalerl.config.errors import ConfigError
        from stalerl.config.share_gpu import share_gpu_problems
        from stalerl.training import share_gpu

        problems = share_gpu_problems(self.worker_cfg)
        if problems:
            raise ConfigError(_format_problems(problems), [k for k, _ in problems])
        device_type = next(self.model.parameters()).device.type
        plan = share_gpu.make_plan(self.worker_cfg, share_gpu.ModelDims.of(self.model), self.n_train,
                                   self.n_rollout, device_type)
        for line in plan.lines():
            self.log(line)
        share_gpu.apply_memory_fraction(plan.train_fraction, device_type, self.log)
        return plan

    @classmethod
    def for_trainer(cls, trainer: Any) -> "AdmissionSource":
        cfg = trainer.cfg
        return cls(cfg.rollout, worker_cfg=cfg, actor_cfg=cfg.actor, temperature=cfg.gconfig.temperature,
                   model=trainer.model, pad_token_id=trainer.tokenizer.pad_token_id, actor=trainer.actor,
                   dataset=trainer.dataset, total_steps=trainer.total_steps, run_dir=trainer.run_dir,
                   probe=trainer.probe, eval_plan=trainer.eval_plan, eval_gconfig=cfg.eval_gconfig,
                   eval_batch_size=cfg.valid_dataset.batch_size, log=trainer.log)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        start = time.perf_counter()
        self.start_workers()
        self.startup_seconds = time.perf_counter() - start
        self.log(f"{self.n_rollout} rollout + {self.n_train} train workers up in {self.startup_seconds:.1f}s")

    def start_workers(self) -> None:
        total_updates = self.total_steps * self.actor_cfg.ppo_n_minibatches
        res = worker_resources(self.worker_cfg)
        gpus = self._local_gpu_plan(res)
        self.hosting.reserve("rollout", self.n_rollout, res)
        self.hosting.reserve("train", self.n_train - 1, res)  # rank 0 is this controller
        self._start_dispatcher()
        if self.n_train > 1:
            store, init_method = master_store(self.hosting.host_address(), self.n_train, timeout_s=300.0)
            for rank in range(1, self.n_train):
                self.train_workers.append(self.hosting.spawn(
                    f"train/{rank}", "stalerl.training.workers.train_worker", "TrainWorker",
                    dict(cfg=self.worker_cfg, rank=rank, world_size=self.n_train, init_method=init_method,
                         total_updates=total_updates), res, gpu=gpus.get(f"train/{rank}"),
                    env=self._share_env(f"train/{rank}")))
            group = init_group(0, self.n_train, init_method, timeout_s=300.0, store=store,
                               share_gpu=self.share_plan is not None)
            self.actor.dp = DataParallel(rank=0, size=self.n_train, group=group)
        for i in range(self.n_rollout):
            w = self.hosting.spawn(f"rollout/{i}", "stalerl.training.workers.rollout_worker", "RolloutWorker",
                                   dict(cfg=self.worker_cfg, index=i), res, gpu=gpus.get(f"rollout/{i}"),
                                   env=self._share_env(f"rollout/{i}"))
            self.outstanding[w.role] = 0  # first: the dispatcher (already running) reads it for every listed worker
            self.rollout_workers.append(w)
        self._wait(lambda: len(self.ready) == self.n_rollout + self.n_train - 1, "workers to start")
        self._connect_nccl_senders()

    def _connect_nccl_senders(self) -> None:
        """vLLM rollout workers on their own GPUs take the nccl path (rollout_worker_weight_sync, the same choice
        their engines made at start): each joins a group with this process as rank 0, which then broadcasts every
        version from its GPU (stalerl.rollout.vllm_nccl) instead of sharing a host copy."""
        if self.worker_sync is None:
            return
        path, why = self.worker_sync
        self.log(f"vLLM weight sync: {path} ({why})")
        if path != "nccl":
            return
        from stalerl.rollout.vllm_nccl import NCCLWeightSender, worker_init_info

        device = next(self.model.parameters()).device
        for w in self.rollout_workers:
            info = worker_init_info(self.hosting.host_address(), free_port(),
                                    self.rollout.vllm.tensor_parallel_size or 1)
            sender = NCCLWeightSender(info, device)
            w.call("init_weight_transfer", info)  # the worker joins while this process joins as rank 0
            sender.connect()
            self.nccl_senders[w.role] = sender

    def _share_env(self, role: str) -> Optional[dict[str, str]]:
        """cluster.share_gpu: the worker's memory cap, applied in the child before its model exists."""
        if self.share_plan is None:
            return None
        from stalerl.training.share_gpu import FRACTION_ENV

        return {FRACTION_ENV: f"{self.share_plan.roles()[role]!r}:{self.share_plan.device}"}

    def _local_gpu_plan(self, res) -> dict[str, int]:
        """Local scheduler on CUDA: rank 0 (this process) keeps GPU 0, train ranks 1..Y-1 and the X rollout workers
        get one device each. Not enough GPUs is an error before anything starts (no silent sharing), unless
        cluster.share_gpu asked for it: then no process gets a device of its own (each inherits this process's
        CUDA_VISIBLE_DEVICES and uses its first device, this process's own)."""
        if self.hosting.name != "local" or not res.gpus or self.share_plan is not None:
            return {}
        roles = [f"train/{r}" for r in range(1, self.n_train)] + [f"rollout/{i}" for i in range(self.n_rollout)]
        have = torch.cuda.device_count()
        if 1 + len(roles) > have:
            raise RuntimeError(f"actor.backend={self.actor_cfg.backend!r} + rollout.backend={self.rollout.backend!r} "
                               f"need {1 + len(roles)} GPUs on this machine (one per process), {have} visible")
        return {role: i + 1 for i, role in enumerate(roles)}

    def shutdown(self) -> None:
        self.stop_event.set()
        if self.dispatcher is not None:
            self.dispatcher.join(5)
        for sender in self.nccl_senders.values():
            sender.close(timeout=1.0)
        for w in self.rollout_workers + self.train_workers:
            w.stop(timeout=1.0 if self.interrupted else 10.0)  # interrupted: in-flight rollouts are redone on resume
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.hosting.close()
        for path in self.weight_files.values():  # transient sync files; the final model is saved separately
            path.unlink(missing_ok=True)

    def _start_dispatcher(self) -> None:
        self.dispatcher = threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True)
        self.dispatcher.start()

    def _wait(self, predicate, what: str) -> None:
        with self.cond:
            while not predicate():
                self._raise_if_failed()
                self.cond.wait(0.1)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            signum = interrupt.stop_requested()
            if signum is not None:  # a signal to the whole job (Slurm, a process group) also reached the workers
                raise interrupt.stop_now(signum, step=self.version, note="a worker stopped before the step ended",
                                         abandoned=True)  # the loop saves the last completed step
            raise self.failure

    # ------------------------------------------------------------------ dispatcher thread
    def _dispatch_loop(self) -> None:
        try:
            self._dispatch()
        except BaseException:  # noqa: BLE001 - a dead dispatcher must stop the run, never leave it waiting
            self._fail(WorkerFailure("dispatcher", None, traceback.format_exc()))

    def _dispatch(self) -> None:
        idle_since: Optional[float] = None
        while not self.stop_event.is_set():
            self._check_processes()
            admitted = self._admit()
            idle = any(self.outstanding[w.role] == 0 for w in self.rollout_workers) and self.ready
            if idle and not admitted and self.manager.capacity() == 0 and not self._data_exhausted():
                idle_since = idle_since or time.perf_counter()
            elif idle_since is not None:
                self.counters["admission_wait_s"] += time.perf_counter() - idle_since
                idle_since = None
            try:
                msg = self.results.get(timeout=0.01)
            except queue.Empty:
                continue
            self._handle(msg)

    def _check_processes(self) -> None:
        if self.failure is not None:
            return
        for w in self.rollout_workers + self.train_workers:
            failure = w.failure()
            if failure is not None:
                self._fail(failure)
                return

    def _fail(self, failure: WorkerFailure) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = failure
            self.cond.notify_all()

        def watchdog():
            # The trainer thread raises at its next wait; if it is blocked inside a collective with a dead rank it
            # never gets there, so end the process ourselves (checkpoints are atomic: the last one stays valid).
            time.sleep(FAILURE_GRACE_S)
            if not self.stop_event.is_set():
                print(f"\nstalerl: {failure}\nstalerl: the trainer did not stop within {FAILURE_GRACE_S:.0f}s; "
                      "exiting", flush=True)
                os._exit(failure_exit_code(failure))

        threading.Thread(target=watchdog, daemon=True).start()

    def _window_filled(self) -> bool:
        """Always true, except under the SLOW_TRAINER_ENV test hook: then true once no task runs and no more may be
        admitted at this version (or the run needs no more prompts)."""
        if not self.slow_trainer:
            return True
        return not self.manager.running and (self.manager.capacity() == 0 or self._data_exhausted())

    def _data_exhausted(self) -> bool:
        return self.manager.admitted_total >= self.total_steps * self.manager.batch_size

    def _next_prompt(self):
        if not self.prompts:
            self.prompts.extend(self.dataset.next_batch())
        return self.prompts.popleft()

    def _admit(self) -> int:
        if not self.weights_published or self.failure is not None:
            return 0
        with self.cond:
            tasks = list(self.tasks_to_resubmit)
            self.tasks_to_resubmit = []
            n = self.manager.capacity()
            if not self._data_exhausted():
                n = min(n, self.total_steps * self.manager.batch_size - self.manager.admitted_total)
                for _ in range(n):
                    e = self._next_prompt()
                    tasks.append(self.manager.admit(payload=(e.question, e.final)))
            if not tasks:
                return 0
            # Spread over the least loaded workers; each worker gets one batched generate call.
            shares: dict[str, list] = {}
            for t in tasks:
                w = min(self.rollout_workers, key=lambda w: (self.outstanding[w.role] + len(shares.get(w.role, [])),
                                                             w.role))
                shares.setdefault(w.role, []).append((t.task_id, *t.payload))
            for w in self.rollout_workers:
                if w.role in shares:
                    self._send_latest_weights(w)  # queued before the tasks: they never run on older weights
                    self.outstanding[w.role] += len(shares[w.role])
                    w.call("generate", shares[w.role])
            return len(tasks)

    def _handle(self, msg) -> None:
        role, kind, _, out = msg
        with self.cond:
            if kind == "ready":
                self.ready.add(role)
            elif kind == "error":
                worker = next((w for w in self.rollout_workers + self.train_workers if w.role == role), None)
                # the child sends "<ExceptionType>: <message>\n<traceback>": the type is kept for the controller
                head = str(out).split(":", 1)[0] if ":" in str(out).split("\n", 1)[0] else ""
                self._fail(WorkerFailure(role, None, out, worker.log_path if worker else None,
                                         exc_type=head if head.isidentifier() else None))
            elif role.startswith("rollout/"):
                if isinstance(out, dict) and "results" in out:
                    for task_id, state in out["results"]:
                        self.manager.finish(task_id, state, head_version=out["version"])
                    self.outstanding[role] -= len(out["results"])
                    self.counters["gen_tokens"] += out["tokens"]
                    self.counters["gen_seconds"] += out["seconds"]
                    for _, state in out["results"]:  # reward/generated: at generation end, not consumption
                        self.counters["gen_reward_sum"] += float(state["rewards"].sum())
                        self.counters["gen_reward_n"] += len(state["rewards"])
                elif isinstance(out, dict) and "weight_transfer" in out:  # joined the nccl group: nothing to do
                    pass
                elif isinstance(out, dict) and "eval" in out:  # an evaluation (see evaluate)
                    self.eval_done[out["eval"]["version"]] = out["eval"]
                else:  # a weight load
                    self.counters["sync_seconds"] += out["seconds"]
                    self.loaded_version[role] = out["version"]
                    self._delete_unneeded_weight_files()
            else:
                self.train_replies[role] = out
            self.cond.notify_all()

    # ------------------------------------------------------------------ weights
    def publish_weights(self, version: int) -> float:
        """Make the current weights (``version``) the ones every later task is generated with.

        Sending is lazy and coalesced: a worker gets the newest weights just before its next tasks (see _admit),
        so a busy worker never accumulates a backlog of weight sets, file handles or files. vLLM workers on nccl get
        a snapshot on this GPU, broadcast when sent (plus the host copy only when their HF model recomputes)."""
        start = time.perf_counter()
        host = self._host_copy(version) if self.host_copy else None
        if self.nccl_senders:
            from stalerl.rollout.vllm_engine import engine_save_dtype, resolve_dtype
            from stalerl.rollout.vllm_nccl import snapshot_parameters, update_info_for

            # in the engine's dtype (what its start-up checkpoint holds): a bf16 engine gets half the bytes
            engine_dtype = resolve_dtype(self.rollout.vllm.dtype, self.actor_cfg.dtype, cpu_build=False)
            params = snapshot_parameters(self.model, engine_save_dtype(engine_dtype))
            self.latest_weights = (version, "receive_weights", (update_info_for(params), params, host))
        elif self.share_plan is not None and self.share_plan.sync[0] == "cuda_ipc":
            from stalerl.training.share_gpu import device_snapshot

            self.latest_weights = (version, "load_weights", device_snapshot(self.model))
        else:
            self.latest_weights = (version, *host)
        self._delete_unneeded_weight_files()
        return time.perf_counter() - start

    def _host_copy(self, version: int) -> tuple[str, Any]:
        """The weights as a state dict a worker can load: (worker method, shared state or file path)."""
        if self.rollout.weight_sync == "shared_memory":
            return "load_weights", self.hosting.share(self.model.state_dict())
        path = self.run_dir / "weights" / f"v{version}.pt"
        atomic_torch_save({k: v.detach().cpu() for k, v in self.model.state_dict().items()}, path)
        self.weight_files[version] = path
        return "load_weights_from_file", str(path)

    def _send_latest_weights(self, worker) -> None:
        version, method, payload = self.latest_weights
        if self.sent_version.get(worker.role, -1) < version:
            if method == "receive_weights":  # nccl: the receive command first (ordered before any later task)
                update_info, params, host = payload
                worker.call(method, version, update_info, host)
                self.nccl_senders[worker.role].submit(version, params)
            else:
                worker.call(method, version, payload)
            self.sent_version[worker.role] = version

    def _delete_unneeded_weight_files(self) -> None:
        """Disk sync: keep only the newest file and those sent to a worker that has not loaded them yet (a version
        that was never sent never will be: sending is coalesced to the newest)."""
        if not self.weight_files:
            return
        needed = {self.latest_weights[0]}
        needed |= {v for role, v in self.sent_version.items() if self.loaded_version.get(role, -1) < v}
        for version in [v for v in self.weight_files if v not in needed]:
            self.weight_files.pop(version).unlink(missing_ok=True)

    # ------------------------------------------------------------------ checkpoint
    def checkpoint_state(self, loop_state) -> dict[str, Any]:
        actor_state = None
        if self.fsdp:  # a collective: gathered before taking the lock, with every train rank
            for w in self.train_workers:
                w.call("actor_state")
            actor_state = self.actor.state_dict()
            self._collect_train_replies("actor_state")
        # Evaluations of older versions cannot be re-run after a resume (their weights are gone): wait for them; one
        # of this very step can (the checkpoint holds its weights), so it is re-requested at resume instead.
        self._wait(lambda: all(v in self.eval_done or v == self.version for v in self.eval_requested),
                   "evaluations of earlier steps before the checkpoint")
        if self.eval_logger is not None:
            self.log_finished_evaluations(self.eval_logger, wait=False)
        with self.cond:
            state = loop_state(actor_state)
            state.update(self.state_dict())
        return state

    def snapshot_state(self, loop_state, actor_placeholder) -> dict[str, Any]:
        """The step boundary's state without waiting for evaluations (checkpoint_state waits for those of earlier
        steps): rows held for an evaluation of an earlier step that is still running are kept without it (a resume
        from this snapshot writes them as they are; its own step's evaluation is re-run). A sharded actor keeps no
        snapshot (stalerl.training.last_step), so no collective is needed here."""
        with self.cond:
            saved_with_held_rows = self.saved_with_held_rows  # describes the last checkpoint, not this snapshot
            state = loop_state(actor_placeholder)
            state.update(self.state_dict())
            self.saved_with_held_rows = saved_with_held_rows
            return copied_except_actor(state, actor_placeholder)

    def abandon_logger(self, logger) -> None:
        """Rows held back for a running evaluation stay unwritten: the snapshot saved holds them (with their step's
        evaluation re-run at resume), so they are not written now without it."""
        getattr(logger, "inner", logger).close()

    def state_dict(self) -> dict[str, Any]:
        """Under self.cond. "fifo" and "tasks_generated" are the synchronous source's keys, kept as they always were
        in these checkpoints (an empty FIFO, nothing generated in this process)."""
        state = {"fifo": {"staleness": int(self.rollout.fixed_staleness), "queue": []}, "tasks_generated": 0}
        state["metric_rows_held"] = list(self.eval_logger.held) if self.eval_logger is not None else []
        self.saved_with_held_rows = bool(state["metric_rows_held"])
        state["manager"] = self.manager.state_dict()
        state["prompts"] = list(self.prompts)
        state["dataset"] = self.dataset.state_dict()  # again under the lock: the dispatcher draws prompts
        return state

    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        self.version = version
        # Rows held back for an evaluation of the checkpoint's step: written once it is re-run (see wrap_logger)
        self._restored_rows = [(int(step), dict(row)) for step, row in state.get("metric_rows_held", [])]
        if any(step == version for step, _ in self._restored_rows):
            self.eval_requested = [version]
        self.prompts = deque(state["prompts"])
        self.tasks_to_resubmit = self.manager.load_state_dict(state["manager"])

    # ------------------------------------------------------------------ loop hooks
    def failure_cause(self, exc: BaseException) -> Optional[BaseException]:
        if isinstance(exc, (WorkerFailure, interrupt.RunInterrupted)):
            self.interrupted = isinstance(exc, interrupt.RunInterrupted)  # workers need no grace then
            return None
        # A dead train rank shows up in rank 0 as a collective error; report the worker's own failure instead.
        deadline = time.time() + 3.0
        while self.failure is None and time.time() < deadline:
            self._check_processes()
            time.sleep(0.1)
        return self.failure

    def on_training_start(self, version: int) -> None:
        """After warm start / restore: every rank and rollout worker gets rank 0's weights."""
        self.version = version
        if self.n_train > 1:
            for w in self.train_workers:
                w.call("sync_parameters")
            broadcast_parameters(self.model, self.actor.dp.group)
            self._collect_train_replies("sync_parameters")
            if self.fsdp:
                # Identical replicas now; shard them all (a restored optimizer state is broadcast from rank 0).
                follows = self.actor.has_pending_optimizer_state
                for w in self.train_workers:
                    w.call("shard", follows, self.actor.lr_scheduler.state_dict())
                self.actor.shard(self.actor_cfg.dtype, copy_model=True, optimizer_state_follows=follows)
                self._collect_train_replies("shard")
            elif version > 0:
                state = self.actor.state_dict()
                for w in self.train_workers:
                    w.call("load_actor_state", state)
                self._collect_train_replies("load_actor_state")
        with self.cond:
            self.publish_weights(version)
            self.weights_published = True
            self._send_evaluations()  # evaluator.at_start, requested before the first weights existed
            self.cond.notify_all()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, version: int) -> dict[str, float]:
        """Non-blocking: the evaluation of the current weights (``version``) is queued to a rollout worker
        right behind those weights and runs there (HF or vLLM engine, the same evaluate_engine and eval_gconfig as
        the synchronous loop's, so the same weights give the same answers); training goes on meanwhile. This step's
        row is held back (EvalMergingLogger) and written with eval/accuracy (or eval/accuracy_subset:
        EvalPlan.metrics) once the result arrives; the end of
        training waits for all of them. Returns {} (nothing to add to the row now)."""
        with self.cond:
            if version not in self.eval_requested:
                self.eval_requested.append(version)
            if self.weights_published:
                self._send_evaluations()
        return {}

    def _send_evaluations(self) -> None:
        """Under self.cond. Each requested version goes to the least loaded rollout worker, after that worker was
        sent the weights of that version (commands are served in order, so it evaluates exactly those)."""
        for version in self.eval_requested:
            if version in self.eval_sent:
                continue
            if self.latest_weights is None or self.latest_weights[0] != version:
                raise RuntimeError(f"evaluation of version {version} requested, but the published weights are "
                                   f"version {None if self.latest_weights is None else self.latest_weights[0]}")
            w = min(self.rollout_workers, key=lambda w: (self.outstanding[w.role], w.role))
            self._send_latest_weights(w)
            g = self.eval_gconfig
            settings = {k: getattr(g, k) for k in ("n_samples", "max_new_tokens", "temperature", "top_p", "top_k",
                                                   "greedy")}
            # all of them, or evaluator.n_prompts_during_training's subset between the first and the last step
            w.call("evaluate", version, [(e.question, e.final) for e in self.eval_plan.examples_for(version)],
                   settings, self.eval_batch_size)
            self.eval_sent[version] = (w.role, time.perf_counter())

    def wrap_logger(self, logger):
        held = self._restored_rows or []
        if held and logger.path.is_file():  # rows written after that checkpoint was taken are there already
            from stalerl.results.metrics_log import read_metrics

            written = {r["step"] for r in read_metrics(logger.path)}
            held = [(step, row) for step, row in held if step not in written]
        self._restored_rows = None
        with self.cond:
            self.eval_requested = [v for v in self.eval_requested if any(step == v for step, _ in held)]
        self.eval_logger = EvalMergingLogger(logger, held)
        return self.eval_logger

    def log_finished_evaluations(self, logger, *, wait: bool) -> None:
        """Merge finished evaluations into their step's held row, then write every held row whose evaluation is
        not pending (rows stay in step order, one per step, as in the synchronous loop)."""
        if wait and self.eval_requested:
            self._wait(lambda: all(v in self.eval_done for v in self.eval_requested), "evaluations to finish")
        with self.cond:
            done = {}
            for v in [v for v in self.eval_requested if v in self.eval_done]:
                self.eval_requested.remove(v)
                role, sent = self.eval_sent.pop(v)
                done[v] = (role, sent, self.eval_done.pop(v))
            pending = set(self.eval_requested)
        for version, (role, sent, res) in sorted(done.items()):
            logger.merge(version, {**self.eval_plan.metrics(res["accuracy"], version), "eval/seconds": res["seconds"],
                                   "eval/latency_s": time.perf_counter() - sent})
            which = "" if self.eval_plan.is_full(version) else f" on a subset of {len(self.eval_plan.subset)} prompts"
            self.log(f"eval (step {version}, on {role}, {res['seconds']:.1f}s while training went on to step "
                     f"{self.version}): accuracy {res['accuracy']:.4g}{which}")
        logger.write_ready(pending)

    def _collect_train_replies(self, what: str) -> list:
        roles = [w.role for w in self.train_workers]
        self._wait(lambda: all(r in self.train_replies for r in roles), what)
        with self.cond:
            return [self.train_replies.pop(r) for r in roles]

    # ------------------------------------------------------------------ one step
    def next_batch(self, version: int) -> RolloutBatch:
        """The batch of ``version``: the oldest finished tasks the manager lets this version consume, once it can."""
        assert version == self.version == self.manager.version, (version, self.version, self.manager.version)
        t0 = time.perf_counter()
        with self.cond:
            while True:
                self._raise_if_failed()
                if self.dispatcher is not None and not self.dispatcher.is_alive():
                    raise RuntimeError("the dispatcher thread stopped; see the traceback above")
                tasks = self.manager.ready_batch()
                if tasks is not None and self._window_filled():
                    self.manager.consume(tasks)
                    break
                self.cond.wait(0.05)
            queue_depth = len(self.manager.finished)
            running = len(self.manager.running)
            counters = dict(self.counters)
            for k in ("gen_tokens", "gen_seconds", "sync_seconds", "admission_wait_s", "gen_reward_sum",
                      "gen_reward_n"):
                self.counters[k] = 0 if k in ("gen_tokens", "gen_reward_n") else 0.0
        self._step = {"queue_depth": queue_depth, "running": running, "counters": counters,
                      "wait_s": time.perf_counter() - t0}
        batch = concat_batches([from_wire(t.result) for t in tasks], self.pad_token_id)
        stale = staleness_stats(batch, version)  # per sample; the manager already asserted the bound per task
        assert stale["staleness/max"] <= self.manager.max_head_offpolicyness, stale
        self._step["mismatch"] = self._probe_fresh(batch)  # before the update: these weights generated them
        return batch

    def after_update(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.manager.advance()
            assert self.manager.version == version, (self.manager.version, version)
            self._step["publish_s"] = self.publish_weights(version)
            self.cond.notify_all()

    def step_row(self, metrics, batch, stale, batch_metrics, times: StepTimes, version):
        step, counters = self._step, self._step["counters"]
        t_train = times.train_s
        metrics["timing/split/optimizer_s"] = times.optimizer_s  # rank 0's
        metrics.update(stale)
        metrics.update({
            "rollout/queue_depth": float(step["queue_depth"]), "rollout/running": float(step["running"]),
            "timing/wait_for_data_s": step["wait_s"], "timing/train_s": t_train,
            "timing/weight_publish_s": step["publish_s"],
            "timing/weight_load_s": counters["sync_seconds"], "timing/admission_wait_s": counters["admission_wait_s"],
            "timing/step_s": time.perf_counter() - times.start,
            "throughput/gen_tokens_per_s": counters["gen_tokens"] / counters["gen_seconds"]
            if counters["gen_seconds"] else 0.0,
            "throughput/train_tokens_per_s": float(batch.attention_mask().sum()) / t_train if t_train else 0.0,
            "version": float(version),
        })
        metrics.update(batch_metrics)
        metrics.update(step["mismatch"])
        if counters["gen_reward_n"]:  # samples finished generating since the last step
            metrics["reward/generated"] = counters["gen_reward_sum"] / counters["gen_reward_n"]
        return metrics

    def _probe_fresh(self, batch) -> dict[str, float]:
        """stalerl.training.mismatch on the consumed samples the current weights generated (all of step 0's): those
        are fresh, so their log-ratio is the engine mismatch alone. Before the update, on rank 0 only."""
        self.probe.seconds = 0.0
        if not self.probe.due(self.version):
            return {}
        rows = fresh_rows(batch.versions, batch.response_mask, self.version)
        if not rows:
            return {}
        self.probe.last_step = self.version
        actor = self.actor
        if self.fsdp:  # the sharded actor's forward is a collective; rank 0's unsharded copy holds the same weights
            if self._probe_actor is None:
                from stalerl.training.actor import Actor

                self._probe_actor = Actor(self.model, self.actor_cfg, temperature=self.temperature,
                                          total_updates=1)
            actor = self._probe_actor
        out = self.probe.probe(actor, batch.select(rows))
        out["timing/mismatch_probe_s"] = self.probe.seconds
        return out

    def can_skip_whole_step(self) -> bool:
        return self.n_train == 1  # with several train ranks every rank joins each optimizer step

    def update(self, actor, batch, advantages) -> dict[str, float]:
        """The loop's update of ``actor`` (rank 0's), with every other train rank taking its share."""
        if self.n_train == 1:
            return actor.update(batch, advantages)
        # Cut the batch into the global mini-batches first, then give every rank an even share of each, so the
        # optimizer steps are the same whatever the number of ranks.
        rank_rows: list[list[int]] = [[] for _ in range(self.n_train)]
        rank_sizes: list[list[int]] = [[] for _ in range(self.n_train)]
        for mini in torch.tensor_split(torch.arange(batch.num_rows), self.actor_cfg.ppo_n_minibatches):
            for rank, share in enumerate(torch.tensor_split(mini, self.n_train)):
                rank_rows[rank] += share.tolist()
                rank_sizes[rank].append(int(share.numel()))
        for rank, w in enumerate(self.train_workers, start=1):
            sub = batch.select(rank_rows[rank])
            w.call("update", to_wire(sub.state()), advantages[rank_rows[rank], :sub.response_ids.shape[1]].numpy(),
                   rank_sizes[rank])
        own = batch.select(rank_rows[0])
        metrics = actor.update(own, advantages[rank_rows[0], :own.response_ids.shape[1]],
                               minibatch_sizes=rank_sizes[0])
        if self.fsdp:  # every rank joins the gather; rank 0's unsharded copy gets the new weights to publish
            with torch.no_grad():
                self.model.load_state_dict(actor.full_model_state())
        self._collect_train_replies("update")
        return metrics
