#!/usr/bin/env bash
# Tensor-parallel TTFT on one multi-GPU host (issues 24, 36), NCCL. Rows go to
# $OUT/results/<device>-x<GPUs>/tp.jsonl (copy $OUT/results/* into experiments/results/), logs to $OUT.
#
# THE DEVICE COMMAND (issue 36; ~6 min on 2x H100, well inside one 10-minute call; .whl/ and .carry/ carried when
# there, neither needed by this step):
#   OUT=$OUT bash experiments/tp_suite.sh quick
# quick = kernel (only when no build of ours is importable: NVRTC or a carried .carry/ extension skip it), the GPU
# TP tests, the interconnect as parse_topo reads it on this machine, then Llama 3 8B (synthetic fp16 checkpoint,
# ~16 GB, written once to $LLM_ATTN_CACHE) at TP=1 and TP=2, 2048 / 8192 / 32768 tokens, stock sdpa vs llm_attn,
# paired (10 repeats), each TP row with its ranks' host-bound flags and comm wait; one line per finished point as
# it goes, the layer tables of TP=2 at 8192, and the short table last. QUICK_GRAPH=1 adds graph TTFT (TP=1 and
# TP=2, 2048 and 8192; +~2 min).
#
#   OUT=/tmp/out bash experiments/tp_suite.sh [build] [awq] [test] [topo] [quick] [ttft8b] [graph8b] [long]
#                                             [gen70b] [ttft70b] [long70b] [table]
# (no steps = quick). Each step fits one 10-minute device command; gen70b, ttft70b, long and long70b are commands
# of their own.
#   build   the kernel extension (experiments/gpu_suite.sh build; skipped when up to date)
#   awq     gptqmodel from the carried .whl/ into /tmp/site (as gpu_suite.sh awq) for the AWQ TP=1 baselines
#   test    tests/test_tp_gpu.py (2 NCCL ranks on tiny-tp: shard patching, tokens/logits vs one GPU, CLI rows with
#           host-bound flags, comm wait and graph TTFT, the interconnect not misread)
#   topo    nvidia-smi topo -m as printed (escapes shown by cat -v) and as parse_topo reads it
#   ttft8b  Llama 3 8B, $SEQS (2048 8192), sdpa vs llm_attn: fp16 weights at TP=1 and TP=2, and the AWQ int4
#           checkpoint at TP=1 (AWQ cannot be sharded by transformers' TP plan: see below)
#   graph8b graph TTFT (the whole prefill in a CUDA graph, NCCL collectives captured) and eager TTFT of the 8B at
#           TP=1 and TP=2, $SEQS: TP compared without host noise
#   long    Llama 3 8B fp16 at TP=2, $LONG_SEQS (32768 65536 131072), $LONG_REPEATS (3) paired repeats, 1 warm-up;
#           shortest first: a length that runs out of memory is recorded as an oom row and stops the run there
#   gen70b  the synthetic Llama 3 70B AWQ int4 checkpoint (40.6 GB on disk: 20 shards of 2 GiB), then fp16 (141 GB)
#           only where the disk has room (the writer says in one line what fits). Time: ~1 min at the rate the 8B AWQ
#           checkpoint is written on an H100 (5.4 GB in ~6 s: the GPU generates, the page cache absorbs the writes;
#           256 GiB of RAM holds 40.6 GB), up to ~3 min where the disk itself sets the pace (0.3 GB/s); the step
#           prints the measured time and the free disk before and after. Not yet measured on the -x2 machines.
#           Resumable: a writer killed mid-way (the call's 10 minutes) keeps its finished shards, and the next
#           gen70b (or ttft70b, which writes a missing checkpoint first) goes on from there.
#   ttft70b 70B AWQ int4 at TP=1 (one GPU: the baseline; 40.6 GB of weights on an 80 GB card), and 70B at TP=2: from
#           the fp16 checkpoint when gen70b could write it, else 'llama-3-70b:init' (config-only skeleton;
#           transformers initialises each rank's weight shard at load: the exact geometry, fp16, no 141 GB on disk;
#           rows say source initialised-at-load; 70.5 GB of weights per rank: on an H100 little room is left for
#           long prompts, on an H200 plenty)
#   long70b 'llama-3-70b:init' at TP=2, $LONG70_SEQS (32768 65536; give 131072 a call of its own: ~30 s a prefill)
#   table   the table of every row in the results file, grouped by TP degree, and the TP=2 layer tables
# Why no AWQ at TP=2: gptqmodel's QuantLinear keeps qweight/qzeros/scales as buffers; transformers' TP plan
# (apply_tensor_parallelism) shards parameters only, so every rank keeps the whole int4 weight and the row-wise
# layers fail with "mixed torch.Tensor and DTensor" (seen on CPU with gptqmodel 7.5.0 + transformers 5.17). The
# harness refuses it in one line; TP rows use fp16 weights.
# Disk: the -x2 machines have 128 GiB: 8B fp16 (16 GB) + 70B AWQ (41 GB) fit, 70B fp16 (141 GB) does not.
set -uo pipefail
cd "$(dirname "$0")/.."
# Mandatory on the lent multi-GPU machines: no NVLink multicast (NVLS) in NCCL, none in torch's symmetric memory.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export LLM_ATTN_CACHE=${LLM_ATTN_CACHE:-/tmp/llm_attn_cache}
OUT=${OUT:-/tmp/llm_attn_out}; mkdir -p "$OUT" "$LLM_ATTN_CACHE"
steps=${*:-quick}
has() { [[ " $steps " == *" $1 "* ]]; }
[ -e llm_attn/patches ] || ln -s ../patches llm_attn/patches
SEQS=${SEQS:-2048 8192}
REPEATS=${REPEATS:-10}
WARMUP=${WARMUP:-2}
LONG_SEQS=${LONG_SEQS:-32768 65536 131072}
LONG70_SEQS=${LONG70_SEQS:-32768 65536}
LONG_REPEATS=${LONG_REPEATS:-3}
STEP_LIMIT=${STEP_LIMIT:-540}  # seconds for one launcher call: a hung collective must not eat the whole device call
QUICK_LIMIT=${QUICK_LIMIT:-200}  # the same in quick (each of its runs takes ~75 s)
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
slug=$(python3 -c "from llm_attn.envinfo import device_name as n, device_slug as s; print(s(n('cuda:0')))" \
  2>/dev/null || echo unknown)
