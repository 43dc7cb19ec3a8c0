"""The fused sampler: filters never leak tokens outside the allowed set; seeds reproduce."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.step_io import bitmask_words
from jaxserve.runner.penalties import PenaltyTables, PenaltyUpdates, count_accepted_drafts, update_tables
from jaxserve.runner.sampler import _process_logits, sample
from jaxserve.runner.step_batch import SamplingArrays

VOCAB = 64
ROWS = 8
SLOTS = 4
BIASED = 3
TOP = 5


def arrays(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, output_index=0, **extra) -> SamplingArrays:
    full = lambda v, dtype: np.full(ROWS, v, dtype)  # noqa: E731
    fields = dict(
        temperature=full(temperature, np.float32), top_k=full(top_k, np.int32), top_p=full(top_p, np.float32),
        min_p=full(min_p, np.float32),
        seeds=np.arange(ROWS, dtype=np.uint32) if seeds is None else np.asarray(seeds, np.uint32),
        output_index=full(output_index, np.int32),
        bias_token_ids=np.full((ROWS, BIASED), VOCAB, np.int32), bias_values=np.zeros((ROWS, BIASED), np.float32),
        penalty_slots=full(SLOTS, np.int32), penalty_drafts=np.full((ROWS, 0), VOCAB, np.int32),
        repetition_penalty=full(1.0, np.float32),
        frequency_penalty=full(0.0, np.float32), presence_penalty=full(0.0, np.float32),
        wants_logprobs=full(True, np.bool_), wants_top_logprobs=full(False, np.bool_),
        token_bitmask=np.full((ROWS, bitmask_words(VOCAB)), -1, np.int32), constrained=full(False, np.bool_),
    )
    return SamplingArrays(**{**fields, **extra})


@functools.partial(jax.jit, static_argnames="on_cuda")
def _sample(logits, params, tables, on_cuda=False):
    return sample(logits, params, tables, TOP, on_cuda=on_cuda)


def sample_jit(logits, params, tables=None, on_cuda=False):
    out = _sample(logits, params, tables or PenaltyTables.zeros(SLOTS, VOCAB), on_cuda=on_cuda)
    return out.tokens, out.logprobs


def grammar_bitmask(allowed: dict[int, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Bitmask i32[R, W] and constrained bool[R] for rows whose grammar allows only the given tokens."""
    bits = np.zeros((ROWS, bitmask_words(VOCAB) * 32), np.bool_)
    for row, tokens in allowed.items():
        bits[row, tokens] = True
    words = np.packbits(bits.reshape(ROWS, -1, 32), axis=-1, bitorder="little").view(np.int32)[..., 0]
    return words, np.isin(np.arange(ROWS), list(allowed))


def allowed_set(logits_row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The sampler's contract, computed independently in float64."""
    x = logits_row.astype(np.float64) / temperature
    order = np.argsort(-x)
    keep = order[:top_k] if top_k > 0 else order
    probs = np.exp(x[keep] - x[keep].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    keep = keep[: max(1, int((mass_before < top_p).sum()))]
    p_all = np.exp(x - x.max())
    keep = [t for t in keep if p_all[t] >= min_p * p_all.max()]
    return set(int(t) for t in keep)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 5, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (0.7, 0, 1.0, 0.2), (1.3, 10, 0.8, 0.05), (1.0, 1, 1.0, 0.0)],
)
def test_filters_never_emit_outside_allowed_set(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 2).astype(np.float32)
    allowed = [allowed_set(row, temperature, top_k, top_p, min_p) for row in logits]
    seen: list[set[int]] = [set() for _ in range(ROWS)]
    for step in range(200):
        tokens, _ = sample_jit(logits, arrays(temperature, top_k, top_p, min_p, output_index=step))
        for row, token in enumerate(np.asarray(tokens)):
            seen[row].add(int(token))
    for row in range(ROWS):
        assert seen[row] <= allowed[row], f"row {row} emitted {seen[row] - allowed[row]}"
        assert len(seen[row]) == len(allowed[row]) or len(allowed[row]) > 10  # the set is explored


def test_unfiltered_sampling_follows_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.2] + [1e-9] * (VOCAB - 3)] * ROWS, np.float32))
    counts = np.zeros(VOCAB)
    for step in range(250):
        tokens, _ = sample_jit(logits, arrays(output_index=step))
        np.add.at(counts, np.asarray(tokens), 1)
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq[:3], [0.5, 0.3, 0.2], atol=0.03)


