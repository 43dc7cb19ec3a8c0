"""A GGUF's tokenizer keys, read as llama.cpp reads them.

A GGUF carries no `tokenizer.json`: it names its tokenizer by llama.cpp's keys, and transformers' GGUF reader
rebuilds one from them (`gguf_cache.convert_with_transformers`). Where the two read a key differently, the
file means what llama.cpp, which wrote it, reads it to mean, and llama.cpp's reading matches the model's own
`tokenizer.json` (checked against the token ids of the original tokenizers, docs/benchmarks.md, stop 100):

- `tokenizer.ggml.pre` names the regexes that split text before the merges. transformers knows some names and
  splits the others as GPT-2 does: DeepSeek's tokenizers, and those that split digits one by one
  (StarCoder's, Command-R's), are added here.
- A vocabulary made by tiktoken (Llama 3's, Mistral's Tekken) takes a piece that is itself a token whole,
  before any merge (`ignore_merges`); its merges alone may not reach that token.
- A sentencepiece vocabulary of a Llama-shaped model (Llama 2's, Mistral's before Tekken) puts its prefix
  space before every run of text, even one that starts with a space (`tokenizer.ggml.add_space_prefix`,
  true unless the file says otherwise): the normalizer Llama 2's `tokenizer.json` has. transformers gives those
  files a pre-tokenizer that adds none to text already starting with a space.
"""

import logging
from typing import Any

logger = logging.getLogger(__name__)

# `tokenizer.ggml.pre` -> the regexes its tokenizer splits text with, each applied to the pieces of the one
# before (their `tokenizer.json`: a sequence of isolating splits, then byte-level without GPT-2's regex).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# DeepSeek LLM's (V1, V2, V2-Lite): its letters are the cased scripts' letters its tokenizer lists
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e"
    "\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_FULLWIDTH_PUNCTUATION = "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002"
_DEEPSEEK_LLM = ("[\r\n]", rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+", rf"\s?[!-/:-~{_FULLWIDTH_PUNCTUATION}]+", r"\s+$",
                 _CJK_HANGUL, r"\p{N}+")
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
# DeepSeek V3's (V3, R1): digits in threes, CJK and kana runs, then words with their marks
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_REGEX)
_SPLITS = {
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "deepseek-v3": _DEEPSEEK_V3,
    **dict.fromkeys(("starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _DIGITS_THEN_GPT2),
}
# Names whose split is GPT-2's, which transformers gives a name it does not know. SmolLM's splits digits
# apart first, which changes no token of its vocabulary (no token holds a digit beside anything else).
_GPT2_SPLITS = frozenset({"gpt-2", "default", "smollm", "mpt", "olmo", "phi-2", "jais", "trillion"})

# Names whose vocabulary takes a piece that is a token whole before merging it (llama.cpp's list)
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                            "lfm2", "tekken", "glm4", "glm5", "minicpm5", "youtu"})

# Sentencepiece files whose architecture transformers builds its own tokenizer for (Gemma's has no prefix
# space; Phi-3's has the normalizer already)
_OWN_SENTENCEPIECE = frozenset({"gemma", "gemma2", "gemma3", "phi3"})


def read_as_llama_cpp(tokenizer: Any, fields: dict[str, Any], architecture: str) -> bool:
    """Make `tokenizer` (transformers', built from the GGUF whose metadata `fields` holds: key -> value) split,
    merge and prefix text as llama.cpp does for that file; whether anything changed. Warns where the file names
    a split neither knows."""
    backend = tokenizer.backend_tokenizer
    changed = False
    model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre")
    if model == "gpt2" and pre is not None:
        if pre in _SPLITS:
            backend.pre_tokenizer, changed = _split_pre_tokenizer(_SPLITS[pre]), True
        elif pre not in _GPT2_SPLITS and pre not in _known_to_transformers(default=frozenset({pre})):
            logger.warning("this file's pre-tokenizer %r is not one jaxserve or transformers knows, and its text "
                           "is split as GPT-2 splits it, which may tokenize some text (numbers, CJK) unlike the "
                           "model's own tokenizer; pass --tokenizer with the model's hub id (or a directory "
                           "with its tokenizer.json) to use its own", pre)
        if pre in _IGNORE_MERGES:
            backend.model.ignore_merges, changed = True, True
    if (model == "llama" and architecture not in _OWN_SENTENCEPIECE
            and fields.get("tokenizer.ggml.add_space_prefix", True)):
        from tokenizers import normalizers

        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer, changed = None, True
    return changed


def _split_pre_tokenizer(regexes: tuple[str, ...]) -> Any:
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _known_to_transformers(default: frozenset[str]) -> frozenset[str]:
    """The `tokenizer.ggml.pre` names transformers' GGUF reader splits by, or `default` where this transformers
    does not say."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return default
    return frozenset(GGUF_PRE_TOKENIZER_SPLITS)
