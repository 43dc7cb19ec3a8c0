"""Tensor parallelism on CPU devices: TP=2 (and for a tiny Llama TP=4) give TP=1's greedy tokens and logprobs.

The test process has one CPU device, so the checks run in a worker process with four
(`--xla_force_host_platform_device_count=4`, tests/parallel_helpers.py), which loads each model at TP=1, 2
and 4 in turn and reports what each produced. Models: a tiny Llama with fewer KV heads than devices (KV
heads replicated), a tiny Llama whose heads split over no device count (query heads padded), a tiny GPT-2,
and the bundled SmolLM2 (9 query / 3 KV heads: both at once).
"""


import json

import numpy as np
import pytest

from jaxserve.parallel import HeadLayout
from tests.eagle import write_eagle3
from tests.lora_helpers import write_adapter
from tests.mtp import write_mtp_target
from tests.parallel_helpers import assert_same_as_tp1, assert_tracks_tp1, run_tp


def test_head_layout_replicates_kv_heads_and_pads_query_heads():
    same = HeadLayout(num_heads=32, num_kv_heads=8, tp=4)
    assert same.is_identity
    replicated = HeadLayout(num_heads=4, num_kv_heads=2, tp=4)  # vLLM's case: fewer KV heads than devices
    assert (replicated.num_heads_eff, replicated.num_kv_heads_eff) == (4, 4)
    assert replicated.kv_sources().tolist() == [0, 0, 1, 1]
    smol = HeadLayout(num_heads=9, num_kv_heads=3, tp=2)  # SmolLM2: neither divides
    assert (smol.num_heads_eff, smol.num_kv_heads_eff) == (12, 6)
    slots = smol.query_slots()
    # Every query head's slot reads a replica of its own KV head, and each device gets whole groups.
    for head, slot in enumerate(slots):
        assert smol.kv_sources()[slot // smol.group_eff] == head // smol.group
    assert len(set(slots.tolist())) == 9
    weights = np.arange(9 * 2, dtype=np.float32).reshape(9, 2) + 1
    padded = smol.apply("q", weights, axis=0)
    assert padded.shape == (12, 2) and np.count_nonzero(padded.any(axis=1)) == 9
    np.testing.assert_array_equal(padded[slots], weights)
    kv = smol.apply("kv", np.arange(3, dtype=np.float32)[None, :], axis=1)
    assert kv.tolist() == [[0, 0, 1, 1, 2, 2]]


@pytest.mark.slow
def test_a_tiny_llama_matches_tp1_at_tp2_and_tp4(tp_worker, tiny_model_dir, tmp_path):
    results = run_tp(tp_worker, str(tiny_model_dir("llama")), tmp_path)
    assert results[4]["kv_shard_shape"][0] == 1  # 2 KV heads replicated to 4, one per device
    assert_same_as_tp1(results)


@pytest.mark.slow
def test_lora_adapters_match_tp1_at_tp2(tp_worker, tiny_model_dir, tmp_path):
    """The adapter's slots on every device, added to the split projections (the q/k/v/gate/up outputs split
    by head or width, o/down's inputs): the same greedy tokens and top logprobs as on one device."""
    base = tiny_model_dir("llama")
    adapter = write_adapter(tmp_path / "adapter", base, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"), rank=4, seed=7)
    results = run_tp(tp_worker, str(base), tmp_path / "cache", tp_sizes=(2, 1), lora=str(adapter))
    assert_same_as_tp1(results)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["llama", "mixtral"])
def test_a_draft_model_splits_over_the_target_s_devices(target, tp_worker, tiny_model_dir, tmp_path):
    """A draft model beside a TP=2 target loads over the same two devices (its KV cache split as the target's):
    the target's greedy tokens are TP=1's. The Llama target as its own draft has every draft accepted; the
    mixture of experts, its experts split whole (expert parallelism), takes the dense Llama as its draft."""
    draft = str(tiny_model_dir("llama"))
    results = run_tp(tp_worker, str(tiny_model_dir(target)), tmp_path, tp_sizes=(2, 1),
                     expert_parallel=target == "mixtral", speculative={"model": draft, "num_speculative_tokens": 2})
    assert_same_as_tp1(results)
    for tp, got in results.items():
        drafted, accepted = got["drafts"]
        assert drafted > 0 and (accepted == drafted or target != "llama"), (tp, got["drafts"])
        assert got["draft_kv_devices"] == got["kv_devices"]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["eagle3", "mtp-glm4-moe", "mtp-deepseek-v3"])
