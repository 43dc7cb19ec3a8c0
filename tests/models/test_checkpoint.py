"""orbax checkpoints: `jaxserve convert` round trips exactly, and a restore lands on every shard."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.checkpoint import MARKER, save_checkpoint
from jaxserve.models.loader import load_model, metadata_dir
from tests.parallel_helpers import assert_same_as_tp1, assert_tracks_tp1, run_tp


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    model = load_model(str(tiny_model_dir("llama")), "float32")
    out = save_checkpoint(model, metadata_dir(model.source), tmp_path_factory.mktemp("ckpt") / "tiny-llama")
    return model, out


def test_convert_then_load_gives_the_same_weights_and_tokens(converted):
    from jaxserve import LLM, SamplingParams

    original, out = converted
    assert (out / MARKER).is_file() and (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list(out.glob("*.safetensors"))
    restored = load_model(str(out), "float32")
    flat_a = dict(nnx.to_flat_state(original.state))
    flat_b = dict(nnx.to_flat_state(restored.state))
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_a[key].get_value()), np.asarray(flat_b[key].get_value()))
    assert restored.eos_token_ids == original.eos_token_ids

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    options = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32],
                   request_buckets=[1, 4], num_kv_pages=32)
    outputs = [LLM(model=m, **options).generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
               for m in (str(out), str(original.source.directory))]
    assert outputs[0].token_ids == outputs[1].token_ids
    assert outputs[0].top_logprobs == outputs[1].top_logprobs  # same weights, same step: identical logits


def test_convert_refuses_a_directory_that_is_not_empty(converted):
    original, out = converted
    with pytest.raises(FileExistsError, match="not empty"):
        save_checkpoint(original, metadata_dir(original.source), out)


def test_a_bfloat16_checkpoint_restores_in_float32(tiny_model_dir, tmp_path):
    model = load_model(str(tiny_model_dir("llama")), "bfloat16")
    out = save_checkpoint(model, metadata_dir(model.source), tmp_path / "bf16")
    restored = load_model(str(out), "float32")
    leaf = nnx.to_pure_dict(restored.state)["embed_tokens"]
    assert leaf.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(nnx.to_pure_dict(model.state)["embed_tokens"],
                                                                np.float32))


@pytest.mark.slow
def test_a_checkpoint_restores_bfloat16_weights_onto_replicated_heads(tp_worker, converted, tmp_path):
    """At TP=4 the tiny Llama's 2 KV heads are replicated: the stored float32 tensors are read whole, laid
    out on the host and cast there to the bfloat16 the weights ask for, the norms staying float32."""
    _, out = converted
    results = run_tp(tp_worker, str(out), tmp_path, tp_sizes=(4, 1), weight_dtype="bfloat16")
    assert {r["q_proj_dtype"] for r in results.values()} == {"bfloat16"}
    assert results[4]["kv_shard_shape"][0] == 1 and len(results[4]["q_proj_shards"]) == 4
    assert_tracks_tp1(results)


def test_bfloat16_weights_under_a_float32_model_round_trip(tiny_model_dir, tmp_path, caplog):
    """A checkpoint keeps each parameter's dtype, and a restore casts each to the dtype its model asks for."""
    model = load_model(str(tiny_model_dir("llama")), "float32", weight_dtype="bfloat16")
    out = save_checkpoint(model, metadata_dir(model.source), tmp_path / "mixed")
    mixed = nnx.to_pure_dict(load_model(str(out), "float32", weight_dtype="bfloat16").state)
    assert mixed["embed_tokens"].dtype == mixed["layers"][0]["mlp"]["up_proj"].dtype == np.dtype("bfloat16")
    assert mixed["norm"]["scale"].dtype == np.float32
    for path in (("embed_tokens",), ("layers", 0, "mlp", "up_proj"), ("norm", "scale")):
        stored, restored = nnx.to_pure_dict(model.state), mixed
        for key in path:
            stored, restored = stored[key], restored[key]
        np.testing.assert_array_equal(np.asarray(stored, np.float32), np.asarray(restored, np.float32))
    assert "the checkpoint stores its weights in" not in caplog.text
    widened = nnx.to_pure_dict(load_model(str(out), "float32").state)  # every parameter float32 again
    assert {leaf.dtype for leaf in jax.tree.leaves(widened)} == {np.dtype(np.float32)}
    assert "stores its weights in bfloat16; they are restored in float32" in caplog.text


@pytest.mark.slow
def test_a_checkpoint_restores_onto_its_shards_at_tp2_and_tp4(tp_worker, converted, tmp_path):
    """TP=2 keeps the tiny Llama's heads (each shard read where it lives); TP=4 replicates its 2 KV heads
    (read whole, laid out on the host); both give TP=1's tokens."""
    _, out = converted
    results = run_tp(tp_worker, str(out), tmp_path)
    assert_same_as_tp1(results)
    for tp in (2, 4):
        shards = results[tp]["q_proj_shards"]
        assert len({device for device, _ in shards}) == tp  # one shard per device
        assert all(shape == [64, 4 // tp, 16] for _, shape in shards)  # q_proj [D, N, H] split by head
