"""kernels/generate_kernels.py writes the instantiation files, kernels/kernel_tiles.h and llm_attn/_kernel_table.py
from one spec: the committed files must be what it writes now, so the nvcc build, NVRTC and the Python mirror of the
dispatch (llm_attn/_plan.py) cannot drift. CPU only, standard library only."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "kernels" / "generate_kernels.py"
HINT = "run python kernels/generate_kernels.py"


def _generate(out: Path) -> dict[str, str]:
    r = subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*") if p.is_file()}


def test_committed_files_match_the_spec(tmp_path):
    generated = _generate(tmp_path)
    # 8 fwd, 8 fwd_sm90, 4 decode, 4 decode_fp8kv, 4 prefill_fp8kv, 8 bwd, 8 bwd_sm90, 8 fwd_int8, 8 fwd_fp8_sm90
    assert len([p for p in generated if p.endswith(".cu")]) == 60
    stale = [p for p, text in generated.items() if not (ROOT / p).is_file() or (ROOT / p).read_text() != text]
    assert not stale, f"out of date: {stale}; {HINT}"


def test_no_instantiation_file_outside_the_spec(tmp_path):
    generated = {Path(p).name for p in _generate(tmp_path)}
    extra = sorted(p.name for p in (ROOT / "kernels").glob("flash_*_hdim*.cu") if p.name not in generated)
    assert not extra, f"instantiation files not in the spec: {extra}; add them to kernels/generate_kernels.py"


def test_check_mode_reports_an_edited_file(tmp_path):
    """--check (what CI can run) passes on a fresh copy and fails, naming the file, once one is edited."""
    _generate(tmp_path)
    ok = subprocess.run([sys.executable, str(GENERATOR), "--check", "--out", str(tmp_path)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    victim = tmp_path / "kernels" / "flash_fwd_hdim128_bf16_causal.cu"
    victim.write_text(victim.read_text().replace("true", "false"))
    shutil.copy(victim, tmp_path / "kernels" / "flash_fwd_hdim96_bf16_causal.cu")  # a file the spec does not know
    bad = subprocess.run([sys.executable, str(GENERATOR), "--check", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert "kernels/flash_fwd_hdim128_bf16_causal.cu" in bad.stdout and "flash_fwd_hdim96" in bad.stdout
    assert HINT in bad.stdout


def test_plan_reads_the_generated_table():
    """_plan's tile tables are the generated ones, and every (head_dim, dtype) the spec instantiates is planned."""
    from llm_attn import _kernel_table as table
    from llm_attn import _plan

    assert set(_plan.CONFIGS) == set(table.HEAD_DIMS)
    for d, c in table.FWD_CONFIGS.items():
        cfg = _plan.CONFIGS[d]
        assert (cfg.large, cfg.small, cfg.wide) == tuple(_plan.FwdTraits(*c[k]) for k in ("large", "small", "wide"))
        assert cfg.wide64 == (None if c["wide64"] is None else _plan.FwdTraits(*c["wide64"]))
        assert cfg.block_n == cfg.large.block_n
    names = _plan.all_kernels()
    for kind, d, tag, causal, _ in table.INSTANTIATIONS:
        if kind == "fwd":
            want = _plan.fwd_kernel_name(tag == "bf16", _plan.CONFIGS[d].large, causal, False)
        elif kind == "decode":
            want = _plan.decode_kernel_name(tag == "bf16", _plan.DecodeTraits(d, *_plan.DECODE_CONFIGS["Deep"]))
        else:
            continue  # the Hopper and backward kernels have no NVRTC path yet
        assert want in names, want


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