def test_a_drafter_of_the_target_s_states_splits_over_its_devices(drafter, tp_worker, tiny_model_dir,
                                                                   smollm2_tokenizer, tmp_path):
    """An EAGLE-3 drafter (a draft vocabulary) beside a TP=4 Llama (its 4 query and 2 KV heads laid out as 4
    and 4: each KV head replicated), and GLM-4.5's and DeepSeek-V3's own MTP layers beside their models at TP=2:
    each drafter's query heads split over the devices as its family's are (DeepSeek's latent copied to each),
    the target's states kept in pages split along their width beside its K/V, the drafter's cache on the same
    devices; the greedy tokens are TP=1's, and so is every round's drafts."""
    if drafter == "eagle3":
        target = tiny_model_dir("llama")
        write_eagle3(tmp_path / "eagle3", json.loads((target / "config.json").read_text()), (0, 1),
                     draft_vocab_size=3000)
        speculative = {"method": "eagle3", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": 2}
    else:
        target = tmp_path / drafter
        target.mkdir()
        write_mtp_target(target, drafter.removeprefix("mtp-"), smollm2_tokenizer)
        speculative = {"method": "mtp", "num_speculative_tokens": 2}
    split = 4 if drafter == "eagle3" else 2
    results = run_tp(tp_worker, str(target), tmp_path / "cache", tp_sizes=(split, 1), speculative=speculative)
    assert_same_as_tp1(results)
    for tp, got in results.items():
        assert got["drafts"][0] > 0, (tp, got["drafts"])
        assert got["proposals"] == results[1]["proposals"], f"TP={tp}: the drafts differ from TP=1's"
        assert got["draft_kv_devices"] == got["kv_devices"]
        width = 2 * 64 if drafter == "eagle3" else 64  # EAGLE-3's: two layers' inputs
        assert got["last_kv_shard_shape"][0] == 1 and got["last_kv_shard_shape"][-1] == width // tp
        heads = {"eagle3": 4, "mtp-glm4-moe": 4, "mtp-deepseek-v3": 4}[drafter]  # query heads, laid out
        assert [shape[1] for _, shape in got["draft_q_proj_shards"]] == [heads // tp] * tp, got["draft_q_proj_shards"]


@pytest.mark.slow
def test_a_tiny_gpt2_matches_tp1_at_tp2(tp_worker, tiny_model_dir, tmp_path):
    """GPT-2's fused QKV, learned positions and LayerNorms split in two (TP=4 adds only what the Llama checks)."""
    assert_same_as_tp1(run_tp(tp_worker, str(tiny_model_dir("gpt2")), tmp_path, tp_sizes=(2, 1)))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "num_heads"), [("bert", 4), ("xlm-roberta", 4), ("bert", 6)])
