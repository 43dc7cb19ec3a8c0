"""Speculative decoding from a model's own multi-token prediction layer (`--speculative-config '{"method":
"mtp", ...}'`, DeepSeek-V3's and GLM-4.5's): each round's drafts are the layer's greedy chain as transformers'
PyTorch decoder layer computes it in float64 from the target's own hidden states; outputs are token for token
those of plain decoding; the layer's tables are the target's unless its own differ; models without such a
layer, and what the method does not take, are refused."""

import dataclasses

import pytest
import transformers

from jaxserve.config import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from jaxserve.models.deepseek import DeepseekConfig
from jaxserve.models.layers import LoraShape
from jaxserve.models.llama import LlamaConfig
from jaxserve.models.mtp import DeepseekMtpConfig, LlamaMtpConfig, mtp_config
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import assert_same, drafting_workload, make_engine, make_prompts, run
from tests.engine.test_eagle import assert_reference_drafts, proposer_of, recorded_rounds, run_drafting
from tests.models.test_quantization import _write_fp8_checkpoint, write_dequantized_checkpoint
from tests.mtp import MtpReference, write_mtp_gguf, write_mtp_target

SPEC = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, smollm2_tokenizer, smollm2_gguf) -> dict:
    """GLM-4.5's layer with tables of its own; DeepSeek-V3's with copies of the model's; a GLM-4.5 GGUF file
    whose layer has its own LM head and a copy of the model's embeddings."""
    dirs = {}
    for kind, own in (("glm4-moe", ("embed_tokens", "head")), ("deepseek-v3", ()), ("glm4-moe-head", ("head",))):
        dirs[kind] = tmp_path_factory.mktemp(f"mtp-{kind}") / kind
        dirs[kind].mkdir()
        write_mtp_target(dirs[kind], kind.removesuffix("-head"), smollm2_tokenizer, own_tables=own)
    dirs["gguf"] = dirs["glm4-moe-head"] / "tiny-glm4moe.gguf"
    write_mtp_gguf(dirs["gguf"], dirs["glm4-moe-head"], smollm2_gguf)
    return dirs


@pytest.fixture(scope="module")
def glm_engines(mtp_dirs) -> dict:
    return {"plain": make_engine(mtp_dirs["glm4-moe"]),
            "mtp": make_engine(mtp_dirs["glm4-moe"], speculative_config=SPEC)}


