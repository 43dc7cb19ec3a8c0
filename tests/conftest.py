"""Shared fixtures: the bundled SmolLM2 GGUF, tiny random-weight HF models saved to disk, engines, a server."""

import atexit
import ctypes
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaxserve.config import EngineConfig
from jaxserve.platform import nvidia_gpu_visible, prepare_jax_platform

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
# XLA's persistent cache from the first compile on, in the workers and every process they start (jax reads
# these at import): the one `jaxserve serve` uses by default, so identical programs (the engines of the
# tests' ladder on one tiny model, module after module) compile once per run and load after. Before, a
# worker turned it on only when a test built an engine with the default cache, partway through the run.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(EngineConfig.compilation_cache_dir).expanduser()))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # as jaxserve's engines set it
# The backend that is there (servers and subprocesses the tests start inherit these settings): the CPU
# where no NVIDIA GPU is visible, else the GPU; JAX_PLATFORMS=cpu runs the suite on the CPU anyway.
if not nvidia_gpu_visible():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
prepare_jax_platform()  # as the CLI does: the CUDA plugin of the test extra stays quiet without a GPU
if os.environ.get("JAX_PLATFORMS") != "cpu":
    # Workers, engine cores and test servers share one GPU: no process takes JAX's default 75% up front,
    # and each pools at most a tenth of it (`make test-gpu`'s six workers and the servers and engine-core
    # processes they start, which inherit this). A fifth each ran the GPU out of memory under six workers on
    # an H200; engines that size their KV cache by budget take less than the pool
    # (`tests.helpers.TEST_GPU_MEMORY_UTILIZATION`).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1")
    # The tests compare float32 paths with float32 and float64 references at a CPU's tolerances; a GPU
    # multiplies float32 in TF32 by default (about 1e-3 relative). bfloat16 is unaffected.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    # The tests check results, not speed: XLA:GPU's GEMM autotuning (compiling and timing candidate tilings
    # on the device) would take most of every compile, and the suite compiles hundreds of steps.
    if "autotune" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
# Test modules whose test-extra dependencies are missing (a GPU image has pytest but not these) are left
# out of collection rather than failing it: `make test-gpu` collects every file to pick the `gpu` ones.
_NEEDS = {"api/test_fuzz.py": ("schemathesis",), "api/test_openapi.py": ("schemathesis", "jsonschema_rs")}
collect_ignore = [path for path, modules in _NEEDS.items()
                  if any(importlib.util.find_spec(module) is None for module in modules)]