RESULTS=${RESULTS:-$OUT/results/$slug-x$ngpu}; mkdir -p "$RESULTS"
ROWS=$RESULTS/tp.jsonl
echo "rows: $ROWS; disk free in $LLM_ATTN_CACHE: $(df -BG --output=avail "$LLM_ATTN_CACHE" | tail -1 | tr -d ' ')"

ttft() {  # ttft TP MODEL [extra args]: one TP run (the harness starts torchrun); its lines as they come
  local tp=$1 model=$2; shift 2
  local log="$OUT/ttft_tp${tp}_${model//[:\/]/_}_$(date +%s).log"
  echo "== TP=$tp $model ${*:---seq $SEQS}"
  # timeout signals the whole process group (launcher, torchrun, ranks); SIGKILL 30 s later if a rank is stuck in CUDA.
  timeout -k 30 -s INT "$STEP_LIMIT" python3 -m llm_attn.ttft --tp "$tp" --model "$model" --impl sdpa llm_attn \
    --repeats "$REPEATS" --warmup "$WARMUP" --dtype float16 --out "$ROWS" --no-progress "$@" 2>&1 | tee "$log" \
    | grep --line-buffered -E "^(model:|TP=|  ttft|  graph|python -m llm_attn.ttft: error|rank [0-9]+:|--tp )"
  local rc=${PIPESTATUS[0]}
  echo "   exit $rc ($log)"
  [ "$rc" = 0 ] || [ "$rc" = 1 ] || tail -15 "$log"
}

table() {  # the rows so far: layer tables (TP=2, seq $LAYER_SEQ) first, the short table last
  python3 - "$ROWS" "${LAYER_SEQ:-8192}" <<'EOF'
import json, sys
from pathlib import Path
from llm_attn.harness.tp_table import layer_table, summary_table
p, layer_seq = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
rows = [r for r in rows if "tp" in r]
for r in rows:
    if r["status"] == "ok" and r["measurement"] == "ttft" and r["tp"]["degree"] > 1 and r["seq"] == layer_seq:
        print(layer_table(r) + "\n")
bad = [f"{r['measurement']} TP={r['tp']['degree']} {r['impl']} seq {r['seq']}: {r['status']}: {r.get('error')}"
       for r in rows if r["status"] != "ok"]
print("\n".join(bad) + "\n" if bad else "", end="")
print(summary_table(rows, short=True) if rows else f"no TP rows in {p}")
EOF
}

topo() {
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  echo "nvidia-smi topo -m (cat -v: escapes shown as ^[):"; head -$((ngpu + 1)) "$OUT/topo.txt" | cat -v
  python3 - "$OUT/topo.txt" "$ngpu" <<'EOF'
import json, sys
from llm_attn.harness.tp_topology import describe_link, parse_topo
got = parse_topo(open(sys.argv[1]).read(), list(range(int(sys.argv[2]))))
print("parse_topo:", json.dumps(got), "|", "; ".join(f"{k}: {describe_link(v)}" for k, v in got["links"].items()))
EOF
}

