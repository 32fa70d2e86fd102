"""pitstop: fast, cheap and explainable LLM training runs."""

__version__ = "0.1.0"
