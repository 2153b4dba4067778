"""Starting the ranks of ``python -m llm_attn.ttft --tp N``: torchrun on this host, its output passed through, its
own failure report kept out of the way.

torchrun's agent answers any rank that exits non-zero with a Python traceback and a failure table (about thirty lines)
after the rank's own message, and no rank can stop it from doing so. ``launch`` runs torchrun with its stderr piped
and passes every line of the ranks through as it comes, but drops the agent's log lines and its final report: when
a rank said what went wrong in one line (``python -m llm_attn.ttft: error: ...``), that line stays the last one and
the launcher exits with the rank's own status (2 for bad input, 1 for a point that stopped the run); when no rank
said anything, the launcher says in one line which rank failed with which status.

A torchrun started by hand (``torchrun --nproc-per-node 2 -m llm_attn.ttft --tp 2 ...``) has no such launcher
around it: ``started_by_launcher()`` tells the ranks which case they are in (see ``llm_attn.harness.tp``).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

# Set for the ranks by ``launch``: they were started by this launcher, which filters torchrun's report.
LAUNCHER_ENV = "LLM_ATTN_TP_LAUNCHER"
# torchrun's agent logs through torch's logging format: 'E1125 21:52:54.400000 7641 .../torch/distributed/...] msg'.
_AGENT_LOG = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
_AGENT_FRAME = re.compile(r"torch/distributed/(run|launcher|elastic)/")


def started_by_launcher() -> bool:
    return os.environ.get(LAUNCHER_ENV) == "1"


class ReportFilter:
    """Feeds torchrun's stderr line by line: ``feed`` returns the lines to pass through. A traceback is held until
    its frames show whose it is: the agent's (frames in torch/distributed/run.py, launcher/, elastic/) is dropped
    with everything after it (torchrun prints nothing else once it reports); a rank's is passed through whole."""

    def __init__(self, prog: str):
        self.error_prefix = f"{prog}: error: "
        self.held: list[str] = []
        self.dropped: list[str] = []
        self.in_report = False
        self.rank_error: str | None = None

    def feed(self, line: str) -> list[str]:
        if self.in_report or _AGENT_LOG.match(line):
            self.dropped.append(line)
            return []
        if line.startswith("Traceback (most recent call last):") and not self.held:
            self.held = [line]
            return []
        if self.held:
            self.held.append(line)
            if _AGENT_FRAME.search(line):
                self.in_report = True
                self.dropped += self.held
                self.held = []
                return []
            if line[:1].strip():  # the exception line ends a rank's traceback
                out, self.held = self.held, []
                return out
            return []
        if line.startswith(self.error_prefix):
            self.rank_error = line.rstrip("\n")
        return [line]

    def flush(self) -> list[str]:
        out, self.held = self.held, []
        return out

    def root_cause(self) -> tuple[int | None, int | None]:
        """(rank, exit status) of torchrun's 'Root Cause' entry (else its first failure line), from what was dropped."""
        text = "".join(self.dropped)
        tail = text.split("Root Cause", 1)[1] if "Root Cause" in text else text
        rank = re.search(r"rank\s*:\s*(\d+)", tail)
        code = re.search(r"exitcode\s*:\s*(-?\d+)", tail)
        if code is None:
            m = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", text)
            return (int(m.group(2)), int(m.group(1))) if m else (None, None)
        return (int(rank.group(1)) if rank else None), int(code.group(1))


def _status(code: int | None, fallback: int) -> int:
    if code is None:
        return fallback
    return 128 - code if code < 0 else code  # a rank killed by signal S: 128 + S, as a shell reports it


def launch(tp: int, argv: list[str], prog: str = "python -m llm_attn.ttft") -> int:
    """Start ``tp`` ranks of ``python -m llm_attn.ttft <argv>`` with torchrun on this host; return the ranks'
    status (module docstring)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           "-m", "llm_attn.ttft", *argv]
    print(f"--tp {tp}: starting {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
    env[LAUNCHER_ENV] = "1"
    filt = ReportFilter(prog)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    try:
        for line in proc.stderr:
            for out in filt.feed(line):
                sys.stderr.write(out)
            sys.stderr.flush()
        for out in filt.flush():
            sys.stderr.write(out)
        rc = proc.wait()
    except KeyboardInterrupt:
        # torchrun ends its ranks on SIGTERM; give it a moment, then make sure.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 130
    if rc == 0:
        return 0
    rank, code = filt.root_cause()
    status = _status(code, rc)
    if filt.rank_error is None:
        who = f"rank {rank}" if rank is not None else "a rank"
        print(f"{prog}: error: --tp {tp}: {who} exited with status {status} (its output is above; torchrun's own "
              f"report left out)", file=sys.stderr, flush=True)
    return status
