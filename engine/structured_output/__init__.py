"""Structured output: compiling a request's grammar spec and matching its tokens (xgrammar)."""
