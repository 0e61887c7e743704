"""MeCeFO reproduction: fault-tolerant LLM training (NeurIPS 2025, arXiv:2510.16415) and analysis tools."""

__version__ = "0.1.0"
