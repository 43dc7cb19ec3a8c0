"""Reference ragged paged attention against a float64 numpy oracle, and the impl choice."""

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
from tests.ops.paged_cases import MIXES, make_case, oracle


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2), (3, 1)])
def test_reference_matches_oracle(mix, num_q_heads, num_kv_heads):
    rng = np.random.default_rng(sorted(MIXES).index(mix))
    case = make_case(rng, *MIXES[mix], num_q_heads, num_kv_heads)
    scale = 0.25
    got = np.asarray(ragged_paged_attention(*case.args, sm_scale=scale, impl="reference"))
    want = oracle(case, scale)
    num_real = case.num_real_tokens
    np.testing.assert_allclose(got[:num_real], want[:num_real], atol=2e-5, rtol=1e-5)
    assert np.all(got[num_real:] == 0), "padding tokens must come back as zeros"
    assert np.all(np.isfinite(got))


def test_auto_fits_this_machine_and_bad_choices_are_rejected():
    capability = cuda_compute_capability()
    kernel_runs = capability is not None and capability >= MIN_PALLAS_COMPUTE_CAPABILITY
    assert resolve_impl("auto") == ("pallas" if kernel_runs else "reference")
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
     ("gpu", "gfx942", "reference"), ("cpu", None, "reference")],
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
    assert resolve_attention("auto", local_facts(jax.devices("cpu")[0])).impl == "reference"
