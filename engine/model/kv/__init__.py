"""The model's one door to storage: the KV backend protocol and its dense implementation."""
