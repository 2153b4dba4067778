"""The cross-device report behind ``python -m llm_attn.report``: ``merge`` reads and merges result rows,
``tables`` writes the markdown tables, ``plots`` the PNG plots, ``document`` puts them together (``write_report``).
"""

from llm_attn.reporting.document import write_report
from llm_attn.reporting.merge import Merged, load_rows

__all__ = ["Merged", "load_rows", "write_report"]
