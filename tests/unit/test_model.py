"""stalerl.core.model: char tokenizer, tiny models, load_policy, device resolution, prompt format (CPU, no downloads)."""

import json
import os

import pytest
import torch

from stalerl.data import Example
from stalerl.core.model import (
    CHAR_VOCAB,
    PolicyLoadError,
    PromptFormatter,
    build_char_tokenizer,
    build_tiny_model,
    is_char_tokenizer,
    load_policy,
    load_tokenizer,
    parse_dtype,
    resolve_device,
)

TEXTS = [
    "Q: 53+5=? A: #### 58",
    "Tom has 36 apples. He buys 13 more and gives 20 away. How many apples does he have now?",
    "36+13=49. 49-20=29. #### 29",
    "a  b , . ( x ) $3 <<48/2=24>> \\boxed{3} 'quoted' 50% \n new line\ttab",
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen(tok):
    return build_tiny_model("qwen2", tok)


@pytest.fixture(scope="module")
def saved_qwen(tmp_path_factory, tok, qwen):
    d = tmp_path_factory.mktemp("tiny_qwen2")
    qwen.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _enc(tok, texts):
    return tok(texts, return_tensors="pt", padding=True)


# ------------------------------------------------------------------------------------------------ tokenizer


def test_char_tokenizer_round_trip(tok):
    assert len(tok) == len(CHAR_VOCAB) <= 128
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert len(ids) == len(text)  # one token per character, no bos/eos added
        assert 3 not in ids  # no <unk>
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("Ab1").input_ids) == ["A", "b", "1"]
    assert tok.decode(tok("ab").input_ids + [tok.eos_token_id, 0], skip_special_tokens=True) == "ab"
    assert tok("é").input_ids == [tok.unk_token_id]


def test_char_tokenizer_left_padding(tok):
    enc = _enc(tok, ["ab", "abcd"])
    assert enc.input_ids.tolist() == [[0, 0] + tok("ab").input_ids, tok("abcd").input_ids]
    assert enc.attention_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_char_tokenizer_save_and_autotokenizer_reload(tmp_path, tok):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["padding_side"] == "left"
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert reloaded.padding_side == "left" and reloaded.pad_token_id == 0 and reloaded.eos_token_id == 1
    for text in TEXTS:
        assert reloaded(text).input_ids == tok(text).input_ids
        assert reloaded.decode(reloaded(text).input_ids) == text
    assert is_char_tokenizer(reloaded)


def test_load_tokenizer_next_to_a_qwen2_config(saved_qwen, tok):
    # transformers 5.x AutoTokenizer would build a byte-level Qwen2Tokenizer here; load_tokenizer must not
    reloaded = load_tokenizer(saved_qwen)
    for text in TEXTS:
        assert reloaded(text).input_ids == tok(text).input_ids
        assert reloaded.decode(reloaded(text).input_ids) == text
    assert reloaded.padding_side == "left"


# --------------------------------------------------------------------------------------------------- models


def test_tiny_qwen2_defaults(tok, qwen):
    n = sum(p.numel() for p in qwen.parameters())
    assert n == 542_080  # measured reference size (vocab 101 -> 128)
    cfg = qwen.config
    assert cfg.vocab_size == 128 and cfg.tie_word_embeddings and cfg._attn_implementation == "sdpa"
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 2)
    g = qwen.generation_config
    assert (g.pad_token_id, g.eos_token_id, g.bos_token_id) == (0, 1, 2)
    assert qwen.dtype == torch.float32


def test_tiny_llama_and_sizes(tok):
    llama = build_tiny_model("llama", tok)
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in llama.parameters()) == 541_312
    bigger = build_tiny_model("qwen2", tok, hidden_size=256, num_hidden_layers=4, intermediate_size=1024)
    assert 4.0e6 < sum(p.numel() for p in bigger.parameters()) < 4.5e6
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt2'"):
        build_tiny_model("gpt2", tok)
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model("qwen2", tok, hidden_size=130)


