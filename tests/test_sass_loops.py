"""experiments/sass_loops.py on CPU: cuobjdump's -sass text parsed into functions, loops found from backward
branches (nested ones too, largest first), opcodes without guards or modifiers, and the CLI's one-line errors.

    pytest tests/test_sass_loops.py
"""

from __future__ import annotations

import pytest

from conftest import load_script

SASS = """
	code for sm_90
		Function : _Z5outerv
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;               /* 0x000000000204783b */
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;   /* 0x000000060408723c */
        /*0030*/               @!P0 LDSM.16.MT88.4 R12, [R2+0x100] ;      /* 0x000100000210783b */
        /*0040*/                   HMMA.16816.F32.BF16 R8, R12, R6, R8 ;  /* 0x000000060c08723c */
        /*0050*/               @P1 BRA 0x20 ;                             /* 0xfffffffc00007947 */
        /*0060*/                   ISETP.NE.AND P2, PT, R0, RZ, PT ;      /* 0x000000ff0000720c */
        /*0070*/              @!P2 BRA `(.L_x_3) 0x10 ;                   /* 0xfffffff400007947 */
        /*0080*/                   BRA 0x90 ;                             /* 0x0000000000007947 */
        /*0090*/                   EXIT ;                                 /* 0x000000000000794d */
		..........
		Function : _Z5otherv
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def _mod():
    return load_script("experiments/sass_loops.py")


def test_functions_and_opcodes():
    mod = _mod()
    funcs = mod.functions(SASS)
    assert list(funcs) == ["_Z5outerv", "_Z5otherv"]
    assert len(funcs["_Z5outerv"]) == 10 and funcs["_Z5otherv"] == [(0, "EXIT")]
    assert mod.opcode("@!P0 LDSM.16.MT88.4 R12, [R2+0x100]") == "LDSM"
    assert mod.opcode("@UP1 HMMA.16816.F32.BF16 R8, R4, R6, R8") == "HMMA"


def test_loops_are_backward_branches_largest_first():
    mod = _mod()
    found = mod.loops(mod.functions(SASS)["_Z5outerv"])
    # 0x70 -> 0x10 (instructions 1..7) holds 0x50 -> 0x20 (2..5); the forward BRA 0x90 is no loop
    assert [(lp.first, lp.last, lp.size) for lp in found] == [(1, 7, 7), (2, 5, 4)]
    assert found[0].opcodes == {"LDSM": 2, "HMMA": 2, "BRA": 2, "ISETP": 1}
    assert found[1].opcodes == {"HMMA": 2, "LDSM": 1, "BRA": 1}
    text = mod.describe("_Z5outerv", mod.functions(SASS)["_Z5outerv"], 1)
    assert "loop [1, 7] 7 instructions" in text and "loop [2, 5]" not in text and "whole: " in text


def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys):
    mod = _mod()
    with pytest.raises(SystemExit) as e:
        mod.main(["x.cubin", "f", "--loops", "0"])
    assert e.value.code == 2 and "--loops must be at least 1" in capsys.readouterr().err
    monkeypatch.setattr(mod.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        mod.main(["x.cubin", "f"])
    assert e.value.code == 2 and "cuobjdump is not on PATH" in capsys.readouterr().err
