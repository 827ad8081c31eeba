"""residency: a shared LLM inference box. This package holds what every role shares."""

__version__ = "0.1.0"
