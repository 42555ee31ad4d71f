"""The HF engine's decode loop with a preallocated KV cache: the same numbers as transformers' ``generate``, less work.

What ``generate`` (transformers 5, :class:`~transformers.DynamicCache`) costs per step, and what this loop does instead:

- its cache grows by ``torch.cat`` in every layer at every step: the whole (rows x kv heads x length x head dim) K and V
  copied per step, O(length) per step and O(length^2) per generation (at 32 rows x 300 positions, ~0.4 GB of copies
  per step on SmolLM2). Here every layer writes the new position into a buffer allocated once for
  ``prompt + max_new_tokens`` positions (:class:`PreallocatedKVLayer`) and attends over a *view* of its filled prefix,
  so attention sees the same keys, values and mask sizes as under ``generate`` (no masked tail: the result does not
  depend on the buffer's capacity);
- its stopping criteria, logits-processor list and model-kwargs bookkeeping run in Python per step; here one step is
  the model's forward plus a fixed handful of tensor ops, the same count at step 1 and step 1000;
- it runs the prompts' forward on every row, though the trainer asks for n samples of each prompt: with
  ``share_prefill=True`` each distinct prompt's forward runs once and its K/V rows are repeated for its samples
  (an n-fold smaller prefill, which dominates short answers);
- finished rows keep running through the model until every row ends. Here, with ``compact=True`` (opt-in, see
  below), they leave the batch (the live rows' cache, mask and positions are gathered to the front) once at most 3/4
  of its rows are still live (``COMPACT_AT``), so a long tail of one or two rows does not cost a full batch per step.

Exactness (``tests/unit/test_static_decode.py``, ``tests/e2e/test_real_model_decode.py``): with ``compact=False`` and
``share_prefill=False`` every tensor the model sees has the shape and values it has under ``generate`` (same prompt,
mask, position ids, ``logits_to_keep=1``), the warpers are transformers' own classes in ``generate``'s order, and
sampling is ``torch.multinomial`` on the full (rows x vocab) probabilities at every step, as ``generate`` does
(finished rows included: their draws are thrown away, but they consume the generator's stream the same way). So
greedy tokens, sampled tokens under the same seed and the float32 behaviour log-probs are bit-identical to
``generate``'s, and the global generator ends in the same state.

With ``compact=True`` the model runs on fewer rows after a compaction. Sampling stays draw-for-draw the same (the
live rows' probabilities are written into a full-batch buffer where finished rows keep a valid stale row, and
``torch.multinomial`` draws each row from its own row only). The forward is bit-identical only where the matmul gives
a row the same bits in the smaller batch, at its new place, which depends on the BLAS: with torch 2.13's CPU kernels
a GEMM with K=576 gives different last bits at M <= 11 (another kernel for small M), and on 2 threads a row that
moves inside the batch can change its bits too (the rows are split between threads and register tiles by position).
So a compaction happens only to a set of rows that :func:`rows_keep_their_bits` has checked on this machine, at
their new places (every linear shape of the model, under the same threads and autocast); otherwise the finished rows
stay in the batch and cost compute but no Python work. That check covers the matmuls only, and it is not enough on
2 threads: there attention's output for a row that moved changed in the last bit (tiny:llama, 16 rows cut to 12,
``o_proj``'s input differing by 2e-9 while every linear kept its bits), so the log-probs move in the last bits:
up to 5e-7 on the tiny models, 1.9e-5 on SmolLM2 (6 prompts x 3 samples, 24 tokens, T 0.7; the same tokens there,
but a near-tie could flip one). On one thread (the tests' setting) compaction is bit-exact. Hence ``compact`` is off
by default (``HFRolloutEngine(compact_finished_rows=...)``): an opt-in for long generations with a long tail.

The shared prefill (``share_prefill``, on by default in the engine) is held to the same check (each distinct prompt's
tokens, at their place in the smaller prefill, against the full one) and measured bit-exact where it ran: tiny models
on 1 and 2 threads, SmolLM2 on 1 thread. On 2 threads the check refuses it for SmolLM2's 6 prompts x 3 samples (the
head's 6 rows against 18 differ: a small-M kernel), and the 18 rows are prefilled as ``generate`` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


# Finished rows leave the batch once at most this fraction of its rows is live: a compaction copies the live rows'
# cache prefix (~5% of a decode step at 32 rows x 100 positions on SmolLM2), and saves >= 25% of every later step.
COMPACT_AT = 0.75


class PreallocatedKVLayer(DynamicLayer):
    """One layer's K/V in a (rows, kv heads, ``capacity``, head dim) buffer allocated at the first write; every update
    writes the new positions in place and returns views of the filled prefix (what ``DynamicLayer`` returns after its
    ``torch.cat``: same shape, same values, no copy of the past)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self._k = torch.empty((rows, heads, self.capacity, dim), dtype=key_states.dtype, device=key_states.device)
        self._v = torch.empty((rows, value_states.shape[1], self.capacity, value_states.shape[-1]),
                              dtype=value_states.dtype, device=value_states.device)
        self.length = 0
        self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"preallocated KV cache full: {end} positions for a capacity of {self.capacity}")
        self._k[:, :, self.length:end].copy_(key_states)
        self._v[:, :, self.length:end].copy_(value_states)
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (in that order) at the front of the buffer; the rest of it is left unused.
        Copies the filled prefix of the kept rows only."""
        if not self.is_initialized:
            return
        m = index.numel()
        self._k[:m, :, :self.length] = self._k[index, :, :self.length]
        self._v[:m, :, :self.length] = self._v[index, :, :self.length]
        self._k, self._v = self._k[:m], self._v[:m]
        self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]


    def expand_rows(self, index: torch.Tensor) -> None:
        """Row i becomes row ``index[i]`` of the current buffer (e.g. one prompt's K/V repeated for its samples); the
        buffer is reallocated at ``index``'s row count with the same capacity."""
        if not self.is_initialized:
            return
        k = self._k.new_empty((index.numel(), *self._k.shape[1:]))
        v = self._v.new_empty((index.numel(), *self._v.shape[1:]))
        k[:, :, :self.length] = self._k[index, :, :self.length]
        v[:, :, :self.length] = self._v[index, :, :self.length]
        self._k, self._v = k, v
        self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]


