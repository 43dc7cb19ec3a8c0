"""A sentence-transformers directory's pooling and length (`models/pooling_config.py`): the Pooling module
found through modules.json wherever it lives, one mode of cls, mean or last taken, anything else refused with
a warning, and no files meaning no say."""

import json

import pytest

from jaxserve.models.pooling_config import max_seq_length, pooling_type
from tests.encoders import save_sentence_transformers_pooling


@pytest.mark.parametrize(("mode", "expected"), [("cls_token", "cls"), ("mean_tokens", "mean"),
                                                 ("lasttoken", "last"), ("max_tokens", None)])
def test_the_pooling_module_s_mode(tmp_path, mode, expected, caplog):
    save_sentence_transformers_pooling(tmp_path, mode, max_seq_length=256)
    assert pooling_type(tmp_path) == expected and max_seq_length(tmp_path) == 256
    assert ("not one jaxserve pools by" in caplog.text) == (expected is None)


def test_the_module_is_found_where_modules_json_puts_it(tmp_path):
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "pool", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                               "pooling_mode_mean_tokens": False}))
    assert pooling_type(tmp_path) == "cls"
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                               "pooling_mode_mean_tokens": True}))
    assert pooling_type(tmp_path) is None  # two concatenated: not a vector jaxserve pools


def test_a_module_that_is_not_applied_is_said(tmp_path, caplog):
    save_sentence_transformers_pooling(tmp_path, "cls_token")
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert pooling_type(tmp_path) == "cls"
    assert "modules sentence_transformers.models.Dense are not applied" in caplog.text


def test_no_files_or_broken_ones_say_nothing(tmp_path):
    assert pooling_type(tmp_path) is None and max_seq_length(tmp_path) is None
    (tmp_path / "modules.json").write_text("{not json")
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "long"}))
    assert pooling_type(tmp_path) is None and max_seq_length(tmp_path) is None
