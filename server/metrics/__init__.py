"""Prometheus metrics of a served model, their vLLM aliases, and disaggregation metrics."""
