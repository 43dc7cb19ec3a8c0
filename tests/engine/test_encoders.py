"""Encoders (BERT, XLM-RoBERTa; `models/bert.py`) served by `--runner pooling`: embeddings (first token, mean,
and a sentence-transformers model's own pooling and length) and classifier logits against transformers' in
float32, prompts of different lengths packed into one step (each attends over its own prompt only, both
ways); a cross-encoder's pair scores with BERT's token types; what an encoder refuses."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from jaxserve.llm import LLM
from jaxserve.sampling_params import POOLING_PARAMS
from tests.encoders import save_sentence_transformers_pooling
from tests.engine.helpers import LADDER

pytestmark = pytest.mark.slow  # transformers reference

TEXTS = ["the cat sat on the mat", "where is paris?", "what is the capital of france? paris is the capital city",
         "a", "deep learning model server, fast and slow"]
QUERY = "where is the cat?"
DOCUMENTS = ["the cat sat on the mat", "money in the bank", "a dog is on the mat", "paris is a city"]


def _llm(directory, **overrides) -> LLM:
    return LLM(model=str(directory), dtype="float32", page_size=4, compilation_cache_dir=None,
               **{**LADDER, **overrides})


def _hidden(model, tokenizer, text: str, pair: str | None = None, types: bool = True) -> np.ndarray:
    """transformers' final hidden states [T, D] of the tokenizer's encoding, in float64."""
    encoded = dict(tokenizer(text, text_pair=pair, return_tensors="pt"))
    if not types:
        encoded.pop("token_type_ids", None)
    with torch.no_grad():
        return model.double()(**encoded).last_hidden_state[0].numpy()


def _logits(model, tokenizer, text: str, pair: str | None = None) -> np.ndarray:
    encoded = dict(tokenizer(text, text_pair=pair, return_tensors="pt"))
    if model.config.model_type != "bert":
        encoded.pop("token_type_ids")  # (RoBERTa's tokenizers give none; this test's WordPiece one does)
    with torch.no_grad():
        return model.double()(**encoded).logits[0].numpy()


@pytest.mark.gpu  # the encoder's step on the device there is
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
@pytest.mark.parametrize(("pooling_type", "rows"), [("auto", 8), ("mean", 8), ("auto", 16)])
def test_embeddings_match_transformers(encoder_dir, kind, pooling_type, rows):
    """No --runner: an encoder serves as a pooling engine; auto pools the first token ([CLS]). The prompts,
    3 to 14 tokens, run packed together in one step of the 64-token bucket: on a CPU, attending in one dense
    product, or with a 16-row bucket through the paged kernel (`bert.pages_pay`)."""
    directory, model = encoder_dir(kind)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    llm = _llm(directory, pooling_type=pooling_type, max_num_seqs=rows, request_buckets=(1, 2, 4, rows))
    assert llm.engine.info.runner == "pooling"
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs, strict=True):
        hidden = _hidden(model, tokenizer, text, types=kind == "bert")
        expected = hidden[0] if pooling_type == "auto" else hidden.mean(axis=0)
        assert output.prompt_token_ids == tokenizer(text)["input_ids"]
        np.testing.assert_allclose(output.outputs.embedding, expected, rtol=1e-4, atol=1e-5)


def test_a_prompt_attends_to_its_own_tokens_only_and_both_ways(encoder_dir):
    """Changing a prompt's last token changes its first token's state (attention looks ahead), and a prompt's
    embedding is the same alone as beside others in one step."""
    directory, _ = encoder_dir("bert")
    llm = _llm(directory)
    first, second = (o.outputs.embedding for o in llm.embed(["the cat sat", "the cat is"], use_tqdm=False))
    assert np.abs(np.subtract(first, second)).max() > 1e-3
    together = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    alone = [llm.embed([text], use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-5)  # (other buckets: float32's last bits)


def test_a_sentence_transformers_model_s_pooling_and_length_are_read(tmp_path, encoder_dir):
    """modules.json's Pooling module (mean here) is --pooling-type auto's, and sentence_bert_config.json's
    max_seq_length the context served; a prompt over it is refused."""
    import shutil

    source, model = encoder_dir("bert")
    directory = tmp_path / "st"
    shutil.copytree(source, directory)
    save_sentence_transformers_pooling(directory, "mean_tokens", max_seq_length=12)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    llm = _llm(directory)
    assert llm.engine.info.limits.max_model_len == 12
    short = [text for text in TEXTS if len(tokenizer(text)["input_ids"]) <= 12]
    for text, output in zip(short, llm.embed(short, use_tqdm=False), strict=True):
        np.testing.assert_allclose(output.outputs.embedding, _hidden(model, tokenizer, text).mean(axis=0),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="12"):
        llm.embed([TEXTS[2]], use_tqdm=False)


@pytest.mark.gpu
def test_a_bert_cross_encoder_scores_pairs_with_their_token_types(encoder_dir):
    """BERT's pair `[CLS] q [SEP] d [SEP]` is type 0 then type 1, as the tokenizer says: the scores are
    transformers' sigmoids of its logits with those types (which differ without them)."""
    directory, model = encoder_dir("bert", 1)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    llm = _llm(directory)
    assert llm.engine.info.runner == "pooling" and llm.engine.info.score_activation == "sigmoid"
    scores = [output.outputs.score for output in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    logits = np.array([_logits(model, tokenizer, QUERY, document)[0] for document in DOCUMENTS])
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), rtol=1e-4, atol=1e-6)
    encoded = tokenizer(QUERY, text_pair=DOCUMENTS[0], return_tensors="pt")
    with torch.no_grad():
        untyped = model.double()(input_ids=encoded["input_ids"]).logits[0, 0].item()
    assert abs(untyped - logits[0]) > 1e-3, "the types must matter for the test to show they are read"


