"""kvstrata: a tiered KV-cache storage engine for LLM inference."""

from __future__ import annotations

__version__ = "0.1.0"
