"""Speculative decoding from an EAGLE drafter (`--speculative-config '{"method": "eagle", "model": ...}'`):
each round's drafts are the drafter's greedy chain as transformers' PyTorch Llama layer computes it in float64
from the target's own hidden states; outputs are token for token those of plain decoding; the drafter's
pages and the target's hidden states' pages come and go with the requests; nothing compiles after warm-up;
checkpoints that are not a drafter for the target are refused."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jaxserve.config import CacheConfig, SpeculativeConfig
from jaxserve.engine import draft_model_proposer
from jaxserve.engine.core import drafter_cache
from jaxserve.engine.eagle_proposer import EagleProposer
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.eagle3 import default_aux_layers
from jaxserve.runner.model_runner import kv_page_bytes
from jaxserve.sampling_params import SamplingParams
from tests.eagle import greedy_pick, write_eagle, write_eagle3
from tests.engine.helpers import assert_same, drafting_workload, make_engine, make_prompts, run
from tests.engine.test_draft_model import every_draft_runs
from tests.helpers import count_compilations

HIDDEN = 64  # the tiny Llama's (tests/conftest.py)


@pytest.fixture(scope="module")
def target_config(llama_dir) -> dict:
    return json.loads((llama_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, target_config):
    directory = tmp_path_factory.mktemp("eagle") / "tiny-eagle"
    write_eagle(directory, target_config)
    return directory


@pytest.fixture(scope="module")
def engines(llama_dir, eagle_dir) -> dict[str, LLMEngine]:
    spec = {"method": "eagle", "model": str(eagle_dir), "num_speculative_tokens": 3}
    with pytest.MonkeyPatch.context() as patch:  # a round's decode steps in one call, as on a GPU
        patch.setattr(draft_model_proposer, "one_call_decodes", lambda platform: True)
        one_call = make_engine(llama_dir, speculative_config=spec)
    assert proposer_of(one_call).runner.num_decode_steps == 2
    return {"plain": make_engine(llama_dir), "eagle": make_engine(llama_dir, speculative_config=spec),
            "eagle-one-call": one_call}


def proposer_of(engine: LLMEngine) -> EagleProposer:
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, EagleProposer)
    return proposer


class Reference:
    """The target and the drafter in float64 with transformers' PyTorch Llama: the drafter is a one-layer
    `LlamaModel` fed [embedding ; feature] through `fc`, its input norm and final norm identities (as EAGLE's)."""

    def __init__(self, llama_dir, eagle_dir) -> None:
        self.target = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float64).eval()
        config = transformers.LlamaConfig.from_pretrained(eagle_dir)
        self.drafter = transformers.LlamaModel(config).to(torch.float64).eval()
        from safetensors.torch import load_file

        weights = {name: tensor.to(torch.float64) for name, tensor in
                   load_file(str(eagle_dir / "model.safetensors")).items()}
        self.fc_weight, self.fc_bias = weights.pop("fc.weight"), weights.pop("fc.bias", None)
        self.para_norms = []  # HASS's: the embedding's and the feature's
        for name in ("embedding_layernorm", "hidden_states_layernorm"):
            if f"{name}.weight" in weights:
                norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(HIDDEN, config.rms_norm_eps)
                norm.weight.data = weights.pop(f"{name}.weight")
                self.para_norms.append(norm.to(torch.float64))
        weights.pop("embed_tokens.weight")
        missing, unexpected = self.drafter.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) == {"embed_tokens.weight", "layers.0.input_layernorm.weight",
                                                   "norm.weight"}
        self.drafter.layers[0].input_layernorm = torch.nn.Identity()
        self.drafter.norm = torch.nn.Identity()

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], float]:
        """The drafter's k greedy drafts after `tokens`, and the smallest gap between the two largest logits
        of its choices (a near tie is where float32 may choose otherwise)."""
        ids = torch.tensor([tokens])
        features = self.target.model(ids).last_hidden_state[0]  # [n, D]: the target's final (normed) states
        embed, head = self.target.model.embed_tokens.weight, self.target.lm_head.weight
        inputs = list(tokens[1:])  # position j takes token j + 1 and the feature at j
        feeds = list(features[:-1])
        drafts, gap = [], np.inf
        for _ in range(k):
            embedded, fed = embed[torch.tensor(inputs)], torch.stack(feeds)
            if self.para_norms:
                embedded, fed = self.para_norms[0](embedded), self.para_norms[1](fed)
            fused = torch.cat([embedded, fed], dim=-1) @ self.fc_weight.T
            if self.fc_bias is not None:
                fused = fused + self.fc_bias
            out = self.drafter(inputs_embeds=fused[None]).last_hidden_state[0]  # [n', D]
            logits = (out[-1] @ head.T).numpy()
            best, margin = greedy_pick(logits)
            gap = min(gap, margin)
            drafts.append(best)
            inputs.append(drafts[-1])
            feeds.append(out[-1])  # the drafter's output stands in for the target's feature
        return drafts, gap


