"""A GGUF file's config and tokenizer, converted once and kept as an HF directory keyed by the file's hash.

transformers reads both from GGUF metadata, building the config and the tokenizer (its vocabulary and
merges) in Python, which took seconds of every start; reading the converted `config.json` and
`tokenizer.json` takes milliseconds. The key is the file's SHA-256, so a changed file converts anew, and
each file appears whole or not at all (written aside, then renamed), so concurrent starts are safe. The
dequantized tensors of a small file are kept there too, as float32 safetensors (see `iter_cached_gguf_tensors`).
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.config import cache_home

logger = logging.getLogger(__name__)

_CONVERTED_FILES = ("config.json", "tokenizer_config.json")
_FORMAT = "4"  # bump when what is written here changes


def cache_root() -> Path:
    """`$JAXSERVE_CACHE_DIR/gguf`, by default `~/.cache/jaxserve/gguf`."""
    return cache_home() / "gguf"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def content_digest(path: Path) -> str:
    """`file_sha256(path)`, remembered under the file's identity (path, inode, size, modification time):
    hashing a 4 GB GGUF takes seconds of every start, a stat microseconds. Any write to the file changes its
    modification time, so a changed file is hashed anew."""
    info = path.stat()
    identity = f"{path.resolve()}\0{info.st_ino}\0{info.st_size}\0{info.st_mtime_ns}".encode()
    memo = cache_root() / "digests" / hashlib.sha256(identity).hexdigest()
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = file_sha256(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.with_name(f".{memo.name}.{os.getpid()}")
        staging.write_text(digest)
        os.replace(staging, memo)
    except OSError as e:  # a cache that cannot be written only costs the next start a hash
        logger.warning("could not remember %s's digest: %s", path.name, e)
    return digest


def _fill_from_metadata(config: Any, gguf_path: Path) -> Any:
    """`config` completed from the file's metadata where transformers' GGUF reader leaves things out: the head
    size (`{arch}.attention.key_length`; Qwen3-0.6B's is 128, not hidden_size / heads = 64), an expert's MLP
    width (Qwen3-MoE, Qwen2-MoE) and a shared expert's (Qwen2-MoE), a `llama` file's experts, which make it a
    Mixtral (llama.cpp writes Mixtral as `llama` with `expert_count`; transformers reads it as a dense Llama),
    Phi-3's LongRoPE factors (tensors in the 128k variants' files), gpt-oss's window and YaRN scaling
    (`gguf.py` hides the scaling from transformers), the configs of the families transformers reads as others
    (`gguf._READ_AS`: Granite's multipliers, SmolLM3's layers without RoPE, OLMo 2 and 3, Gemma 1, DeepSeek-V2
    and V3), and Gemma 2
    27B's query scale (llama.cpp's rule: its 46 layers scale queries by (hidden / heads)^-1/2, the others by
    head_size^-1/2, which transformers' default of 256 gives)."""
    from jaxserve.models.gguf import read_gguf

    reader = read_gguf(gguf_path)
    arch = reader.fields["general.architecture"].contents()

    def field(key: str) -> Any:
        found = reader.fields.get(f"{arch}.{key}")
        return None if found is None else found.contents()

    if (head_dim := field("attention.key_length")) is not None:
        config.head_dim = int(head_dim)
    if (expert_width := field("expert_feed_forward_length")) is not None:
        config.moe_intermediate_size = int(expert_width)
    if (shared_width := field("expert_shared_feed_forward_length")) is not None:
        config.shared_expert_intermediate_size = int(shared_width)
    if arch == "phi3" and (factors := {t.name: t.data for t in reader.tensors if t.name.startswith("rope_factors_")}):
        original = field("rope.scaling.original_context_length") or config.max_position_embeddings
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": "longrope",
                                  "long_factor": [float(f) for f in factors["rope_factors_long.weight"]],
                                  "short_factor": [float(f) for f in factors["rope_factors_short.weight"]],
                                  "original_max_position_embeddings": int(original)}
        config.original_max_position_embeddings = int(original)
    if arch == "gpt-oss" and (window := field("attention.sliding_window")) is not None:  # transformers reads
        config.sliding_window = int(window)  # `gpt-oss.sliding_window`, where llama.cpp writes none
    if arch == "gpt-oss" and (factor := field("rope.scaling.factor")) is not None:  # hidden from transformers
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": field("rope.scaling.type") or "yarn",
                                  "factor": float(factor)}
        if (original := field("rope.scaling.original_context_length")) is not None:
            config.rope_parameters["original_max_position_embeddings"] = int(original)
    if arch == "gemma2" and config.num_hidden_layers == 46:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    if arch == "granite":  # llama.cpp's names for Granite's multipliers
        from transformers import GraniteConfig

        scales = {"embedding_multiplier": field("embedding_scale"), "residual_multiplier": field("residual_scale"),
                  "attention_multiplier": field("attention.scale"), "logits_scaling": field("logit_scale")}
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        scales["attention_multiplier"] = scales["attention_multiplier"] or head_dim**-0.5  # llama.cpp's default
        config = GraniteConfig(**_llama_fields(config, reader), **{k: float(v) for k, v in scales.items() if v})
    if arch == "smollm3":  # llama.cpp leaves RoPE out of every fourth layer, as SmolLM3's config does by default
        from transformers import SmolLM3Config

        config = SmolLM3Config(**_llama_fields(config, reader), no_rope_layer_interval=4)
    if arch == "olmo2" and (window := field("attention.sliding_window")):  # llama.cpp writes OLMo 3 as `olmo2`
        from transformers import Olmo3Config

        config = Olmo3Config(**{**_llama_fields(config, reader),
                                **_olmo3_fields(field, config.num_hidden_layers, window)})
    elif arch == "olmo2":
        from transformers import Olmo2Config

        if field("rope.scaling.type") not in (None, "none"):
            raise ValueError(f"{gguf_path.name}: an `olmo2` file with RoPE scaling and no window (neither OLMo 2 "
                             "nor OLMo 3), which jaxserve does not serve")
        config = Olmo2Config(**_llama_fields(config, reader))
    if arch == "gemma":  # read as Gemma 2, whose soft caps, window and query scale Gemma 1 has not
        from transformers import GemmaConfig

        gemma2_only = ("final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar", "sliding_window",
                       "layer_types", "cache_implementation", "use_bidirectional_attention")
        config = GemmaConfig(**{k: v for k, v in _own_fields(config).items() if k not in gemma2_only})
    if arch == "deepseek2":
        config = _deepseek_config(config, _required(field, gguf_path.name, arch), {t.name for t in reader.tensors})
    if arch == "glm4moe":
        config = _glm4_moe_config(config, _required(field, gguf_path.name, arch), {t.name for t in reader.tensors})
    if arch == "llama" and field("expert_count"):
        from transformers import MixtralConfig

        config = MixtralConfig(**_own_fields(config), num_local_experts=int(field("expert_count")),
                               num_experts_per_tok=int(field("expert_used_count")), sliding_window=None)
    return config


