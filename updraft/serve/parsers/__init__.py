"""Readers of what a model wrote: tool calls (tools.py: the required calls' grammar and the
calls read back; tool_parsers.py and marked_calls.py: each family's own syntax),
reasoning (reasoning.py: ``<think>`` tags) and one reply read for both (reply.py); or
harmony's channels, which carry both (harmony.py, and harmony_grammar.py for its grammars).
"""