class Reference3:
    """An EAGLE-3 drafter in float64 beside transformers' PyTorch target: the target's features are its
    `hidden_states` entering the drafter's layers, the drafter's layer written out from EAGLE-3's definition
    with transformers' rotary embedding."""

    def __init__(self, llama_dir, eagle_dir) -> None:
        self.target = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float64).eval()
        self.config = json.loads((eagle_dir / "config.json").read_text())
        self.layers = self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        self.w = {name: torch.tensor(np.asarray(value, np.float64) if value.dtype != np.int64 else value)
                  for name, value in load_file(str(eagle_dir / "model.safetensors")).items() if name != "t2d"}
        self.rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
            transformers.LlamaConfig.from_pretrained(eagle_dir))
        self.eps = self.config["rms_norm_eps"]

    def _norm(self, x, name):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    def _layer(self, embedded, fed):  # [m, D] each -> the layer's output before the final norm, [m, D]
        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        head_dim = self.config["head_dim"]
        normed = self._norm(fed, "midlayer.hidden_norm")
        residual = normed if self.config["norm_before_residual"] else fed
        x = torch.cat([self._norm(embedded, "midlayer.input_layernorm"), normed], dim=-1)
        m = x.shape[0]
        q = (x @ self.w["midlayer.self_attn.q_proj.weight"].T).view(m, heads, head_dim).transpose(0, 1)[None]
        k = (x @ self.w["midlayer.self_attn.k_proj.weight"].T).view(m, kv_heads, head_dim).transpose(0, 1)[None]
        v = (x @ self.w["midlayer.self_attn.v_proj.weight"].T).view(m, kv_heads, head_dim).transpose(0, 1)[None]
        cos, sin = self.rope(v, torch.arange(m)[None])
        q, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = (q @ k.transpose(-1, -2)) / head_dim**0.5 + torch.triu(torch.full((m, m), -torch.inf), 1)
        attended = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(m, heads * head_dim)
        residual = residual + attended @ self.w["midlayer.self_attn.o_proj.weight"].T
        h = self._norm(residual, "midlayer.post_attention_layernorm")
        gated = torch.nn.functional.silu(h @ self.w["midlayer.mlp.gate_proj.weight"].T)
        up = h @ self.w["midlayer.mlp.up_proj.weight"].T
        return residual + (gated * up) @ self.w["midlayer.mlp.down_proj.weight"].T

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], float]:
        states = self.target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        features = torch.cat([states[layer][0] for layer in self.layers], dim=-1) @ self.w["fc.weight"].T
        embed = self.w.get("embed_tokens.weight", self.target.model.embed_tokens.weight)
        inputs, feeds = list(tokens[1:]), list(features[:-1])
        drafts, gap = [], np.inf
        for _ in range(k):
            out = self._layer(embed[torch.tensor(inputs)], torch.stack(feeds))
            logits = (self._norm(out[-1], "norm") @ self.w["lm_head.weight"].T).numpy()
            best, margin = greedy_pick(logits)
            gap = min(gap, margin)
            drafts.append(best + int(self.w["d2t"][best]))
            inputs.append(drafts[-1])
            feeds.append(out[-1])
        return drafts, gap


