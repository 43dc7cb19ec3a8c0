"""Classifiers (transformers' `*ForSequenceClassification`: cross-encoder rerankers, reward and classification
models) served by `--runner pooling`: the class logits of tiny random Llama, Qwen2, Qwen3 and Gemma 2 classifiers
against transformers' own, in float32, through chunked prefill, prefix caching and batching; `LLM.classify`'s
probabilities and `LLM.score`'s cross-encoder scores against transformers'; a classifier chooses the pooling
runner itself, and is refused where that cannot serve it."""

import numpy as np
import pytest
import torch

from jaxserve.llm import LLM
from jaxserve.sampling_params import POOLING_PARAMS
from tests.classifiers import LABELS
from tests.engine.helpers import LADDER, make_prompts

pytestmark = pytest.mark.slow  # transformers reference

def _llm(directory, **overrides) -> LLM:
    options = {**LADDER, "max_num_batched_tokens": 16, "token_buckets": (16,)}  # prompts over 16: chunked
    return LLM(model=str(directory), dtype="float32", page_size=4, num_kv_pages=256, max_model_len=256,
               compilation_cache_dir=None, **{**options, **overrides})


def _reference_logits(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].double().numpy()  # [L]: at the last token


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma2"])
def test_class_logits_match_transformers(classifier_dir, kind):
    """No --runner given: a classifier serves as a pooling engine, and its probabilities are transformers'
    softmax, prompt by prompt, in chunks of 16 tokens, batched, one prompt a cached prefix of another."""
    directory, model = classifier_dir(kind)
    llm = _llm(directory)
    assert llm.engine.info.runner == "pooling" and llm.engine.info.class_labels == tuple(LABELS.values())
    prompts = make_prompts(8)
    prompts.append(prompts[3][:30])
    outputs = llm.classify(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        logits = _reference_logits(model, prompt)
        expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(output.outputs.probs, expected, rtol=2e-4, atol=2e-5)
        assert output.outputs.num_classes == 3 and output.prompt_token_ids == prompt
    # the pooled vectors are the logits themselves, as transformers computes them
    pooled = llm._run([prompts[1]], POOLING_PARAMS, False)[0].embedding
    np.testing.assert_allclose(pooled, _reference_logits(model, prompts[1]), rtol=2e-4, atol=2e-4)


def test_mean_pooling_classifies_the_mean_hidden_state(classifier_dir):
    """The head is linear without a bias: the mean over a prompt's chunks of its tokens' logits is the head
    of their mean hidden state."""
    directory, model = classifier_dir("llama")
    llm = _llm(directory, runner="pooling", pooling_type="mean")
    prompt = make_prompts(4)[3]  # 40 tokens: three chunks
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].double()
        expected = (hidden.mean(0) @ model.score.weight.double().T).numpy()
    pooled = llm._run([prompt], POOLING_PARAMS, False)[0].embedding
    np.testing.assert_allclose(pooled, expected, rtol=2e-4, atol=2e-4)


def test_a_cross_encoder_scores_pairs_as_transformers_does(classifier_dir):
    """One class: `LLM.score` reads each pair as the tokenizer's pair encoding and scores it by the sigmoid
    of its logit, one query against several documents and pairs one to one."""
    directory, model = classifier_dir("qwen2", num_labels=1)
    llm = _llm(directory)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    query, documents = "Where do cats sleep?", ["On warm windowsills.", "Revenue rose by four percent.", "Naps."]

    def expected(first: str, second: str) -> float:
        return float(torch.sigmoid(torch.tensor(_reference_logits(model, tokenizer(first, text_pair=second)
                                                                  ["input_ids"])[0])))

    scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    np.testing.assert_allclose(scores, [expected(query, d) for d in documents], rtol=1e-4, atol=1e-6)
    paired = [o.outputs.score for o in llm.score(documents[:2], [query, query], use_tqdm=False)]
    np.testing.assert_allclose(paired, [expected(d, query) for d in documents[:2]], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="pairs of texts"):
        llm.score([[5, 6, 7]], documents, use_tqdm=False)


def test_a_classifier_refuses_what_it_cannot_serve(classifier_dir, llama_dir):
    directory, _ = classifier_dir("llama")
    llm = _llm(directory)
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.score("a", ["b"], use_tqdm=False)  # three classes: no one score for a pair
    with pytest.raises(ValueError, match="not embeddings"):
        llm.embed([[5, 6, 7]], use_tqdm=False)
    with pytest.raises(ValueError, match="one host and without --enable-lora"):
        _llm(directory, enable_lora=True)
    with pytest.raises(ValueError, match="--runner generate cannot serve it"):
        _llm(directory, runner="generate")
    embedder = _llm(llama_dir, runner="pooling")
    with pytest.raises(ValueError, match="classifier model"):
        embedder.classify([[5, 6, 7]], use_tqdm=False)


