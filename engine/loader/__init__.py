"""From files to a running model: checkpoint formats and streaming, the tokenizer, the builder."""