def test_seed_reproduces_and_greedy_rows_take_argmax():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    a, _ = sample_jit(logits, arrays(seeds=[7] * ROWS, output_index=3))
    b, _ = sample_jit(logits, arrays(seeds=[7] * ROWS, output_index=3))
    c, _ = sample_jit(logits, arrays(seeds=[8] * ROWS, output_index=3))
    assert np.array_equal(a, b)
    mixed = arrays(temperature=1.0)
    mixed.temperature[::2] = 0.0  # greedy rows in a sampled batch
    tokens, logprobs = sample_jit(logits, mixed)
    np.testing.assert_array_equal(np.asarray(tokens)[::2], logits.argmax(-1)[::2])
    expected = jax.nn.log_softmax(logits)[np.arange(ROWS), np.asarray(tokens)]
    np.testing.assert_allclose(logprobs, expected, atol=1e-5)
    assert not np.array_equal(a, c), "another seed should draw other tokens"


def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    ids = np.full((ROWS, BIASED), VOCAB, np.int32)
    values = np.zeros((ROWS, BIASED), np.float32)
    ids[:, 0], values[:, 0] = 7, 100.0  # every row: token 7 wins
    ids[1, 1], values[1, 1] = 7, -np.inf  # row 1 also bans 7 (min_tokens on a stop id): it must never come
    for temperature in (0.0, 1.0):
        tokens, logprobs = sample_jit(logits, arrays(temperature, bias_token_ids=ids, bias_values=values))
        tokens = np.asarray(tokens)
        assert (tokens[[0, *range(2, ROWS)]] == 7).all()
        assert tokens[1] != 7
        # Reported logprobs stay the raw model's.
        expected = jax.nn.log_softmax(logits)[np.arange(ROWS), tokens]
        np.testing.assert_allclose(logprobs, expected, atol=1e-5)


@pytest.mark.parametrize("on_cuda", [False, True])  # CPUs' conditional stages, CUDA GPUs' single one
def test_grammar_bias_bans_and_penalties_together(on_cuda):
    """Greedy rows, each with one kind of processing in one batch: a grammar, a bias, a ban that leaves a
    row no token its grammar allows (it falls back to its grammar), penalties; and a grammar-only batch."""
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    bitmask, constrained = grammar_bitmask({1: [3, 17], 3: [5]})
    ids, values = np.full((ROWS, BIASED), VOCAB, np.int32), np.zeros((ROWS, BIASED), np.float32)
    ids[2, 0], values[2, 0] = 7, 100.0
    ids[3, 0], values[3, 0] = 5, -np.inf  # bans the one token row 3's grammar allows
    tables = update_tables(PenaltyTables.zeros(SLOTS, VOCAB), np.full(16, 0, np.int32), PenaltyUpdates(
        np.full(ROWS, SLOTS, np.int32), np.where(np.arange(16) < 1, 1, SLOTS).astype(np.int32),
        np.full(16, SLOTS, np.int32)), True)  # slot 1's prompt: token 0
    top = int(logits[4].argmax())
    logits[4, 0] = logits[4, top] + 1.0  # row 4's argmax is token 0, the prompt's (a repetition penalty's)
    slots = np.where(np.arange(ROWS) == 4, 1, SLOTS).astype(np.int32)  # row 4 has penalties, at first none
    params = arrays(0.0, token_bitmask=bitmask, constrained=constrained, bias_token_ids=ids, bias_values=values,
                    penalty_slots=slots)
    tokens = np.asarray(sample_jit(logits, params, tables, on_cuda=on_cuda)[0])
    assert tokens[1] == [3, 17][int(logits[1, 17] > logits[1, 3])] and tokens[2] == 7 and tokens[3] == 5
    assert tokens[0] == logits[0].argmax() and tokens[4] == 0
    rep = np.where(np.arange(ROWS) == 4, 100.0, 1.0).astype(np.float32)  # token 0, the prompt's, shrinks
    params = dataclasses.replace(params, repetition_penalty=rep)
    assert np.asarray(sample_jit(logits, params, tables, on_cuda=on_cuda)[0])[4] == top
    grammar_only = arrays(0.0, token_bitmask=bitmask, constrained=constrained)
    tokens = np.asarray(sample_jit(logits, grammar_only, on_cuda=on_cuda)[0])
    assert tokens[3] == 5 and tokens[1] in (3, 17) and tokens[0] == logits[0].argmax()


