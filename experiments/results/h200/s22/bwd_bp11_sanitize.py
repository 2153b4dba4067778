# The BP11 sanitizer run (kernels/NOTES.md "BP11"): the portable backward forced, head_dim 64, both masks,
# q_len == kv_len and q_len != kv_len, GQA. Run under compute-sanitizer --tool racecheck|synccheck|memcheck.
import torch
from llm_attn.backward import force_bwd_tile
from llm_attn import flash_attn_func
for causal in (False, True):
    for (sq, sk) in ((300, 300), (129, 1000)):
        q = torch.randn(1, 4, sq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 2, sk, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 2, sk, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with force_bwd_tile("portable"):
            flash_attn_func(q, k, v, causal=causal).sum().backward()
        torch.cuda.synchronize()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
print("ok")
