"""The jnp attention paths (the reference and the CPU one) against a float64 numpy oracle, and the impl
choice."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve.device import local_facts, target_facts
from jaxserve.ops.attention import (
    MIN_PALLAS_COMPUTE_CAPABILITY,
    AttentionConfig,
    cuda_compute_capability,
    ragged_paged_attention,
    resolve_attention,
    resolve_impl,
)
from jaxserve.ops.paged_attention_cpu import num_work_items, ragged_paged_attention_cpu
from tests.ops.paged_cases import MIXES, make_case, oracle


def assert_matches_oracle(got: np.ndarray, case, scale: float) -> None:
    want = oracle(case, scale)
    num_real = case.num_real_tokens
    np.testing.assert_allclose(got[:num_real], want[:num_real], atol=2e-5, rtol=1e-5)
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2), (3, 1)])
def test_jnp_paths_match_oracle(impl, mix, num_q_heads, num_kv_heads):
    rng = np.random.default_rng(sorted(MIXES).index(mix))
    case = make_case(rng, *MIXES[mix], num_q_heads, num_kv_heads)
    got = np.asarray(ragged_paged_attention(*case.args, sm_scale=0.25, impl=impl))
    assert_matches_oracle(got, case, 0.25)


@pytest.mark.parametrize("query_block", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("pages_per_block", [1, 3, 8])
@pytest.mark.parametrize("mix", ["prefills", "chunk_after_cache", "mixed_with_empty", "long"])
def test_cpu_work_items_of_any_size_match_oracle(query_block, pages_per_block, mix):
    """Items that split requests mid-page, straddle K/V block edges, or hold a whole request; requests with
    no queries and padding requests (NaN pages outside what each request owns would show any overreach)."""
    case = make_case(np.random.default_rng(7), *MIXES[mix], 6, 2)
    got = np.asarray(jax.jit(lambda *a: ragged_paged_attention_cpu(
        *a, sm_scale=0.25, query_block=query_block, pages_per_block=pages_per_block))(*case.args))
    assert_matches_oracle(got, case, 0.25)


def test_cpu_decode_path_matches_oracle():
    """decode_only: one item per request (token r is request r's query), padding requests with kv_len 0."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [1] * 5, [1, 16, 17, 33, 47]
    case = make_case(rng, q_lens, kv_lens, 9, 3, pad_tokens=2, pad_reqs=2)
    got = np.asarray(ragged_paged_attention(*case.args, sm_scale=0.125, impl="cpu", decode_only=True))
    assert_matches_oracle(got, case, 0.125)


def test_work_item_count_covers_every_split():
    # 40 tokens in blocks of 16 from 3 requests: at most 3 whole blocks plus one partial per request.
    assert num_work_items(40, 3, 16) == 6
    assert num_work_items(8, 8, 1) == 8


def test_auto_fits_this_machine_and_bad_choices_are_rejected():
    capability = cuda_compute_capability()
    kernel_runs = capability is not None and capability >= MIN_PALLAS_COMPUTE_CAPABILITY
    assert resolve_impl("auto") == ("pallas" if kernel_runs else "cpu")
    assert resolve_impl("cpu") == "cpu" and resolve_impl("reference") == "reference"
    assert resolve_impl("interpret") == "interpret"
    with pytest.raises(ValueError, match="unknown attention impl"):
        resolve_impl("flash")
    if kernel_runs:
        assert resolve_impl("pallas") == "pallas"
    else:
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            resolve_impl("pallas")


@pytest.mark.parametrize(
    "platform,capability,want",
    [("gpu", "9.0", "pallas"), ("gpu", "8.0", "pallas"), ("gpu", "7.5", "reference"),
     ("gpu", "gfx942", "reference"), ("cpu", None, "cpu")],
)
def test_auto_picks_the_kernel_on_cuda_sm80_and_newer(platform, capability, want):
    device = local_facts(SimpleNamespace(platform=platform, compute_capability=capability, device_kind="x"))
    assert resolve_impl("auto", device) == want
    if want == "pallas":
        assert resolve_impl("pallas", device) == "pallas"
    else:
        with pytest.raises(ValueError, match=r"compute capability|no CUDA GPU"):
            resolve_impl("pallas", device)


@pytest.mark.parametrize("target,num_sms", [("h100", 132), ("a100", 108)])
def test_a_gpu_target_resolves_as_that_gpu_would_here_on_a_cpu(target, num_sms):
    """Compiling for a target picks what a real device of its kind picks, not what this CPU would."""
    attention = resolve_attention("auto", target_facts(target))
    assert attention == AttentionConfig(impl="pallas", num_sms=num_sms)
    assert resolve_attention("auto", local_facts(jax.devices("cpu")[0])).impl == "cpu"
