"""The train worker's actor: per-token log-probs, micro-batching, the registered policy loss, one optimizer step
per mini-batch.

Exactness of splits. The loss aggregates with the mini-batch's global valid-token count (verl's
``global_batch_info``), so summing micro-batch gradients (and averaging across data-parallel ranks, each scaled by
``dp_size``) gives exactly the gradient of the whole mini-batch. A loss that selects tokens over the whole mini-batch
(M2PO) registers a batch selector: the actor runs it once per mini-batch (a no-grad forward pass over every
micro-batch first, when there is more than one micro-batch or rank) and hands each micro-batch its slice of the mask.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from recipe.declaration import reduce_metrics
from recipe.optimizer_batch import MicroBatch, plan_optimizer_batch
from recipe.registry import get_policy_loss_spec
from recipe.rollout_correction import CorrectionParams, apply_correction
from stalerl.core.chunked_logprob import chunked_logprob_check, default_chunk_elements, head_returns_token_logprobs
from stalerl.core.model import autocast_context, disable_dropout, parse_dtype
from stalerl.rollout.batch import RolloutBatch, pack_rows, position_ids_from_mask
from stalerl.rollout.engine import format_duration
from stalerl.training import fsdp

# An update (one step's optimizer steps) that has run this long prints a progress line, then one per this many
# seconds (issue 43 item 7; the HF engine's generation does the same, stalerl.rollout.engine.PROGRESS_EVERY_S).
UPDATE_PROGRESS_EVERY_S = 30.0


def _print_line(line: str) -> None:
    """The default progress log: stdout, flushed (a train worker's stdout is a pipe, block-buffered otherwise)."""
    print(line, flush=True)


class UpdateProgress:
    """Progress of one update over its micro-batches: after a micro-batch, once ``every_s`` seconds have passed
    since the start (then since the last line), one line through ``log``: micro-batches done / total, tokens
    forwarded (real tokens, prompt + response) and their rate, ETA from that rate. The granularity is a
    micro-batch (a line waits for the one running); the planner's no-grad passes (M2PO's selection over the
    mini-batch) call :meth:`check` after each of their micro-batches, so they print too, and count in the elapsed
    time, so in the rate and ETA. ``clock`` is injectable for tests."""

    def __init__(self, total_micro_batches: int, total_tokens: int, log: Callable[[str], None], every_s: float,
                 clock: Callable[[], float] = time.perf_counter):
        self.total_micro_batches, self.total_tokens = total_micro_batches, total_tokens
        self.log, self.every_s, self.clock = log, every_s, clock
        self.start = clock()
        self.next_line = self.start + every_s
        self.micro_batches = self.tokens = 0

    def done(self, tokens: int) -> None:
        """A training micro-batch of ``tokens`` real tokens finished: counted, then :meth:`check`."""
        self.micro_batches += 1
        self.tokens += int(tokens)
        self.check()

    def check(self) -> None:
        """The progress line, if the interval has passed since the start or the last line."""
        now = self.clock()
        if now < self.next_line:
            return
        elapsed = max(now - self.start, 1e-9)
        rate = self.tokens / elapsed
        eta = (self.total_tokens - self.tokens) / rate if rate > 0 else math.inf
        self.log(f"update: {self.micro_batches}/{self.total_micro_batches} micro-batches done, {self.tokens}/"
                 f"{self.total_tokens} tokens at {rate:.1f} tokens/s, {elapsed:.0f} s so far, ETA ~"
                 f"{format_duration(eta) if math.isfinite(eta) else 'unknown'}")
        self.next_line = now + self.every_s


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                   chunk_elements: Optional[int] = None) -> torch.Tensor:
    """log softmax(logits / temperature)[ids] in float32, shape ``ids.shape``, without materialising the full
    (N, T, V) log_softmax: ``logit[id] - logsumexp(logits)``, over row chunks of at most ``chunk_elements`` logits
    (default: the device's budget, :func:`stalerl.core.chunked_logprob.default_chunk_elements`, the same one the
    chunked head uses: 2^22 on a CPU, a fraction of the memory on CUDA, so a GPU's no-grad passes are not cut into
    rows sized for a CPU cache).

    Under autograd the chunks still save their inputs for the backward pass (the softmax gradient needs them); in
    no-grad passes (behaviour recompute, M2PO's selection pass) only one chunk's temporaries exist at a time."""
    n, t, v = logits.shape
    budget = chunk_elements if chunk_elements is not None else default_chunk_elements(logits.device)
    rows = max(1, budget // max(1, t * v))
    parts = []
    for start in range(0, n, rows):
        x = logits[start:start + rows].float()
        if temperature != 1.0:
            x = x / temperature
        picked = x.gather(-1, ids[start:start + rows].unsqueeze(-1)).squeeze(-1)
        parts.append(picked - torch.logsumexp(x, dim=-1))
    if not parts:
        return logits.new_zeros(ids.shape, dtype=torch.float32)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class DataParallel:
    """Where this actor sits among the train workers (size 1: no process group)."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None


ADAMW_IMPLEMENTATIONS = ("foreach", "fused")


def fused_adamw_problem(params: list[torch.Tensor]) -> Optional[str]:
    """Why torch's fused AdamW cannot step these parameters (None: it can): the same conditions torch checks in
    ``AdamW(fused=True)`` (floating-point tensors on a device with fused kernels), asked before any work so the
    refusal is one line naming the key, never a silent fallback to foreach."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    for p in params:
        if p.device.type not in devices or not torch.is_floating_point(p):
            return f"a {p.dtype} parameter on {p.device.type} (fused kernels: floating point on {', '.join(devices)})"
    return None


def build_optimizer(model: torch.nn.Module, opt_cfg: Any) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if opt_cfg.type == "adamw":
        impl = getattr(opt_cfg, "implementation", "foreach")
        if impl not in ADAMW_IMPLEMENTATIONS:
            raise ValueError(f"actor.optimizer.implementation must be foreach or fused, got {impl!r}")
        if impl == "fused":
            problem = fused_adamw_problem(params)
            if problem is not None:
                raise ValueError(f"actor.optimizer.implementation=fused: torch {torch.__version__} has no fused "
                                 f"AdamW for {problem}; set actor.optimizer.implementation=foreach")
        # foreach (default): torch picks the multi-tensor path only for CUDA tensors unless asked, and on CPU runs
        # one small kernel per parameter per operation. The multi-tensor path computes the same update bit for bit
        # (same ops, same order; tests/unit/test_actor.py checks it against foreach=False) in ~half the time on
        # SmolLM2's 272 tensors (bench/real_model_limits.py). fused (opt-in): one kernel per parameter doing the
        # whole update, faster still but rounded differently (tests/unit/test_adamw_implementation.py bounds the
        # difference; bench/adamw_variants.py measures the three).
        return torch.optim.AdamW(params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                                 weight_decay=opt_cfg.weight_decay, **_adamw_kernel(impl))
    if opt_cfg.type == "sgd":
        return torch.optim.SGD(params, lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    raise ValueError(f"actor.optimizer.type must be adamw or sgd, got {opt_cfg.type!r}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, opt_cfg: Any, total_updates: int):
    warmup = int(round(opt_cfg.warmup_steps_proportion * total_updates))
    kind = opt_cfg.lr_scheduler_type

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_updates - warmup))
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"actor.optimizer.lr_scheduler_type must be constant, linear or cosine, got {kind!r}")

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def loss_config(actor_cfg: Any) -> dict[str, Any]:
    """The config the registered losses read: every declared loss parameter from ``actor.<name>`` (a parameter
    that scopes the step planner, M2PO's ``m2_scope``, gets its in-call value: the plan covered the scope, module
    doc) and the PPO clip under the runtime's names."""
    from recipe.registry import declarations

    out: dict[str, Any] = {}
    for decl in declarations().values():
        for p in decl.params:
            out[p.name] = decl.step_scope.planned if decl.is_step_scope(p) else getattr(actor_cfg, p.name)
    out.update(eps_clip=actor_cfg.eps_clip, eps_clip_higher=actor_cfg.eps_clip_higher, c_clip=actor_cfg.c_clip,
               global_batch_info={})
    return out