def test_an_encoder_embeds_at_tp2_and_tp4_as_at_tp1(tp_worker, encoder_dir, kind, num_heads, tmp_path):
    """An encoder's heads split over the devices (its attention over each packed prompt, both ways, per head),
    its prompts embedded as at TP=1, and nothing compiled after the warm-up; 6 heads over 4 devices are laid
    out as 12, 3 a device (`HeadLayout`)."""
    texts = ["the cat sat on the mat", "where is paris?", "a deep network model"]
    results = run_tp(tp_worker, str(encoder_dir(kind, num_heads=num_heads)[0]), tmp_path, embed=texts)
    for tp, got in results.items():
        assert got["compiles_after_warmup"] == 0, tp
        heads = {4: {1: 4, 2: 4, 4: 4}, 6: {1: 6, 2: 6, 4: 12}}[num_heads][tp]
        assert [shape for _, shape in got["q_proj_shards"]] == [[16 * num_heads, heads // tp, 16]] * tp, got
        np.testing.assert_allclose(got["embeddings"], results[1]["embeddings"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mixture_of_experts_matches_tp1_split_by_width_and_by_expert(tp_worker, tiny_model_dir, expert_parallel,
                                                                     tmp_path):
    """Mixtral's 4 experts under tensor parallelism (each expert's MLP width split) and expert parallelism
    (whole experts per device, the rows of the others rolled out): the same tokens and logprobs as one
    device."""
    results = run_tp(tp_worker, str(tiny_model_dir("mixtral")), tmp_path, tp_sizes=(2, 1),
                     expert_parallel=expert_parallel)
    assert_same_as_tp1(results)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "expert_parallel"), [("qwen2-moe", False), ("olmo2", False), ("granite", False),
                                                      ("gpt-oss", False), ("gpt-oss", True), ("olmoe", True),
                                                      ("granite-moe-shared", False), ("glm4", False),
                                                      ("glm4-moe", True), ("deepseek-v3", False),
                                                      ("deepseek-v2", True)])
def test_the_newer_families_match_tp1_at_tp2(tp_worker, kind, expert_parallel, tiny_model_dir, tmp_path):
    """Qwen2-MoE's shared expert split by width beside its routed experts (its gate whole on every device),
    OLMo 2's norms over all query heads and all key heads while the heads are split, Granite's output
    projection bias, GPT-OSS's sinks split with their heads and its experts' biases split with their experts
    (by width, or whole), OLMoE's whole experts beside its norms over all heads, Granite-MoE's ungated shared
    expert, GLM-4's reordered q and k rows split with their heads, GLM-4.5's whole experts beside its router's
    correction bias (on every device) and its per-head q/k norms, DeepSeek's query heads split beside a copy of
    its latent cache on each device: the same tokens and logprobs as one device."""
    results = run_tp(tp_worker, str(tiny_model_dir(kind)), tmp_path, tp_sizes=(2, 1), expert_parallel=expert_parallel)
    assert_same_as_tp1(results)


def test_norms_over_all_heads_refuse_a_padded_head_layout():
    """OLMo 2's query norm is over all N heads at once: padded or replicated heads would change its mean."""
    from jaxserve.models.layers import Rope
    from jaxserve.models.llama import LlamaConfig

    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=9, num_kv_heads=3,
                      head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False,
                      max_position_embeddings=16, rope=Rope((1.0,)), qk_norm="all")
    assert cfg.with_heads(9, 3) == cfg
    with pytest.raises(ValueError, match="split evenly"):
        cfg.with_heads(12, 6)


@pytest.mark.slow
def test_bfloat16_weights_split_over_devices(tp_worker, tiny_model_dir, tmp_path):
    """`weight_dtype` under tensor parallelism: each shard is stored in bfloat16 where it lives, and the
    split model tracks one device's (`assert_tracks_tp1`)."""
    results = run_tp(tp_worker, str(tiny_model_dir("llama")), tmp_path, tp_sizes=(2, 1), weight_dtype="bfloat16")
    assert {r["q_proj_dtype"] for r in results.values()} == {"bfloat16"}
    assert len(results[2]["q_proj_shards"]) == 2
    assert_tracks_tp1(results)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "deepseek-v2"])
def test_fp8_weights_split_over_devices_match_tp1(kind, tp_worker, tiny_model_dir, tmp_path):
    """`--quantization fp8` under tensor parallelism: each device quantizes its shards with the scales of the
    whole weight (a row-parallel weight's channel maximum spans the devices), so the tokens and logprobs are
    TP=1's. DeepSeek's query and output projections split by heads, its latent's projection whole on each device
    (each computes the latent its cache copy keeps)."""
    results = run_tp(tp_worker, str(tiny_model_dir(kind)), tmp_path, tp_sizes=(2, 1), quantization="fp8")
    assert {r["q_proj_dtype"] for r in results.values()} == {"float8_e4m3fn"}
    assert len(results[2]["q_proj_shards"]) == 2
    assert_same_as_tp1(results)


