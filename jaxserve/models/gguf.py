"""GGUF files: tensors dequantized with the `gguf` package, renamed to HF checkpoint names.

Config and tokenizer come from the same file through transformers' GGUF support (see loader.py).
llama.cpp's converter permutes Llama Q/K rows for its rotary layout; we undo that as transformers does.
"""

import contextlib
import copy
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFReader, ReaderField, ReaderTensor
from gguf.quants import dequantize

from jaxserve.models.gguf_weights import KEPT_KINDS, GgufTensor
from jaxserve.models.mxfp4 import GGML_MXFP4_BYTES, GGML_Q5_0_BYTES, ggml_mxfp4_as_q5_0
from jaxserve.models.rope_layout import to_rotate_half

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
}
# Where an architecture names a layer's tensors otherwise: Gemma's four norms (its `ffn_norm` is the norm
# before the MLP), Phi-3's fused projections (split by `llama.hf_weight_stream`).
_ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# A mixture of experts: the router, and each kind of expert weight stacked [E, out, in] as the model keeps it.
# Mixtral is a `llama` file with experts; its older files hold one tensor per expert (`blk.N.ffn_gate.E`),
# renamed to Mixtral's checkpoint names for `llama.hf_weight_stream` to stack.
_EXPERT_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts_gate", "ffn_up_exps": "mlp.experts_up",
                 "ffn_down_exps": "mlp.experts_down"}
