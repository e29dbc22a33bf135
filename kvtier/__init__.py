"""kvtier: a tiered KV-cache block store for LLM inference."""
