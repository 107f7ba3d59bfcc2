"""The ids that end a generation, from a GGUF file's metadata, as llama.cpp finds them.

A chat model ends its turn with a token of its own (Llama 3's ``<|eot_id|>``, Gemma's
``<end_of_turn>``, ChatML's ``<|im_end|>``), which is seldom the file's EOS. llama.cpp
stops at the EOS, the end-of-turn and end-of-message ids the file names
(``tokenizer.ggml.eot_token_id``, ``eom_token_id``), and at every token whose text is
one of the end-of-generation texts below, whatever the file says; so does updraft.
"""

from __future__ import annotations

from typing import Any

STOP_ID_KEYS = ("eos", "eot", "eom")
# The texts llama.cpp takes as the end of a generation (src/llama-vocab.cpp).
STOP_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "</s>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    }
)


def stop_token_ids(fields: dict[str, Any]) -> list[int]:
    """The file's EOS, end-of-turn and end-of-message ids, then those of every token
    whose text ends a generation, in that order, each once."""
    tokens = fields.get("tokenizer.ggml.tokens") or []
    named = [fields.get(f"tokenizer.ggml.{key}_token_id") for key in STOP_ID_KEYS]
    ids = [int(index) for index in named if index is not None and 0 <= int(index) < len(tokens)]
    ids += [index for index, token in enumerate(tokens) if token in STOP_TEXTS]
    texts = {tokens[index] for index in ids}
    # Where "<|end|>" ends a message that a call or a return follows (gpt-oss, Solar
    # Open), and where "</s>" is text beside Gemma 4's "<|tool_response>", llama.cpp
    # takes them out again.
    dropped = set()
    if (
        "<|end|>" in texts
        and texts & {"<|call|>", "<|calls|>"}
        and texts & {"<|return|>", "<|flush|>"}
    ):
        dropped.add("<|end|>")
    if "<|tool_response>" in texts:
        dropped.add("</s>")
    return list(dict.fromkeys(index for index in ids if tokens[index] not in dropped))