_PER_EXPERT_NAMES = {"ffn_gate": "w1", "ffn_down": "w2", "ffn_up": "w3"}
_ARCH_LAYER_NAMES["qwen3moe"] = _EXPERT_NAMES
# Qwen2-MoE: the shared expert beside the routed ones, and its gate
_ARCH_LAYER_NAMES["qwen2moe"] = {
    **_EXPERT_NAMES, "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_ARCH_LAYER_NAMES["llama"] = _EXPERT_NAMES
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
# GPT-OSS: its router (with a bias), its norm before the MLP, its attention sinks (a tensor without a suffix in
# transformers' names), and its experts' biases (`blk.N.ffn_gate_exps.bias` -> `mlp.experts_gate_bias`).
_ARCH_LAYER_NAMES["gpt-oss"] = {**_EXPERT_NAMES, "ffn_gate_inp": "mlp.router",
                                "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
# DeepSeek-V2/V3 (`deepseek2`): the latent attention's projections and norms, the router's correction bias (a
# tensor without a suffix in transformers' names), the shared experts (plural in DeepSeek's names). Files written
# since llama.cpp absorbs the up-projections hold `kv_b_proj` as the keys' part, transposed, and the values'
# (`deepseek.hf_weight_stream` takes either).
_ARCH_LAYER_NAMES["deepseek2"] = {
    **_EXPERT_NAMES, "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj", "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj"}
# GLM-4.5 (`glm4moe`): DeepSeek-V3's router and shared experts beside Llama's attention, its norm before the MLP
# named as Gemma's is. Its multi-token prediction layer (`blk.N.nextn.*` and that layer's block, past
# `num_hidden_layers`) is not loaded (`llama.map_hf_weight`).
_ARCH_LAYER_NAMES["glm4moe"] = {
    **_EXPERT_NAMES, "post_attention_norm": "post_attention_layernorm",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj"}
_UNSUFFIXED = ("attn_sinks", "exp_probs_b")
# OLMo 2: norms after attention and after the MLP (none before), and q/k norms across all heads
_ARCH_LAYER_NAMES["olmo2"] = {"post_attention_norm": "post_attention_layernorm",
                              "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp stores Gemma's RMSNorm weights as (1 + w); transformers' checkpoints hold w.
_NORMS_PLUS_ONE = ("gemma", "gemma2", "gemma3")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma2", "gemma3", "phi3",
                                 "gpt-oss", "granite", "smollm3", "olmo2", "gemma", "deepseek2", "glm4moe")
# Architectures transformers' GGUF reader does not know, and the one it reads their config and tokenizer as
# (`gguf_cache` rebuilds the family's own config from the file): Granite and SmolLM3 are written as Llama
# is, OLMo 2 with Llama's keys, Gemma 1 with Gemma 2's, DeepSeek and GLM-4.5 with Llama's and their own.
_READ_AS = {"granite": "llama", "smollm3": "llama", "olmo2": "llama", "gemma": "gemma2", "deepseek2": "llama",
            "glm4moe": "llama"}
# llama.cpp's converter permutes these architectures' Q/K rows (its `LlamaModel`) for its rotary layout.
_PERMUTED = ("llama", "granite", "smollm3")


class _PlainViewReader(GGUFReader):
    """`GGUFReader`, slicing a plain ndarray view of the file's mapping where it sliced the `np.memmap`.

    The reader takes two slices per metadata value, so a tokenizer's vocabulary and merges (hundreds of
    thousands of strings) mean a million slices, and `np.memmap.__getitem__`, a Python method, made them
    most of a start's GGUF parse. The view maps the same pages; tensors' `data` are views of it.
    """

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        array = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def read_gguf(path: str | Path) -> GGUFReader:
    """The file's metadata and tensor table, parsed once per process while the file is unchanged (a start
    reads them for the config, the tokenizer and the weights). The last file read stays mapped: its pages
    are the page cache's, to evict."""
    path = Path(path).resolve()
    info = path.stat()
    return _parsed(str(path), info.st_ino, info.st_size, info.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _parsed(path: str, inode: int, size: int, mtime_ns: int) -> GGUFReader:
    return _PlainViewReader(path)


@contextlib.contextmanager
def shared_gguf_reads() -> Iterator[None]:
    """Within it, `gguf.GGUFReader(path)` (as transformers calls it, once for a config and again for a
    tokenizer) returns `read_gguf(path)`'s reader: the file is parsed once. A gpt-oss file's reader leaves
    out its RoPE scaling keys, which transformers 5 fails to read (it takes each key's length field for its
    value), and a file of an architecture transformers does not know says one it does (`_READ_AS`);
    `gguf_cache` reads the rest itself."""
    def reader(path: str | Path, mode: str = "r") -> GGUFReader:
        return _for_transformers(read_gguf(path)) if mode == "r" else GGUFReader(path, mode)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = GGUFReader


_UNREADABLE_BY_TRANSFORMERS = {"gpt-oss": "gpt-oss.rope.scaling."}  # architecture -> the keys' prefix


def _for_transformers(reader: GGUFReader) -> GGUFReader:
    arch = gguf_architecture(reader)
    if (read_as := _READ_AS.get(arch)) is not None:
        view = copy.copy(reader)  # the same mapping and tensors; its fields say `read_as`
        view.fields = {_renamed(key, arch, read_as): field._replace(name=_renamed(key, arch, read_as))
                       for key, field in reader.fields.items()}
        view.fields[_ARCHITECTURE] = _string_field(_ARCHITECTURE, read_as)
        return view
    prefix = _UNREADABLE_BY_TRANSFORMERS.get(arch)
    if prefix is None:
        return reader
    view = copy.copy(reader)  # the same mapping and tensors, fewer fields
    view.fields = {key: value for key, value in reader.fields.items() if not key.startswith(prefix)}
    return view


_ARCHITECTURE = "general.architecture"


def _renamed(key: str, arch: str, read_as: str) -> str:
    return read_as + key.removeprefix(arch) if key.startswith(f"{arch}.") else key


def _string_field(name: str, value: str) -> ReaderField:
    """A metadata field holding one string, as the reader parses one."""
    return ReaderField(0, name, [np.frombuffer(value.encode(), np.uint8)], [0], [gguf.GGUFValueType.STRING])


def gguf_architecture(reader: GGUFReader) -> str:
    return reader.fields[_ARCHITECTURE].contents()


def _unpermute_rotary(weight: np.ndarray | GgufTensor, num_heads: int) -> np.ndarray | GgufTensor:
    """Inverse of llama.cpp's Q/K row permutation: per head, interleaved pairs back to two halves (rows, so a
    tensor's blocks move whole)."""
    if isinstance(weight, GgufTensor):
        return GgufTensor(_unpermute_rotary(weight.blocks, num_heads), weight.kind)
    return to_rotate_half(weight, num_heads, rotary_dim=weight.shape[0] // num_heads)


def keeps_blocks(tensor: ReaderTensor) -> bool:
    """Whether a file's tensor can stay in its blocks: a format the native kernel reads (or MXFP4, whose
    blocks become Q5_0's: `mxfp4.ggml_mxfp4_as_q5_0`), a 2-D weight or a mixture's 3-D stacked experts."""
    return tensor.tensor_type.name in (*KEPT_KINDS, "MXFP4") and tensor.data.ndim in (2, 3)


def kept_bytes(tensor: ReaderTensor) -> int:
    """The bytes a kept tensor's blocks take (MXFP4's as Q5_0's)."""
    if tensor.tensor_type.name == "MXFP4":
        return int(tensor.n_bytes) // GGML_MXFP4_BYTES * GGML_Q5_0_BYTES
    return int(tensor.n_bytes)


def _kept(tensor: ReaderTensor) -> GgufTensor | None:
    """A kept tensor's blocks; None for MXFP4 blocks with a scale float16 cannot hold (dequantized instead)."""
    if tensor.tensor_type.name != "MXFP4":
        return GgufTensor(np.asarray(tensor.data), tensor.tensor_type.name)
    blocks = ggml_mxfp4_as_q5_0(tensor.data)
    return None if blocks is None else GgufTensor(blocks, "Q5_0")


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# A multi-token prediction layer's own pieces (llama.cpp's `nextn` tensors) -> their checkpoint names after
# `model.layers.{L}.`; its copies of the tables, where the file keeps them, beside the model's tables' names.
_NEXTN_RE = re.compile(r"^blk\.(\d+)\.nextn\.(\w+)\.weight$")
_NEXTN_NAMES = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm",
                "shared_head_head": "shared_head.head", "embed_tokens": "embed_tokens"}
_NEXTN_TABLES = {"embed_tokens": "token_embd.weight", "shared_head_head": "output.weight"}


def _same_data(first: ReaderTensor, second: ReaderTensor) -> bool:
    """Whether two of a file's tensors are stored alike: the same type, shape and bytes."""
    return (first.tensor_type == second.tensor_type and tuple(first.shape) == tuple(second.shape)
            and np.array_equal(np.asarray(first.data).view(np.uint8), np.asarray(second.data).view(np.uint8)))


def _prediction_layers(reader: GGUFReader, arch: str) -> range:
    """The blocks of a file's multi-token prediction layers, which llama.cpp counts in its block count after the
    model's own (`{arch}.nextn_predict_layers`)."""
    count = reader.fields.get(f"{arch}.nextn_predict_layers")
    blocks = reader.fields.get(f"{arch}.block_count")
    if count is None or blocks is None:
        return range(0)
    return range(int(blocks.contents()) - int(count.contents()), int(blocks.contents()))


def iter_gguf_tensors(
    path: str, num_heads: int, num_kv_heads: int, keep_blocks: bool = False, prediction: bool = False
) -> Iterator[tuple[str, np.ndarray | GgufTensor]]:
    """Yields (HF name, float32 array in HF layout) for every tensor in the file, one at a time, but its
    multi-token prediction layers'. With `keep_blocks`, a 2-D tensor (or a mixture's 3-D stacked experts) in a
    format the native kernel reads comes as a `GgufTensor` of its blocks. With `prediction`, the tensors of its
    first multi-token prediction layer alone, as a checkpoint names them (`models/mtp.py`): its block's as the
    other blocks' are, under `model.layers.{L}.`, and its own pieces (`blk.{L}.nextn.*`) beside them, its copies
    of the embeddings and the LM head only where they are not the model's bytes."""
    reader = read_gguf(path)
    arch = gguf_architecture(reader)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; jaxserve reads "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} GGUF files"
        )
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    prediction_layers = _prediction_layers(reader, arch)
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    first_prediction = prediction_layers.start if prediction_layers else None
    if prediction and first_prediction is None:
        raise ValueError(f"the file has no multi-token prediction layer (its {arch}.nextn_predict_layers is 0 or "
                         "absent)")
    for tensor in reader.tensors:
        block = int(match.group(1)) if (match := _BLOCK_RE.match(tensor.name)) else None
        if prediction and (block is None or block != first_prediction):
            continue
        if not prediction and block is not None and block in prediction_layers:
            continue  # a multi-token prediction layer (GLM-4.5's): not loaded with the model, nor dequantized
        if match := _NEXTN_RE.match(tensor.name):
            layer, kind = match.groups()
            model_table = by_name.get(_NEXTN_TABLES.get(kind, ""))
            if kind == "shared_head_head" and model_table is None:  # tied embeddings: the model's LM head
                model_table = by_name.get("token_embd.weight")
            if kind in _NEXTN_TABLES and model_table is not None and _same_data(tensor, model_table):
                continue  # a copy of the model's table, which the drafter shares
            yield (f"model.layers.{layer}.{_NEXTN_NAMES[kind]}.weight",
                   np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            continue
        array = _kept(tensor) if keep_blocks and keeps_blocks(tensor) else None
        if array is None:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if arch in _NORMS_PLUS_ONE and tensor.name.endswith("norm.weight"):
            array = array - 1.0
        if tensor.name in _GLOBAL_NAMES:
            yield _GLOBAL_NAMES[tensor.name], array
            continue
        if match := _PER_EXPERT_RE.match(tensor.name):
            layer, kind, expert = match.groups()
            yield f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_PER_EXPERT_NAMES[kind]}.weight", array
            continue
        match = _LAYER_RE.match(tensor.name)
        if match is None or match.group(2) not in names:
            continue
        layer, kind, suffix = match.groups()
        if arch in _PERMUTED and kind == "attn_q":
            array = _unpermute_rotary(array, num_heads)
        elif arch in _PERMUTED and kind == "attn_k":
            array = _unpermute_rotary(array, num_kv_heads)
        name = f"model.layers.{layer}.{names[kind]}"
        if kind.endswith("_exps"):  # stacked experts: their weights unsuffixed, their biases `_bias`
            yield (name if suffix == "weight" else f"{name}_bias"), array
        else:
            yield (name if kind in _UNSUFFIXED else f"{name}.{suffix}"), array
