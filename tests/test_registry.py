"""CPU tests of the attention-implementation registry (``llm_attn.registry``): registration and its errors, every
CPU-capable built-in entry against a float64 reference, every entry through ``patch_model`` against stock sdpa
(with fallback counting and exact unpatching), plugins from a file, from a module and from a package's entry
point, and the example plugin measured through the real CLIs.

    pytest tests/test_registry.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version

import llm_attn
from llm_attn import registry
from llm_attn.reference import attention_naive

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "my_attention.py"
NEW_HF = version.parse(transformers.__version__) >= version.parse("4.53")


def _qkv(b, hq, hkv, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g).to(dtype) for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


# -- the table ------------------------------------------------------------------------------------------------------
def test_builtins_are_registered_with_their_sources():
    names = registry.names()
    for n in ("eager", "sdpa", "flash_attention_2", "llm_attn", "naive", "flex", "numba"):
        assert n in names
        src = registry.get(n).source
        assert src["kind"] == "built-in" and src["module"].startswith("llm_attn.impls."), src
    assert [registry.get(n).stock for n in ("eager", "sdpa", "flash_attention_2", "llm_attn")] == [True] * 3 + [False]
    # The harness knows no implementation by name: the default comparison comes from the entries' flags.
    assert registry.default_impls("cpu") == ["eager", "sdpa", "llm_attn"]
    assert registry.unavailable_reason("flash_attention_2", "cpu") == "flash_attention_2 needs a CUDA GPU"
    assert "unknown attention implementation 'bogus'" in registry.unavailable_reason("bogus", "cpu")


def test_harness_has_no_hard_coded_implementations():
    src = (REPO / "llm_attn" / "harness" / "impls.py").read_text() + (REPO / "llm_attn" / "harness" /
                                                                      "sweep.py").read_text()
    assert "ALL_IMPLS" not in src and "OURS" not in src and '"llm_attn"' not in src


def _fn(q, k, v, *, causal, scale, seqused_k=None):
    return attention_naive(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k)[0].to(q.dtype)


def test_register_validates_its_arguments():
    with pytest.raises(ValueError, match="name must start with a letter"):
        llm_attn.register_attention("1bad", _fn)
    with pytest.raises(TypeError, match="fn must be callable"):
        llm_attn.register_attention("ok_name", 3)
    with pytest.raises(TypeError, match="dtypes must be"):
        llm_attn.register_attention("ok_name", _fn, dtypes=("float16",))
    with pytest.raises(ValueError, match="head_dims must be positive"):
        llm_attn.register_attention("ok_name", _fn, head_dims=(0,))
    with pytest.raises(ValueError, match="already registered"):
        llm_attn.register_attention("sdpa", _fn)
    with pytest.raises(ValueError, match="built in"):
        registry.unregister_attention("llm_attn")


def test_api_registration_and_what_it_supports():
    entry = llm_attn.register_attention("t_api", _fn, dtypes=(torch.float32,), head_dims=(16,), devices=("cpu",),
                                        supports_seqused_k=False, description="test")
    try:
        assert entry.source == {"kind": "api", "module": __name__}
        assert entry.choose(torch.device("cpu"), torch.float32, 16) == ("cpu", None)
        assert "takes float32, got float16" in entry.choose(torch.device("cpu"), torch.float16, 16)[1]
        assert "head_dim (16,), got 64" in entry.choose(torch.device("cpu"), torch.float32, 64)[1]
        assert entry.choose(torch.device("cpu"), torch.float32, 64, backend="reference") == ("reference", None)
        q, k, v = _qkv(1, 2, 1, 5, 5, 16, torch.float32)
        bad = llm_attn.register_attention("t_api", lambda q, k, v, **kw: q[:, :, :1], dtypes=(torch.float32,),
                                          devices=("cpu",))
        with pytest.raises(RuntimeError, match="returned .* expected a tensor of q's shape"):
            bad.run("cpu", q, k, v, causal=True, scale=0.25)
    finally:
        registry.unregister_attention("t_api")


# -- every CPU-capable entry against float64 ------------------------------------------------------------------------
CPU_ENTRIES = ["eager", "sdpa", "llm_attn", "naive", "flex"]
SHAPES = [  # (b, hq, hkv, sq, sk, d, causal, seqused)
    (1, 4, 4, 17, 17, 32, True, None),       # MHA, odd length
    (2, 8, 2, 1, 63, 64, True, None),        # GQA decode row
    (1, 8, 1, 13, 40, 16, True, None),       # MQA, a chunk over a prefix (bottom-right)
    (1, 4, 2, 40, 9, 32, True, None),        # more queries than keys: rows that see nothing output 0
    (2, 4, 2, 7, 33, 64, False, None),       # non-causal
    (2, 4, 2, 5, 33, 64, True, [33, 20]),    # seqused_k
]


@pytest.mark.parametrize("name", CPU_ENTRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entries_match_float64(name, dtype):
    entry = registry.get(name)
    if dtype not in entry.dtypes:
        pytest.skip(f"{name} does not take {dtype}")
    for b, hq, hkv, sq, sk, d, causal, used in SHAPES:
        if entry.head_dims is not None and d not in entry.head_dims:
            continue
        seq = torch.tensor(used, dtype=torch.int32) if used else None
        if seq is not None and not entry.supports_seqused_k:
            continue
        q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq)
        variant, why = entry.choose(q.device, dtype, d)
        assert why is None, why
        out = entry.run(variant, q, k, v, causal=causal, scale=d ** -0.5, seqused_k=seq)
        ref, _ = attention_naive(q, k, v, causal=causal, seqused_k=seq)
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        assert out.dtype == dtype and not out.isnan().any(), (name, sq, sk)
        assert (out.double() - ref).abs().max().item() < tol, (name, b, hq, hkv, sq, sk, d, causal, used)


# -- every entry through patch_model --------------------------------------------------------------------------------
needs_hf = pytest.mark.skipif(not NEW_HF, reason="the AttentionInterface target needs transformers >= 4.53")


def _tiny(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


@needs_hf
@pytest.mark.parametrize("name", ["naive", "flex", "sdpa", "eager", "llm_attn"])
def test_patch_model_with_every_entry(name):
    from transformers import StaticCache

    from llm_attn.patches import patch_model, unpatch_model

    model = _tiny()
    ids = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        ref_gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        report = patch_model(model, impl=name)
        assert report.impl == name and report.impl_source["kind"] == "built-in"
        out = model(ids).logits
        assert report.native_calls and report.num_fallback_calls == 0, str(report)
        assert (out - ref).abs().max().item() < 1e-4
        gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(gen, ref_gen)
        # A static cache with unused slots needs seqused_k: entries without it fall back to stock, counted.
        report.reset_counters()
        cache = StaticCache(config=model.config, max_cache_len=40)
        model(ids, past_key_values=cache, use_cache=True)
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True,
                     cache_position=torch.tensor([ids.shape[1]])).logits
        if registry.get(name).supports_seqused_k:
            assert report.num_fallback_calls == 0, str(report)
        else:
            assert any("does not support seqused_k" in r for r in report.fallback_calls), str(report)
        assert not step.isnan().any()
        unpatch_model(model)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)  # stock again, bit for bit


@needs_hf
def test_padding_falls_back_per_call_for_a_plugin(tmp_path):
    from llm_attn.patches import patched

    registry.load_plugin(str(EXAMPLE))
    model = _tiny()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: a mask the kernel cannot express
    with torch.no_grad(), patched(model, impl="mine") as report:
        model(ids, attention_mask=mask)
        assert report.num_native_calls == 0 and report.num_fallback_calls == 2, str(report)
        assert any("padding" in r for r in report.fallback_calls)
        model(ids)
        assert report.num_native_calls == 2


# -- plugins --------------------------------------------------------------------------------------------------------
def test_plugin_file_registers_and_reloads(tmp_path):
    names = registry.load_plugin(str(EXAMPLE))
    assert names == ["mine"]
    src = registry.get("mine").source
    assert src["kind"] == "plugin" and src["path"] == str(EXAMPLE.resolve()) and len(src["sha256"]) == 16
    assert registry.load_plugin(str(EXAMPLE)) == ["mine"]  # loading twice is harmless
    assert registry.plugin_specs_for(["sdpa", "mine"]) == [str(EXAMPLE.resolve())]


def test_plugin_errors_are_clear(tmp_path):
    with pytest.raises(registry.PluginError, match="no such file"):
        registry.load_plugin(str(tmp_path / "missing.py"))
    empty = tmp_path / "empty_plugin.py"
    empty.write_text("x = 1\n")
    with pytest.raises(registry.PluginError, match="registered no attention implementation"):
        registry.load_plugin(str(empty))
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("raise RuntimeError('nope')\n")
    with pytest.raises(registry.PluginError, match="importing it failed: RuntimeError: nope"):
        registry.load_plugin(str(broken))
    with pytest.raises(registry.PluginError, match="no module 'no_such_module_xyz'"):
        registry.load_plugin("no_such_module_xyz:thing")


PKG = textwrap.dedent('''
    import torch
    import llm_attn
    from llm_attn.impls.naive import naive_attention

    def register():
        llm_attn.register_attention("{name}", naive_attention, dtypes=(torch.float32,), devices=("cpu",),
                                    supports_seqused_k=True, description="from a package")
''')


def _fake_installed_package(root: Path, name: str) -> None:
    """A real installed distribution (dist-info with an entry point) on a path importlib.metadata searches."""
    (root / f"{name}_pkg.py").write_text(PKG.format(name=name))
    info = root / f"{name}_pkg-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-pkg\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[llm_attn.attention]\n{name} = {name}_pkg:register\n")
    (info / "RECORD").write_text("")


def test_module_attr_plugin_and_entry_point_in_a_fresh_process(tmp_path):
    _fake_installed_package(tmp_path, "epkern")
    (tmp_path / "modkern.py").write_text(PKG.format(name="modkern").replace("def register", "def make"))
    code = textwrap.dedent('''
        import json
        from llm_attn import registry
        registry.load_plugin("modkern:make")
        print(json.dumps({n: registry.get(n).source for n in ("epkern", "modkern")}))
    ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["epkern"] == {"kind": "entry-point", "entry_point": "epkern = epkern_pkg:register",
                             "package": "epkern-pkg", "version": "1.2.3"}
    assert got["modkern"]["kind"] == "plugin" and got["modkern"]["module"] == "modkern:make"


# -- the example plugin through the CLIs ----------------------------------------------------------------------------
def test_example_plugin_is_small():
    assert len(EXAMPLE.read_text().splitlines()) < 60


@needs_hf
def test_example_plugin_through_the_ttft_cli(tmp_path):
    """What the README shows: a kernel the registry has never seen, measured next to sdpa and llm_attn."""
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "llm_attn.ttft", "--plugin", str(EXAMPLE.relative_to(REPO)), "--impl", "mine",
           "sdpa", "llm_attn", "--seq", "16", "--repeats", "2", "--warmup", "1", "--new-tokens", "3",
           "--decode-repeats", "1", "--measure", "ttft", "decode_graph", "correctness", "--no-progress", "--out",
           str(out), "--device", "cpu"]  # the CPU path on any machine (a GPU's default model is the 8B AWQ one)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| mine " in proc.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    by = {(r["measurement"], r["impl"]): r for r in rows}
    assert set(by) == {(m, i) for m in ("ttft", "decode_graph") for i in ("mine", "sdpa", "llm_attn")} | {
        ("correctness", "mine"), ("correctness", "llm_attn")}
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["impl_info"]["name"] == r["impl"]
    mine = by[("ttft", "mine")]
    assert mine["impl_info"]["source"]["kind"] == "plugin"
    assert mine["impl_info"]["source"]["path"] == str(EXAMPLE.resolve())
    assert mine["attention_calls"]["impl"] > 0 and mine["attention_calls"]["stock_fallback"] == 0
    assert by[("decode_graph", "mine")]["attention_calls"]["stock_fallback"] == 0  # seqused_k supported
    assert by[("ttft", "sdpa")]["impl_info"]["source"]["kind"] == "built-in"
    assert f"--plugin {EXAMPLE.resolve()}" in mine["command"]
    corr = by[("correctness", "mine")]
    assert corr["max_abs_logit_diff"] < 1e-4 and corr["greedy_agreement"] == 1.0


@needs_hf
def test_example_plugin_in_an_experiment_file(tmp_path):
    from llm_attn import experiment

    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "plug.py").write_text(EXAMPLE.read_text().replace('"mine"', '"mine_exp"'))
    toml = tmp_path / "plug.toml"
    toml.write_text('name = "plug"\nseqs = [16]\nimpls = ["sdpa", "mine_exp"]\nplugins = ["k/plug.py"]\n'
                    'measurements = ["ttft", "correctness"]\nrepeats = 1\nwarmup = 0\nnew_tokens = 2\n')
    # --device cpu: the rows land under res/cpu on any machine (a GPU's would be its slug, with the 8B AWQ model).
    assert experiment.main([str(toml), "--results-dir", str(tmp_path / "res"), "--no-progress", "--device",
                            "cpu"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "res" / "cpu" / "plug.jsonl").read_text().splitlines()]
    assert {(r["measurement"], r["impl"]) for r in rows} == {("ttft", "sdpa"), ("ttft", "mine_exp"),
                                                             ("correctness", "mine_exp")}
    assert all(r["status"] == "ok" for r in rows)
    from llm_attn.report import write_report

    text = write_report([tmp_path / "res"], tmp_path / "rep").read_text()
    assert "## Attention implementations" in text and "mine_exp" in text and "plug.py" in text


def test_bad_plugin_on_the_cli_exits_2(capsys, tmp_path):
    from llm_attn import ttft

    with pytest.raises(SystemExit) as e:
        ttft.main(["--plugin", str(tmp_path / "nope.py"), "--impl", "sdpa"])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