kernel() {  # our kernel, unless a build is importable already (NVRTC, or the extension carried in .carry/)
  if python3 -c "import sys, llm_attn; b = llm_attn.kernel_build(); print('kernel build:', b); sys.exit(b is None)"; then
    :
  else
    bash experiments/gpu_suite.sh build | tail -3
  fi
}

if has build; then
  bash experiments/gpu_suite.sh build | tail -3
fi
if has quick; then
  kernel
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
if has test || has quick; then
  start=$SECONDS
  timeout -k 30 -s INT 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_tp_gpu.py 2>&1 | tee "$OUT/pytest_tp.log" \
    | grep -v -E "^\s*$" | tail -15
  echo "GPU TP tests: $((SECONDS - start)) s"
fi
if has topo || has quick; then
  topo
fi
if has quick; then
  echo "8B fp16 checkpoint: $(python3 -m llm_attn.models generate llama-3-8b fp16 2>&1 | tail -1)"
  for tp in 1 2; do
    [ "$tp" -le "$ngpu" ] || { echo "TP=$tp skipped: $ngpu GPU(s)"; continue; }
    STEP_LIMIT=$QUICK_LIMIT ttft "$tp" llama-3-8b:fp16 --seq ${QUICK_SEQS:-2048 8192 32768} --measure ttft
  done
  if [ "${QUICK_GRAPH:-0}" = 1 ]; then
    for tp in 1 2; do
      [ "$tp" -le "$ngpu" ] && STEP_LIMIT=$QUICK_LIMIT ttft "$tp" llama-3-8b:fp16 --seq 2048 8192 --measure ttft_graph
    done
  fi
  echo "quick: $SECONDS s"
fi
if has ttft8b; then
  # The AWQ refusal at TP=2, shown as the harness prints it (exit 2, nothing loaded).
  python3 -m llm_attn.ttft --tp 2 --model llama-3-8b:awq --out "$OUT/refused.jsonl" 2>&1 | tail -1
  ttft 1 llama-3-8b:awq --seq $SEQS
  ttft 1 llama-3-8b:fp16 --seq $SEQS
  [ "$ngpu" -ge 2 ] && ttft 2 llama-3-8b:fp16 --seq $SEQS || echo "TP=2 skipped: $ngpu GPU(s)"
fi
if has graph8b; then
  ttft 1 llama-3-8b:fp16 --seq $SEQS --measure ttft ttft_graph
  [ "$ngpu" -ge 2 ] && ttft 2 llama-3-8b:fp16 --seq $SEQS --measure ttft ttft_graph
fi
if has long; then
  REPEATS=$LONG_REPEATS WARMUP=1 ttft 2 llama-3-8b:fp16 --seq $LONG_SEQS --measure ttft
fi
if has gen70b; then
  start=$SECONDS
  echo "disk free before: $(df -BG --output=avail "$LLM_ATTN_CACHE" | tail -1 | tr -d ' ')"
  python3 -m llm_attn.models generate llama-3-70b awq 2>&1 | grep -E "resuming|wrote model-000(05|10|15|20)|error|Error|\(" | tail -8
  echo "70B AWQ: $((SECONDS - start)) s; disk free after: $(df -BG --output=avail "$LLM_ATTN_CACHE" | tail -1 | tr -d ' ');" \
       "$(du -sh "$LLM_ATTN_CACHE"/llama-3-70b-awq-* 2>/dev/null | cut -f1) on disk"
  python3 -m llm_attn.models generate llama-3-70b fp16 2>&1 | tail -1  # one line "not enough free disk" on 128 GiB
fi
if has ttft70b; then
  ttft 1 llama-3-70b:awq --seq $SEQS
  if [ "$ngpu" -lt 2 ]; then
    echo "70B at TP=2 not run: $ngpu GPU(s)"
  elif ls -d "$LLM_ATTN_CACHE"/llama-3-70b-fp16-*/.llm_attn_complete >/dev/null 2>&1; then
    ttft 2 llama-3-70b:fp16 --seq $SEQS
  else
    echo "no 70B fp16 checkpoint (141 GB; too big for this disk?): TP=2 on llama-3-70b:init (weights initialised at load)"
    ttft 2 llama-3-70b:init --seq $SEQS
  fi
fi
if has long70b; then
  REPEATS=$LONG_REPEATS WARMUP=1 ttft 2 llama-3-70b:init --seq $LONG70_SEQS --measure ttft
fi
if has table || has quick || has ttft8b || has graph8b || has long || has ttft70b || has long70b; then
  echo
  table
fi
