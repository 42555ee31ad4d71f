"""actor.dtype=auto's choice (stalerl.core.hardware): bf16 only where the hardware multiplies it natively."""

from stalerl.core.hardware import auto_compute_dtype, cpu_flags


def test_bf16_on_cpus_with_native_bf16_and_float32_elsewhere():
    assert auto_compute_dtype("cpu", {"avx2", "avx512f", "avx512_bf16"})[0] == "bfloat16"
    assert auto_compute_dtype("cpu", {"avx2", "amx_bf16", "amx_tile"})[0] == "bfloat16"
    dtype, why = auto_compute_dtype("cpu", {"avx2", "fma", "avx512f", "avx512bw"})  # AVX512 without BF16
    assert dtype == "float32" and "neither AMX-BF16 nor AVX512-BF16" in why
    assert auto_compute_dtype("cpu", set())[0] == "float32"  # no /proc/cpuinfo (macOS, ARM): the safe choice
    assert "amx_bf16" in auto_compute_dtype("cpu", {"avx512_bf16", "amx_bf16"})[1]  # names the faster unit


def test_cuda_follows_the_cards_bf16_support():
    assert auto_compute_dtype("cuda", cuda_bf16=True)[0] == "bfloat16"
    assert auto_compute_dtype("cuda", cuda_bf16=False)[0] == "float32"


def test_cpu_flags_reads_the_first_processor_and_tolerates_absence(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == set()


def test_actor_dtype_auto_resolves_once_with_one_line_and_other_values_stay():
    from stalerl.config import load_config
    from stalerl.config.rules import resolve_compute_dtype

    cfg = load_config(["actor.dtype=auto", "actor.device=cpu"])
    lines = []
    line = resolve_compute_dtype(cfg, log=lines.append)
    expected = auto_compute_dtype("cpu")[0]
    assert cfg.actor.dtype == expected and lines == [line]
    assert line.startswith(f"stalerl: actor.dtype=auto -> {expected}: ")
    assert resolve_compute_dtype(cfg, log=lines.append) is None and len(lines) == 1  # resolved: nothing to do
    fixed = load_config(["actor.dtype=float32"])
    assert resolve_compute_dtype(fixed, log=lines.append) is None and fixed.actor.dtype == "float32"



def test_cpu_isa_lists_the_recorded_extensions_in_order_and_nothing_else():
    from stalerl.core.hardware import CPU_ISA_FLAGS, cpu_isa

    assert cpu_isa({"fma", "amx_bf16", "avx2", "avx512_bf16", "avx512f", "sse4_2"}) == list(CPU_ISA_FLAGS)
    assert cpu_isa({"avx512f", "avx2"}) == ["avx2", "avx512f"]
    assert cpu_isa(set()) == [] and cpu_isa({"avx", "sse4_2"}) == []
