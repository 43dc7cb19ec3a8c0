"""`jaxserve compile`, the command around jaxserve/compile_ladder.py: chooses the platform, compiles, prints.

For a GPU target the process's jax platform must be the CPU before jax starts a backend (the CUDA plugin
must not look for a driver), so this module imports compile_ladder, which imports jax, only after that.
"""

from pathlib import Path

from jaxserve.config import CompileConfig


def main(config: CompileConfig) -> None:
    """Compiles every bucket of `config.preset`'s ladder, prints the report and writes it to `config.json`."""
    target = None if config.target == "local" else config.target
    if target is not None:
        from jaxserve.device import use_cpu_platform

        use_cpu_platform()
        import jax

        # A deviceless executable cannot be loaded back (no GPU client to load it into): jax's persistent cache,
        # where JAX_COMPILATION_CACHE_DIR turns it on, would only take entries that warn when read.
        jax.config.update("jax_enable_compilation_cache", False)
    from jaxserve.compile_ladder import compile_ladder, format_report
    from jaxserve.models.layers import LoraShape

    report = compile_ladder(
        config.model,
        target=target,
        preset=config.preset,
        dtype=config.dtype,
        attention_impl=config.attention_impl,
        max_model_len=config.max_model_len,
        context_len=config.context_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_dtype=config.kv_cache_dtype,
        num_kv_pages=config.num_kv_pages,
        jobs=config.jobs,
        xla_cost=config.xla_cost,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_expert_parallel=config.enable_expert_parallel,
        quantization=config.quantization,
        variants=config.variants,
        lora=LoraShape(config.max_loras, config.max_lora_rank) if config.max_loras else None,
        revision=config.revision,
        download_dir=config.download_dir,
        hf_overrides=config.hf_overrides,
        enforce_eager=config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        speculative_config=config.speculative_config,
    )
    print(format_report(report))
    if config.json:
        Path(config.json).write_text(report.to_json())
        print(f"wrote {config.json}")
