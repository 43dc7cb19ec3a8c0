"""Predicted step times on a GPU target for any bucket: the roofline of `jaxserve compile`.

`jaxserve compile` reports, per compiled bucket, the same analytic roofline (jaxserve/roofline.py) at a
fixed context length; the bucket benchmark needs it for every step of a trace, with the keys that step
really attends, and for ladders nobody has compiled yet (`--suggest`), so it evaluates the roofline
directly from the model's shapes and the target's peak figures. Compiling proves a bucket builds for the
target and gives its memory; it does not change the predicted time. These are predictions: a lower bound
that ignores launch overheads, imperfect overlap and the sampler.
"""

from collections.abc import Callable

from jaxserve.runner.buckets import Bucket


def roofline_step_seconds(model: str | None, target: str, dtype: str = "auto") -> Callable[[Bucket, int], float]:
    """(bucket, keys attended by its requests) -> predicted seconds on `target` for `model`'s shapes."""
    import jax.numpy as jnp

    from jaxserve.compile_ladder import load_model_config
    from jaxserve.device import target_facts
    from jaxserve.models.loader import build_abstract_model, resolve_dtype
    from jaxserve.ops.attention import resolve_attention
    from jaxserve.roofline import model_shape, step_cost

    _, hf_config = load_model_config(model)
    facts = target_facts(target)
    jax_dtype = resolve_dtype(dtype, facts.platform)
    abstract = build_abstract_model(hf_config, jax_dtype, resolve_attention("auto", facts))
    itemsize = jnp.dtype(jax_dtype).itemsize
    shape = model_shape(abstract.num_params, abstract.cfg)
    peak = facts.peak_flops_for(jnp.dtype(jax_dtype).name)

    def seconds(bucket: Bucket, num_keys: int) -> float:
        context = num_keys / bucket.num_reqs  # padded rows attend nothing: spread the real keys over R
        return step_cost(shape, bucket.num_tokens, bucket.num_reqs, context, itemsize, peak,
                         facts.memory_bandwidth).seconds

    return seconds
