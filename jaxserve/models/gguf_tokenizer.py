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
- A GGUF names one EOS, and a chat model's turn may end at another token: llama.cpp ends generation at the
  file's EOS, EOT and EOM and at the tokens whose text ends a turn in the families it knows (Phi-3's `<|end|>`
  beside its EOS `<|endoftext|>`, Llama 3.1's `<|eom_id|>`, Qwen's `<|endoftext|>` beside `<|im_end|>`): the
  list their `generation_config.json` gives, which a GGUF does not carry.
- A sentencepiece vocabulary of a Llama-shaped model (Llama 2's, Mistral's before Tekken) puts its prefix
  space before every run of text, even one that starts with a space (`tokenizer.ggml.add_space_prefix`,
  true unless the file says otherwise): the normalizer Llama 2's `tokenizer.json` has. transformers gives those
  files a pre-tokenizer that adds none to text already starting with a space.
"""

import logging
from dataclasses import dataclass
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
# GLM-4's (GLM-4, 4.5, 4.6, 5): Llama 3's, its letters without their marks
_GLM4 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_SPLITS = {
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "deepseek-v3": _DEEPSEEK_V3,
    **dict.fromkeys(("glm4", "glm5", "chatglm-bpe"), _GLM4),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS_THEN_GPT2),
}
# Names whose split is GPT-2's, which transformers gives a name it does not know. A byte-level file that names
# none ("default", files older than the key) is split as GPT-2 splits text too; llama.cpp splits those by a
# regex of its own, which is no model's.
_GPT2_SPLITS = frozenset({"default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling",
                          "gigachat", "a.x-4.0", "mellum", "modern-bert", "roberta-bpe", "jina-es", "jina-de",
                          "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code"})

# Names whose vocabulary takes a piece that is a token whole before merging it (llama.cpp's list)
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                            "lfm2", "jina-v5-nano", "tekken", "glm4", "glm5", "minicpm5", "youtu",
                            "granite-embed-multi-97m"})

# Names whose files begin a text with BOS where they do not say (`tokenizer.ggml.add_bos_token`), as their
# models' own tokenizers do (llama.cpp's list: Llama 3's, Tekken's)
_BOS_BY_DEFAULT = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                             "lfm2", "jina-v5-nano", "tekken"})

# Names whose texts llama.cpp begins with no BOS whatever the file says (its BOS id is null for them): their chat
# templates write the model's prefix themselves (GLM-4's `[gMASK]<sop>`)
_NO_BOS = frozenset({"glm4", "glm5", "chatglm-bpe"})

# Sentencepiece files whose architecture transformers builds its own tokenizer for (its GGUF reader's
# `GGUF_SENTENCEPIECE_BUILDERS`: Gemma's has no prefix space, Phi-3's has the normalizer already)
_OWN_SENTENCEPIECE = frozenset({"gemma", "gemma2", "gemma3", "phi3"})


@dataclass(frozen=True)
class GgufVocabulary:
    """A GGUF's tokenizer keys (`tokenizer.ggml.*`)."""

    model: str | None  # "gpt2": byte-level BPE; "llama": sentencepiece
    pre: str | None
    tokens: list[str]  # byte-level files spell their normal tokens in GPT-2's byte alphabet, the others as text
    token_types: list[int]  # llama.cpp's: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    add_space_prefix: bool
    add_bos: bool | None  # None: the file does not say
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None

    @classmethod
    def read(cls, fields: dict[str, Any]) -> "GgufVocabulary":
        """From a GGUF reader's `fields` (key -> ReaderField)."""
        def value(name: str, default: Any = None) -> Any:
            field = fields.get(f"tokenizer.ggml.{name}")
            return default if field is None else field.contents()

        tokens = value("tokens", [])
        add_bos = value("add_bos_token")
        return cls(value("model"), value("pre"), tokens, value("token_type", [_NORMAL] * len(tokens)),
                   bool(value("add_space_prefix", True)), None if add_bos is None else bool(add_bos),
                   value("bos_token_id"), value("eos_token_id"), value("eot_token_id"), value("eom_token_id"))


_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def fit_tokenizer_json(document: dict[str, Any], vocabulary: GgufVocabulary, architecture: str,
                       file_name: str) -> bool:
    """Make `document` (the `tokenizer.json` of the tokenizer transformers built from the file, as loaded) split,
    merge, prefix and find special tokens as llama.cpp does for that file; whether anything changed. Warns where
    the file names a split neither knows."""
    changed = False
    if vocabulary.model == "gpt2":
        changed |= _keep_special_tokens_whole(document, vocabulary)
        pre = vocabulary.pre
        if pre in _SPLITS:
            document["pre_tokenizer"], changed = _split_pre_tokenizer(_SPLITS[pre]), True
        elif pre is not None and pre not in _GPT2_SPLITS and pre not in (_known_to_transformers() or {pre}):
            logger.warning("%s: its pre-tokenizer %r is not one jaxserve or transformers knows, and its text is "
                           "split as GPT-2 splits it, which may tokenize some text (numbers, CJK) unlike the "
                           "model's own tokenizer; pass --tokenizer with the model's hub id (or a directory "
                           "with its tokenizer.json) to use its own", file_name, pre)
        if pre in _IGNORE_MERGES:
            document["model"]["ignore_merges"], changed = True, True
        if pre in _NO_BOS and vocabulary.add_bos and document.get("post_processor") is not None:
            document["post_processor"], changed = None, True
        if vocabulary.add_bos is None and pre in _BOS_BY_DEFAULT and vocabulary.bos_id is not None:
            document["post_processor"], changed = _bos_first(vocabulary.tokens[vocabulary.bos_id],
                                                             vocabulary.bos_id), True
    if vocabulary.model == "llama" and architecture not in _OWN_SENTENCEPIECE:
        _prefix_space_as_llama_cpp(document, vocabulary.add_space_prefix)
        changed = True
    return changed