def test_tiny_model_deterministic_and_leaves_global_rng(tok, qwen):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    again = build_tiny_model("qwen2", tok, seed=0)
    assert torch.equal(torch.rand(3), before)  # global RNG untouched
    for (k, a), b in zip(qwen.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    other = build_tiny_model("qwen2", tok, seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, qwen.model.embed_tokens.weight)


def test_generate_pure_sampling(tok, qwen):
    enc = _enc(tok, ["Q: 1+2=? A:", "Q: 10+20=? A:"])
    torch.manual_seed(0)
    out = qwen.generate(
        **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6,
        output_logits=True, output_scores=True, return_dict_in_generate=True,
    )
    assert out.sequences.shape[0] == 2 and out.sequences.shape[1] <= enc.input_ids.shape[1] + 6
    assert torch.equal(out.sequences[:, : enc.input_ids.shape[1]], enc.input_ids)
    # top_k=0 / top_p=1: the processed scores are the raw logits (no -inf from a hidden top_k=50)
    for s, l in zip(out.scores, out.logits):
        assert torch.isfinite(s).all() and torch.allclose(s, l)
    torch.manual_seed(0)
    again = qwen.generate(**enc, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=6)
    assert torch.equal(again, out.sequences)
    assert isinstance(tok.batch_decode(again[:, enc.input_ids.shape[1]:], skip_special_tokens=True)[0], str)


# ---------------------------------------------------------------------------------------------- load_policy


def test_load_policy_tiny(tok):
    model, tokenizer = load_policy("tiny:qwen2", tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    assert sum(p.numel() for p in model.parameters()) == 542_080 and is_char_tokenizer(tokenizer)
    assert not model.training
    model_l, _ = load_policy("tiny:llama", tiny_kwargs={"num_hidden_layers": 1}, dtype="fp32", device="auto", seed=0)
    assert model_l.config.num_hidden_layers == 1 and type(model_l).__name__ == "LlamaForCausalLM"
    bf, _ = load_policy("tiny:qwen2", tiny_kwargs={}, dtype="bfloat16", device="cpu", seed=0)
    assert bf.dtype == torch.bfloat16
    assert bf(**_enc(tok, ["Q: 1+1=? A:"])).logits.dtype == torch.bfloat16
    a, _ = load_policy("tiny:qwen2", tiny_kwargs={}, dtype="float32", device="cpu", seed=3)
    b, _ = load_policy("tiny:qwen2", tiny_kwargs={}, dtype="float32", device="cpu", seed=3)
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_save_and_load_policy_round_trip(saved_qwen, tok, qwen):
    model, tokenizer = load_policy(saved_qwen, tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    texts = ["Q: 1+2=? A:", "Q: 10+20=? A: #### 30"]
    enc = _enc(tok, texts)
    assert torch.equal(_enc(tokenizer, texts).input_ids, enc.input_ids)  # the reloaded tokenizer agrees
    qwen.eval()
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, qwen(**enc).logits)
    assert tokenizer.padding_side == "left" and PromptFormatter(tokenizer).kind == "char"
    assert model.generation_config.eos_token_id == 1 and model.config.pad_token_id == 0


def test_load_policy_errors(tmp_path, saved_qwen):
    with pytest.raises(FileNotFoundError, match=r"actor.path='/no/such/model' does not exist.*tiny:qwen2.*local"):
        load_policy("/no/such/model", tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    with pytest.raises(FileNotFoundError, match=r"Qwen/Qwen2.5-0.5B.*does not exist"):
        load_policy("Qwen/Qwen2.5-0.5B", tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"no config.json.*weights.bin"):
        load_policy(str(tmp_path / "empty"), tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    with pytest.raises(ValueError, match="is a file"):
        load_policy(str(tmp_path / "empty" / "weights.bin"), tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    # config.json and tokenizer present, weights missing -> wrapped load failure naming the path
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(saved_qwen):
        if not name.endswith(".safetensors"):
            (broken / name).write_bytes((open(os.path.join(saved_qwen, name), "rb")).read())
    with pytest.raises(PolicyLoadError, match=r"actor.path='.*broken': failed to load the model"):
        load_policy(str(broken), tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(PolicyLoadError, match=r"broken'"):
        load_policy(str(broken), tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    with pytest.raises(ValueError, match="unknown tiny architecture 'mamba'"):
        load_policy("tiny:mamba", tiny_kwargs={}, dtype="float32", device="cpu", seed=0)
    with pytest.raises(ValueError, match="bad tiny model option"):
        load_policy("tiny:qwen2", tiny_kwargs={"hidden": 64}, dtype="float32", device="cpu", seed=0)
    with pytest.raises(ValueError, match="actor.dtype='int8'"):
        load_policy("tiny:qwen2", tiny_kwargs={}, dtype="int8", device="cpu", seed=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_cuda_requested_without_cuda():
    with pytest.raises(RuntimeError, match=r"actor.device='cuda'.*not available"):
        resolve_device("cuda")
    with pytest.raises(RuntimeError, match=r"actor.device='cuda:0'"):
        load_policy("tiny:qwen2", tiny_kwargs={}, dtype="float32", device="cuda:0", seed=0)
    assert resolve_device("auto") == torch.device("cpu")


def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="actor.device='gpu0'"):
        resolve_device("gpu0")
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    assert parse_dtype(torch.float16) is torch.float16


# ------------------------------------------------------------------------------------------------ prompting


def test_prompt_formatter_char(tok):
    fmt = PromptFormatter(tok)
    assert fmt.kind == "char"
    assert fmt.format("53+5=?") == "Q: 53+5=? A:"
    ex = Example("53+5=?", "#### 58", "58")
    assert fmt.sft_target(ex) == " #### 58"
    assert tok.decode(tok(fmt.format(ex.question) + fmt.sft_target(ex)).input_ids) == "Q: 53+5=? A: #### 58"


def test_prompt_formatter_chat_template(tmp_path):
    chat_tok = build_char_tokenizer()
    chat_tok.init_kwargs.pop("stalerl_char_tokenizer")
    chat_tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    # make it look like a different tokenizer (not the built-in vocabulary) and give it a chat template
    chat_tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert not is_char_tokenizer(chat_tok)
    fmt = PromptFormatter(chat_tok)
    assert fmt.kind == "chat"
    prompt = fmt.format("What is 2+3?")
    assert prompt == "<|user|>What is 2+3?\nPlease put your final answer within \\boxed{}.\n<|assistant|>"
    ex = Example("q", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72")
    target = fmt.sft_target(ex)
    assert target == "Natalia sold 48/2 = 24 clips.\nThe final answer is \\boxed{72}."
    from stalerl.core.reward import gsm8k_reward

    assert gsm8k_reward(target, ex.answer) == 1.0
    # the template survives save/reload
    chat_tok.save_pretrained(tmp_path)
    assert PromptFormatter(load_tokenizer(str(tmp_path))).format("hi") == fmt.format("hi")


def test_prompt_formatter_plain_and_errors():
    plain_tok = build_char_tokenizer()
    plain_tok.init_kwargs.pop("stalerl_char_tokenizer")
    plain_tok.add_tokens(["<extra>"])  # vocabulary differs from the built-in one
    fmt = PromptFormatter(plain_tok)
    assert fmt.kind == "plain"
    assert fmt.format("2+3?") == "Question: 2+3?\nAnswer:"
    assert fmt.sft_target(Example("2+3?", "#### 5", "5")) == " #### 5"
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        PromptFormatter(plain_tok, kind="chat")
    with pytest.raises(ValueError, match="prompt format must be one of"):
        PromptFormatter(plain_tok, kind="fancy")
    assert PromptFormatter(plain_tok, kind="char").format("x") == "Q: x A:"


def test_prompt_instruction_replaces_the_formats_default_and_comes_from_the_config(tmp_path):
    from stalerl.config import load_config

    chat_tok = build_char_tokenizer()
    chat_tok.init_kwargs.pop("stalerl_char_tokenizer")
    chat_tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fmt = PromptFormatter(chat_tok, kind="chat", instruction=" Answer with just the number.")
    assert fmt.format("What is 2+3?") == "<|user|>What is 2+3? Answer with just the number.\n<|assistant|>"
    assert PromptFormatter(chat_tok, kind="chat", instruction="").format("x") == "<|user|>x\n<|assistant|>"
    assert PromptFormatter(chat_tok, kind="plain", instruction=" Be brief.").format("x") == "Question: x Be brief.\nAnswer:"
    assert PromptFormatter(build_char_tokenizer(), kind="auto").format("1+1=?") == "Q: 1+1=? A:"  # char: no default
    cfg = load_config(["prompt.format=plain", "prompt.instruction= Just the number."])
    assert PromptFormatter.from_config(chat_tok, cfg).format("x") == "Question: x Just the number.\nAnswer:"
    cfg = load_config(["prompt.format=chat"])  # the default instruction: ask for \boxed{}
    assert PromptFormatter.from_config(chat_tok, cfg).format("x") == (
        "<|user|>x\nPlease put your final answer within \\boxed{}.\n<|assistant|>")
