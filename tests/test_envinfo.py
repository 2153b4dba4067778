"""llm_attn.envinfo: what every result row records about the run. CPU only.

    pytest tests/test_envinfo.py
"""

from __future__ import annotations

from llm_attn._ext import kernel_build
from llm_attn.envinfo import capture_env


def test_rows_record_which_kernel_build_ran():
    """A TTFT or bench row says whether the AOT extension or the NVRTC backend ran ours (LLM_ATTN_BACKEND picks it:
    rows measured with each must be told apart), and None where neither can run."""
    env = capture_env("cpu")
    assert "llm_attn_kernel_build" in env
    assert env["llm_attn_kernel_build"] == kernel_build()
    assert env["llm_attn_kernel_build"] in (None, "aot", "nvrtc")
    assert env["llm_attn_kernel_built"] is (kernel_build() is not None)
