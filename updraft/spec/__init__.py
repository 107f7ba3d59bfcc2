"""Speculative decoding: proposers of draft tokens and their verification."""
