"""The DeepSeek-V4.1-Flash text model, module by module as the technical report reads."""
