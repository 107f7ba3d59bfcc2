"""Speculative decoding: proposers of draft tokens. The runner verifies the drafts."""