@pytest.mark.slow
def test_an_fp8_checkpoint_with_block_scales_splits_over_devices_quantized_per_channel(tp_worker, tiny_model_dir,
                                                                                      tmp_path):
    """A checkpoint with block scales (DeepSeek-V3's layout) under tensor parallelism: its weights dequantized
    and quantized again per output channel as they load (the kernel that reads blocks runs on one device), so
    TP=2 gives what TP=1 gives for the dequantized checkpoint with --quantization fp8."""
    from tests.models.test_quantization import _write_fp8_checkpoint, write_dequantized_checkpoint

    source = tiny_model_dir("llama")
    dequantized = _write_fp8_checkpoint(source, tmp_path / "fp8", block=(16, 32), fmt="fp8")
    write_dequantized_checkpoint(source, tmp_path / "dequantized", dequantized)
    split = run_tp(tp_worker, str(tmp_path / "fp8"), tmp_path / "cache-fp8", tp_sizes=(2,))
    whole = run_tp(tp_worker, str(tmp_path / "dequantized"), tmp_path / "cache-dequantized", tp_sizes=(1,),
                   quantization="fp8")
    assert split[2]["q_proj_dtype"] == whole[1]["q_proj_dtype"] == "float8_e4m3fn"
    assert len(split[2]["q_proj_shards"]) == 2
    assert_same_as_tp1({2: split[2], 1: whole[1]})


@pytest.mark.slow
def test_bundled_smollm2_matches_tp1_at_tp2(tp_worker, tmp_path):
    """SmolLM2's 9 query / 3 KV heads split in two: both padded and replicated at once."""
    results = run_tp(tp_worker, None, tmp_path, tp_sizes=(2, 1), max_tokens=12)
    assert results[2]["kv_shard_shape"][0] == 3  # 3 KV heads replicated to 6, 3 per device
    assert_same_as_tp1(results, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("block", "expert_parallel", "impl"), [
    (None, False, "reference"), (None, True, "reference"), ((24, 24), False, "reference"),
    ((48, 48), False, "reference"), ((16, 16), True, "interpret")],
    ids=["per channel, by width", "per channel, by expert", "blocks, by width", "blocks refined, by width",
         "blocks, by expert, the interpreted kernels"])
def test_an_fp8_checkpoint_s_experts_split_over_devices_in_e4m3(block, expert_parallel, impl, tp_worker,
                                                                 tiny_model_dir, tmp_path):
    """An FP8 checkpoint's experts under tensor parallelism stay in e4m3 with their scales: each device holds its
    slice of every expert's width (the down projection's 24 rows a device in a block of 24, or, stored in one
    block of 48, in one of 24, the scale repeated over the two it covers; a scale per channel whole on every
    device) or, expert parallel, its own experts (in blocks of 16, three of them in the down projection's 48
    rows). TP=2 gives the same checkpoint's TP=1 tokens: with per-channel scales its dense weights, quantized
    again per channel under the mesh, keep their values (each channel's largest is 448 already); with blocks
    only the experts are stored in e4m3. With the interpreted kernels, each device's experts go through the
    Triton grouped matmul under `shard_map`."""
    from tests.models.test_quantization import _write_fp8_checkpoint

    keep = {"self_attn", "layers.1"} if block else set()  # layer 1's MLP is dense
    _write_fp8_checkpoint(tiny_model_dir("qwen3-moe"), tmp_path / "fp8", block=block, fmt="fp8" if block else
                          "compressed-tensors", keep=keep)
    results = run_tp(tp_worker, str(tmp_path / "fp8"), tmp_path / "cache", tp_sizes=(2, 1),
                     expert_parallel=expert_parallel, attention_impl=impl)
    experts = results[2]["experts"]  # the 6 experts' down projections [E, F, D] = [6, 48, 64]
    split_block = {None: 48, (24, 24): 24, (48, 48): 24, (16, 16): 16}[block]
    assert experts["form"] == f"fp8, blocks of {split_block}"
    shard, scale = (([3, 48, 64], [3, -(-48 // split_block), 64]) if expert_parallel
                    else ([6, 24, 64], [6, -(-24 // split_block), 64]))
    assert [s for _, s in experts["values"]] == [shard, shard] and [s for _, s in experts["scale"]] == [scale, scale]
    assert results[1]["experts"]["form"] == f"fp8, blocks of {block[1] if block else 48}"
    assert_same_as_tp1(results)