def run_drafting(engine: LLMEngine, requests: dict, arrivals: dict, warmed_up: bool = True) -> tuple[dict, int, int]:
    """`requests` with every draft run; returns the outputs, the draft tokens verified and the accepted ones;
    checks that the drafter's cache ends empty and (`warmed_up`) that nothing compiled."""
    counts, proposer = engine.scheduler.speculation, proposer_of(engine)
    before = counts.num_draft_tokens, counts.num_accepted_tokens
    with every_draft_runs(engine), count_compilations() as compiled:
        outputs = run(engine, requests, arrivals)
    assert compiled == [] or not warmed_up, f"compiled after warm-up: {compiled}"
    assert proposer.pages.num_free_pages == proposer.pages.num_usable_pages, "drafter pages leaked"
    assert not proposer._states
    return outputs, counts.num_draft_tokens - before[0], counts.num_accepted_tokens - before[1]


def recorded_rounds(engine: LLMEngine, requests: dict, arrivals: dict, warmed_up: bool = True) -> tuple[list, int]:
    """Runs `requests` with every draft run (`run_drafting`; `warmed_up`: and nothing compiled); returns each
    round's (tokens, drafts, tokens the drafter caught up on) where it drafted, and the draft tokens verified."""
    proposer = proposer_of(engine)
    propose_batch, rounds = proposer.propose_batch, []

    def recording_propose_batch(running, max_drafts):
        caught_up = {request.request_id: request.num_tokens - 1 - proposer._states[request.request_id].num_computed
                     if request.request_id in proposer._states else request.num_tokens - 1 for request in running}
        proposals = propose_batch(running, max_drafts)
        rounds.extend((request.token_ids(0, request.num_tokens), drafts, caught_up[request.request_id])
                      for request, drafts in zip(running, proposals, strict=True) if drafts)
        return proposals

    proposer.propose_batch = recording_propose_batch
    try:
        outputs, drafted, _ = run_drafting(engine, requests, arrivals, warmed_up)
    finally:
        del proposer.propose_batch
    assert len(outputs) == len(requests)
    return rounds, drafted


def assert_reference_drafts(rounds: list, reference: "Reference", every: int = 3) -> int:
    """Each `every`-th round's drafts are the reference's (but at near ties); returns how many were checked."""
    checked = 0
    for tokens, drafts, _ in rounds[::every]:
        expected, gap = reference.drafts(tokens, len(drafts))
        if gap < 1e-3:  # a near tie: float32 may take the other
            continue
        assert drafts == expected, f"after {len(tokens)} tokens"
        checked += 1
    return checked


