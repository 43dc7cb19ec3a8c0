"""`TokenizerCopies`: the copies a start prepares are handed out first, each once, then copies are made as
they are taken; each is a tokenizer of its own that tokenizes as the original does. An engine prepares them
while its warm-up's first step runs, and its threads take those."""

import copy
import threading
from pathlib import Path

import pytest

from jaxserve.models.gguf_cache import converted_dir
from jaxserve.models.tokenizer import TokenizerCopies, load_tokenizer

TEXT = "Hello world, é 日本語 \t  tabs\n\nnew lines <|im_start|> 1234567 🙂"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path):
    return load_tokenizer(converted_dir(smollm2_gguf))


@pytest.fixture
def deep_copies(monkeypatch) -> list[object]:
    """Every deep copy of a tokenizer made from here on (the copied objects)."""
    made, deepcopy = [], copy.deepcopy

    def counted(value, *args):
        result = deepcopy(value, *args)
        if not args and type(value).__name__.endswith(("Tokenizer", "Backend")):  # the outermost call
            made.append(result)
        return result

    monkeypatch.setattr(copy, "deepcopy", counted)
    return made


def test_prepared_copies_are_handed_out_once_each_then_copies_are_made_as_taken(tokenizer, deep_copies):
    copies = TokenizerCopies(tokenizer, 2)
    copies.make()
    assert len(deep_copies) == 2
    copies.make()  # nothing more is wanted
    assert len(deep_copies) == 2
    taken = [copies.take() for _ in range(3)]
    assert len(deep_copies) == 3  # the third, made as it was taken
    assert {id(t) for t in taken} == {id(t) for t in deep_copies}  # each handed out once
    assert len({id(t) for t in [tokenizer, *taken]}) == 4
    want = tokenizer(TEXT)["input_ids"]
    assert all(t(TEXT)["input_ids"] == want for t in taken)
    assert all(t.decode(want) == tokenizer.decode(want) for t in taken)


def test_a_copy_taken_before_they_are_made_is_one_fewer_to_make(tokenizer, deep_copies):
    copies = TokenizerCopies(tokenizer, 3)
    first = copies.take()
    copies.make()
    assert len(deep_copies) == 3  # the one taken, and the two still wanted
    assert len({id(first), id(copies.take()), id(copies.take())}) == 3


def test_copies_taken_while_they_are_made_are_each_their_own(tokenizer):
    copies = TokenizerCopies(tokenizer, 3)
    maker = threading.Thread(target=copies.make)
    maker.start()
    taken = [copies.take() for _ in range(3)]
    maker.join()
    assert len({id(t) for t in [tokenizer, *taken]}) == 4


def test_an_engine_makes_its_copies_during_the_warm_up_and_its_threads_take_them(llama_dir, monkeypatch,
                                                                                  deep_copies):
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import TOKENIZER_COPIES
    from jaxserve.runner.model_runner import ModelRunner
    from tests.engine.helpers import make_engine

    compiled_when_made = []
    warmup = ModelRunner.warmup

    def noted_warmup(runner, *args, meanwhile=None, **kwargs):
        def noted():
            compiled_when_made.append(len(runner._compiled))
            meanwhile()

        return warmup(runner, *args, meanwhile=noted, **kwargs)

    monkeypatch.setattr(ModelRunner, "warmup", noted_warmup)
    engine = make_engine(llama_dir)
    assert len(compiled_when_made) == 1 and compiled_when_made[0] >= 1  # once, beside the first bucket's run
    prepared = list(deep_copies)
    assert len(prepared) == TOKENIZER_COPIES
    async_engine = AsyncEngine(engine)
    try:
        third = engine.tokenizer_copy()
        assert deep_copies == prepared  # the grammar compiler's, the async engine's and this one were prepared
        assert {id(async_engine.tokenizer), id(third)} < {id(t) for t in prepared}
        assert async_engine.tokenizer is not third and engine.tokenizer not in (async_engine.tokenizer, third)
        engine.tokenizer_copy()
        assert len(deep_copies) == TOKENIZER_COPIES + 1  # none left: made as taken
    finally:
        async_engine.shutdown()
