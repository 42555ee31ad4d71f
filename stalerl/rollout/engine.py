"""Rollout engines: generate n samples per prompt and return a :class:`RolloutBatch` with rewards.

Every engine returns, per response token, the behaviour log-prob under the distribution it actually sampled from
(temperature applied; top-k/top-p truncation included when enabled) and the weight version that produced it.

Two decode paths in :class:`HFRolloutEngine` (``decode=``): ``"static"`` (the default,
:mod:`stalerl.rollout.static_decode`: a preallocated KV cache, a fixed amount of Python per step, one prefill per
prompt for its n samples; finished rows compacted away on request) and ``"generate"`` (transformers' ``generate`` with
:class:`SampledLogProbRecorder`). They give bit-identical tokens and float32 log-probs
(tests/unit/test_static_decode.py); the second stays as the reference. Only the static path prints progress lines.

Memory. Only the sampled token's log-prob is kept per step (:class:`SampledLogProbRecorder`), never the
(rows x steps x vocab) stack of scores: with a 151,936-token vocabulary, 512 rows x 256 steps of float32 scores
would be ~80 GB.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from stalerl.core.model import autocast_context
from stalerl.rollout.batch import RolloutBatch
from stalerl.rollout.static_decode import DecodeProgress, static_decode

RewardFn = Callable[[str, str], float]

# HFRolloutEngine's decode loops: the static-cache loop (default) and transformers' generate (the exactness reference).
DECODE_PATHS = ("static", "generate")
# A generate call that has run this long prints a progress line, then one per this many seconds (issue 43 item 7).
PROGRESS_EVERY_S = 30.0


class RolloutEngine(Protocol):
    version: int

    def generate(self, questions: Sequence[str], answers: Sequence[str], *, n_samples: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                 ) -> RolloutBatch: ...

    def set_version(self, version: int) -> None: ...


def stop_token_ids(tokenizer, generation_config: Any = None) -> tuple[int, ...]:
    """The end tokens every engine stops at (and keeps, as the response's last token): the tokenizer's eos, then
    each ``eos_token_id`` of the model's generation config, in order, without repeats.

    ``generation_config``: the model's ``generation_config`` (transformers reads ``generation_config.json``, or falls
    back to ``config.json``'s ``eos_token_id`` when the file is absent; vLLM does the same). Qwen2.5-Instruct lists
    two (``<|im_end|>``, ``<|endoftext|>``): vLLM stops at both on its own, transformers' ``generate`` only at what
    it is given, so both engines are given this set explicitly."""
    ids: list[int] = []
    listed = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if listed is None:
        listed = []
    elif isinstance(listed, int):
        listed = [listed]
    for token in [tokenizer.eos_token_id, *listed]:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    if not ids:
        raise ValueError("the tokenizer has no eos token and the model's generation config lists none: nothing "
                         "would end a response")
    return tuple(ids)


def generation_seed(run_seed: int, first_task_id: int) -> int:
    """The sampling seed of a generate call: the same tasks get the same samples in the sync and async loops."""
    return (run_seed * 1_000_003 + first_task_id) % (2**63 - 1)


class SampledLogProbRecorder(LogitsProcessor):
    """Applies the sampling warpers (temperature, then top-k, then top-p: transformers' own classes in its order) and
    records the log-prob of each sampled token under the processed distribution, one (rows,) column per step.

    The warpers live here rather than in ``generate``'s own list because transformers runs user processors *before*
    its warpers; with ``temperature=1, top_k=0, top_p=1`` in the ``GenerationConfig`` it adds none, so this is the
    last processor and its output is exactly what ``torch.multinomial`` draws from. The token sampled from step t's
    scores is only known at step t+1 (the last column of ``input_ids``), so one step's scores are held until then:
    memory is one (rows x vocab) block plus (rows x steps) floats. Call :meth:`finish` with the final sequences."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        self.warpers = LogitsProcessorList()
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        self.columns: list[torch.Tensor] = []
        self._pending: Optional[torch.Tensor] = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = self.warpers(input_ids, scores)
        if self._pending is not None:
            self._record(input_ids[:, -1])
        self._pending = scores
        return scores

    def _record(self, tokens: torch.Tensor) -> None:
        pending = self._pending
        picked = pending.gather(-1, tokens.unsqueeze(-1).to(pending.device)).squeeze(-1)
        self.columns.append(picked.float() - torch.logsumexp(pending.float(), dim=-1))
        self._pending = None

    def finish(self, sequences: torch.Tensor, num_generated: int) -> torch.Tensor:
        """(rows, num_generated) float32 log-probs of the generated tokens (the last ``num_generated`` columns)."""
        if self._pending is not None:
            self._record(sequences[:, -1])
        if len(self.columns) != num_generated:
            raise RuntimeError(f"recorded {len(self.columns)} behaviour log-prob steps for {num_generated} generated "
                               "tokens; a logits processor ran out of step with generate()")
        if not self.columns:
            return torch.zeros((sequences.shape[0], 0), dtype=torch.float32, device=sequences.device)
        return torch.stack(self.columns, dim=1)


class HFRolloutEngine:
    """transformers ``generate`` on a causal LM (the trainer's own module when they share a process).

    ``format_prompt`` turns a question into the prompt text (chat template or the tiny model's ``Q: .. A:``);
    ``reward_fn(completion, answer)`` scores each response.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, format_prompt: Callable[[str], str], reward_fn: RewardFn,
                 *, device: Optional[torch.device] = None, version: int = 0, compute_dtype: str = "float32",
                 decode: str = "static", compact_finished_rows: bool = False, share_prompt_prefill: bool = True,
                 log: Callable[[str], None] = print,
                 progress_every_s: float = PROGRESS_EVERY_S):
        """``decode``: ``"static"`` (:func:`~stalerl.rollout.static_decode.static_decode`: a preallocated KV cache and
        a fixed amount of Python per step; the same tokens and log-probs) or ``"generate"`` (transformers'
        ``generate``, the reference it is tested against). ``share_prompt_prefill``: the n samples of a prompt share
        one prefill of it (static decode only, where a probe of this machine's matmuls finds it bit-exact).
        ``compact_finished_rows``: finished rows leave the batch (static decode only; off by default: bit-exact on
        one thread, not on two, where attention's result for a row that moved differs in the last bits; see
        :mod:`stalerl.rollout.static_decode`). ``log``: where the progress line of a generation longer than
        ``progress_every_s`` goes (the trainer's own ``log``)."""
        if decode not in DECODE_PATHS:
            raise ValueError(f"decode={decode!r}: expected one of {', '.join(DECODE_PATHS)}")
        self.decode = decode
        self.compact_finished_rows = bool(compact_finished_rows)
        self.share_prompt_prefill = bool(share_prompt_prefill)
        self.log = log
        self.progress_every_s = float(progress_every_s)
        self.last_decode_steps = 0  # decode steps of the last generate call (its response length)
        self.last_prefill_rows = 0  # rows the last static-path prefill ran on (fewer than the rows when shared)
        self.model = model
        # actor.dtype: generation runs under the same autocast as the actor's forward (parameters stay float32).
        self.compute_dtype = compute_dtype
        self.tokenizer = tokenizer
        self.format_prompt = format_prompt
        self.reward_fn = reward_fn
        self.device = device or next(model.parameters()).device
        self.version = version
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        if self.pad_id is None or self.eos_id is None:
            raise ValueError("the tokenizer needs pad and eos tokens for batched generation")
        self.stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.last_generate_seconds = 0.0

    def set_version(self, version: int) -> None:
        self.version = int(version)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Install a complete weight set, then its version (never a half-written one: load_state_dict is atomic
        from the sampler's point of view because sampling runs in this same thread)."""
        self.model.load_state_dict(state_dict)
        self.set_version(version)

    def tokenize_prompts(self, questions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [self.format_prompt(q) for q in questions]
        self.tokenizer.padding_side = "left"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device).bool()

    @torch.no_grad()
    def generate(self, questions: Sequence[str], answers: Sequence[str], *, n_samples: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
                 ) -> RolloutBatch:
        start = time.perf_counter()
        prompt_ids, prompt_mask = self.tokenize_prompts(questions)
        prompt_ids = prompt_ids.repeat_interleave(n_samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(n_samples, dim=0)
        group_ids = torch.arange(len(questions)).repeat_interleave(n_samples)
        was_training = self.model.training
        self.model.eval()
        try:
            with autocast_context(self.device, self.compute_dtype):
                if self.decode == "static":
                    response_ids, behavior_logp = self._static_decode(prompt_ids, prompt_mask, max_new_tokens,
                                                                      temperature, top_p, top_k, greedy, start)
                else:
                    response_ids, behavior_logp = self._hf_generate(prompt_ids, prompt_mask, max_new_tokens,
                                                                    temperature, top_p, top_k, greedy)
        finally:
            if was_training:
                self.model.train()
        response_mask = _mask_through_first_eos(response_ids, self.stop_ids)
        response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, self.pad_id))
        behavior_logp = torch.where(response_mask, behavior_logp, torch.zeros_like(behavior_logp))
        texts = self.tokenizer.batch_decode(
            [ids[m].tolist() for ids, m in zip(response_ids.cpu(), response_mask.cpu())], skip_special_tokens=True)
        row_answers = [answers[i // n_samples] for i in range(len(texts))]
        rewards = torch.tensor([float(self.reward_fn(t, a)) for t, a in zip(texts, row_answers)],
                               dtype=torch.float32)
        versions = torch.where(response_mask.cpu(), torch.full(response_mask.shape, self.version, dtype=torch.long),
                               torch.full(response_mask.shape, -1, dtype=torch.long))
        batch = RolloutBatch(
            prompt_ids=prompt_ids.cpu(), prompt_mask=prompt_mask.cpu(), response_ids=response_ids.cpu(),
            response_mask=response_mask.cpu(), behavior_logp=behavior_logp.cpu(), versions=versions,
            rewards=rewards, group_ids=group_ids, texts=texts, answers=row_answers,
        )
        self.last_generate_seconds = time.perf_counter() - start
        return batch

    def _static_decode(self, prompt_ids, prompt_mask, max_new_tokens, temperature, top_p, top_k, greedy, start):
        rows = prompt_ids.shape[0]

        def report(p: DecodeProgress) -> None:
            elapsed = time.perf_counter() - start  # the whole call: tokenization and prefill included
            rate = p.tokens / max(p.elapsed_s, 1e-9)
            # At most max_steps - step more steps at the rate so far: an upper bound, rows usually end earlier.
            eta = (p.max_steps - p.step) * p.elapsed_s / max(p.step, 1)
            self.log(f"generation: {p.rows_done}/{rows} rows done, step {p.step}/{p.max_steps}, {p.tokens} tokens "
                     f"at {rate:.1f} tokens/s, {elapsed:.0f} s so far, ETA <= {format_duration(eta)}")

        result = static_decode(self.model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                               stop_ids=self.stop_ids, pad_id=self.pad_id, greedy=greedy, temperature=temperature,
                               top_k=top_k, top_p=top_p, compact=self.compact_finished_rows,
                               share_prefill=self.share_prompt_prefill, progress=report,
                               progress_every_s=self.progress_every_s)
        self.last_decode_steps, self.last_prefill_rows = result.steps, result.prefill_rows
        return result.tokens, result.logp

    def _hf_generate(self, prompt_ids, prompt_mask, max_new_tokens, temperature, top_p, top_k, greedy):
        """transformers' ``generate`` with a :class:`SampledLogProbRecorder`: the path the static loop must equal."""
        # An explicit GenerationConfig: the checkpoint's own generation_config.json (repetition_penalty, top_k=50
        # defaults, ...) would otherwise reshape the sampling distribution, and the behaviour log-probs would no
        # longer be the policy's softmax at the sampling temperature.
        gen = GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                               eos_token_id=list(self.stop_ids),
                               bos_token_id=getattr(self.tokenizer, "bos_token_id", None),
                               return_dict_in_generate=True, repetition_penalty=1.0, num_beams=1)
        processors = LogitsProcessorList()
        recorder = None
        if greedy:
            gen.do_sample = False
        else:
            gen.do_sample = True
            # The warpers run inside the recorder (see SampledLogProbRecorder); generate adds none of its own.
            gen.temperature, gen.top_p, gen.top_k = 1.0, 1.0, 0
            recorder = SampledLogProbRecorder(temperature=temperature, top_k=top_k, top_p=top_p)
            processors.append(recorder)
        out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=gen,
                                  logits_processor=processors)
        response_ids = out.sequences[:, prompt_ids.shape[1]:]
        self.last_decode_steps = response_ids.shape[1]
        if recorder is None:
            return response_ids, torch.zeros(response_ids.shape, dtype=torch.float32, device=response_ids.device)
        return response_ids, recorder.finish(out.sequences, response_ids.shape[1])


def format_duration(seconds: float) -> str:
    """'45 s', '3 min 05 s', '2 h 07 min': the ETA of a progress line (generation here, the actor's update)."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _mask_through_first_eos(ids: torch.Tensor, eos_id: Union[int, Sequence[int]]) -> torch.Tensor:
    """True for tokens up to and including the first end token (``eos_id``: one id or several) of each row (all
    tokens if there is none)."""
    stops = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=ids.dtype, device=ids.device)
    is_eos = torch.isin(ids, stops)
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # eos strictly before this position
    return eos_before == 0


def evaluate_engine(engine: Any, examples: Sequence[Any], eval_gconfig: Any, batch_size: int) -> dict[str, Any]:
    """The evaluation every loop runs (the synchronous trainer on its own engine, an asynchronous run on a rollout
    worker's): ``examples`` (``.question``/``.final`` or ``(question, answer)`` pairs) in consecutive chunks of
    ``batch_size`` prompts, ``eval_gconfig``'s sampling (greedy by default), rewards summed.

    Returns ``correct`` (the summed rewards), ``n`` (prompts x samples), ``accuracy`` and ``digest``: a SHA-256 of
    every generated text in order, so two evaluations can be shown to have generated exactly the same answers."""
    import hashlib

    pairs = [(e.question, e.final) if hasattr(e, "question") else (e[0], e[1]) for e in examples]
    g = eval_gconfig
    correct, digest = 0.0, hashlib.sha256()
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        out = engine.generate([q for q, _ in chunk], [a for _, a in chunk], n_samples=g.n_samples,
                              max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                              top_k=g.top_k, greedy=g.greedy)
        correct += float(out.rewards.sum())
        for text in out.texts:
            digest.update(text.encode("utf-8", "surrogatepass") + b"\0")
    n = len(pairs) * g.n_samples
    return {"correct": correct, "n": n, "accuracy": correct / max(1, n), "digest": digest.hexdigest()}