# llama.cpp's `expert_gating_func`: how a DeepSeek router scores its experts (a file without it is V2's softmax)
_SOFTMAX_GATING, _SIGMOID_GATING = 1, 2


def _required(field: Callable[[str], Any], file: str, arch: str) -> Callable[[str, Any], Any]:
    """`field`, and a key's default where it may be missing; a key with no default that the file lacks is an
    error naming it."""
    missing = object()

    def read(key: str, default: Any = missing) -> Any:
        value = field(key)
        if value is not None:
            return value
        if default is missing:
            raise ValueError(f"{file}: the `{arch}` file has no `{arch}.{key}`, which jaxserve needs to serve it")
        return default

    return read


def _deepseek_config(config: Any, field: Callable[..., Any], tensor_names: set[str]) -> Any:
    """A `deepseek2` file's DeepSeek-V2 config (softmax router) or V3 config (sigmoid router, with its correction
    bias), rebuilt from llama.cpp's keys. The heads' query/key and value widths are `key_length_mla` and
    `value_length_mla` where the file has them (written since llama.cpp absorbs the up-projections; its
    `key_length` is then the cached latent's), else `key_length` and `value_length`. YaRN's `yarn_log_multiplier`
    is 0.1 x the config's `mscale_all_dim`, which DeepSeek's configs set equal to `mscale`."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    rope_dims = int(field("rope.dimension_count"))
    qk_dims = int(field("attention.key_length_mla", None) or field("attention.key_length"))
    rope = {"rope_type": "default", "rope_theta": float(field("rope.freq_base", 10000.0))}
    if (scaling := field("rope.scaling.type", None)) == "yarn":
        mscale = float(field("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope.update(rope_type="yarn", factor=float(field("rope.scaling.factor")), mscale=mscale, mscale_all_dim=mscale,
                    original_max_position_embeddings=int(field("rope.scaling.original_context_length")),
                    beta_fast=float(field("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(field("rope.scaling.yarn_beta_slow", 1.0)))
    elif scaling not in (None, "none"):
        raise ValueError(f"a `deepseek2` file with RoPE scaling {scaling!r}, which DeepSeek's configs do not use")
    gating = int(field("expert_gating_func", _SOFTMAX_GATING))
    if gating not in (_SOFTMAX_GATING, _SIGMOID_GATING):
        raise ValueError(f"a `deepseek2` file whose experts are scored by llama.cpp's gating function {gating}: "
                         "jaxserve serves its softmax (1) and sigmoid (2)")
    sigmoid = gating == _SIGMOID_GATING
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, tie_word_embeddings="output.weight" not in tensor_names,
        rope_parameters=rope, q_lora_rank=int(field("attention.q_lora_rank", 0)) or None,
        kv_lora_rank=int(field("attention.kv_lora_rank")), qk_rope_head_dim=rope_dims,
        qk_nope_head_dim=qk_dims - rope_dims,
        v_head_dim=int(field("attention.value_length_mla", None) or field("attention.value_length")),
        **_deepseek_experts(field))
    if sigmoid:
        return DeepseekV3Config(**fields)
    return DeepseekV2Config(**fields, topk_method="group_limited_greedy" if fields["n_group"] > 1 else "greedy")


def _deepseek_experts(field: Callable[..., Any]) -> dict[str, Any]:
    """The config fields of DeepSeek's experts (DeepSeek's and GLM-4.5's configs name them alike) from llama.cpp's
    keys: the dense layers before them, their counts, width, scale, normalisation and groups (one where the file
    does not say)."""
    groups = int(field("expert_group_count", 1))
    return dict(
        first_k_dense_replace=int(field("leading_dense_block_count", 0)),
        n_routed_experts=int(field("expert_count")), num_experts_per_tok=int(field("expert_used_count")),
        moe_intermediate_size=int(field("expert_feed_forward_length")),
        n_shared_experts=int(field("expert_shared_count", 0)),
        routed_scaling_factor=float(field("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(field("expert_weights_norm", False)), n_group=groups,
        topk_group=int(field("expert_group_used_count", groups)))


def _glm4_moe_config(config: Any, field: Callable[..., Any], tensor_names: set[str]) -> Any:
    """A `glm4moe` file's GLM-4.5 config, rebuilt from llama.cpp's keys: its block count holds the multi-token
    prediction layers (`nextn_predict_layers`) after the model's own; RoPE covers `rope.dimension_count` of each
    head; biases on q, k and v and per-head q/k norms where the file holds their tensors; DeepSeek-V3's router
    (llama.cpp's sigmoid gating) over `expert_group_count` groups, 1 where the file does not say (GLM-4.5's and
    4.6's configs have one group)."""
    from transformers import Glm4MoeConfig

    if field("rope.scaling.type", None) not in (None, "none"):
        raise ValueError("a `glm4moe` file with RoPE scaling, which GLM-4.5's configs do not use")
    if int(field("expert_gating_func", _SIGMOID_GATING)) not in (0, _SIGMOID_GATING):  # 0: llama.cpp's sigmoid here
        raise ValueError("a `glm4moe` file whose experts are not scored by a sigmoid, as GLM-4.5's are")
    head_dim = int(field("attention.key_length", None) or config.hidden_size // config.num_attention_heads)
    mtp_layers = int(field("nextn_predict_layers", 0))
    rope = {"rope_type": "default", "rope_theta": float(field("rope.freq_base", 10000.0)),
            "partial_rotary_factor": int(field("rope.dimension_count", head_dim)) / head_dim}
    return Glm4MoeConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers - mtp_layers, num_nextn_predict_layers=mtp_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=head_dim, max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        tie_word_embeddings="output.weight" not in tensor_names, rope_parameters=rope,
        attention_bias="blk.0.attn_q.bias" in tensor_names, use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        **_deepseek_experts(field))


def _olmo3_fields(field: Callable[[str], Any], num_layers: int, window: int) -> dict[str, Any]:
    """OLMo 3's window, layer kinds and RoPE from an `olmo2` file's metadata, as llama.cpp runs them: the
    layers `attention.sliding_window_pattern` marks are windowed (a flag per layer, or a period n: every n-th
    layer full; 4 by default) and rotate unscaled; the full ones take the file's scaling (YaRN). YaRN's
    attention factor is the checkpoint's own where the converter wrote it (`rope.scaling.yarn_attn_factor`,
    which llama.cpp leaves for its own figure, the same at OLMo 3's default), else YaRN's default."""
    pattern = field("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        windowed = [bool(flag) for flag in pattern]
    else:
        period = 4 if pattern is None else int(pattern)
        windowed = [period == 0 or layer % period < period - 1 for layer in range(num_layers)]
    base = float(field("rope.freq_base") or 10000.0)
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    scaling = field("rope.scaling.type")
    if scaling == "yarn":
        full.update(rope_type="yarn", factor=float(field("rope.scaling.factor")))
        if (original := field("rope.scaling.original_context_length")) is not None:
            full["original_max_position_embeddings"] = int(original)
        if (own := field("rope.scaling.yarn_attn_factor")) is not None:
            full["attention_factor"] = float(own)
        for beta in ("beta_fast", "beta_slow"):
            if (value := field(f"rope.scaling.yarn_{beta}")) is not None:
                full[beta] = float(value)
    elif scaling not in (None, "none"):
        raise ValueError(f"an OLMo 3 file with RoPE scaling {scaling!r} (jaxserve reads YaRN)")
    sliding = {"rope_type": "default", "rope_theta": base}  # llama.cpp's OLMo 2 graph rotates every layer at the base
    return {"sliding_window": int(window),
            "layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed],
            "rope_parameters": {"sliding_attention": sliding, "full_attention": full}}


def _own_fields(config: Any) -> dict[str, Any]:
    """A config's fields, to make another family's config of them."""
    skipped = ("model_type", "architectures", "transformers_version")
    return {k: v for k, v in config.to_dict().items() if k not in skipped}


def _llama_fields(config: Any, reader: Any) -> dict[str, Any]:
    """A Llama config read from a file of another architecture (`gguf._READ_AS`), as the fields of that family's
    config: with biases on the attention's projections where the file holds them (Granite's may)."""
    return {**_own_fields(config), "attention_bias": any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)}


# The bundled model's converted files, shipped with the package (models/bundled/, tokenizer.json gzipped):
# transformers reads a GGUF's metadata only with torch installed (its GGUF reader imports it), and serving
# needs no torch. Keyed by the GGUF's SHA-256; tests/models/test_gguf_cache.py checks them against a fresh
# conversion.
_SHIPPED_CONVERSIONS = {"b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53": "bundled"}
_SHIPPED_FILES = ("config.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.json.gz")


def _write_shipped(package_dir: str, staging: Path) -> None:
    import gzip
    from importlib import resources

    source = resources.files(__package__).joinpath(package_dir)
    for name in _SHIPPED_FILES:
        data = source.joinpath(name).read_bytes()
        if name.endswith(".gz"):
            data, name = gzip.decompress(data), name.removesuffix(".gz")
        (staging / name).write_bytes(data)


def convert_with_transformers(gguf_path: Path, staging: Path) -> None:
    """The GGUF's config (head size filled in) and tokenizer, read by transformers and saved to `staging`."""
    from jaxserve.models.gguf import gguf_architecture, read_gguf, shared_gguf_reads
    from jaxserve.models.gguf_tokenizer import GgufVocabulary, end_of_generation_ids, fit_tokenizer_json
    from jaxserve.models.tokenizer import load_tokenizer

    kwargs = {"gguf_file": gguf_path.name}
    with shared_gguf_reads():  # transformers parses the file for the config and again for the tokenizer
        try:
            from transformers import AutoConfig, AutoTokenizer

            config = AutoConfig.from_pretrained(str(gguf_path.parent), **kwargs)
        except ImportError as e:  # transformers' GGUF reader imports torch
            raise RuntimeError(
                f"reading {gguf_path.name}'s config and tokenizer takes transformers' GGUF reader, which needs "
                f"torch (pip install torch; once converted, the files are cached and torch is not needed again): {e}"
            ) from e
        config = _fill_from_metadata(config, gguf_path)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    reader = read_gguf(gguf_path)
    vocabulary = GgufVocabulary.read(reader.fields)
    ends = end_of_generation_ids(vocabulary)
    if ends:  # a GGUF has no generation_config.json: its ends are the config's, as in HF configs that list several
        config.eos_token_id = ends if len(ends) > 1 else ends[0]
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    # as loaded: a family's own class rebuilds parts of it (Qwen2's adds NFC), which the fitted copy keeps
    document = json.loads(load_tokenizer(staging).backend_tokenizer.to_str())
    if fit_tokenizer_json(document, vocabulary, gguf_architecture(reader), gguf_path.name):
        (staging / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False))
        _name_generic_class(staging / "tokenizer_config.json")