def test_both_forms_of_the_logit_processing_give_the_same_logits():
    """The CUDA form (every stage for every row) and the CPU form (each stage behind its conditional)
    agree exactly, row by row, on a batch with every kind of processing and on a grammar-only batch: a row
    without a grammar, bias or penalty keeps its logits bit for bit."""
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.standard_normal((ROWS, VOCAB)) * 4, jnp.float32)
    bitmask, constrained = grammar_bitmask({1: [3, 17, 40], 3: [5]})
    ids, values = np.full((ROWS, BIASED), VOCAB, np.int32), np.zeros((ROWS, BIASED), np.float32)
    ids[2, :2], values[2, :2] = [7, 9], [2.5, -1.0]
    ids[3, 0], values[3, 0] = 5, -np.inf
    tables = update_tables(PenaltyTables.zeros(SLOTS, VOCAB), np.arange(16, dtype=np.int32), PenaltyUpdates(
        np.full(ROWS, SLOTS, np.int32), np.where(np.arange(16) < 6, 1, SLOTS).astype(np.int32),
        np.where(np.arange(16) >= 10, 1, SLOTS).astype(np.int32)), True)  # slot 1: prompt 0-5, outputs 10-15
    slots = np.where(np.arange(ROWS) == 4, 1, SLOTS).astype(np.int32)
    penalty = lambda v: np.where(np.arange(ROWS) == 4, v, 0.0).astype(np.float32)  # noqa: E731
    full = arrays(0.0, token_bitmask=bitmask, constrained=constrained, bias_token_ids=ids, bias_values=values,
                  penalty_slots=slots, repetition_penalty=1.0 + penalty(0.8), frequency_penalty=penalty(0.3),
                  presence_penalty=penalty(0.6))
    for params in (full, arrays(0.0, token_bitmask=bitmask, constrained=constrained)):
        with_conds = np.asarray(_process_logits(logits, params, tables, True))
        without = np.asarray(_process_logits(logits, params, tables, False))
        np.testing.assert_array_equal(with_conds, without)
        plain = ~np.isin(np.arange(ROWS), [1, 2, 3, 4])
        np.testing.assert_array_equal(without[plain], np.asarray(logits)[plain])
    assert not np.array_equal(without, np.asarray(logits)), "the grammar-only batch masks rows 1 and 3"


def _penalised_oracle(logits, prompt, outputs, rep, freq, pres):
    """vLLM's penalties in float64 numpy for one row."""
    x = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=VOCAB)
    seen = (counts > 0) | np.isin(np.arange(VOCAB), prompt)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0)


