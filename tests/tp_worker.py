"""One rank of the CPU/GPU tensor-parallel tests (tests/test_tp.py, tests/test_tp_gpu.py), run under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py CHECKPOINT OUT.json DEVICE DTYPE

Loads CHECKPOINT sharded by transformers' TP plan (llm_attn.harness.tp_world.load_sharded), then on the same prompt runs
stock sdpa and ours (patch_model, impl llm_attn; backend "reference" on CPU, "cuda" on GPUs). Every attention call of
ours is recorded with the head counts it was given (a spy around the real op: the computation is untouched). Rank 0
writes every rank's tokens, last-position logits, patch counters and seen head counts to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch

from llm_attn import ops
from llm_attn.impls import flash_kernel
from llm_attn.harness import tp_world
from llm_attn.harness.measure import prefill_first_token
from llm_attn.harness.sweep import DTYPES, make_prompt
from llm_attn.patches import patch_model, unpatch_model

PROMPT = dict(batch=2, seq=48, seed=5)


def main(checkpoint: str, out: str, device: str, dtype: str) -> None:
    world = tp_world.World(device)
    seen: list[tuple[int, int]] = []
    real = ops.flash_attn_func

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1]))
        return real(q, k, v, *args, **kwargs)

    try:
        model, info = tp_world.load_sharded(checkpoint, world, DTYPES[dtype])
        prompt = make_prompt(info["config"]["vocab_size"], PROMPT["batch"], PROMPT["seq"], PROMPT["seed"],
                             world.device)
        result = {"rank": world.rank, "local_heads": tp_world.local_heads(model)}
        with torch.inference_mode():
            model.set_attn_implementation("sdpa")
            tok, logits = prefill_first_token(model, prompt)
            result["sdpa"] = {"token": tok.tolist(), "logits": logits.float().cpu().tolist()}
            # The reference path looks the op up in llm_attn.ops at call time; the CUDA entry calls its own import.
            ops.flash_attn_func = flash_kernel.flash_attn_func = spy
            try:
                backend = "reference" if device == "cpu" else "cuda"
                report = patch_model(model, impl="llm_attn", backend=backend)
                tok, logits = prefill_first_token(model, prompt)
                result["llm_attn"] = {"token": tok.tolist(), "logits": logits.float().cpu().tolist(),
                                      "native": dict(report.native_calls), "fallback": report.num_fallback_calls,
                                      "patched": report.num_patched}
                unpatch_model(model)
            finally:
                ops.flash_attn_func = flash_kernel.flash_attn_func = real
        result["seen_heads"] = sorted(set(seen))
        result["num_seen"] = len(seen)
        gathered = world.gather(result)
        if world.rank == 0:
            with open(out, "w") as fh:
                json.dump({"ranks": gathered, "prompt": prompt.cpu().tolist(), "world": world.world}, fh)
    finally:
        world.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