def preallocated_cache(num_layers: int, capacity: int) -> Cache:
    return Cache(layers=[PreallocatedKVLayer(capacity) for _ in range(num_layers)])


def sampling_warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList:
    """transformers' own warpers, in ``generate``'s order (temperature, top-k, top-p), only those that change
    something (as :class:`~stalerl.rollout.engine.SampledLogProbRecorder` builds them)."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


@dataclass
class DecodeProgress:
    """What a progress callback is told: rows finished of ``rows``, tokens generated so far (finished rows' padding
    not counted), decode steps run of at most ``max_steps``, seconds since the call began."""
    rows_done: int
    rows: int
    tokens: int
    step: int
    max_steps: int
    elapsed_s: float


@dataclass
class DecodeResult:
    """``tokens``: (rows, steps) generated ids, ``pad_id`` after a row's end token; ``logp``: (rows, steps) float32
    log-prob of each token under the processed sampling distribution (0 where not sampled: greedy, or after the end).
    ``steps`` is the number of decode steps run: ``max_new_tokens``, or fewer when every row ended earlier;
    ``compactions`` how often finished rows left the batch; ``prefill_rows`` the rows the prompts' forward ran on."""
    tokens: torch.Tensor
    logp: torch.Tensor
    steps: int
    compactions: int
    prefill_rows: int