@pytest.mark.parametrize("skip_untouched", [True, False])  # CPUs' conditional update, CUDA GPUs' plain one
def test_penalty_tables_count_inputs_and_penalties_match_an_oracle(skip_untouched):
    rng = np.random.default_rng(3)
    tables = PenaltyTables.zeros(SLOTS, VOCAB)
    none = np.full(16, SLOTS, np.int32)
    # Slot 2: a prompt [5, 9, 9] then generated tokens 3, 3, 11 fed as decode inputs; stale data first.
    stale = PenaltyUpdates(np.full(ROWS, SLOTS, np.int32), none, np.where(np.arange(16) < 4, 2, SLOTS))
    tables = update_tables(tables, np.full(16, 30, np.int32), stale, skip_untouched)
    reset = np.full(ROWS, SLOTS, np.int32)
    reset[0] = 2
    prompt_slots = none.copy()
    prompt_slots[:3] = 2
    ids = np.zeros(16, np.int32)
    ids[:3] = [5, 9, 9]
    tables = update_tables(tables, ids, PenaltyUpdates(reset, prompt_slots, none), skip_untouched)
    for token in (3, 3, 11):
        output_slots = none.copy()
        output_slots[0] = 2
        ids[0] = token
        tables = update_tables(tables, ids, PenaltyUpdates(np.full(ROWS, SLOTS, np.int32), none, output_slots),
                               skip_untouched)
    counts = np.asarray(tables.output_counts)
    assert counts[2, 3] == 2 and counts[2, 11] == 1 and counts[2].sum() == 3  # the stale 30s were cleared
    assert set(np.flatnonzero(np.asarray(tables.prompt_mask)[2])) == {5, 9}

    logits = (rng.standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
    slots = np.full(ROWS, SLOTS, np.int32)
    slots[4] = 2
    rep, freq, pres = np.ones(ROWS, np.float32), np.zeros(ROWS, np.float32), np.zeros(ROWS, np.float32)
    rep[4], freq[4], pres[4] = 1.7, 0.5, 1.5
    params = arrays(0.0, penalty_slots=slots, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    tokens, _ = sample_jit(logits, params, tables)
    expected = _penalised_oracle(logits[4], [5, 9, 9], [3, 3, 11], 1.7, 0.5, 1.5)
    assert np.asarray(tokens)[4] == expected.argmax()
    untouched = [r for r in range(ROWS) if r != 4]
    np.testing.assert_array_equal(np.asarray(tokens)[untouched], logits[untouched].argmax(-1))


@pytest.mark.parametrize("skip_untouched", [True, False])
def test_a_draft_rows_penalties_count_the_drafts_before_it_and_the_accepted_drafts_are_counted(skip_untouched):
    """A speculative decode's rows 2..5: one request (slot 1) at draft positions 0..3 feeding its last token
    then drafts 7, 7, 12. Row j's penalties count the slot's outputs and drafts 0..j - 1 (the float64
    oracle's outputs), rows without a slot none; once sampled, the drafts the verification accepts (each up
    to the first whose row before it sampled something else) are counted into the slot, and only those."""
    rng = np.random.default_rng(5)
    tables = PenaltyTables.zeros(SLOTS, VOCAB)
    none = np.full(16, SLOTS, np.int32)
    prompt_slots, output_slots, ids = none.copy(), none.copy(), np.zeros(16, np.int32)
    prompt_slots[:2], ids[:2] = 1, [7, 20]  # the prompt, then the outputs so far: 3 and the last token, 7
    output_slots[2:4], ids[2:4] = 1, [3, 7]
    tables = update_tables(tables, ids, PenaltyUpdates(np.full(ROWS, SLOTS, np.int32), prompt_slots, output_slots),
                           skip_untouched)
    drafts_fed = [7, 7, 12]
    drafts = np.full((ROWS, 3), VOCAB, np.int32)  # D = 3
    for position in range(1, 4):
        drafts[2 + position, :position] = drafts_fed[:position]
    slots = np.full(ROWS, SLOTS, np.int32)
    slots[2:6] = 1
    rep, freq, pres = np.ones(ROWS, np.float32), np.zeros(ROWS, np.float32), np.zeros(ROWS, np.float32)
    rep[2:6], freq[2:6], pres[2:6] = 1.5, 0.9, 0.4
    logits = (rng.standard_normal((ROWS, VOCAB)) * 0.3).astype(np.float32)
    logits[:, [3, 7, 12]] = [2.0, 7.0, 2.9]  # the counts decide between 7 and 12
    params = arrays(0.0, penalty_slots=slots, penalty_drafts=drafts, repetition_penalty=rep, frequency_penalty=freq,
                    presence_penalty=pres)
    tokens = np.asarray(sample_jit(logits, params, tables, on_cuda=not skip_untouched)[0])
    for position in range(4):
        expected = _penalised_oracle(logits[2 + position], [7, 20], [3, 7, *drafts_fed[:position]], 1.5, 0.9, 0.4)
        assert tokens[2 + position] == expected.argmax(), position
        without = _penalised_oracle(logits[2 + position], [7, 20], [3, 7], 1.5, 0.9, 0.4)
        assert (without.argmax() != expected.argmax()) == (position in (1, 2))  # the drafts decide rows 3, 4
    others = [0, 1, 6, 7]
    np.testing.assert_array_equal(tokens[others], logits[others].argmax(-1))

    count = jax.jit(count_accepted_drafts, static_argnames="skip_untouched")
    base = np.asarray(tables.output_counts)[1]
    for matching in range(4):  # the samples of rows 2..4 equal drafts 0..matching - 1, then one differs
        samples = tokens.copy()
        samples[2:5] = [*drafts_fed[:matching], *([40] * (3 - matching))]
        counted = np.asarray(count(tables, drafts, samples, slots, skip_untouched=skip_untouched).output_counts)
        expected = base + np.bincount(drafts_fed[:matching], minlength=VOCAB)
        np.testing.assert_array_equal(counted[1], expected)
        np.testing.assert_array_equal(np.delete(counted, 1, axis=0), np.delete(np.asarray(tables.output_counts), 1, 0))


def test_top_logprobs_are_the_raw_models_top_tokens():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    wants = np.zeros(ROWS, np.bool_)
    wants[3] = True
    out = _sample(logits, arrays(wants_top_logprobs=wants), PenaltyTables.zeros(SLOTS, VOCAB))
    reference = np.asarray(jax.nn.log_softmax(logits.astype(np.float64)))
    order = np.argsort(-reference[3])[:TOP]
    np.testing.assert_array_equal(np.asarray(out.top_token_ids)[3], order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs)[3], reference[3, order], atol=1e-5)


def test_logprobs_are_computed_for_the_rows_that_ask_and_change_no_token():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    temperature = np.where(np.arange(ROWS) % 2 == 0, 0.0, 1.0).astype(np.float32)  # greedy and sampled rows
    asks = np.arange(ROWS) % 3 == 0
    tables = PenaltyTables.zeros(SLOTS, VOCAB)
    nobody = _sample(logits, arrays(temperature, wants_logprobs=np.zeros(ROWS, np.bool_)), tables)
    some = _sample(logits, arrays(temperature, wants_logprobs=asks), tables)
    np.testing.assert_array_equal(nobody.tokens, some.tokens)  # the same draws whether logprobs are wanted
    expected = np.asarray(jax.nn.log_softmax(logits.astype(np.float64)))[np.arange(ROWS), np.asarray(some.tokens)]
    np.testing.assert_allclose(np.asarray(some.logprobs)[asks], expected[asks], atol=1e-5)
