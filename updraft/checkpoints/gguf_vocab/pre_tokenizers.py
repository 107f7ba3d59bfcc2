"""llama.cpp's pre-tokenizers by name (``tokenizer.ggml.pre``), as ``tokenizers``
pre-tokenizers: how a byte-level BPE tokenizer cuts text into words before merging.

Each entry is the split patterns of the tokenizer that name stands for, as the model's
own tokenizer.json writes them (llama.cpp runs the same patterns, rewritten for its
regex engine, in ``src/llama-vocab.cpp``; where a rewrite cuts otherwise, the
tokenizer.json's pattern is kept). Several patterns are applied one after
another, each cutting the pieces of the one before, with what lies between matches
kept as pieces of its own. A name not in the table is refused by name: no other
pattern stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers


@dataclass(frozen=True)
class Splitting:
    """One pre-tokenizer: its patterns (empty: GPT-2's own, which the byte-level
    pre-tokenizer applies itself), and whether a word found whole in the vocabulary is
    taken as one token before any merge (Llama 3's ``ignore_merges``)."""

    patterns: tuple[str, ...] = ()
    ignore_merges: bool = False


class UnknownPreTokenizer(ValueError):
    """A ``tokenizer.ggml.pre`` name this table does not hold."""


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: combining marks stay with the letters they follow.
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken: a word is an optional capitalised run then lower-case letters.
# llama.cpp's rewrite of it for its regex engine cuts otherwise where a capital is not
# ASCII ("ÉCOLE": "É", "COLE") or a combining mark follows a letter; this is the
# pattern the model was trained with, as its tokenizer.json writes it.
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k (GPT-4o's and gpt-oss's), as tiktoken writes it: Tekken's two
# case-aware words, each taking a contraction after it, digits in threes, and a "/" kept
# after punctuation. llama.cpp's rewrite of it, like Tekken's, cuts otherwise where a
# capital is not ASCII or a combining mark follows a letter.
_SUFFIX = _CONTRACTIONS + "?"
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _SUFFIX
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _SUFFIX
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# StarCoder's, also SmolLM's and Refact's: every digit alone, then GPT-2's words.
STARCODER = (r"\p{N}", _GPT2_WORDS)
# Falcon's: punctuation runs first, then GPT-2's words, then digits in threes.
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_WORDS, r"[0-9][0-9][0-9]")
_CJK = r"[一-龥ࠀ-一가-퟿]+"
# DeepSeek LLM's: newlines, Latin-script words, ASCII and full-width punctuation,
# trailing blanks, CJK runs, digit runs.
_LATIN_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
    "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _LATIN_LETTERS + r"]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _CJK,
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
# DeepSeek V3's (and R1's): digits in threes, CJK and kana runs, then words.
DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# llama.cpp's patterns for a BPE file that names no pre-tokenizer, or "default".
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_WORDS, r"\p{N}+", r"[0-9][0-9][0-9]")

SPLITTINGS: dict[str, Splitting] = {
    "default": Splitting(DEFAULT),
    "gpt-2": Splitting(),
    "phi-2": Splitting(),
    "llama3": Splitting((LLAMA3,), ignore_merges=True),
    "llama-v3": Splitting((LLAMA3,), ignore_merges=True),
    "llama-bpe": Splitting((LLAMA3,), ignore_merges=True),
    "falcon3": Splitting((LLAMA3,), ignore_merges=True),
    "pixtral": Splitting((LLAMA3,), ignore_merges=True),
    "smaug-bpe": Splitting((LLAMA3,)),
    "dbrx": Splitting((LLAMA3,)),
    "qwen2": Splitting((QWEN2,)),
    "deepseek-r1-qwen": Splitting((QWEN2,)),
    "stablelm2": Splitting((QWEN2,)),
    "megrez": Splitting((QWEN2,)),
    "qwen35": Splitting((QWEN35,)),
    "tekken": Splitting((TEKKEN,), ignore_merges=True),
    "gpt-4o": Splitting((O200K,)),
    "llama4": Splitting((O200K,)),
    "deepseek-llm": Splitting(DEEPSEEK_LLM),
    "deepseek-coder": Splitting(DEEPSEEK_CODER),
    "deepseek-v3": Splitting(DEEPSEEK_V3),
    "smollm": Splitting(STARCODER),
    "starcoder": Splitting(STARCODER),
    "refact": Splitting(STARCODER),
    "falcon": Splitting(FALCON),
    "mpt": Splitting(),
}


def splitting(name: str) -> Splitting:
    """The pre-tokenizer llama.cpp calls ``name``; UnknownPreTokenizer when there is none."""
    if name not in SPLITTINGS:
        raise UnknownPreTokenizer(
            f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not known; "
            f"known: {', '.join(sorted(SPLITTINGS))}"
        )
    return SPLITTINGS[name]


def byte_level(name: str) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer of ``name``: its splits, then text as bytes."""
    patterns = splitting(name).patterns
    if not patterns:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in patterns]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