@pytest.mark.parametrize("kind", ["glm4-moe", pytest.param("deepseek-v3", marks=pytest.mark.gpu), "gguf"])
def test_each_round_drafts_the_mtp_layer_s_chain_on_the_target_s_states(mtp_dirs, request, kind):
    """Rounds after plain steps, corrections and sampled tokens (staggered requests, sampled at 1.0), after a
    100-token prompt read in two chunks, and after a prefix-cache hit: each round's drafts are the float64
    reference's chain, through GLM-4.5's attention and experts and DeepSeek-V3's latent attention and experts,
    and from a GLM-4.5 GGUF file's `nextn` tensors; the layer's own tables are loaded where they differ from the
    target's, and shared where they are copies. On a GPU (`make test-gpu`), DeepSeek-V3's: a round's decode
    steps in one call."""
    engine = (request.getfixturevalue("glm_engines")["mtp"] if kind == "glm4-moe"
              else make_engine(mtp_dirs[kind], speculative_config=SPEC))
    drafter = proposer_of(engine).runner.model
    assert isinstance(drafter.cfg, DeepseekMtpConfig if kind == "deepseek-v3" else LlamaMtpConfig)
    assert drafter.cfg.num_layers == 1 and drafter.cfg.moe_layers == (True,)
    target_state = engine.core.runner.model.state
    own = {"glm4-moe": ("embed_tokens", "lm_head"), "deepseek-v3": (), "gguf": ("lm_head",)}[kind]
    for table in ("embed_tokens", "lm_head"):  # a copy of the model's is the target's array
        assert (drafter.state[table][...] is target_state[table][...]) == (table not in own), table
    prompts = make_prompts(5)
    requests = {f"s{i}": (prompts[i], SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
                for i in range(5)}
    prefix, greedy = list(range(2000, 2066)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests |= {"long": (list(range(1000, 1100)), greedy), "first": ([*prefix, 5], greedy),
                 "hit": ([*prefix, 7, 8], greedy)}
    arrivals = {f"s{i}": 3 * i for i in range(5)} | {"long": 2, "first": 4, "hit": 10}
    rounds, drafted = recorded_rounds(engine, requests, arrivals)
    assert drafted > 0 and len(rounds) > 30
    assert any(count > 64 for _, _, count in rounds), "no round caught up past the largest bucket"
    assert any(tokens[:67] == [*prefix, 7] for tokens, _, _ in rounds), "the prefix-hit request never drafted"
    reference = MtpReference(mtp_dirs["glm4-moe-head" if kind == "gguf" else kind])
    assert assert_reference_drafts(rounds, reference, every=2) > 12


def test_mtp_drafts_give_the_plain_outputs(glm_engines):
    """Penalties, logprobs, grammars, bans, seeded sampling, n > 1, prefix-cache hits and stops: every output
    is the plain engine's, and nothing compiles after warm-up."""
    requests, arrivals = drafting_workload(glm_engines["plain"])
    plain = run(glm_engines["plain"], requests, arrivals)
    outputs, drafted, accepted = run_drafting(glm_engines["mtp"], requests, arrivals)
    assert_same(plain, outputs)
    assert drafted > 0 and 0 <= accepted <= drafted


def test_the_speculative_config_takes_vllm_s_mtp_spellings(mtp_dirs):
    """vLLM's older per-family names are "mtp"; "model", where given, must be the served model (its name or its
    directory); no quantization or revision of its own; one host."""
    for name in ("mtp", "deepseek_mtp", "glm4_moe_mtp"):
        assert SpeculativeConfig.of({"method": name, "num_speculative_tokens": 1}).method == "mtp"
    with pytest.raises(ValueError, match="not quantized"):
        SpeculativeConfig.of({**SPEC, "quantization": "fp8"})
    with pytest.raises(ValueError, match="no \"revision\""):
        SpeculativeConfig.of({**SPEC, "model": "a/b", "revision": "main"})
    served = str(mtp_dirs["glm4-moe"])

    def engine_config(spec, **parallel):
        return EngineConfig(model=ModelConfig(model=served),
                            scheduler=SchedulerConfig(speculative_config=SpeculativeConfig.of(spec)),
                            parallel=ParallelConfig(**parallel))

    engine_config({**SPEC, "model": served})
    engine_config({**SPEC, "model": served + "/"})
    with pytest.raises(ValueError, match="the model's own layer"):
        engine_config({**SPEC, "model": "other/model"})
    with pytest.raises(ValueError, match="one host"):
        engine_config(SPEC, tensor_parallel_size=2, num_processes=2, coordinator_address="127.0.0.1:1234")


def test_models_without_an_mtp_layer_are_refused(llama_dir, tiny_model_dir):
    """A Llama (no MTP layers in its config) and a GLM-4.5 whose config counts one its checkpoint lacks."""
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        make_engine(llama_dir, warmup=False, speculative_config=SPEC)
    with pytest.raises(ValueError, match=r"no multi-token prediction layer: model\.layers\.3\.eh_proj\.weight"):
        make_engine(tiny_model_dir("glm4-moe"), warmup=False, speculative_config=SPEC)


def test_the_layer_s_config_is_a_one_layer_model_of_its_family(mtp_dirs):
    """One layer, with experts as the target's layer L would have them, and neither the target's LoRA stacks
    (a LoRA server drafts with the base layer) nor its count of MTP layers."""
    hf = transformers.AutoConfig.from_pretrained(mtp_dirs["glm4-moe"])
    target = dataclasses.replace(LlamaConfig.from_hf(hf), lora=LoraShape(max_loras=2, max_rank=8))
    cfg = mtp_config(target)
    assert (cfg.num_layers, cfg.moe_layers, cfg.lora, cfg.mtp_layers, cfg.feature_width) == (1, (True,), None, 0, 64)
    assert target.moe_layers == (False, True, True)  # the target's first layer is dense
    cfg = mtp_config(DeepseekConfig.from_hf(transformers.AutoConfig.from_pretrained(mtp_dirs["deepseek-v3"])))
    assert (cfg.num_layers, cfg.moe_layers, cfg.mtp_layers) == (1, (True,), 0)
    with pytest.raises(ValueError, match="2 multi-token prediction layers"):
        mtp_config(dataclasses.replace(target, mtp_layers=2))
    assert SpeculativeConfig.of({**SPEC, "max_model_len": 64}).max_model_len == 64  # no "model" needed


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_an_fp8_checkpoint_s_layer_drafts_with_its_weights_dequantized(mtp_dirs, tmp_path, fmt):
    """An FP8 GLM-4.5 (every layer's projections e4m3, experts included, the MTP layer's block's too):
    compressed-tensors' per-channel or per-tensor scales with static input scales, or DeepSeek-V3's layout
    (`weight_scale_inv` per block of 16 x 24 here): the target keeps its FP8 weights, the layer's are
    dequantized as they load, and its drafts are the reference's over the dequantized checkpoint."""
    fp8, plain = tmp_path / "fp8", tmp_path / "dequantized"
    dequantized = (_write_fp8_checkpoint(mtp_dirs["glm4-moe"], fp8, per_tensor={"k_proj", "down_proj"})
                   if fmt == "compressed-tensors" else
                   _write_fp8_checkpoint(mtp_dirs["glm4-moe"], fp8, block=(16, 24), fmt="fp8"))
    assert any(name.startswith("model.layers.3.") for name in dequantized)  # the MTP layer's block
    write_dequantized_checkpoint(mtp_dirs["glm4-moe"], plain, dequantized)
    engine = make_engine(fp8, speculative_config=SPEC)
    assert engine.core.runner.model.quantization == "fp8"
    prompts = make_prompts(4)
    requests = {f"g{i}": (prompts[i], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                for i in range(4)}
    rounds, drafted = recorded_rounds(engine, requests, {f"g{i}": 2 * i for i in range(4)})
    assert drafted > 0
    assert assert_reference_drafts(rounds, MtpReference(plain), every=1) > 8
