"""Readers of what a model wrote: tool calls (tools.py: the required calls' grammar and the
calls read back; tool_parsers.py: the model's own syntax). A reasoning parser goes here.
"""
