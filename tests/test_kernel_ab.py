"""experiments/kernel_ab.py on CPU: argument errors are argparse errors, and the summary pairs rounds, flags a
variant whose output differs (or is NaN) and leaves ours/ref out where SDPA's causal mask differs from ours.

    pytest tests/test_kernel_ab.py
"""

from __future__ import annotations


import pytest

from conftest import load_script


def _mod():
    return load_script("experiments/kernel_ab.py")


@pytest.mark.parametrize("argv,msg", [
    (["--variant", "a", "--shape", "1,2,3"], "batch,heads,kv_heads"),
    (["--variant", "a", "--shape", "1,32,5,8,8,128,0"], "multiple of"),
    (["--variant", "a", "--shape", "1,32,8,8,8,128,2"], "causal 0 or 1"),
    (["--variant", "a:FOO", "--shape", "1,32,8,8,8,128,0"], "NAME[:KEY=VALUE"),
    (["--variant", "a", "--shape", "1,32,8,8,8,128,0"], "two or more --variant"),
    (["--variant", "a", "--variant", "a", "--shape", "1,32,8,8,8,128,0"], "names must differ"),
    (["--variant", "a", "--variant", "b", "--shape", "1,32,8,8,8,128,0", "--rounds", "0"], "at least 1"),
])
def test_bad_arguments_are_argparse_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        _mod().main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def _point(shape, ms, ref_ms, head, kernel="k"):
    return {"shape": shape, "dtype": "bf16", "kernels": [kernel], "out_head": head,
            "ours": {"status": "ok", "ms": ms}, "ref": {"status": "ok", "ms": ref_ms}}


def test_summary_pairs_rounds_and_flags_mismatches():
    mod = _mod()
    sq_eq = (1, 32, 8, 2048, 2048, 128, 1)
    chunk = (1, 32, 8, 128, 8192, 128, 1)  # causal q != kv: SDPA's mask is top-left, so no ours/ref column
    results = []
    for r, (a_ms, b_ms) in enumerate([(1.0, 0.5), (2.0, 1.0), (1.0, 1.0)]):
        results.append({
            "a": {(sq_eq, "bf16"): _point(list(sq_eq), a_ms, 1.0, [0.0, 1.0], "ka"),
                  (chunk, "bf16"): _point(list(chunk), 1.0, 9.0, [0.0])},
            "b": {(sq_eq, "bf16"): _point(list(sq_eq), b_ms, 1.0, [0.0, 1.0], "kb"),
                  (chunk, "bf16"): _point(list(chunk), 1.0, 9.0, [float("nan")])},
        })
    table, bad, kernels = mod.summarise(results, ["a", "b"], "cudnn", 0.0)
    lines = table.splitlines()
    row = next(line for line in lines if "2048,2048" in line)
    assert "2.000 (1.000-2.000)" in row  # a/b time per round: 2, 2, 1 -> median 2, min 1, max 2
    assert "1.000" in row  # cudnn/a: median of 1/1, 1/2, 1/1
    chunk_row = next(line for line in lines if "128,8192" in line)
    assert chunk_row.count(" - ") >= 2  # ours/ref left out on both variants
    assert bad == ["b 1,32,8,128,8192,128,1 bf16: output differs from a by nan"]
    assert kernels == {"a": ["k", "ka"], "b": ["k", "kb"]}