@pytest.mark.parametrize("tied", [True, False])
def test_a_causal_reranker_made_a_classifier_as_vllm_does(tmp_path, smollm2_tokenizer, tied):
    """Qwen3-Reranker's recipe for vLLM: a Qwen3ForCausalLM served with `--hf-overrides` naming a classifier
    architecture, `classifier_from_token: ["no", "yes"]` and `is_original_qwen3_reranker`: its score is the
    probability of "yes" against "no" at the pair's last token, transformers' causal LM's softmax over the two
    logits; without the flag, two classes whose probabilities are that softmax. Its LM head tied or not."""
    import transformers

    from tests.conftest import TINY_VOCAB

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=TINY_VOCAB, initializer_range=0.3, bos_token_id=1, eos_token_id=2, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tied)).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(tmp_path)
    no, yes = smollm2_tokenizer.convert_tokens_to_ids(["no", "yes"])
    query, documents = "Where do cats sleep?", ["On warm windowsills.", "Revenue rose by four percent."]
    pairs = [smollm2_tokenizer(query, text_pair=document)["input_ids"] for document in documents]
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0, -1].double() for ids in pairs]
    p_yes = [float(torch.softmax(row[[no, yes]], 0)[1]) for row in logits]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    reranker = _llm(tmp_path, hf_overrides={**overrides, "is_original_qwen3_reranker": True})
    assert reranker.engine.info.class_labels == ("yes",)
    scores = [o.outputs.score for o in reranker.score(query, documents, use_tqdm=False)]
    np.testing.assert_allclose(scores, p_yes, rtol=1e-4, atol=1e-6)
    two_way = _llm(tmp_path, hf_overrides=overrides)
    assert two_way.engine.info.class_labels == ("no", "yes")
    two_classes = two_way.classify(pairs, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.probs[1] for o in two_classes], p_yes, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="'nope-not-a-token' is not a token"):
        _llm(tmp_path, hf_overrides={**overrides, "classifier_from_token": ["no", "nope-not-a-token"]})
    with pytest.raises(ValueError, match="architectures"):
        _llm(tmp_path, hf_overrides={"classifier_from_token": ["no", "yes"]})


def test_a_gemma_reranker_made_from_its_yes_token_as_vllm_does(tiny_model_dir, tiny_hf_model, smollm2_tokenizer):
    """bge-reranker-v2-gemma's recipe for vLLM: a GemmaForCausalLM with `classifier_from_token: ["Yes"]` and
    `method: no_post_processing`: one class, the LM head's "Yes" row (Gemma's tied embeddings), its score the
    sigmoid of the causal LM's "Yes" logit at the pair's last token."""
    model = tiny_hf_model("gemma")
    yes = smollm2_tokenizer.convert_tokens_to_ids("Yes")
    query, documents = "Where do cats sleep?", ["On warm windowsills.", "Revenue rose by four percent."]
    pairs = [smollm2_tokenizer(query, text_pair=document)["input_ids"] for document in documents]
    with torch.no_grad():
        expected = [float(torch.sigmoid(model(torch.tensor([ids])).logits[0, -1, yes].double())) for ids in pairs]
    llm = _llm(tiny_model_dir("gemma"), hf_overrides={"architectures": ["GemmaForSequenceClassification"],
                                                      "classifier_from_token": ["Yes"],
                                                      "method": "no_post_processing"})
    assert llm.engine.info.class_labels == ("Yes",)
    scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="method must be one of"):
        _llm(tiny_model_dir("gemma"), hf_overrides={"architectures": ["GemmaForSequenceClassification"],
                                                    "classifier_from_token": ["Yes"], "method": "softmax"})


def test_a_cross_encoder_s_sentence_transformers_activation_sets_its_scores(classifier_dir):
    """As vLLM reads it: the activation a sentence-transformers cross-encoder's config names (the older
    `sbert_ce_default_activation_function`, or `sentence_transformers.activation_fn`) turns a pair's logit into
    its score; /classify keeps the classifier's own (a sigmoid for one class, none for a regression)."""
    directory, model = classifier_dir("qwen2", num_labels=1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    query, document = "Where do cats sleep?", "On warm windowsills."
    logit = _reference_logits(model, tokenizer(query, text_pair=document)["input_ids"])[0]
    identity = _llm(directory, hf_overrides={"sbert_ce_default_activation_function":
                                             "torch.nn.modules.linear.Identity"})
    assert identity.score(query, [document], use_tqdm=False)[0].outputs.score == pytest.approx(logit, rel=1e-4,
                                                                                                abs=1e-5)
    query_logit = _reference_logits(model, tokenizer.encode(query))[0]
    assert identity.classify([tokenizer.encode(query)], use_tqdm=False)[0].outputs.probs[0] == pytest.approx(
        1 / (1 + np.exp(-query_logit)), rel=1e-4, abs=1e-6)
    sentence_transformers = {"activation_fn": "torch.nn.modules.activation.Sigmoid"}
    sigmoid = _llm(directory, hf_overrides={"problem_type": "regression",
                                            "sentence_transformers": sentence_transformers})
    assert sigmoid.score(query, [document], use_tqdm=False)[0].outputs.score == pytest.approx(
        1 / (1 + np.exp(-logit)), rel=1e-4, abs=1e-6)
    assert sigmoid.classify([tokenizer.encode(query)], use_tqdm=False)[0].outputs.probs[0] == pytest.approx(
        query_logit, rel=1e-4, abs=1e-5)


def test_a_classifier_s_engine_in_its_own_process_classifies_alike(classifier_dir):
    """--engine-process: the classes, their labels and the activations cross the core's pipe (EngineInfo)."""
    directory, _ = classifier_dir("llama")
    prompts = make_prompts(3)
    expected = [o.outputs.probs for o in _llm(directory).classify(prompts, use_tqdm=False)]
    llm = _llm(directory, engine_process=True)
    try:
        assert llm.engine.info.class_labels == tuple(LABELS.values())
        got = [o.outputs.probs for o in llm.classify(prompts, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