# Caches jaxserve writes (a GGUF's converted config and tokenizer) go to a fresh directory per session,
# so every run also exercises the conversion; servers and workers the tests start inherit it. The process
# that made it removes it at exit (each run's held about 600 MB).
if "JAXSERVE_CACHE_DIR" not in os.environ:
    os.environ["JAXSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module() -> Iterator[None]:
    """A worker runs many modules: what one module compiled (jit caches) and allocated goes before the next
    starts, back to the OS (glibc keeps freed memory in its arenas). Without it each worker grew to 6-7 GB
    over a run, and two of them beside the test servers ran a 24 GB machine out of memory."""
    yield
    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    if trim := getattr(ctypes.CDLL(None), "malloc_trim", None):  # glibc
        trim(0)


def _cpu_only_reason(item: pytest.Item) -> str | None:
    if (marker := item.get_closest_marker("cpu_only")) is not None:
        return marker.args[0] if marker.args else "a CPU's behaviour"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Off the CPU, the tests marked `cpu_only` (native CPU kernels, XLA:CPU's code, the CPU's KV budget
    and allocator, CPU devices) skip, each with its reason."""
    reasons = {item: reason for item in items if (reason := _cpu_only_reason(item))}
    if not reasons:
        return
    import jax

    if (backend := jax.default_backend()) != "cpu":
        for item, reason in reasons.items():
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason}; the backend here is {backend}"))


def pytest_configure(config: pytest.Config) -> None:
    """JAXSERVE_TEST_COMPILE_LOG=FILE: each XLA compile of the run, test by test (tests/compile_log.py)."""
    if path := os.environ.get("JAXSERVE_TEST_COMPILE_LOG"):
        from tests.compile_log import CompileLog

        config.pluginmanager.register(CompileLog(path), "jaxserve-compile-log")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With JAXSERVE_TEST_FAILURES set to a file, each failure's report is appended there as it happens (by
    the controlling process under xdist): a run stopped at its time limit, as the prepared GPU check's is,
    keeps the reasons that pytest's summary at the end would have given."""
    if not report.failed or not (path := os.environ.get("JAXSERVE_TEST_FAILURES")):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes what its workers report
        return
    with open(path, "a") as log:
        log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(scope="module")
def tp_worker() -> Iterator[object]:
    """A process with four CPU devices that runs a module's tensor-parallel checks in turn
    (tests/parallel_helpers.py)."""
    from tests.parallel_helpers import TPWorker

    worker = TPWorker()
    yield worker
    worker.close()


TINY_VOCAB = 49152  # the SmolLM2 tokenizer, saved beside each tiny model


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from jaxserve.models.loader import bundled_model_path

    try:
        return bundled_model_path()
    except RuntimeError as e:  # a GPU machine that was sent the checkout without the 98 MB model
        pytest.skip(f"the bundled model is not installed here ({e})")


@pytest.fixture(scope="session")
def smollm2_tokenizer(request: pytest.FixtureRequest):
    from jaxserve.models.gguf_cache import converted_dir
    from jaxserve.models.tokenizer import load_tokenizer

    if directory := os.environ.get("JAXSERVE_TEST_TOKENIZER"):  # SmolLM2's tokenizer saved apart (a GPU
        return load_tokenizer(Path(directory))  # machine that was sent the checkout without the model)
    return load_tokenizer(converted_dir(request.getfixturevalue("smollm2_gguf")))


# Kinds whose norms sit apart from Llama's (OLMo 2's after each block) or scale with multipliers (Granite):
# their norms' weights random, so that a norm in the wrong place shows.
RANDOM_NORM_KINDS = ("olmo2", "olmo3", "granite", "olmoe", "glm4")


def _tiny_hf_model(kind: str, layers_added: int = 0):
    """The random model of `kind`; `layers_added`: with that many more layers (`tests/mtp.py`)."""
    model = _build_tiny_hf_model(kind)
    import torch

    if layers_added:
        config = type(model.config)(**{**model.config.to_dict(),
                                       "num_hidden_layers": model.config.num_hidden_layers + layers_added})
        torch.manual_seed(1)
        model = type(model)(config)

    with torch.no_grad():  # HF zero-initialises biases; random ones make parity tests see them
        for name, tensor in model.named_parameters():
            if name.endswith((".bias", "_bias")):  # GPT-OSS's experts' too (gate_up_proj_bias...)
                tensor.normal_(std=0.3)
            if name.endswith(".sinks"):  # GPT-OSS's attention sinks: some heads' far above the scores
                tensor.normal_(std=2.0)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3's per-head norms start at ones
                tensor.normal_(mean=1.0, std=0.3)
            if kind.startswith("gemma") and name.endswith("norm.weight"):  # Gemma's (1 + w) norms, at zeros
                tensor.normal_(std=0.3)
            elif kind in RANDOM_NORM_KINDS and name.endswith("norm.weight"):  # where a norm's place is the test
                tensor.normal_(mean=1.0, std=0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, zeros at first: where it moves the choice
                buffer.normal_(std=0.3)
    return model


def _build_tiny_hf_model(kind: str):
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=TINY_VOCAB, initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
        return transformers.GPT2LMHeadModel(config)
    llama_like = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        rms_norm_eps=1e-5, **common,
    )
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like))
    if kind == "llama-128":  # every projection a whole number of 128 x 128 FP8 blocks (DeepSeek-V3's), N of 64s
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**llama_like, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like))
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**llama_like))
    # Windows shorter than the parity tests' 23-token prompts, so they mask.
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**llama_like, sliding_window=7))
    if kind == "qwen2-window":  # layer 0 full, layer 1 windowed (max_window_layers)
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **llama_like, use_sliding_window=True, sliding_window=5, max_window_layers=1))
    if kind == "phi3":  # LongRoPE with an original context of 16, partial rotary
        rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                    original_max_position_embeddings=16,
                    short_factor=[1.0 + 0.1 * i for i in range(6)], long_factor=[1.0 + 0.5 * i for i in range(6)])
        config = transformers.Phi3Config(**{**llama_like, "num_hidden_layers": 3}, rope_parameters=rope,
                                         original_max_position_embeddings=16, sliding_window=9, pad_token_id=0)
        return transformers.Phi3ForCausalLM(config)
    if kind == "yarn":
        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like, rope_parameters=rope))
    if kind == "mixtral":  # 4 experts, 2 per token, in every layer
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **llama_like, num_local_experts=4, num_experts_per_tok=2))
    if kind == "qwen3-moe":  # 6 experts, 2 per token, weights not renormalised; layer 1 dense
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **{**llama_like, "num_hidden_layers": 3}, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1))
    if kind == "qwen2-moe":  # 6 experts, 2 per token, and a gated shared expert; layer 1 dense
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **{**llama_like, "num_hidden_layers": 3}, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1))
    if kind == "granite":  # multipliers far from 1, and biases on q, k, v and o
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **llama_like, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.5,
            logits_scaling=2.5, attention_bias=True))
    if kind == "granite-moe":  # Granite's multipliers; 4 experts, 2 a token, the softmax over the two
        return transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
            **{**llama_like, "intermediate_size": 48}, embedding_multiplier=3.0, residual_multiplier=0.4,
            attention_multiplier=0.5, logits_scaling=2.5, num_local_experts=4, num_experts_per_tok=2))
    if kind == "granite-moe-shared":  # and a shared expert, ungated
        return transformers.GraniteMoeSharedForCausalLM(transformers.GraniteMoeSharedConfig(
            **{**llama_like, "intermediate_size": 48}, embedding_multiplier=3.0, residual_multiplier=0.4,
            attention_multiplier=0.5, logits_scaling=2.5, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=40))
    if kind == "olmoe":  # OLMo 2's norms over all heads, before the blocks; 6 experts, 2 a token; q, k, v clipped
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **{**llama_like, "intermediate_size": 48}, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
            clip_qkv=1.5))
    if kind == "glm4":  # RoPE on adjacent pairs over half of each head; norms before and after each block
        return transformers.Glm4ForCausalLM(transformers.Glm4Config(
            **llama_like, attention_bias=True, pad_token_id=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)))
    if kind == "glm4-moe":  # GLM-4.5: partial rotary, q/k/v biases, per-head q/k norms (its option); a dense layer,
        # then DeepSeek-V3's routing (sigmoid scores, a correction bias, 2 of 4 groups, renormalised and scaled)
        # over 8 experts, and a shared expert
        return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
            **{**llama_like, "num_hidden_layers": 3}, attention_bias=True, use_qk_norm=True, pad_token_id=0,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
            first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)))
    if kind.startswith("deepseek"):  # latent attention; a dense layer, then 8 experts and a shared one
        mla = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, moe_intermediate_size=24,
                   n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                   pad_token_id=0, **{**llama_like, "num_key_value_heads": 4, "head_dim": 8, "num_hidden_layers": 3})
        if kind == "deepseek-v2":  # V2-Lite's: one query projection, softmax and top k; YaRN with its mscale
            rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                        mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1)
            return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
                **mla, q_lora_rank=None, topk_method="greedy", norm_topk_prob=False, rope_parameters=rope))
        # V3's: queries through a latent; sigmoid scores with a correction bias, 2 of 4 groups, renormalised
        # and scaled
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **mla, q_lora_rank=20, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5))
    if kind == "smollm3":  # layer 1 without RoPE
        return transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
            **{**llama_like, "num_hidden_layers": 3}, no_rope_layers=[1, 0, 1], pad_token_id=0))
    if kind == "gpt-oss":  # sliding, full, sliding; 4 experts, 2 a token; a clamp the tiny model's values reach
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **{**llama_like, "num_hidden_layers": 3, "intermediate_size": 48}, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    if kind == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**llama_like))
    if kind == "olmo3":  # OLMo 2's norms; windowed, full, windowed layers, YaRN (with its own attention factor,
        rope = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),  # as OLMo 3's) on the full
                "full_attention": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,  # one only
                                       original_max_position_embeddings=128, attention_factor=1.3)}
        return transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **{**llama_like, "num_hidden_layers": 3}, sliding_window=5, rope_parameters=rope,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    if kind == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(
            **{**llama_like, "head_dim": 32, "tie_word_embeddings": True}, pad_token_id=0))
    gemma_like = dict(llama_like, head_dim=32, query_pre_attn_scalar=24, sliding_window=6, num_hidden_layers=3,
                      tie_word_embeddings=True, pad_token_id=0)
    if kind == "gemma2":  # local, global, local; caps low enough to bend the tiny model's scores and logits
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **gemma_like, attn_logit_softcapping=3.0, final_logit_softcapping=5.0))
    if kind == "gemma3":  # local, global, local, each kind with its own RoPE base
        rope = {"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=10000.0)}
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **gemma_like, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=rope))
    raise ValueError(kind)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Callable[[str], Path]:
    """kind -> a local HF directory (config.json, model.safetensors, tokenizer) of a random model."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            directory = tmp_path_factory.mktemp(f"tiny-{kind}")
            model = _tiny_hf_model(kind).eval()
            model.save_pretrained(directory, safe_serialization=True)
            smollm2_tokenizer.save_pretrained(directory)
            made[kind] = directory
        return made[kind]

    return make


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory, smollm2_tokenizer):
    """(kind, num_labels, problem_type) -> (a local HF directory of a random classifier, its transformers model).
    A one-class classifier (a cross-encoder) gets a tokenizer that encodes a pair with a separator between its
    texts, as BERT's and XLM-R's do (`classifiers.with_pair_separator`)."""
    from tests.classifiers import classifier, with_pair_separator

    made = {}

    def make(kind: str, num_labels: int = 3, problem_type: str | None = None):
        key = kind, num_labels, problem_type
        if key not in made:
            directory = tmp_path_factory.mktemp(f"classifier-{kind}-{num_labels}")
            model = classifier(kind, num_labels, problem_type)
            model.save_pretrained(directory, safe_serialization=True)
            tokenizer = with_pair_separator(smollm2_tokenizer) if num_labels == 1 else smollm2_tokenizer
            tokenizer.save_pretrained(directory)
            made[key] = directory, model
        return made[key]

    return make


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory):
    """(kind, num_labels, num_heads) -> (a local HF directory of a random encoder with a WordPiece tokenizer, its
    transformers model): `tests/encoders.py`."""
    from tests.encoders import encoder, wordpiece_tokenizer

    made = {}

    def make(kind: str, num_labels: int | None = None, num_heads: int = 4):
        key = kind, num_labels, num_heads
        if key not in made:
            directory = tmp_path_factory.mktemp(f"encoder-{kind}-{num_labels}-{num_heads}")
            model = encoder(kind, num_labels, num_heads)
            model.save_pretrained(directory, safe_serialization=True)
            wordpiece_tokenizer().save_pretrained(directory)
            made[key] = directory, model
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir) -> Callable[[str], object]:
    """kind -> the transformers PyTorch model saved in tiny_model_dir(kind), in float32, with transformers'
    plain (eager) attention: its SDPA and flash paths drop Gemma 2's attn_logit_softcapping, and versions
    that let Gemma 2 take SDPA pick it by default (5.17 does; 5.24 keeps it eager)."""
    import torch
    import transformers

    def load(kind: str):
        return transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir(kind), dtype=torch.float32, attn_implementation="eager"
        ).eval()

    return load


@pytest.fixture(autouse=True)
def _own_traces_under_monkeypatch(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that patches code gets traces of its own: runners made alike share their step functions and
    what JAX holds for them (`runner.step_fn._shared`), so an engine made under a patch of the code a step
    traces (a kernel counted, a platform faked) would otherwise run an earlier engine's trace, and leave its
    own to later tests. JAX's in-memory caches go before and after such a test."""
    patches = "monkeypatch" in request.fixturenames and "jax" in sys.modules
    if patches:
        sys.modules["jax"].clear_caches()
    yield
    if patches:
        sys.modules["jax"].clear_caches()


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(llama_dir):
    """An engine on the tiny random Llama, one per test module."""
    from tests.engine.helpers import make_engine

    return make_engine(llama_dir)


@pytest.fixture(scope="session")
def compile_cache() -> Path:
    """XLA's persistent cache for the servers and subprocesses the tests start: the one `jaxserve serve` and
    the tests' in-process engines use by default, so a server whose steps another server, worker or earlier
    run compiled (the same model, ladder and flags) loads them (JAX locks its writes)."""
    from jaxserve.config import EngineConfig

    return Path(EngineConfig.compilation_cache_dir).expanduser()


@pytest.fixture(scope="session")
def server(tmp_path_factory, compile_cache) -> Iterator:
    """A real `jaxserve serve` on the bundled SmolLM2 (tests/api/helpers.py). It runs its engine core in its
    own process (`--engine-process`), so the HTTP suites cover that split; the in-thread core serves the
    TestClient apps and the fuzz and hardening servers."""
    from tests.api.helpers import API_KEY, start_server, stop_server

    server = start_server(tmp_path_factory.mktemp("server"), compile_cache, "--api-key", API_KEY,
                          "--engine-process")
    yield server
    stop_server(server)