def padded_tokens(prompt_len: list[int], resp_len: list[int], groups: list[list[int]]) -> int:
    """Tokens the forward passes over ``groups`` compute, padding included: each micro-batch is its rows x (its
    longest prompt + its longest response), the width RolloutBatch.select trims it to."""
    return sum(len(g) * (max(prompt_len[i] for i in g) + max(resp_len[i] for i in g)) for g in groups if g)


def pack_micro_batches(prompt_len: list[int], resp_len: list[int], max_tokens: int, *,
                       sort_by_length: bool = False, packed: bool = False) -> list[list[int]]:
    """Row indices per micro-batch: rows added greedily while rows x (longest prompt + longest response) stays within
    ``max_tokens`` (a row alone may exceed it). All rows fitting at once: one micro-batch in row order. Otherwise
    ``sort_by_length`` takes the rows by response length, then prompt length (stable: ties keep row order), else
    in row order. Responses first: they vary most (GSM8K: 20-512 tokens against prompts of ~65-265), and by
    response alone the padding is ~3% lower than by prompt + response (bench/micro_batch_padding.py).

    ``packed`` (actor.mb_spec.pack_sequences): a micro-batch is one row of its rows' real tokens, so ``max_tokens``
    bounds the sum of prompt + response lengths, padding no longer counted."""
    n = len(prompt_len)
    if n == 0:
        return []
    if packed:
        return _pack_by_real_tokens(prompt_len, resp_len, max_tokens, sort_by_length)
    if n * (max(prompt_len) + max(resp_len)) <= max_tokens:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: (resp_len[i], prompt_len[i])) if sort_by_length else range(n)
    groups: list[list[int]] = []
    cur: list[int] = []
    p_max = r_max = 0
    for i in order:
        np_, nr = max(p_max, prompt_len[i]), max(r_max, resp_len[i])
        if cur and (len(cur) + 1) * (np_ + nr) > max_tokens:
            groups.append(cur)
            cur, p_max, r_max = [], 0, 0
            np_, nr = prompt_len[i], resp_len[i]
        cur.append(i)
        p_max, r_max = np_, nr
    if cur:
        groups.append(cur)
    return groups