def test_an_xlm_roberta_classifier_matches_transformers(encoder_dir):
    """RoBERTa's classifier (dense, tanh, out_proj over <s>) and its positions past the padding index."""
    directory, model = encoder_dir("xlm-roberta", 3)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    llm = _llm(directory)
    for text, output in zip(TEXTS, llm.classify(TEXTS, use_tqdm=False), strict=True):
        logits = _logits(model, tokenizer, text)
        np.testing.assert_allclose(output.outputs.probs, np.exp(logits) / np.exp(logits).sum(), rtol=1e-4, atol=1e-6)
    pooled = llm._run([tokenizer(TEXTS[0])["input_ids"]], POOLING_PARAMS, False)[0].embedding
    np.testing.assert_allclose(pooled, _logits(model, tokenizer, TEXTS[0]), rtol=1e-4, atol=1e-5)


def test_what_an_encoder_refuses(encoder_dir):
    directory, _ = encoder_dir("bert")
    with pytest.raises(ValueError, match=r"the model is an encoder .*--runner generate cannot serve it"):
        _llm(directory, runner="generate")
    classifier, _ = encoder_dir("bert", 1)
    with pytest.raises(ValueError, match="classifier head reads its first token"):
        _llm(classifier, pooling_type="mean")
    with pytest.raises(ValueError, match="pooling"):
        _llm(directory).generate(["the cat"], use_tqdm=False)


