"""Policy models and tokenizers: a built-in char-level tokenizer and tiny random-init causal LMs (no downloads),
local Hugging Face checkpoints, device resolution, and the prompt format.

Notes for transformers 5.x (see docs ``cpu-tiny-model.md``):

* ``generate(do_sample=True)`` silently applies ``top_k=50`` unless ``top_k`` is passed: always pass
  ``top_k=0, top_p=1.0`` so the sampling distribution is the plain softmax that behaviour log-probs assume. (Putting
  ``top_k=0`` into ``model.generation_config`` is not an option: ``save_pretrained`` then refuses to save, because
  ``top_k`` is set while ``do_sample`` is not.)
* Token ids of the padding rows of the rounded-up vocabulary (``len(tokenizer) <= id < vocab_size``) can be sampled
  by an untrained model; they decode to nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import string
from typing import Any, Optional

import torch

__all__ = [
    "CHAR_TOKENIZER_FLAG",
    "CHAR_VOCAB",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "PolicyLoadError",
    "PromptFormatter",
    "build_char_tokenizer",
    "autocast_context",
    "build_tiny_model",
    "disable_dropout",
    "is_char_tokenizer",
    "load_policy",
    "load_policy_from_config",
    "load_tokenizer",
    "parse_dtype",
    "resolve_device",
]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
# The measured vocabulary first (digits, "+-*/=?:#.,$()", space, a-z, A-Z), then the rest of printable ASCII plus
# newline and tab, so GSM8K text (calculator annotations <<48/2=24>>, \boxed{}, quotes, %) round-trips exactly.
# 101 tokens in all, rounded up to a 128-row embedding: the same parameter count as the measured 77-token version.
_BASE_CHARS = string.digits + "+-*/=?:#.,$()" + " " + string.ascii_lowercase + string.ascii_uppercase
_EXTRA_CHARS = "".join(c for c in string.punctuation if c not in _BASE_CHARS) + "\n\t"
CHAR_VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(_BASE_CHARS) + tuple(_EXTRA_CHARS)
CHAR_TOKENIZER_FLAG = "stalerl_char_tokenizer"  # saved in tokenizer_config.json, survives save/load
TINY_ARCHS = ("qwen2", "llama")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class PolicyLoadError(RuntimeError):
    """The policy (model or tokenizer) could not be built or loaded."""


# --------------------------------------------------------------------------------------------------- tokenizer


def build_char_tokenizer():
    """The built-in char-level tokenizer (``PreTrainedTokenizerFast``; in transformers 5.x an alias of
    ``TokenizersBackend``): one token per character, exact round trip over ``CHAR_VOCAB``, left padding, no
    bos/eos added on encode. ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(CHAR_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # "[\s\S]" rather than "." so that newlines are single tokens too.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # without it decode() puts a space between characters
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,  # would turn " ," into "," and break the round trip
        **{CHAR_TOKENIZER_FLAG: True},
    )
    return tok


def is_char_tokenizer(tokenizer) -> bool:
    """True for the built-in char tokenizer, also after a save/reload."""
    if getattr(tokenizer, "init_kwargs", {}).get(CHAR_TOKENIZER_FLAG):
        return True
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return False
    return len(vocab) == len(CHAR_VOCAB) and all(vocab.get(t) == i for i, t in enumerate(CHAR_VOCAB))