def _bos_first(bos: str, bos_id: int) -> dict[str, Any]:
    """`tokenizer.json`'s post-processor that puts BOS before a text (and before each of a pair)."""
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {"type": "TemplateProcessing",
            "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def _prefix_space_as_llama_cpp(document: dict[str, Any], add_space_prefix: bool) -> None:
    """Spaces as `▁`, and with `add_space_prefix` one before every run of text, which decoding takes off the
    text's start again (llama.cpp's `remove_space`); without it, none either way."""
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    prepend = [{"type": "Prepend", "prepend": "\u2581"}] if add_space_prefix else []
    document["normalizer"] = {"type": "Sequence", "normalizers": [*prepend, replace]}
    document["pre_tokenizer"] = None
    decoder = document.get("decoder") or {}
    if not add_space_prefix and decoder.get("type") == "Sequence":
        decoder["decoders"] = [step for step in decoder["decoders"] if step.get("type") != "Strip"]


def _keep_special_tokens_whole(document: dict[str, Any], vocabulary: GgufVocabulary) -> bool:
    """A byte-level file's control and user-defined tokens are text (`<｜User｜>`), not spelled in the byte
    alphabet. transformers spells those holding other characters (DeepSeek's `｜` and `▁`, CJK), leaves them out
    of its special tokens, and adds its special ones again past the vocabulary (DeepSeek's BOS at 102,401 of
    102,400), beside GPT-2's default `<|endoftext|>` where the file has none. Each is its file id's token again,
    matched whole in text, and the tokenizer holds no token past the file's."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = document["model"]["vocab"]
    added = {entry["id"]: entry for entry in document["added_tokens"] if entry["id"] < len(vocabulary.tokens)}
    changed = len(added) < len(document["added_tokens"])
    for i, (text, kind) in enumerate(zip(vocabulary.tokens, vocabulary.token_types, strict=True)):
        if kind not in (_CONTROL, _USER_DEFINED) or set(text) <= alphabet:
            continue  # spelled already, or transformers has it right
        spelled = "".join(spelling[byte] for byte in text.encode())
        if vocab.get(spelled) == i:
            del vocab[spelled]
        vocab[text] = i
        added[i] = {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                    "normalized": False, "special": kind == _CONTROL}
        changed = True
    document["added_tokens"] = sorted(added.values(), key=lambda entry: entry["id"])
    ids = {entry["content"]: entry["id"] for entry in document["added_tokens"]}
    for token in ((document.get("post_processor") or {}).get("special_tokens") or {}).values():
        token["ids"] = [ids.get(content, i) for content, i in zip(token["tokens"], token["ids"], strict=True)]
    return changed


# Texts of tokens that end a turn, wherever a vocabulary holds them (llama.cpp's list, for the families served)
_END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>",
                      "<end_of_turn>", "<|return|>", "<|call|>", "<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>")
# Harmony's (GPT-OSS's) `<|end|>` ends a message, not the answer: not an end where `<|return|>` and `<|call|>` are
_HARMONY_ENDS = ("<|return|>", "<|call|>")


def end_of_generation_ids(vocabulary: GgufVocabulary) -> list[int]:
    """The ids generation ends at, the file's EOS first."""
    by_text = {text: i for i, text in enumerate(vocabulary.tokens) if text in _END_OF_TURN_TEXTS}
    if all(text in by_text for text in _HARMONY_ENDS):
        by_text.pop("<|end|>", None)
    keyed = [vocabulary.eos_id, vocabulary.eot_id, vocabulary.eom_id]
    return list(dict.fromkeys([int(i) for i in keyed if i is not None] + sorted(by_text.values())))


def _split_pre_tokenizer(regexes: tuple[str, ...]) -> dict[str, Any]:
    """`tokenizer.json`'s pre-tokenizer: isolating splits by each regex in turn, then bytes to GPT-2's alphabet."""
    splits = [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
              for regex in regexes]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}


def _known_to_transformers() -> frozenset[str] | None:
    """The `tokenizer.ggml.pre` names transformers' GGUF reader splits by; None where this transformers does not
    say."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return None
    return frozenset(GGUF_PRE_TOKENIZER_SPLITS)