def test_steps_grow_to_take_the_longest_prompt_whole(encoder_dir, caplog):
    """128 positions where the ladder's steps take 64 tokens: the steps grow to 128 (a top token bucket), and a
    prompt of 128 tokens is embedded whole; --max-model-len 100 grows them to 100 only."""
    directory, model = encoder_dir("bert")
    with caplog.at_level("INFO"):
        llm = _llm(directory)
    assert llm.engine.info.limits.max_model_len == llm.engine.info.max_num_batched_tokens == 128
    assert "--max-num-batched-tokens 64 raised to its context, 128" in caplog.text
    prompt = [2, *(5 + i % 60 for i in range(126)), 3]
    with torch.no_grad():
        hidden = model.double()(input_ids=torch.tensor([prompt])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(llm.embed([prompt], use_tqdm=False)[0].outputs.embedding, hidden[0], rtol=1e-4,
                               atol=1e-5)
    shorter = _llm(directory, max_model_len=100)
    assert shorter.engine.info.limits.max_model_len == shorter.engine.info.max_num_batched_tokens == 100


def test_truncation_keeps_the_special_tokens(encoder_dir):
    """truncate_prompt_tokens keeps a text's last tokens inside [CLS] ... [SEP], a pair's longer text cut first,
    as vLLM's tokenizers truncate (on the left): the first token's state is still [CLS]'s."""
    directory, model = encoder_dir("bert", 1)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    llm = _llm(directory)
    tokenizer.truncation_side = "left"
    query, document = QUERY, "the dog sat on the mat in paris, the capital of france"
    expected = tokenizer(query, text_pair=document, truncation=True, max_length=12, return_tensors="pt")
    assert expected["input_ids"][0, 0].item() == tokenizer.cls_token_id and len(expected["input_ids"][0]) == 12
    with torch.no_grad():
        logit = model.double()(**expected).logits[0, 0].item()
    (scored,) = llm.score(query, [document], truncate_prompt_tokens=12, use_tqdm=False)
    assert scored.prompt_token_ids == expected["input_ids"][0].tolist()
    np.testing.assert_allclose(scored.outputs.score, 1 / (1 + np.exp(-logit)), rtol=1e-4, atol=1e-6)
    (embedded,) = _llm(encoder_dir("bert")[0]).embed([document], truncate_prompt_tokens=5, use_tqdm=False)
    assert embedded.prompt_token_ids == [tokenizer.cls_token_id, *tokenizer.encode(document)[-4:-1],
                                         tokenizer.sep_token_id]


def test_fp8_weights_serve_an_encoder(encoder_dir):
    """--quantization fp8: each layer's six projections in e4m3 with per-channel scales (the embeddings and the
    head stay), the vectors tracking float32's (e4m3 rounds each weight by up to 6%, and this tiny random model's
    two layers compound it)."""
    from flax import nnx, traverse_util

    from jaxserve.models.quantization import Fp8Weight

    directory, _ = encoder_dir("bert")
    exact = np.asarray([o.outputs.embedding for o in _llm(directory).embed(TEXTS, use_tqdm=False)])
    llm = _llm(directory, quantization="fp8")
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(llm.engine.runner.model.state))
    assert sorted(path[-1] for path, value in flat.items() if isinstance(value, Fp8Weight) and path[1] == 0) == [
        "down_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert sum(isinstance(value, Fp8Weight) for value in flat.values()) == 2 * 6
    rounded = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    cosine = np.sum(exact * rounded, 1) / np.linalg.norm(exact, axis=1) / np.linalg.norm(rounded, axis=1)
    assert cosine.min() > 0.95 and np.abs(exact - rounded).max() > 1e-4, cosine  # rounded, and close


def test_a_cross_encoder_scores_alike_over_two_data_parallel_ranks(encoder_dir):
    """--data-parallel-size 2: each rank's core in its own process sizes and schedules as an encoder (steps that
    take its prompts whole), and the pairs' scores and classes are one rank's."""
    directory, _ = encoder_dir("bert", 1)
    documents = [*DOCUMENTS, *TEXTS]
    one = _llm(directory)
    scores = [o.outputs.score for o in one.score(QUERY, documents, use_tqdm=False)]
    probs = [o.outputs.probs for o in one.classify(TEXTS, use_tqdm=False)]
    two = _llm(directory, data_parallel_size=2)
    try:
        np.testing.assert_allclose([o.outputs.score for o in two.score(QUERY, documents, use_tqdm=False)], scores,
                                   rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose([o.outputs.probs for o in two.classify(TEXTS, use_tqdm=False)], probs, rtol=1e-5,
                                   atol=1e-7)
    finally:
        two.engine.shutdown()
