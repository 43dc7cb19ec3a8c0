"""An encoder's checkpoint names (`models/bert.map_hf_weight`): with the task model's prefix or without it (a
sentence-transformers checkpoint), BERT's old gamma/beta norms, and each family's own classifier head (a RoBERTa
checkpoint's pooler, which some keep, is not read into it)."""

import numpy as np
import transformers

from jaxserve.models.bert import BertConfig, map_hf_weight
from jaxserve.models.classifier import ClassifierHead


def _config(kind: str, classifier: bool) -> BertConfig:
    config_class = transformers.BertConfig if kind == "bert" else transformers.XLMRobertaConfig
    hf = config_class(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      max_position_embeddings=34, pad_token_id=1)
    cfg = BertConfig.from_hf(hf)
    return BertConfig(**{**cfg.__dict__, "classifier": ClassifierHead(1) if classifier else None})


def _path(name: str, cfg: BertConfig):
    mapped = map_hf_weight(name, cfg)
    return None if mapped is None else mapped[0]


def test_names_with_and_without_the_task_prefix():
    cfg = _config("bert", classifier=False)
    for prefix in ("", "bert.", "model."):
        assert _path(f"{prefix}encoder.layer.0.attention.self.query.weight", cfg) == ("layers", 0, "q_proj")
        assert _path(f"{prefix}embeddings.LayerNorm.gamma", cfg) == ("embeddings_norm", "scale")
        assert _path(f"{prefix}encoder.layer.0.output.LayerNorm.beta", cfg) == ("layers", 0, "output_norm", "bias")
    assert _path("embeddings.position_ids", cfg) is None and _path("pooler.dense.weight", cfg) is None
    q = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)  # torch's [out, in]
    _, transform = map_hf_weight("encoder.layer.0.attention.self.query.weight", cfg)
    np.testing.assert_array_equal(transform(q, cfg), q.T.reshape(8, 2, 4))


def test_each_family_reads_its_own_classifier_head():
    bert, roberta = _config("bert", classifier=True), _config("xlm-roberta", classifier=True)
    assert _path("bert.pooler.dense.weight", bert) == ("head_dense",)
    assert _path("classifier.weight", bert) == ("score",)
    assert _path("roberta.pooler.dense.weight", roberta) is None  # kept by some checkpoints, never read
    assert _path("classifier.dense.weight", roberta) == ("head_dense",)
    assert _path("classifier.out_proj.bias", roberta) == ("score_bias",)
    assert roberta.position_offset == 2 and roberta.max_position_embeddings == 32 and bert.position_offset == 0