def _name_generic_class(tokenizer_config: Path) -> None:
    """Have the tokenizer loaded as transformers' generic class, which takes tokenizer.json as it is: a family's
    own class (GPT-2's, Qwen2's) rebuilds its split from its own defaults on loading."""
    fields = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**fields, "tokenizer_class": "TokenizersBackend"}, indent=2) + "\n")


def _converted_target(digest: str) -> tuple[Path, bool]:
    """Where a GGUF's converted files go, and whether they are all there."""
    target = cache_root() / f"{digest}-v{_FORMAT}"
    return target, all((target / name).is_file() for name in _CONVERTED_FILES)


def is_converted(gguf_path: Path) -> bool:
    """Whether `gguf_path`'s config and tokenizer need no reading by transformers: converted already, or
    shipped with the package."""
    digest = content_digest(gguf_path)
    return digest in _SHIPPED_CONVERSIONS or _converted_target(digest)[1]


def converted_dir(gguf_path: Path) -> Path:
    """The HF directory holding `gguf_path`'s config and tokenizer, converting them on first use."""
    digest = content_digest(gguf_path)
    target, done = _converted_target(digest)
    if done:
        return target
    logger.info("converting %s's config and tokenizer once (cached in %s)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        if digest in _SHIPPED_CONVERSIONS:
            _write_shipped(_SHIPPED_CONVERSIONS[digest], staging)
        else:
            convert_with_transformers(gguf_path, staging)
        try:
            staging.rename(target)
        except OSError:  # another process got there first (or a partial directory is in the way)
            if not all((target / name).is_file() for name in _CONVERTED_FILES):
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


_TENSORS_FILE = "tensors.safetensors"  # a file's tensors, every one dequantized to float32
_BLOCKS_COPY = "tensors-blocks-2"  # the copy keeping the kept formats' blocks ("-2": a mixture's experts too)


def _blocks_file() -> str:
    """The copy with the kept formats' tensors as their blocks, the rest in float32: named by those formats,
    so that a copy written when fewer were kept, holding them dequantized, is not read."""
    from jaxserve.models.gguf_weights import KEPT_KINDS

    return f"{_BLOCKS_COPY}-{'-'.join(sorted(kind.lower() for kind in KEPT_KINDS))}.safetensors"


def _kinds_in(copy: Path) -> set[str]:
    """The formats a blocks copy's name lists (none for the first such copies, named `tensors-blocks-2`)."""
    return set(copy.stem.removeprefix(_BLOCKS_COPY).split("-")[1:])


# The largest copy kept: the whole copy is held in memory while the first load writes it, and a dequantized
# tensor takes float32's 4 bytes a weight where the file may hold 0.5-2. Past it, a file's start reads the
# file itself: its parsing and dequantizing then cost less than reading a float32 copy from disk.
MAX_COPY_BYTES = 2 * 2**30


def copy_bytes(gguf_path: Path, keep_blocks: bool) -> int:
    """The bytes `iter_cached_gguf_tensors` would keep for the file: the kept formats' blocks as stored
    (with `keep_blocks`), every other tensor in float32."""
    from jaxserve.models.gguf import keeps_blocks, kept_bytes, read_gguf

    return sum(kept_bytes(t) if keep_blocks and keeps_blocks(t) else 4 * int(t.n_elements)
               for t in read_gguf(gguf_path).tensors)


def iter_cached_gguf_tensors(
    gguf_path: Path, num_heads: int, num_kv_heads: int, keep_blocks: bool = False
) -> Iterator[tuple[str, Any]]:
    """`iter_gguf_tensors`, from a safetensors copy kept beside the converted config: float32 arrays, and
    with `keep_blocks` each kept tensor's blocks (u8, its format in the file's metadata) as a `GgufTensor`.

    Parsing a GGUF's metadata (49k vocabulary strings, field by field) and dequantizing took about 6 s of
    every start for the bundled model; the copy is memory-mapped in well under a second. The first load
    reads the GGUF and writes the copy (aside, then renamed); the tensors are the same arrays. A file whose
    copy would pass `MAX_COPY_BYTES` is read from the file at every start instead.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from jaxserve.models.gguf import iter_gguf_tensors
    from jaxserve.models.gguf_weights import GgufTensor

    target = converted_dir(gguf_path) / (_blocks_file() if keep_blocks else _TENSORS_FILE)
    if not target.is_file() and (size := copy_bytes(gguf_path, keep_blocks)) > MAX_COPY_BYTES:
        logger.info("%s's tensors are read from the file at every start: a copy would take %.1f GiB, past the "
                    "cache's %.0f GiB", gguf_path.name, size / 2**30, MAX_COPY_BYTES / 2**30)
        yield from iter_gguf_tensors(str(gguf_path), num_heads, num_kv_heads, keep_blocks)
        return
    if target.is_file():
        with safe_open(str(target), framework="numpy") as f:
            kinds = f.metadata() or {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                yield name, GgufTensor(tensor, kinds[name]) if name in kinds else tensor
        return
    tensors: dict[str, np.ndarray] = {}
    kinds: dict[str, str] = {}
    for name, array in iter_gguf_tensors(str(gguf_path), num_heads, num_kv_heads, keep_blocks):
        if isinstance(array, GgufTensor):
            kinds[name] = array.kind
        tensors[name] = np.ascontiguousarray(array.blocks if isinstance(array, GgufTensor) else array)
        yield name, array
    fd, staging = tempfile.mkstemp(dir=target.parent, prefix=".tensors-")
    os.close(fd)
    try:
        save_file(tensors, staging, metadata=kinds or None)
        os.replace(staging, target)
    except OSError as e:  # a cache that cannot be written only costs the next start time
        logger.warning("could not cache %s's tensors: %s", gguf_path.name, e)
        Path(staging).unlink(missing_ok=True)
        return
    if keep_blocks:
        _remove_older_blocks_copies(target)


def _remove_older_blocks_copies(target: Path) -> None:
    """Deletes the blocks copies beside `target` that keep no format it does not (fewer, or the same under an
    older name), which no start reads again; a copy keeping formats this one does not (a newer jaxserve's,
    sharing the cache) stays."""
    kept = _kinds_in(target)
    for copy in target.parent.glob(f"{_BLOCKS_COPY}*.safetensors"):
        if copy != target and _kinds_in(copy) <= kept:
            try:
                copy.unlink()
            except OSError as e:
                logger.debug("could not remove the older copy %s: %s", copy, e)