@torch.no_grad()
def static_decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                  max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, greedy: bool,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, compact: bool = False,
                  share_prefill: bool = False, progress: Optional[Callable[[DecodeProgress], None]] = None,
                  progress_every_s: float = 30.0) -> DecodeResult:
    """Generate up to ``max_new_tokens`` per left-padded prompt row, stopping a row at its first ``stop_ids`` token
    (kept as the row's last token). ``progress`` is called every ``progress_every_s`` seconds of decoding (never for
    a call shorter than that). The caller sets eval mode and the autocast context."""
    rows, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    capacity = prompt_len + max_new_tokens
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    cache = preallocated_cache(num_layers, capacity)
    # The 2D mask generate grows by one column per step, preallocated: step t passes a view of its first P+t columns.
    mask = torch.ones((rows, capacity), dtype=torch.long, device=device)
    mask[:, :prompt_len] = prompt_mask.long()
    # generate's position ids: cumsum of the mask - 1, 0 on padding; then the last one + 1 per step
    positions = prompt_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(~prompt_mask.bool(), 0)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    warpers = None if greedy else sampling_warpers(temperature, top_k, top_p)
    linears = linear_shapes(model) if compact or share_prefill else {}

    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logp = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    live = torch.arange(rows, device=device)  # original row of each row the model still runs
    unfinished = torch.ones(rows, dtype=torch.bool, device=device)  # over the live rows
    probs_all: Optional[torch.Tensor] = None  # (rows, vocab): what torch.multinomial draws from, every row
    pad = torch.tensor(pad_id, dtype=torch.long, device=device)
    start = time.perf_counter()
    next_report = start + progress_every_s
    compactions = 0
    compact_below = COMPACT_AT * rows  # compact once this few rows are live (and the probe agrees)

    first, inverse = _first_of_each_prompt(prompt_ids, prompt_mask) if share_prefill else (None, None)
    if first is not None and first.numel() < rows and _prefill_keeps_its_bits(model, linears, rows, first,
                                                                             prompt_len):
        # n samples of one prompt: its prefill runs once, then its K/V rows are repeated (see the module docstring)
        out = model(input_ids=prompt_ids[first], attention_mask=mask[first, :prompt_len],
                    position_ids=positions[first], past_key_values=cache, use_cache=True, logits_to_keep=1,
                    return_dict=True)
        for layer in cache.layers:
            layer.expand_rows(inverse)
        out.logits = out.logits.index_select(0, inverse)
        prefill_rows = first.numel()
    else:
        prefill_rows = rows
        out = model(input_ids=prompt_ids, attention_mask=mask[:, :prompt_len], position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True)
    last_position = positions[:, -1:]
    steps = 0
    for t in range(max_new_tokens):
        logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
        del out
        if greedy:
            picked = torch.argmax(logits, dim=-1)
        else:
            scores = warpers(None, logits)
            probs = torch.softmax(scores, dim=-1)
            if live.numel() == rows:
                picked = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                # generate draws every row at every step; the finished rows' stale probabilities only keep the
                # draw shape (and so the live rows' draws) the same.
                probs_all.index_copy_(0, live, probs)
                picked = torch.multinomial(probs_all, num_samples=1).squeeze(1).index_select(0, live)
            if probs_all is None:
                probs_all = probs
            chosen = scores.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
            logp[live, t] = torch.where(unfinished, chosen - torch.logsumexp(scores, dim=-1), 0.0)
        picked = torch.where(unfinished, picked, pad)
        tokens[live, t] = picked
        steps = t + 1
        unfinished = unfinished & ~torch.isin(picked, stops)
        n_live = int(unfinished.sum())
        if n_live == 0 or steps == max_new_tokens:
            break
        if progress is not None and time.perf_counter() >= next_report:
            # tokens: those not padding (an end token that is also the pad token goes uncounted: a rough figure)
            progress(DecodeProgress(rows_done=rows - n_live, rows=rows, tokens=int((tokens[:, :steps] != pad_id).sum()),
                                    step=steps, max_steps=max_new_tokens, elapsed_s=time.perf_counter() - start))
            next_report = time.perf_counter() + progress_every_s
        if compact and n_live <= compact_below and not rows_keep_their_bits(linears, rows, live[unfinished]):
            compact_below = COMPACT_AT * n_live  # not exact here: probe again once another quarter of them ends
        elif compact and n_live <= compact_below:
            keep = unfinished.nonzero().squeeze(1)
            for layer in cache.layers:
                layer.keep_rows(keep)
            live, unfinished, picked = live[keep], unfinished[keep], picked[keep]
            mask, last_position = mask[keep], last_position[keep]
            compactions += 1
            compact_below = COMPACT_AT * live.numel()
        last_position = last_position + 1
        length = prompt_len + steps
        out = model(input_ids=picked.unsqueeze(1), attention_mask=mask[:, :length + 1], position_ids=last_position,
                    past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True)
    return DecodeResult(tokens=tokens[:, :steps], logp=logp[:, :steps], steps=steps, compactions=compactions,
                        prefill_rows=prefill_rows)