def load_tokenizer(path: str):
    """The tokenizer saved in the local directory ``path``, with left padding and ``pad = eos`` when it has no pad
    token.

    The built-in char tokenizer (marked in its ``tokenizer_config.json``) is loaded as the plain
    ``PreTrainedTokenizerFast`` it was saved as: ``AutoTokenizer`` in transformers 5.x ignores the saved
    ``tokenizer_class`` when the directory's ``config.json`` has ``model_type`` ``qwen2`` and builds a
    ``Qwen2Tokenizer``, which replaces the pre-tokenizer and decoder with byte-level BPE ones (spaces vanish on
    decode). Everything else goes through ``AutoTokenizer`` (``local_files_only=True``).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = os.path.join(path, "tokenizer_config.json")
    flagged = False
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as f:
                flagged = bool(json.load(f).get(CHAR_TOKENIZER_FLAG))
        except (OSError, ValueError):
            flagged = False
    if flagged:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ------------------------------------------------------------------------------------------------------- models


def build_tiny_model(
    arch: str,
    tokenizer,
    *,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    seed: int = 0,
):
    """A random-init ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` (fp32, sdpa, tied embeddings) for ``tokenizer``.

    The vocabulary is ``len(tokenizer)`` rounded up to a multiple of 64. Initialisation uses ``seed`` only (the global
    torch RNG is left as it was). The default qwen2 has 542,080 parameters with the char tokenizer.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"tiny model: hidden_size ({hidden_size}) must be divisible by num_attention_heads "
            f"({num_attention_heads}), and num_attention_heads by num_key_value_heads ({num_key_value_heads})"
        )
    vocab_size = int(math.ceil(len(tokenizer) / 64) * 64)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        **ids,
    )
    config.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(torch.float32)
    for key, value in ids.items():
        setattr(model.generation_config, key, value)
    return model


def parse_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"actor.dtype={dtype!r} is not supported; use float32, bfloat16 or float16")
    return _DTYPES[key]


def autocast_context(device: torch.device, compute_dtype: Any):
    """The context every forward of the policy runs in: ``torch.autocast(compute_dtype)`` for a lower-precision
    compute dtype (parameters stay float32, matmuls run in bf16), nothing for float32.

    The same context for generation, behaviour/recompute log-probs and the training forward, so the three see the
    same numerics and an on-policy log-ratio is exactly 0 where the computation is the same."""
    dtype = parse_dtype(compute_dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Switch every dropout of ``model`` off, in place (as verl and TRL do for RL training).

    Behaviour log-probs come from an eval-mode (dropout-free) pass; a training forward with dropout would make the
    on-policy log-ratio nonzero and the update depend on the micro-batch split (the dropout masks follow the RNG).
    Covers ``nn.Dropout`` modules and float attributes named ``*dropout`` that HF attention modules read in train
    mode (e.g. ``Qwen2Attention.attention_dropout``). ``model.config`` is left alone, so a saved model keeps its
    dropout settings for whoever fine-tunes it next."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if name.endswith("dropout") and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` -> ``cuda`` when available, else ``cpu``. A CUDA (or MPS) device that is not there is an error
    naming ``actor.device``."""
    if isinstance(device, torch.device):
        device = str(device)
    if device is None or str(device).lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"actor.device={device!r} is not a device torch knows ({e}); use auto, cpu or cuda") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"actor.device={device!r} but CUDA is not available in this environment (torch {torch.__version__}); "
                "set actor.device=cpu or auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(
                f"actor.device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise RuntimeError(f"actor.device={device!r} but MPS is not available; set actor.device=cpu or auto")
    elif dev.type != "cpu":
        raise ValueError(f"actor.device={device!r}: unsupported device type {dev.type!r}; use auto, cpu or cuda")
    return dev


def load_policy(
    path: str,
    *,
    tiny_kwargs: Optional[dict] = None,
    dtype: Any = "float32",
    device: Any = "cpu",
    seed: int = 0,
):
    """``(model, tokenizer)`` for ``actor.path``, in eval mode, on ``device`` in ``dtype``.

    ``"tiny:qwen2"`` / ``"tiny:llama"``: the char tokenizer and ``build_tiny_model(arch, tok, seed=seed,
    **tiny_kwargs)``. Anything else is a local Hugging Face directory (``config.json`` + weights + tokenizer files),
    loaded with ``local_files_only=True``; its tokenizer is switched to left padding, and gets ``pad = eos`` when it
    has no pad token. The device, dtype and path are checked before any model is built.
    """
    dev = resolve_device(device)
    torch_dtype = parse_dtype(dtype)
    if not isinstance(path, str) or not path:
        raise ValueError(f"actor.path must be a non-empty string, got {path!r}; use tiny:qwen2 or a local directory")
    if path.startswith("tiny:"):
        arch = path.split(":", 1)[1]
        if arch not in TINY_ARCHS:
            raise ValueError(
                f"actor.path={path!r}: unknown tiny architecture {arch!r}; use one of "
                + ", ".join(f"tiny:{a}" for a in TINY_ARCHS)
            )
        kwargs = dict(tiny_kwargs or {})
        if "seed" in kwargs and kwargs["seed"] != seed:
            raise ValueError(f"tiny model options set seed={kwargs['seed']} but load_policy got seed={seed}")
        kwargs["seed"] = seed
        tokenizer = build_char_tokenizer()
        try:
            model = build_tiny_model(arch, tokenizer, **kwargs)
        except TypeError as e:
            raise ValueError(f"actor.path={path!r}: bad tiny model option ({e})") from None
        model = model.to(device=dev, dtype=torch_dtype)
        model.eval()
        return model, tokenizer

    from stalerl.core.model_store import resolve_model_path, stderr_log  # a known model name: fetched once

    local = os.path.expanduser(resolve_model_path(path, log=stderr_log))
    if not os.path.exists(local):
        raise FileNotFoundError(
            f"actor.path={path!r} does not exist. Nothing is downloaded: use a built-in tiny model "
            "(actor.path=tiny:qwen2 or tiny:llama), a known model (stalerl-model list), or a local directory "
            "holding a Hugging Face checkpoint (config.json, weights, tokenizer files)"
        )
    if not os.path.isdir(local):
        raise ValueError(
            f"actor.path={path!r} is a file; it must be a directory holding a Hugging Face checkpoint "
            "(config.json, weights, tokenizer files), or tiny:qwen2"
        )
    if not os.path.isfile(os.path.join(local, "config.json")):
        raise FileNotFoundError(
            f"actor.path={path!r} has no config.json, so it is not a Hugging Face model directory "
            f"(it holds: {', '.join(sorted(os.listdir(local))[:15]) or 'nothing'})"
        )
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = load_tokenizer(local)
    except Exception as e:
        raise PolicyLoadError(
            f"actor.path={path!r}: failed to load the tokenizer ({type(e).__name__}: {e})"
        ) from e
    try:
        model = AutoModelForCausalLM.from_pretrained(local, local_files_only=True, dtype=torch_dtype)
    except Exception as e:
        raise PolicyLoadError(
            f"actor.path={path!r}: failed to load the model ({type(e).__name__}: {e})"
        ) from e
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model = model.to(dev)
    model.eval()
    return model, tokenizer


# ------------------------------------------------------------------------------------------------------ prompts


class PromptFormatter:
    """Turns a question into the prompt text, and an example into the warm-start (SFT) target text.

    ``kind`` (chosen from the tokenizer unless given):

    * ``"char"`` (the built-in char tokenizer): ``Q: {question} A:``; target ``" " + example.answer``
      (e.g. ``" #### 58"``);
    * ``"chat"`` (the tokenizer has a chat template): the template applied to one user message,
      ``question + "\\nPlease put your final answer within \\boxed{}."``, with the generation prompt; target: the
      worked answer without GSM8K calculator annotations and the ``#### N`` line, then
      ``"The final answer is \\boxed{N}."``;
    * ``"plain"``: ``Question: {question}\\nAnswer:``; target ``" " + example.answer``.

    The caller appends the eos token to the target.
    """

    KINDS = ("char", "chat", "plain")
    BOXED_INSTRUCTION = "\nPlease put your final answer within \\boxed{}."

    def __init__(self, tokenizer, kind: Optional[str] = None, instruction: Optional[str] = None):
        if kind == "auto":
            kind = None
        if kind is None:
            if is_char_tokenizer(tokenizer):
                kind = "char"
            elif getattr(tokenizer, "chat_template", None):
                kind = "chat"
            else:
                kind = "plain"
        if kind not in self.KINDS:
            raise ValueError(f"prompt format must be one of {self.KINDS}, got {kind!r}")
        if kind == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompt format 'chat' needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.kind = kind
        # prompt.instruction: appended to the question; None = the kind's default (only chat has one)
        self.instruction = instruction if instruction is not None else (
            self.BOXED_INSTRUCTION if kind == "chat" else "")

    @classmethod
    def from_config(cls, tokenizer, cfg: Any) -> "PromptFormatter":
        """The run config's ``prompt`` section (every process that formats prompts builds it this way)."""
        prompt = getattr(cfg, "prompt", None)
        if prompt is None:
            return cls(tokenizer)
        return cls(tokenizer, kind=prompt.format, instruction=prompt.instruction)

    def format(self, question: str) -> str:
        if self.kind == "char":
            return f"Q: {question}{self.instruction} A:"
        if self.kind == "chat":
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question + self.instruction}],
                add_generation_prompt=True,
                tokenize=False,
            )
        return f"Question: {question}{self.instruction}\nAnswer:"

    def sft_target(self, example) -> str:
        if self.kind != "chat":
            return " " + example.answer
        body = example.answer.rsplit("####", 1)[0]
        body = re.sub(r"<<[^<>]*>>", "", body).strip()
        final = example.final
        return (body + "\n" if body else "") + f"The final answer is \\boxed{{{final}}}."


def load_policy_from_config(cfg: Any):
    """``load_policy`` with the run config's actor section (the controller, train ranks and rollout workers all
    build the same policy this way, so their initial weights are identical).

    The parameters are always float32 (master weights: a bf16 parameter does not move under lr ~1e-6 AdamW
    updates); ``actor.dtype`` is the compute dtype, applied with :func:`autocast_context` by the actor and the
    rollout engine. Dropout is switched off (:func:`disable_dropout`)."""
    actor = cfg.actor
    tiny = {k: getattr(actor.tiny, k) for k in actor.tiny.__dataclass_fields__}
    model, tokenizer = load_policy(actor.path, tiny_kwargs=tiny, dtype="float32",
                                   device=str(resolve_device(actor.device)), seed=cfg.seed)
    disable_dropout(model)
    if actor.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tokenizer
