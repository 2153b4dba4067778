#!/usr/bin/env bash
# Tensor-parallel TTFT on one multi-GPU host (issue 24), NCCL, rows appended to $OUT/tp.jsonl, a table printed last.
#   OUT=/tmp/out bash experiments/tp_suite.sh [build] [awq] [test] [ttft8b] [gen70b] [ttft70b] [table]
# (no steps = build awq test ttft8b table). Each step fits one 10-minute device command; run gen70b and ttft70b as
# commands of their own.
#   build   the kernel extension (experiments/gpu_suite.sh build; skipped when up to date)
#   awq     gptqmodel from the carried .whl/ into /tmp/site (as gpu_suite.sh awq) for the AWQ TP=1 baselines
#   test    tests/test_tp_gpu.py (2 NCCL ranks on tiny-tp: shard patching, tokens/logits vs one GPU, CLI rows)
#   ttft8b  Llama 3 8B synthetic, 2048 and 8192 tokens, sdpa vs llm_attn: fp16 weights at TP=1 and TP=2, and the
#           AWQ int4 checkpoint at TP=1 (AWQ cannot be sharded by transformers' TP plan: see below)
#   gen70b  writes the synthetic Llama 3 70B checkpoint, AWQ int4 (~40 GB) always, fp16 (~141 GB) when the disk
#           has room (the writer checks free disk first and says in one line what fits)
#   ttft70b 70B AWQ int4 at TP=1 (one GPU: the baseline), and 70B at TP=2: from the fp16 checkpoint when gen70b
#           could write it, else 'llama-3-70b:init' (config-only skeleton; transformers initialises each rank's
#           weight shard at load: the exact geometry, fp16, no 141 GB on disk; rows say source initialised-at-load)
#   table   the TTFT table of every row in $OUT/tp.jsonl, grouped by TP degree
# Why no AWQ at TP=2: gptqmodel's QuantLinear keeps qweight/qzeros/scales as buffers; transformers' TP plan
# (apply_tensor_parallelism) shards parameters only, so every rank keeps the whole int4 weight and the row-wise
# layers fail with "mixed torch.Tensor and DTensor" (seen on CPU with gptqmodel 7.5.0 + transformers 5.17; the buffer
# layout is the same for every gptqmodel AWQ kernel). The harness refuses it in one line; TP rows use fp16 weights.
# Disk: nvidia-h200-x2 has 128 GiB: the 70B fp16 checkpoint (141 GB) does not fit there (gen70b says so in one
# line), so TP=2 runs 'llama-3-70b:init'; on nvidia-h200-x4 / -x8 (235 GiB) gen70b writes the fp16 checkpoint.
set -uo pipefail
cd "$(dirname "$0")/.."
# Mandatory on the lent multi-GPU machines: no NVLink multicast (NVLS) in NCCL, none in torch's symmetric memory.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export LLM_ATTN_CACHE=${LLM_ATTN_CACHE:-/tmp/llm_attn_cache}
OUT=${OUT:-/tmp/llm_attn_out}; mkdir -p "$OUT" "$LLM_ATTN_CACHE"
steps=${*:-build awq test ttft8b table}
has() { [[ " $steps " == *" $1 "* ]]; }
[ -e llm_attn/patches ] || ln -s ../patches llm_attn/patches
SEQS=${SEQS:-2048 8192}
REPEATS=${REPEATS:-10}
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m | tee "$OUT/topo.txt" | head -$((ngpu + 1))
echo "disk free in $LLM_ATTN_CACHE: $(df -BG --output=avail "$LLM_ATTN_CACHE" | tail -1 | tr -d ' ')"

ttft() {  # ttft TP MODEL [extra args]: one TP run (the harness starts torchrun), rows into $OUT/tp.jsonl
  local tp=$1 model=$2; shift 2
  echo "== TP=$tp $model $*"
  python3 -m llm_attn.ttft --tp "$tp" --model "$model" --impl sdpa llm_attn --seq $SEQS --repeats "$REPEATS" \
    --dtype float16 --measure ttft --out "$OUT/tp.jsonl" "$@" >"$OUT/ttft_tp${tp}_${model//[:\/]/_}.log" 2>&1
  local rc=$?
  echo "   exit $rc"; tail -$(( rc ? 25 : 6 )) "$OUT/ttft_tp${tp}_${model//[:\/]/_}.log"
}

if has build; then
  bash experiments/gpu_suite.sh build | tail -3
fi
if has awq || has ttft8b || has ttft70b; then
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    [ -d /tmp/site/gptqmodel ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation \
      --target /tmp/site .whl/*.whl .whl/pypcre-*.tar.gz >"$OUT/awq_install.log" 2>&1 \
      || { echo "gptqmodel install failed (AWQ baselines will stop with the install hint)"; tail -5 "$OUT/awq_install.log"; }
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  else
    echo "no .whl/ carried: the AWQ TP=1 baselines need gptqmodel (see experiments/gpu_suite.sh)"
  fi
fi
if has test; then
  python3 -m pytest -q -p no:cacheprovider tests/test_tp_gpu.py 2>&1 | tee "$OUT/pytest_tp.log" | tail -15
fi
if has ttft8b; then
  # The AWQ refusal at TP=2, shown as the harness prints it (exit 2, nothing loaded).
  python3 -m llm_attn.ttft --tp 2 --model llama-3-8b:awq --out "$OUT/refused.jsonl" 2>&1 | tail -1
  ttft 1 llama-3-8b:awq
  ttft 1 llama-3-8b:fp16
  [ "$ngpu" -ge 2 ] && ttft 2 llama-3-8b:fp16 || echo "TP=2 skipped: $ngpu GPU(s)"
fi
if has gen70b; then
  python3 -m llm_attn.models generate llama-3-70b awq 2>&1 | tail -2
  python3 -m llm_attn.models generate llama-3-70b fp16 2>&1 | tail -1  # one line "not enough free disk" on 128 GiB
fi
if has ttft70b; then
  ttft 1 llama-3-70b:awq
  if [ "$ngpu" -lt 2 ]; then
    echo "70B at TP=2 not run: $ngpu GPU(s)"
  elif ls -d "$LLM_ATTN_CACHE"/llama-3-70b-fp16-*/.llm_attn_complete >/dev/null 2>&1; then
    ttft 2 llama-3-70b:fp16
  else
    echo "no 70B fp16 checkpoint (141 GB; too big for this disk?): TP=2 on llama-3-70b:init (weights initialised at load)"
    ttft 2 llama-3-70b:init
  fi
fi
if has table || has ttft8b || has ttft70b; then
  echo
  python3 - "$OUT/tp.jsonl" <<'EOF'
import json, sys
from pathlib import Path
from llm_attn.harness.tp import summary_table
p = Path(sys.argv[1])
rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
rows = [r for r in rows if r.get("status") == "ok" and "tp" in r]
print(summary_table(rows) if rows else f"no TP rows in {p}")
EOF
fi