@pytest.mark.parametrize("name", ["eagle", "eagle-one-call"])
def test_each_round_drafts_the_drafter_s_chain_on_the_target_s_states(engines, llama_dir, eagle_dir, name):
    """Rounds start after plain steps, corrections and sampled tokens (staggered requests, sampled at 1.0),
    after a 100-token prompt read in two chunks (its first round catching up in two calls), and after a
    prefix-cache hit (the second request on a 66-token prefix finds 64 of its tokens' states in the target's
    cached pages): each round's drafts are the float64 reference's chain from the target's states at the
    tokens then, so the states reached the drafter at the right positions, from steps before the round too."""
    prompts = make_prompts(6)
    params = {f"s{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)}
    requests = {f"s{i}": (prompts[i], params[f"s{i}"]) for i in range(6)}
    prefix, greedy = list(range(2000, 2066)), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests |= {"long": (list(range(1000, 1100)), greedy), "first": ([*prefix, 5], greedy),
                 "hit": ([*prefix, 7, 8], greedy)}
    arrivals = {f"s{i}": 4 * i for i in range(6)} | {"long": 2, "first": 5, "hit": 12}
    hits = engines[name].scheduler.prefix_cache_hits
    rounds, drafted = recorded_rounds(engines[name], requests, arrivals)
    assert engines[name].scheduler.prefix_cache_hits - hits >= 64, "the prefix-hit request found no cached page"
    assert drafted > 0 and len(rounds) > 40
    assert any(1 < count < 20 for _, _, count in rounds), "no round caught up on several tokens"
    assert any(count > 64 for _, _, count in rounds), "no round caught up past the largest bucket"
    assert any(tokens[:67] == [*prefix, 7] for tokens, _, _ in rounds), "the prefix-hit request never drafted"
    assert assert_reference_drafts(rounds, Reference(llama_dir, eagle_dir), every=1) > 40


def test_a_hass_drafter_norms_both_inputs(llama_dir, tmp_path, target_config):
    """HASS's checkpoints (`add_para_norm`): the embedding and the feature each normed before `fc`, as the
    reference does it."""
    directory = tmp_path / "hass"
    write_eagle(directory, target_config, fc_bias=False, para_norms=True, seed=1)
    engine = make_engine(llama_dir, speculative_config={"method": "eagle", "model": str(directory),
                                                        "num_speculative_tokens": 3})
    assert proposer_of(engine).runner.model.cfg.para_norms
    prompts = make_prompts(4)
    requests = {f"g{i}": (prompts[i], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                for i in range(4)}
    rounds, _ = recorded_rounds(engine, requests, {f"g{i}": 2 * i for i in range(4)})
    assert assert_reference_drafts(rounds, Reference(llama_dir, directory), every=2) > 5


@pytest.mark.parametrize("name", ["eagle", "eagle-one-call"])
def test_any_eagle_draft_gives_the_plain_outputs(engines, name):
    """Penalties, logprobs, grammars, bans, seeded sampling, n > 1, prefix-cache hits and stops: every output
    is the plain engine's."""
    requests, arrivals = drafting_workload(engines["plain"])
    plain = run(engines["plain"], requests, arrivals)
    outputs, drafted, accepted = run_drafting(engines[name], requests, arrivals)
    assert_same(plain, outputs)
    assert drafted > 0 and 0 <= accepted <= drafted


def test_the_target_keeps_its_states_and_the_drafter_its_features(engines):
    """The target's cache ends with a page array of its hidden states, the drafter's with one of its
    features, both [1, pages, page_size, D], and the KV budget counts them: a page costs F float32 values a
    token more (EAGLE-3: two layers' inputs, 2D); an EAGLE drafter's cache is sized as it is allocated, never
    FP8."""
    engine = engines["eagle"]
    target, drafter = engine.core.runner, proposer_of(engine).runner
    assert target.kv_caches[-1][0].shape == (1, target.num_pages, target.page_size, HIDDEN)
    assert drafter.kv_caches[-1][0].shape == (1, drafter.num_pages, drafter.page_size, HIDDEN)
    assert len(target.kv_caches) == 2 + 1 and len(drafter.kv_caches) == 1 + 1
    assert drafter.num_pages == target.num_pages
    cache = CacheConfig(page_size=4)
    plain = kv_page_bytes(target.model, cache)
    assert kv_page_bytes(target.model, cache, ()) - plain == 4 * HIDDEN * 4
    assert kv_page_bytes(target.model, cache, (0, 1)) - plain == 4 * 2 * HIDDEN * 4
    assert drafter_cache(dataclasses.replace(cache, kv_cache_dtype="fp8"), drafter.model).kv_cache_dtype == "auto"
    assert drafter.kv_dtype == target.kv_dtype


def test_the_speculative_config_takes_an_eagle_drafter():
    config = SpeculativeConfig.of({"method": "eagle", "model": "a/b", "num_speculative_tokens": 2})
    assert (config.method, config.model) == ("eagle", "a/b")
    assert SpeculativeConfig.of({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B",
                                 "num_speculative_tokens": 2}).method == "eagle"  # vLLM infers it from the name
    with pytest.raises(ValueError, match="take their model"):
        SpeculativeConfig.of({"method": "eagle", "num_speculative_tokens": 2})
    assert SpeculativeConfig.of({"model": "org/EAGLE3-LLaMA3.1-Instruct-8B",
                                 "num_speculative_tokens": 2}).method == "eagle3"
    with pytest.raises(ValueError, match="not quantized"):
        SpeculativeConfig.of({"method": "eagle", "model": "a/b", "num_speculative_tokens": 2, "quantization": "fp8"})


def test_what_cannot_draft_for_the_target_is_refused(llama_dir, tmp_path, target_config, tiny_model_dir, eagle_dir):
    """A draft model's checkpoint (no `fc`), a drafter of another width, a target that is not Llama-style
    (GPT-2) and one whose every layer has a sliding window (Mistral: it drops the pages of its states), each
    refused at start."""
    spec = {"method": "eagle", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="not an EAGLE drafter"):
        make_engine(llama_dir, warmup=False, speculative_config={**spec, "model": str(llama_dir)})
    narrow = tmp_path / "narrow"
    write_eagle(narrow, target_config)
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "hidden_size": 32, "head_dim": 8}))
    with pytest.raises(ValueError, match="hidden size 32"):
        make_engine(llama_dir, warmup=False, speculative_config={**spec, "model": str(narrow)})
    with pytest.raises(ValueError, match="Llama-style target"):
        make_engine(tiny_model_dir("gpt2"), warmup=False, speculative_config={**spec, "model": str(eagle_dir)})
    with pytest.raises(ValueError, match="every layer has a sliding window"):
        make_engine(tiny_model_dir("mistral"), warmup=False, speculative_config={**spec, "model": str(eagle_dir)})


