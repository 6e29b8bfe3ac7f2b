"""Speculative decoding: a proposer drafts tokens, one target step verifies them."""