def _pack_by_real_tokens(prompt_len: list[int], resp_len: list[int], max_tokens: int,
                         sort_by_length: bool) -> list[list[int]]:
    """:func:`pack_micro_batches` for packed micro-batches: greedy over rows (ordered as there) while the sum of
    real tokens stays within ``max_tokens`` (a row alone may exceed it)."""
    n = len(prompt_len)
    if sum(prompt_len) + sum(resp_len) <= max_tokens:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: (resp_len[i], prompt_len[i])) if sort_by_length else range(n)
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        size = prompt_len[i] + resp_len[i]
        if cur and used + size > max_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += size
    if cur:
        groups.append(cur)
    return groups


def packing_check(model: torch.nn.Module, atol: float = 1e-4) -> tuple[bool, str]:
    """``(ok, reason)``: whether this model's attention keeps packed rows apart (actor.mb_spec.pack_sequences): two
    short rows packed into one (no attention mask, position ids restarting at 0) must give each row's own float32
    next-token log-probs (those the actor computes), run alone, within ``atol``. Probed once at start, because
    whether the position ids are honoured is the model's and its attention implementation's business
    (transformers' sdpa/eager masks detect the packing from the position ids; other implementations may not), so
    no list of model types. The tolerance sits between float32 rounding across shapes (SmolLM2-135M: 6e-6; the
    tiny models: < 1e-6) and rows that see each other (SmolLM2: 22, the second row attending to the first)."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    rows = [(torch.arange(6, device=device) * 7 + 3).remainder(vocab), (torch.arange(4, device=device) * 5 + 11)
            .remainder(vocab)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            def next_token_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
                return token_logprobs(logits[:, :-1], ids[1:].unsqueeze(0))[0]

            alone = [next_token_logp(model(input_ids=r.unsqueeze(0), use_cache=False).logits, r) for r in rows]
            logits = model(input_ids=torch.cat(rows).unsqueeze(0), use_cache=False,
                           position_ids=torch.cat([torch.arange(len(r), device=device) for r in rows]).unsqueeze(0)
                           ).logits
            packed = [next_token_logp(logits[:, :len(rows[0])], rows[0]),
                      next_token_logp(logits[:, len(rows[0]):], rows[1])]
    except Exception as exc:  # a forward that refuses the inputs: packing is refused with its message
        return False, f"its forward failed on a packed row ({type(exc).__name__}: {exc})"[:300]
    finally:
        model.train(was_training)
    err = float((torch.cat(packed) - torch.cat(alone)).abs().max())
    if not err <= atol:
        return False, (f"packed rows' float32 log-probs differ from each row's own by {err:.2e} > {atol:g} (its "
                       "attention does not keep the sequences apart)")
    return True, ""


def correction_params(cfg: Any) -> CorrectionParams:
    """The experiment config's rollout_correction section as the recipe's parameter object."""
    rc = cfg.rollout_correction
    return CorrectionParams(rc.mode, float(rc.threshold), float(rc.low), float(rc.high))


class Actor:
    def __init__(self, model: torch.nn.Module, actor_cfg: Any, *, temperature: float, total_updates: int,
                 dp: Optional[DataParallel] = None, loss_scale_factor: Optional[int] = None,
                 correction: Optional[CorrectionParams] = None, log: Callable[[str], None] = _print_line,
                 progress_every_s: float = UPDATE_PROGRESS_EVERY_S):
        """``log``: where an update longer than ``progress_every_s`` prints its progress lines (the trainer passes
        the run's log, as it does for the HF engine's generation progress)."""
        self.model = model
        self.log = log
        self.progress_every_s = float(progress_every_s)
        # rollout_correction (recipe/rollout_correction.py): a step before the loss on every mini-batch; none = off
        self.correction = correction or CorrectionParams()
        # Mixed precision: fp32 master parameters stepped by the optimizer, forward/backward under autocast.
        low = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
        if low:
            raise ValueError(
                f"the actor trains float32 master parameters, but {len(low)} parameter(s) are "
                f"{dict(model.named_parameters())[low[0]].dtype} (first: {low[0]}). Load the model in float32 and "
                "set actor.dtype=bfloat16 for bf16 compute (stalerl.core.model.load_policy_from_config does this)")
        self.compute_dtype = parse_dtype(getattr(actor_cfg, "dtype", "float32"))
        # Dropout off: the behaviour pass runs in eval mode, so the training forward must be dropout-free too for an
        # on-policy log-ratio of exactly 0 and an update that does not depend on the micro-batch split.
        disable_dropout(model)
        self._logits_to_keep = _accepts_logits_to_keep(model)
        # Log-probs from the last hidden states in chunks (stalerl.core.chunked_logprob): a micro-batch's (tokens x vocab)
        # logits never exist. Used when the model's head verifiably gives the plain log-probs (a bias-free linear
        # head whose logits the model does not post-process, e.g. no soft-capping); else the plain logits path.
        # Never silent: the trainer logs the reason once, and every update records actor/chunked_logprobs (1/0).
        self.chunked_logprobs, self.chunked_logprobs_reason = chunked_logprob_check(model)
        # seq-mean-token-sum-norm divides by a constant (verl's loss_scale_factor): the generation budget, never a
        # micro-batch's padded width, which would make the update depend on the split.
        self.loss_scale_factor = loss_scale_factor
        self.cfg = actor_cfg
        self.temperature = float(temperature)
        self.dp = dp or DataParallel()
        self.device = next(model.parameters()).device
        self.spec = get_policy_loss_spec(actor_cfg.loss)
        self.total_updates = max(1, total_updates)
        self.optimizer = build_optimizer(model, actor_cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, actor_cfg.optimizer, self.total_updates)
        self.sharded = False  # actor.backend=fsdp:dY after shard(): parameters are FSDP2 DTensor shards
        self.max_tokens_per_mb = int(actor_cfg.mb_spec.max_tokens_per_mb)
        self.length_bucketing = bool(getattr(actor_cfg.mb_spec, "length_bucketing", False))
        self.pack_sequences = bool(getattr(actor_cfg.mb_spec, "pack_sequences", False))
        if self.pack_sequences:
            self._check_packing(model, str(getattr(actor_cfg, "backend", "torch:d1")))
        self._adamw_implementation = str(getattr(actor_cfg.optimizer, "implementation", "foreach"))
        self.logp_seconds = 0.0  # wall time in compute_logp (no-grad passes), for the trainer's step-time split
        self.optimizer_seconds = 0.0  # wall time of gradient clipping + optimizer step (the split's optimizer part)

    @staticmethod
    def _check_packing(model: torch.nn.Module, backend: str) -> None:
        """actor.mb_spec.pack_sequences=true: refused at start, in one line, where it is not known to work."""
        from stalerl.config.backend import parse_backend

        b = parse_backend(backend, key="actor.backend")
        if b.engine == "fsdp" and b.dp > 1:
            # Packing changes only the forward's inputs, but no test covers it under FSDP2's sharded forward
            # (tests/unit/test_pack_sequences.py runs the replicated engine): refused rather than assumed.
            raise ValueError(f"actor.mb_spec.pack_sequences=true is not supported with actor.backend={backend} "
                             "(untested under FSDP2); set actor.mb_spec.pack_sequences=false or actor.backend=torch:dY")
        ok, reason = packing_check(model)
        if not ok:
            raise ValueError(f"actor.mb_spec.pack_sequences=true: {type(model).__name__} cannot run packed rows: "
                             f"{reason}; set actor.mb_spec.pack_sequences=false")

    # ---------------------------------------------------------------- log-probs
    def _forward_logp(self, mb: RolloutBatch) -> torch.Tensor:
        if self.pack_sequences:
            return self._forward_logp_packed(mb)
        input_ids = mb.input_ids().to(self.device)
        attn = mb.attention_mask().to(self.device)
        p = mb.prompt_ids.shape[1]
        r = mb.response_ids.shape[1]
        kwargs = {}
        if self._logits_to_keep:
            # Only the last r+1 positions: the prompt's logits (rows x prompt x vocab) are never computed.
            kwargs["logits_to_keep"] = r + 1
        # position t predicts token t+1: the response tokens are predicted from columns p-1 .. p+r-2 (the first r
        # of the r+1 kept columns)
        columns = slice(0, r) if self._logits_to_keep else slice(p - 1, p + r - 1)
        ids = mb.response_ids.to(self.device)
        head = (head_returns_token_logprobs(self.model, ids, columns, self.temperature) if self.chunked_logprobs
                else contextlib.nullcontext())
        with autocast_context(self.device, self.compute_dtype), head:
            out = self.model(input_ids=input_ids, attention_mask=attn.long(),
                             position_ids=position_ids_from_mask(attn), use_cache=False, **kwargs)
        if self.chunked_logprobs:
            return out.logits  # the head returned the (N, r) float32 log-probs
        return token_logprobs(out.logits[:, columns], ids, self.temperature)

    def _forward_logp_packed(self, mb: RolloutBatch) -> torch.Tensor:
        """:meth:`_forward_logp` over the micro-batch packed into one row (actor.mb_spec.pack_sequences): the same
        (N, R) float32 log-probs up to float rounding, 0 on response padding (the padded path leaves values there
        that every consumer masks out). No attention mask: transformers then builds the per-sequence causal mask
        from the restarting position ids (probed at start, :func:`packing_check`)."""
        packed = pack_rows(mb)
        ids = packed.target_ids.to(self.device).unsqueeze(0)  # (1, M)
        predictor = packed.predictor.to(self.device)
        kwargs = {}
        if self._logits_to_keep:
            # Only the M predicting columns reach the head (transformers takes a 1-D index tensor here).
            kwargs["logits_to_keep"] = predictor
            columns: Any = slice(0, predictor.numel())
        else:
            columns = predictor
        head = (head_returns_token_logprobs(self.model, ids, columns, self.temperature) if self.chunked_logprobs
                else contextlib.nullcontext())
        with autocast_context(self.device, self.compute_dtype), head:
            out = self.model(input_ids=packed.input_ids.to(self.device), attention_mask=None,
                             position_ids=packed.position_ids.to(self.device), use_cache=False, **kwargs)
        lp = out.logits if self.chunked_logprobs else token_logprobs(out.logits[:, columns], ids, self.temperature)
        # Back to the padded (N, R) layout, differentiably (index_put of the (M,) values into zeros).
        full = torch.zeros(mb.response_ids.shape, dtype=torch.float32, device=self.device)
        return full.index_put((packed.rows.to(self.device), packed.cols.to(self.device)), lp.reshape(-1))

    def micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        """Rows packed while rows x padded width stays within max_tokens_per_mb (at least one row per micro-batch);
        with mb_spec.pack_sequences, while their real tokens (prompt + response, no padding) do.

        A batch that fits one micro-batch is one, in its own row order (bit-for-bit the update it always had).
        Otherwise, with mb_spec.length_bucketing (the GPU configs), rows are taken in order of length (response,
        then prompt; ties by row), so rows of similar length share a micro-batch and less padding is computed;
        without it (the default), consecutive rows. Either way the update is the same up to float rounding (module
        docstring)."""
        return pack_micro_batches(batch.prompt_mask.sum(dim=1).tolist(), batch.response_mask.sum(dim=1).tolist(),
                                  self.max_tokens_per_mb, sort_by_length=self.length_bucketing,
                                  packed=self.pack_sequences)

    @torch.no_grad()
    def compute_logp(self, batch: RolloutBatch, progress: Optional[UpdateProgress] = None) -> torch.Tensor:
        """Log-probs of the batch's responses under the current weights (no grad), (N, R) on CPU, 0 on padding.
        ``progress``: the running update's, checked after each micro-batch (the planner's pass)."""
        start = time.perf_counter()  # the .cpu() copies below wait for the device, so this is the pass's time
        was_training = self.model.training
        self.model.eval()
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        micro = self.micro_batches(batch)
        for rows in micro:
            mb = batch.select(rows)
            lp = self._forward_logp(mb).cpu()
            out[rows, :lp.shape[1]] = torch.where(mb.response_mask, lp, torch.zeros_like(lp))
            if progress is not None:
                progress.check()
        for _ in range(self._missing_passes(len(micro))):
            fsdp.dummy_forward(self.model, self.device, self.compute_dtype)
        self.model.train(was_training)
        self.logp_seconds += time.perf_counter() - start
        return out

    def _missing_passes(self, n_micro: int) -> int:
        """Sharded model: forward passes this rank must add so every rank runs as many as the busiest one (each
        forward all-gathers the layers). 0 for a replicated model."""
        if not self.sharded or self.dp.size == 1:
            return 0
        return fsdp.max_over_ranks(n_micro, self.dp.group) - n_micro

    # ---------------------------------------------------------------- sharding (actor.backend=fsdp:dY)
    def shard(self, dtype: str = "float32", *, copy_model: bool = False,
              lr_scheduler_state: Optional[dict] = None, optimizer_state_follows: bool = False) -> None:
        """Shard the model over the data-parallel group with FSDP2 and rebuild the optimizer over the shards.

        Collective: every rank calls it at the same point, with the same ``optimizer_state_follows`` (rank 0 then
        broadcasts the optimizer state it had before sharding, e.g. from a checkpoint). ``copy_model``: shard a copy
        and leave ``self.model``'s original unsharded for the caller (rank 0 keeps it to evaluate, publish and
        save). The replicas must be identical before this (broadcast rank 0's weights first)."""
        if self.sharded:
            return
        import copy

        carried = None
        if optimizer_state_follows and self.dp.rank == 0:
            carried = fsdp.optimizer_state_by_name(self.model, self.optimizer.state_dict())
        model = copy.deepcopy(self.model) if copy_model else self.model
        self.model = fsdp.shard_model(model, self.dp.size, dtype)
        self.device = next(self.model.parameters()).device
        self.sharded = True
        scheduler_state = lr_scheduler_state or self.lr_scheduler.state_dict()
        self.optimizer = build_optimizer(self.model, self.cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.cfg.optimizer, self.total_updates)
        self.lr_scheduler.load_state_dict(scheduler_state)
        if optimizer_state_follows:
            fsdp.load_full_optimizer_state(self.model, self.optimizer, carried)

    @property
    def has_pending_optimizer_state(self) -> bool:
        """Not sharded yet and the optimizer has state (a restored checkpoint) that shard() must carry over."""
        return not self.sharded and bool(self.optimizer.state)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Sharded: collective, the full weights on rank 0 (CPU) and {} elsewhere. Replicated: the local weights."""
        if self.sharded:
            return fsdp.full_model_state(self.model)
        return self.model.state_dict()

    # ---------------------------------------------------------------- update
    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp.size > 1:
            torch.distributed.all_reduce(t, group=self.dp.group)
        return t

    def _needs_plan(self, n_micro: int) -> bool:
        """Whether the step needs the planner: a loss whose step needs a selector, split over micro-batches or
        ranks (one call over the whole step decides for itself, with the same result and no extra forward)."""
        return self.spec.declaration.step != "nothing" and (n_micro > 1 or self.dp.size > 1)

    def _plan_group(self) -> Optional[Any]:
        """The ranks one step decision spans: all data-parallel ranks, unless the loss's step-scope parameter
        (M2PO's m2_scope) says local."""
        if self.dp.size == 1:
            return None
        scope = self.spec.declaration.step_scope
        if scope is not None and getattr(self.cfg, scope.param) == scope.local:
            return None
        return self.dp.group

    def update(self, batch: RolloutBatch, advantages: torch.Tensor,
               minibatch_sizes: Optional[list[int]] = None) -> dict[str, float]:
        """ppo_n_minibatches optimizer steps over the batch; returns step metrics (means over mini-batches).

        ``minibatch_sizes``: this rank's rows of each global mini-batch, in order (data parallelism: the controller
        cuts the batch into mini-batches first and shards each, so rank count cannot change the mini-batches)."""
        self.model.train()
        n_mini = int(self.cfg.ppo_n_minibatches)
        if minibatch_sizes is None:
            # Exactly n_mini mini-batches, even if some are empty: every data-parallel rank must take the same
            # number of optimizer steps (each one joins collectives).
            chunks = [c.tolist() for c in torch.tensor_split(torch.arange(batch.num_rows), n_mini)]
        else:
            if len(minibatch_sizes) != n_mini or sum(minibatch_sizes) != batch.num_rows:
                raise ValueError(f"minibatch_sizes {minibatch_sizes} must have {n_mini} entries summing to "
                                 f"{batch.num_rows} rows")
            bounds = [0]
            for size in minibatch_sizes:
                bounds.append(bounds[-1] + size)
            chunks = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        per_step: list[dict[str, float]] = []
        loss_parts: list[tuple[dict[str, float], dict[str, float]]] = []
        selection_parts: list[tuple[dict[str, float], dict[str, float]]] = []
        # The micro-batch splits up front: the progress lines' totals (issue 43 item 7); only rank 0 prints.
        minis = [batch.select(chunk) for chunk in chunks]
        micros = [self.micro_batches(mini) for mini in minis]
        real = (batch.prompt_mask.sum(dim=1) + batch.response_mask.sum(dim=1)).tolist()
        progress = UpdateProgress(sum(len(m) for m in micros), sum(real[i] for c in chunks for i in c),
                                  self.log if self.dp.rank == 0 else (lambda line: None), self.progress_every_s)
        for chunk, mini, micro in zip(chunks, minis, micros):
            metrics, parts, selection = self._update_minibatch(mini, advantages[chunk], micro, progress)
            per_step.append(metrics)
            loss_parts.extend(parts)
            if selection is not None:
                selection_parts.append(selection)
        keys = set().union(*per_step)
        out = {k: sum(m.get(k, 0.0) for m in per_step) / len(per_step) for k in sorted(keys)}
        # The loss's own metrics: one value by its declared rules (recipe/declaration.py) over every micro-batch of
        # every mini-batch on every rank, so a SUM is the step's sum and a MAX the step's max wherever the step was
        # cut (a plain mean of per-mini-batch or rank 0's values would not be). The planner's selection metrics are
        # already whole-mini-batch (all ranks): they combine by the same rules over the mini-batches only.
        rules = self.spec.declaration.metrics
        reduced = reduce_metrics(self._gather_parts(loss_parts), rules)
        reduced.update(reduce_metrics(selection_parts, rules))
        out.update({f"actor/{k}": v for k, v in reduced.items()})
        return out

    def _gather_parts(self, parts: list[tuple[dict[str, float], dict[str, float]]]
                      ) -> list[tuple[dict[str, float], dict[str, float]]]:
        """Every rank's (counts, metrics) micro-batch parts, in rank order (the identity without data parallelism).
        Collective: every rank calls it once per step (the update is)."""
        if self.dp.size == 1:
            return parts
        gathered: list[Any] = [None] * self.dp.size
        torch.distributed.all_gather_object(gathered, parts, group=self.dp.group)
        return [part for rank_parts in gathered for part in rank_parts]

    def _update_minibatch(self, mini: RolloutBatch, adv: torch.Tensor, micro: Optional[list[list[int]]] = None,
                          progress: Optional[UpdateProgress] = None
                          ) -> tuple[dict[str, float], list[tuple[dict[str, float], dict[str, float]]],
                                     Optional[tuple[dict[str, float], dict[str, float]]]]:
        """One optimizer step on a mini-batch: (its step metrics, the loss's per-micro-batch (counts, metrics)
        parts, and the planner's selection metrics of the whole mini-batch as one (counts, metrics) part, or None),
        which :meth:`update` reduces over the whole step by the loss's declared rules."""
        adv = adv[:, :mini.response_ids.shape[1]]
        micro = self.micro_batches(mini) if micro is None else micro
        # Rollout correction, once over the mini-batch (per token or per row: the split cannot change it). Rejected
        # tokens leave the loss mask (and the denominators counted from it); the forward still sees every token.
        is_weights, loss_mask, correction_metrics = apply_correction(mini.behavior_logp, mini.engine_logp,
                                                                     mini.response_mask, self.correction)
        totals = self._all_reduce_sum(torch.tensor([float(loss_mask.sum()), float(loss_mask.any(dim=-1).sum())
                                                    if self.correction.active else float(mini.num_rows)],
                                                   dtype=torch.float64))
        cfg = loss_config(self.cfg)
        cfg["global_batch_info"] = {"dp_size": self.dp.size, "batch_num_tokens": int(totals[0]),
                                    "global_batch_size": int(totals[1]), "loss_scale_factor": self.loss_scale_factor}
        extra_full: dict[str, torch.Tensor] = {}
        selection_metrics: dict[str, float] = {}
        if self._needs_plan(len(micro)):
            # One decision per mini-batch by the one exact-step planner (recipe.optimizer_batch), from a no-grad
            # forward over every micro-batch first: M2PO's selection over the whole mini-batch (and, with
            # m2_scope=dp_group, every rank), or FIPO's drops decided on the whole mini-batch (rows never span
            # micro-batches) with the step's denominators counting only the kept tokens and rows of all ranks. So
            # splitting the mini-batch into micro-batches or ranks cannot change the update.
            current = self.compute_logp(mini, progress)
            plan = plan_optimizer_batch(self.cfg.loss, [MicroBatch(mini.behavior_logp, current, adv, loss_mask)],
                                        cfg, group=self._plan_group())
            extra_full = plan.extras[0]
            if plan.selection is not None:
                selection_metrics = plan.selection.metrics()
            if plan.row_drops is not None:  # token-mean divides by the kept tokens, the seq-mean modes by kept rows
                cfg["global_batch_info"]["batch_num_tokens"] = plan.num_tokens
                cfg["global_batch_info"]["global_batch_size"] = plan.num_rows
        elif self.spec.row_selector is not None:
            # One call is the whole step: FIPO counts its kept tokens and rows itself (the all-valid counts would
            # keep the dropped rows in the denominator).
            del cfg["global_batch_info"]["batch_num_tokens"], cfg["global_batch_info"]["global_batch_size"]

        loss_sum = 0.0
        metric_parts: list[tuple[dict[str, float], dict[str, float]]] = []  # (counts, metrics) per micro-batch
        sq_sum, n_tokens, max_abs = 0.0, 0.0, 0.0  # M2 over all valid tokens, for comparisons across losses
        max_log_ratio = -math.inf  # the largest importance ratio, for every loss (not only no_trust_region)
        for rows in micro:
            mb = mini.select(rows)
            width = mb.response_ids.shape[1]
            lp = self._forward_logp(mb)
            kwargs = {k: v[rows, :width].to(self.device) for k, v in extra_full.items()}
            mb_mask = loss_mask[rows, :width]
            loss, metrics = self.spec.fn(
                old_log_prob=mb.behavior_logp.to(self.device), log_prob=lp, advantages=adv[rows, :width].to(self.device),
                response_mask=mb_mask.to(self.device), loss_agg_mode=self.cfg.loss_agg_mode, config=cfg,
                rollout_is_weights=None if is_weights is None else is_weights[rows, :width].to(self.device),
                **kwargs)
            loss.backward()
            loss_sum += float(loss.detach())
            metric_parts.append(({"valid_tokens": float(mb_mask.sum()), "rows": float(len(rows))},
                                 {k: float(v) for k, v in metrics.items()}))
            with torch.no_grad():
                d = torch.where(mb_mask, lp.detach().cpu() - mb.behavior_logp, torch.zeros(()))
                sq_sum += float((d * d).sum())
                n_tokens += float(mb_mask.sum())
                max_abs = max(max_abs, float(d.abs().max()) if d.numel() else 0.0)
                if bool(mb_mask.any()):
                    max_log_ratio = max(max_log_ratio, float(d[mb_mask].max()))
            if progress is not None:
                progress.done(int(mb.prompt_mask.sum()) + int(mb.response_mask.sum()))
        for _ in range(self._missing_passes(len(micro))):  # sharded: join the busiest rank's collectives
            fsdp.dummy_forward(self.model, self.device, self.compute_dtype).backward()
        if self.dp.size > 1:
            if not self.sharded:  # FSDP2 has already averaged the gradients in its reduce-scatters
                # Flattened buckets, one all-reduce each; a rank with no rows joins with zero gradients.
                fsdp.all_reduce_gradients(self.model.parameters(), self.dp.group, self.dp.size)
            loss_t = self._all_reduce_sum(torch.tensor([loss_sum], dtype=torch.float64))
            loss_sum = float(loss_t[0]) / self.dp.size
        # gradient_clipping=0 means no clipping (clip_grad_norm_(max_norm=0) would zero every gradient); the norm is
        # still measured (max_norm=inf scales by 1) for the log.
        t_opt = time.perf_counter()
        clip = float(self.cfg.optimizer.gradient_clipping)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)
        lr_used = float(self.optimizer.param_groups[0]["lr"])  # this step's rate; scheduler.step() sets the next
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm = fsdp.to_float(grad_norm)  # waits for the device, so the time below is the step's
        self.optimizer_seconds += time.perf_counter() - t_opt
        out: dict[str, float] = {}
        out.update(correction_metrics)  # rollout_correction/* (none: no keys)
        out["actor/loss"] = loss_sum
        out["actor/grad_norm"] = grad_norm
        out["actor/lr"] = lr_used
        # Logged for every loss, not only M2PO: a loss-independent staleness diagnostic, the second moment of
        # log(pi_theta / pi_behav) over all valid tokens, where M2PO bounds it only inside its trust-region
        # quadrants; so runs of different losses compare on the same measure of how off-policy their data was.
        out["actor/m2_all_tokens"] = sq_sum / max(1.0, n_tokens)
        out["actor/log_ratio_abs_max"] = max_abs
        out["actor/ratio_max"] = math.exp(min(max_log_ratio, 700.0)) if max_log_ratio > -math.inf else 1.0
        out["actor/num_micro_batches"] = float(len(micro))
        out["actor/chunked_logprobs"] = float(self.chunked_logprobs)  # 0: the plain logits path (logged at start)
        # The planner's selection metrics describe the whole mini-batch's decision: they replace the same keys of the
        # per-call metrics (each call saw only its micro-batch of that decision).
        parts = [(counts, {k: v for k, v in m.items() if k not in selection_metrics}) for counts, m in metric_parts]
        selection = (({"valid_tokens": float(totals[0]), "rows": float(totals[1])}, dict(selection_metrics))
                     if selection_metrics else None)
        return out, parts, selection

    def skip_update(self) -> dict[str, float]:
        """A step whose every prompt group was left out (actor.skip_zero_advantage_groups): no forward, backward or
        optimizer step; the learning-rate schedule advances as ppo_n_minibatches updates would have moved it."""
        lr_used = float(self.optimizer.param_groups[0]["lr"])
        for _ in range(int(self.cfg.ppo_n_minibatches)):
            self.lr_scheduler.step()
        return {"actor/loss": 0.0, "actor/grad_norm": 0.0, "actor/lr": lr_used, "actor/num_micro_batches": 0.0}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Sharded: collective; the full state on rank 0 (optimizer keyed by parameter name), empty elsewhere."""
        if self.sharded:
            state = fsdp.full_state_dict(self.model, self.optimizer)
            state.update(lr_scheduler=self.lr_scheduler.state_dict(), format=fsdp.FULL_STATE_FORMAT)
            return state
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A full state from either engine: the plain optimizer's (keyed by index) or a sharded run's (keyed by
        parameter name), so a run can resume with the other engine or rank count. Into a sharded actor: collective."""
        if state.get("format") == fsdp.FULL_STATE_FORMAT:
            if self.sharded:
                fsdp.load_full_model_state(self.model, state.get("model"))
                fsdp.load_full_optimizer_state(self.model, self.optimizer, state.get("optimizer"))
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(fsdp.optimizer_state_by_index(self.model, state["optimizer"]))
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            _keep_implementation(self.optimizer, self._adamw_implementation)
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        _keep_implementation(self.optimizer, self._adamw_implementation)


def _adamw_kernel(implementation: str) -> dict[str, Optional[bool]]:
    """AdamW's ``foreach`` / ``fused`` flags for actor.optimizer.implementation."""
    return {"foreach": None, "fused": True} if implementation == "fused" else {"foreach": True, "fused": None}


def _keep_implementation(optimizer: torch.optim.Optimizer, implementation: str = "foreach") -> None:
    """``Optimizer.load_state_dict`` restores the saved param groups whole, ``foreach`` and ``fused`` included: a
    checkpoint from before foreach=True (``None`` there, the per-parameter loop on CPU), or from a run with the
    other actor.optimizer.implementation, would quietly bring that kernel back. The kernel is this run's choice,
    not part of the saved state (the state tensors are the same for all three)."""
    if isinstance(optimizer, torch.optim.AdamW):
        for group in optimizer.param_groups:
            group.update(_adamw_kernel(implementation))

