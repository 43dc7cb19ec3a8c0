"""DeepSeek-V2/V3 through the engine: the latent cache (one KV head of C + R dims, kept once, as the keys), the
engine's greedy tokens equal to transformers' own generation, and what is refused (LoRA)."""

import pytest
import torch

from tests.engine.helpers import make_engine, make_prompts, run_staggered


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_the_engine_s_greedy_tokens_are_transformers_generation(kind, tiny_model_dir, tiny_hf_model):
    """Prompts of several lengths in one engine, arriving apart, so decodes and prefill chunks share steps
    over the latent cache; each one's tokens equal transformers' greedy generation of it alone."""
    engine = make_engine(tiny_model_dir(kind), warmup=False, max_num_batched_tokens=16)
    cfg = engine.runner.model.cfg
    k_pages, v_pages = engine.runner.kv_caches[0]
    assert (k_pages.shape[0], k_pages.shape[-1]) == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # [K, pages, page, H]
    assert v_pages is None  # the values are read from the keys' pages: one array a layer
    prompts, max_tokens = make_prompts(4), [9, 6, 8, 5]
    prompts = [[token % cfg.vocab_size for token in prompt] for prompt in prompts]
    got = run_staggered(engine, prompts, max_tokens, arrivals=[0, 0, 2, 3])
    hf = tiny_hf_model(kind)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens[i], do_sample=False,
                                   min_new_tokens=max_tokens[i])[0, len(prompt):].tolist()
        assert got[i] == expected, (i, got[i], expected)


def test_what_the_latent_attention_does_not_serve_is_refused(tiny_model_dir):
    model_dir = str(tiny_model_dir("deepseek-v3"))
    with pytest.raises(ValueError, match="--enable-lora: not supported for DeepseekForCausalLM"):
        make_engine(model_dir, warmup=False, enable_lora=True)
