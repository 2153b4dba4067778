"""The measurement harness behind ``python -m llm_attn.ttft``, ``python -m llm_attn.experiment`` and
``python -m llm_attn.bench`` (the report's library is ``llm_attn.reporting``).

Modules, one job each:

- ``stats``    — statistics derived from raw latency samples (p50/p90/min/stdev%).
- (the environment recorded with every row is ``llm_attn.envinfo``, shared with the kernel benchmark.)
- ``results``  — the JSONL row schema, the crash-safe appending writer and the resumption keys.
- ``devices``  — the datasheet table (``experiments/devices.toml``) used for %-of-peak and roofline projections.
- ``flops``    — model geometry, prefill FLOPs and bytes moved per decoded token.
- ``impls``    — how a loaded model is switched between the implementations of ``llm_attn.registry``.
- ``measure``  — TTFT, decode (``generate`` and static-cache/CUDA-graph) and correctness measurements.
- ``breakdown``— one prefill under torch.profiler: attention / GEMM / quantised weights / other / idle.
- ``paired``   — paired TTFT: every implementation once per repeat in a seeded shuffled order; host-bound flag.
- ``hostenv``  — GPU clocks/locks/other processes and CPU frequency/governor at the start and end of a measurement.
- ``prompts``  — prompts from a local dataset file or a cached dataset (``--prompts``); an offline tokenizer.
- ``hostcost`` — host µs per attention call (ours, ours through the patch, SDPA), no sync.
- ``sweep``    — runs a grid of points through ``measure``, writing one row per measurement, and the summary table.
- ``session``  — one measurement session: defaults, checks, loading the model, running a sweep, summarising rows.
- ``experiments`` — experiment definitions (TOML) and where their results go.
- ``kernel_bench`` — the kernel benchmark's timing and points (``python -m llm_attn.bench``).
- ``cli_args`` — argparse pieces the command lines share (number types, --plugin).
"""
