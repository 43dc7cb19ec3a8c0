"""Tiny random encoders (transformers' BERT and XLM-RoBERTa, bare or `*ForSequenceClassification`) saved with a
small WordPiece tokenizer (`tests/conftest.py`'s `encoder_dir`), for the engine's and the server's encoder tests."""

import json
from pathlib import Path

import torch

WORDS = ["the", "a", "is", "of", "on", "in", "what", "where", "who", "how", "cat", "dog", "sat", "mat", "paris",
         "capital", "france", "city", "river", "bank", "money", "learning", "machine", "model", "server", "fast",
         "slow", "deep", "network"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz.,?!'", *WORDS,
         *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]


def wordpiece_tokenizer():
    """BERT's tokenizer over `VOCAB`: [CLS] a [SEP] for a text, [CLS] a [SEP] b [SEP] with types 0 then 1 for
    a pair."""
    import transformers

    return transformers.BertTokenizer(vocab={token: index for index, token in enumerate(VOCAB)})


def encoder(kind: str, num_labels: int | None = None, num_heads: int = 4):
    """A random `kind` ("bert", "xlm-roberta") encoder: bare, or a classifier of `num_labels` classes; its heads
    16 wide."""
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=len(VOCAB), hidden_size=16 * num_heads, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=num_heads, initializer_range=0.3, hidden_act="gelu")
    if kind == "bert":
        config = transformers.BertConfig(max_position_embeddings=128, type_vocab_size=2, pad_token_id=0, **shape)
        bare, classifier = transformers.BertModel, transformers.BertForSequenceClassification
    else:  # positions past the padding index (XLM-R's 1: 2 + position; [UNK] here, in no test text), no types
        config = transformers.XLMRobertaConfig(max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                                               **shape)
        bare, classifier = transformers.XLMRobertaModel, transformers.XLMRobertaForSequenceClassification
    if num_labels is not None:
        config.num_labels = num_labels
    model = (bare(config, add_pooling_layer=False) if num_labels is None else classifier(config))
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(".bias"):  # HF zero-initialises biases: random ones are tested
                tensor.normal_(std=0.3)
            if "LayerNorm.weight" in name:
                tensor.normal_(mean=1.0, std=0.3)
    return model.eval()


def save_sentence_transformers_pooling(directory: Path, mode: str, max_seq_length: int | None = None) -> None:
    """sentence-transformers' files for a bare encoder: its modules (Transformer, Pooling by `mode`: cls_token,
    mean_tokens, lasttoken..., Normalize) and `max_seq_length`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{key}": key == mode for key in
             ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    if max_seq_length is not None:
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                          "do_lower_case": False}))