def _first_of_each_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt, in row order; for every row, the index of its prompt in ``first``)."""
    key = torch.where(prompt_mask.bool(), prompt_ids, torch.full_like(prompt_ids, -1))
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first_of: dict[int, int] = {}
    for row, group in enumerate(inverse.tolist()):  # once per call, not per step
        first_of.setdefault(group, row)
    order = {group: i for i, group in enumerate(first_of)}
    first = torch.tensor(list(first_of.values()), dtype=torch.long, device=prompt_ids.device)
    position = torch.tensor([order[g] for g in inverse.tolist()], dtype=torch.long, device=prompt_ids.device)
    return first, position


def _prefill_keeps_its_bits(model: torch.nn.Module, linears: dict[tuple, torch.nn.Linear], rows: int,
                            first: torch.Tensor, prompt_len: int) -> bool:
    """Whether a prefill of the prompts' first rows ``first`` alone gives each the bits of the full ``rows``-row
    prefill: every linear of the body sees those rows' ``prompt_len`` tokens out of ``rows x prompt_len``, the head
    (last position only) the rows ``first`` out of ``rows``."""
    head = model.get_output_embeddings()
    body = {k: m for k, m in linears.items() if m is not head}
    heads = {k: m for k, m in linears.items() if m is head}
    tokens = (first.unsqueeze(1) * prompt_len + torch.arange(prompt_len, device=first.device)).reshape(-1)
    return (rows_keep_their_bits(body, rows * prompt_len, tokens)
            and (not heads or rows_keep_their_bits(heads, rows, first)))


def linear_shapes(model: torch.nn.Module) -> dict[tuple, torch.nn.Linear]:
    """One ``nn.Linear`` of ``model`` per (in, out, bias, dtype): what :func:`rows_keep_their_bits` probes."""
    linears: dict[tuple, torch.nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            linears.setdefault((module.in_features, module.out_features, module.bias is not None,
                                module.weight.dtype), module)
    return linears


# (linear shapes, device, full rows, kept rows in order, threads, autocast dtype) -> whether they keep their bits
_KEEPS_BITS: dict[tuple, bool] = {}


def rows_keep_their_bits(linears: dict[tuple, torch.nn.Linear], full_rows: int, index: torch.Tensor) -> bool:
    """Whether every linear shape in ``linears`` (:func:`linear_shapes`) gives rows ``index`` of a ``full_rows``-row
    batch the same bits when it runs on those rows alone, in that order (through the model's own weights, on one
    random batch, under the caller's autocast). The matmul's kernel and its split of the rows between threads and
    register tiles depend on the row count and on where a row sits, not on the values: measured with torch 2.13 on
    2 threads, 16 rows cut to the 12 live ones keep their bits where the first 12 stay in place, but not where a row
    moves from position 7 to 6. So the exact mapping is what is checked; remembered per shape, mapping, thread count
    and autocast dtype. The model's other ops do not mix rows: elementwise ops and norms work on one row, attention
    on one row-head, softmax on one row."""
    if not linears:
        return False
    device_type = next(iter(linears.values())).weight.device.type
    autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    key = (tuple(sorted(linears, key=str)), device_type, full_rows, tuple(index.tolist()), torch.get_num_threads(),
           autocast)
    if key not in _KEEPS_BITS:
        if len(_KEEPS_BITS) > 4096:  # a long run sees many mappings: keep the memo bounded
            _KEEPS_BITS.clear()
        g = torch.Generator().manual_seed(0)
        ok = True
        for (fan_in, _, _, dtype), module in linears.items():
            weight = module.weight
            x = torch.randn((full_rows, fan_in), generator=g).to(device=weight.device, dtype=dtype)
            picked = index.to(weight.device)
            if not torch.equal(module(x).index_select(0, picked), module(x.index_select(0, picked))):
                ok = False
                break
        _KEEPS_BITS[key] = ok
    return _KEEPS_BITS[key]