def test_preemption_leaves_the_drafts_and_the_drafter_s_cache_right(llama_dir, eagle_dir):
    """A target cache too small for every request: requests are preempted and resumed (their drafter state
    dropped, their hidden states computed again with their K/V); every round's drafts are still the
    reference's, and the drafter's pages all come back."""
    small = dict(num_kv_pages=24, warmup=False)
    prompts = make_prompts(5)
    requests = {f"r{i}": (prompts[i], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                for i in range(5)}
    arrivals = {f"r{i}": i % 3 for i in range(5)}
    engine = make_engine(llama_dir, speculative_config={"method": "eagle", "model": str(eagle_dir),
                                                        "num_speculative_tokens": 2}, **small)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda *args: preempted.append(args) or preempt(*args)
    rounds, drafted = recorded_rounds(engine, requests, arrivals, warmed_up=False)  # drafter pages all back
    assert preempted, "nothing was preempted: the test no longer tests preemption"
    assert drafted > 0
    # the drafts after a resumed request's recomputed prefill read the states computed again
    assert assert_reference_drafts(rounds, Reference(llama_dir, eagle_dir), every=1) > 20


@pytest.mark.parametrize("variant", ["draft-vocabulary", "own-embeddings"])
def test_an_eagle3_drafter_drafts_its_chain_over_the_target_s_layer_inputs(llama_dir, tmp_path, target_config,
                                                                          variant):
    """EAGLE-3: the target keeps the inputs of its layers 0 and 1 side by side, `fc` fuses them as they reach
    the drafter, and each round's drafts are the float64 reference's: over a draft vocabulary of 3,000 of the
    target's ids mapped by `d2t` (every draft one of them), or over the whole vocabulary with the drafter's own
    embeddings and its feature normed before the residual."""
    directory = tmp_path / variant
    if variant == "draft-vocabulary":
        write_eagle3(directory, target_config, (0, 1), draft_vocab_size=3000)
    else:
        write_eagle3(directory, target_config, (0, 1), own_embeddings=True, norm_before_residual=True, seed=2)
    engine = make_engine(llama_dir, speculative_config={"method": "eagle3", "model": str(directory),
                                                        "num_speculative_tokens": 3})
    assert engine.core.runner.kv_caches[-1][0].shape[-1] == 2 * HIDDEN  # two layers' inputs
    prompts = make_prompts(5)
    requests = {f"s{i}": (prompts[i], SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
                for i in range(5)}
    rounds, drafted = recorded_rounds(engine, requests, {f"s{i}": 3 * i for i in range(5)})
    assert drafted > 0 and len(rounds) > 20
    if variant == "draft-vocabulary":
        allowed = set((np.arange(3000) + load_file(str(directory / "model.safetensors"))["d2t"]).tolist())
        assert all(set(drafts) <= allowed for _, drafts, _ in rounds)
    assert assert_reference_drafts(rounds, Reference3(llama_dir, directory), every=2) > 8


@pytest.mark.parametrize(("method", "copied_window"), [("eagle", False), ("eagle3", False), ("eagle3", True)])
def test_an_eagle_drafter_reads_a_target_with_windowed_and_full_layers(tiny_model_dir, tmp_path, method,
                                                                         copied_window):
    """A target with a full-attention layer and a windowed one (Qwen2's max_window_layers; GPT-OSS alternates
    so) keeps every page, so its states are there for the drafter: as sequences grow past the window, each
    round's drafts are the float64 reference's over transformers' windowed target (EAGLE's feature is the state
    after the windowed layer; EAGLE-3's the inputs of both layers), and the outputs are plain decoding's. A
    drafter whose config copied the target's `sliding_window` (without `layer_types`) attends to every
    position, as vLLM reads it and as the reference computes."""
    target = tiny_model_dir("qwen2-window")
    config = json.loads((target / "config.json").read_text())
    drafter = {key: value for key, value in config.items()
               if key not in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")}
    drafter = {**drafter, "model_type": "llama"}  # a drafter is a Llama
    if copied_window:
        drafter["sliding_window"] = config["sliding_window"]
    if method == "eagle":
        write_eagle(tmp_path / method, drafter)
    else:
        write_eagle3(tmp_path / method, drafter, (0, 1), draft_vocab_size=3000)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 3}
    engine, plain = make_engine(target, speculative_config=spec), make_engine(target)
    assert engine.scheduler.kv_cache.sliding_window is None  # one full layer: no page released
    assert not proposer_of(engine).runner.model.cfg.sliding_windows
    prompts = make_prompts(4)
    assert min(len(p) for p in prompts) + 16 > 3 * config["sliding_window"]  # every sequence passes the window
    requests = {f"w{i}": (prompts[i], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                for i in range(4)}
    arrivals = {f"w{i}": 2 * i for i in range(4)}
    rounds, drafted = recorded_rounds(engine, requests, arrivals)
    assert drafted > 0
    reference = (Reference if method == "eagle" else Reference3)(target, tmp_path / method)
    assert assert_reference_drafts(rounds, reference, every=2) > 4
    assert_same(run(plain, requests, arrivals), run(engine, requests, arrivals))


def test_eagle3_drafts_give_the_plain_outputs(engines, llama_dir, tmp_path, target_config):
    """Penalties, logprobs, grammars, seeded sampling, n > 1 and prefix-cache hits with an EAGLE-3 drafter:
    every output is the plain engine's, and nothing compiles after warm-up."""
    directory = tmp_path / "eagle3"
    write_eagle3(directory, target_config, (0, 1), draft_vocab_size=3000)
    engine = make_engine(llama_dir, speculative_config={"method": "eagle3", "model": str(directory),
                                                        "num_speculative_tokens": 2})
    requests, arrivals = drafting_workload(engines["plain"])
    plain = run(engines["plain"], requests, arrivals)
    outputs, drafted, _ = run_drafting(engine, requests, arrivals)
    assert_same(plain, outputs)
    assert drafted > 0


def test_eagle3_reads_the_layers_its_config_names_or_vllm_s_default(llama_dir, target_config, tmp_path):
    """Llama-3.1-8B's default layers are vLLM's; layers past the target's are refused, and so is an EAGLE-3
    checkpoint under method "eagle"."""
    assert default_aux_layers(32) == (2, 16, 29)
    directory = tmp_path / "past-the-target"
    write_eagle3(directory, target_config, (0, 5))
    spec = {"model": str(directory), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"inputs of target layers \[0, 5\]"):
        make_engine(llama_dir, warmup=False, speculative_config={**spec, "method": "eagle3"})
    with pytest.raises(ValueError, match='an EAGLE-3 checkpoint: method "eagle3"'):
        make_engine(llama_dir, warmup=False, speculative_config={**spec, "method": "eagle"})
