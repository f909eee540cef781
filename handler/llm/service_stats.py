"""Counters an LLM service keeps for the metrics endpoint (no torch: remote services use it too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServiceStats:
    """Counters the metrics endpoint reads."""

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
