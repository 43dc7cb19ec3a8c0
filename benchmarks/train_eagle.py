"""Trains an EAGLE drafter for the bundled SmolLM2-135M-Instruct on this CPU, then measures what it drafts.

1. Chat prompts from templates and topics; the held-out topics are none of the training ones.
2. The target's greedy answers to the training prompts (jaxserve's engine).
3. The target's final hidden states (its features) and greedy next tokens over each prompt and answer,
   from the model's own forward (`models/llama.py`, through its paged attention over one sequence).
4. The drafter, `models/eagle.py`'s computation written densely (causal attention over the sequence), trained
   with optax on EAGLE's two losses: cross-entropy to the target's greedy token two positions on, and smooth
   L1 to the target's next feature, with uniform noise on the features it reads (the EAGLE authors'). Its
   layer starts as the target's last layer and `fc` as the feature passed through. It is saved as an EAGLE
   checkpoint under the EAGLE authors' names (config.json, model.safetensors).
5. The held-out prompts served greedily with `--speculative-config '{"method": "eagle", ...}'`, every draft run:
   the drafts accepted, tokens a verification step gives, and seconds, beside plain decoding of the same
   prompts (one engine, the proposer off and on, alternating; `benchmarks/draft_rounds.py`'s switch).

    python benchmarks/train_eagle.py --out /tmp/eagle-smollm2          # ~15 minutes on 2 cores
    python benchmarks/train_eagle.py --out /tmp/eagle-smollm2 --skip-training   # step 5 on a saved drafter
"""

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file

from benchmarks.draft_rounds import drafting
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.layers import AttentionMetadata
from jaxserve.models.loader import LoadedModel, bundled_model_path, load_model
from jaxserve.ops.attention import kv_cache_shape
from jaxserve.sampling_params import SamplingParams

TEMPLATES = ("Write a short paragraph about {}.", "Explain {} to a ten-year-old.", "What are three facts about {}?",
             "Give me some practical tips about {}.", "Describe the history of {} briefly.")
TOPICS = ("the ocean", "volcanoes", "honey bees", "the moon", "bread baking", "chess", "rain forests", "trains",
          "the violin", "photosynthesis", "ancient Rome", "recycling", "coffee", "deserts", "penguins", "bicycles",
          "the human heart", "electricity", "gardening", "the pyramids", "solar panels", "sleep", "mountains",
          "airplanes", "friendship", "the piano", "rivers", "dinosaurs", "the internet", "tea", "snow", "lighthouses",
          "the printing press", "butterflies", "olive oil", "marathons", "glaciers", "libraries", "clocks",
          "whales", "soap", "bridges", "maps", "the compass", "mushrooms", "kites", "cheese", "the alphabet",
          "wind turbines", "owls", "the Olympic Games", "paper", "rainbows", "elephants", "jazz", "telescopes",
          "vaccines", "forests", "coral reefs", "the bicycle wheel", "ice cream", "castles", "submarines", "ants")
HELD_OUT = ("earthquakes", "tigers", "the guitar", "windmills", "chocolate", "the Great Wall of China", "comets",
            "sailing boats", "the brain", "origami", "rice", "hot air balloons", "bamboo", "museums", "thunder",
            "dolphins")
PAGE = 16


def conversations(topics: tuple[str, ...], templates: tuple[str, ...]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": template.format(topic)}] for topic in topics for template in templates]


def prompt_ids(tokenizer, conversation: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def greedy_answers(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy answer."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    answers: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                answers[int(output.request_id)] = list(output.outputs[0].token_ids)
    return [prompts[i] + answers[i] for i in range(len(prompts))]


def target_states(target: LoadedModel, sequences: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """The target's final hidden states f32[N, length, D] and greedy next tokens i32[N, length] over each
    sequence (padded to `length`), from its own forward over one sequence's pages at a time."""
    cfg = target.cfg
    num_pages = length // PAGE
    shape = kv_cache_shape(num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim)
    graphdef, state = target.graphdef, target.state

    @jax.jit
    def forward(state, ids, num_tokens):  # i32[length], the sequence's length
        model = nnx.merge(graphdef, state)
        caches = [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)) for _ in range(cfg.num_layers)]
        positions = jnp.arange(length, dtype=jnp.int32)
        md = AttentionMetadata(slot_mapping=jnp.where(positions < num_tokens, positions, num_pages * PAGE),
                               kv_lens=num_tokens[None], page_table=jnp.arange(num_pages, dtype=jnp.int32)[None],
                               cu_q_lens=jnp.stack([0, num_tokens]).astype(jnp.int32))
        hidden, _ = model(ids, positions, caches, md)
        return hidden, jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)

    features = np.zeros((len(sequences), length, cfg.hidden_size), np.float32)
    labels = np.zeros((len(sequences), length), np.int32)
    for index, sequence in enumerate(sequences):
        ids = np.zeros(length, np.int32)
        ids[: len(sequence)] = sequence
        hidden, greedy = forward(state, jnp.asarray(ids), jnp.int32(len(sequence)))
        features[index], labels[index] = np.asarray(hidden), np.asarray(greedy)
    return features, labels


def hf_layer(target: LoadedModel, layer: int) -> dict[str, np.ndarray]:
    """The target's layer `layer` as HF names and layouts ([out, in])."""
    weights = nnx.to_pure_dict(target.state)["layers"][layer]
    attention, mlp = weights["self_attn"], weights["mlp"]
    d = target.cfg.hidden_size
    return {
        "self_attn.q_proj.weight": np.asarray(attention["q_proj"]).reshape(d, -1).T,
        "self_attn.k_proj.weight": np.asarray(attention["k_proj"]).reshape(d, -1).T,
        "self_attn.v_proj.weight": np.asarray(attention["v_proj"]).reshape(d, -1).T,
        "self_attn.o_proj.weight": np.asarray(attention["o_proj"]).reshape(-1, d).T,
        "mlp.gate_proj.weight": np.asarray(mlp["gate_proj"]).T,
        "mlp.up_proj.weight": np.asarray(mlp["up_proj"]).T,
        "mlp.down_proj.weight": np.asarray(mlp["down_proj"]).T,
        "post_attention_layernorm.weight": np.asarray(weights["post_attention_layernorm"]["scale"]),
    }


def rope(x: jax.Array, inv_freq: tuple[float, ...]) -> jax.Array:  # [B, L, heads, H]: rotate-half, positions 0..
    half = x.shape[-1] // 2
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)  # [L, H/2]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def drafter_forward(params: dict, embeddings: jax.Array, tokens: jax.Array, features: jax.Array, cfg) -> jax.Array:
    """`models/eagle.py`'s drafter over whole sequences: tokens i32[B, L] (each position's next token),
    features f32[B, L, D] -> its outputs f32[B, L, D]."""
    x = jnp.concatenate([embeddings[tokens], features], axis=-1) @ params["fc.weight"].T + params["fc.bias"]
    b, length, _ = x.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = rope((x @ params["layers.0.self_attn.q_proj.weight"].T).reshape(b, length, n, h), cfg.rope.inv_freq)
    key = rope((x @ params["layers.0.self_attn.k_proj.weight"].T).reshape(b, length, k, h), cfg.rope.inv_freq)
    value = (x @ params["layers.0.self_attn.v_proj.weight"].T).reshape(b, length, k, h)
    q = q.reshape(b, length, k, n // k, h)
    scores = jnp.einsum("blkgh,bmkh->bkglm", q, key) / h**0.5
    scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, -jnp.inf)
    attended = jnp.einsum("bkglm,bmkh->blkgh", jax.nn.softmax(scores, axis=-1), value).reshape(b, length, n * h)
    x = x + attended @ params["layers.0.self_attn.o_proj.weight"].T
    normed = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    normed = normed * params["layers.0.post_attention_layernorm.weight"]
    gated = jax.nn.silu(normed @ params["layers.0.mlp.gate_proj.weight"].T) * (
        normed @ params["layers.0.mlp.up_proj.weight"].T)
    return x + gated @ params["layers.0.mlp.down_proj.weight"].T


def train(params: dict, embeddings: jax.Array, head: jax.Array, sequences: np.ndarray, features: np.ndarray,
          labels: np.ndarray, lengths: np.ndarray, cfg, epochs: int, batch: int, lr: float, seed: int,
          ce_weight: float = 0.1) -> dict:
    """EAGLE's losses over each sequence's drafter positions j (token j + 1, feature j): cross-entropy to the
    target's greedy token after position j + 1 (weight `ce_weight`, the authors' 0.1), and smooth L1 (weight 1)
    to the feature at j + 1."""
    steps = epochs * (len(sequences) // batch)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 20, 1), steps), weight_decay=0.0)
    state = optimizer.init(params)

    def loss_fn(params, tokens, feats, targets, next_feats, mask, noise):
        out = drafter_forward(params, embeddings, tokens, feats + noise, cfg)
        logits = out @ head.T
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        regression = optax.huber_loss(out, next_feats, delta=1.0).mean(-1)
        total = ((ce_weight * ce + regression) * mask).sum() / mask.sum()
        accuracy = ((jnp.argmax(logits, -1) == targets) * mask).sum() / mask.sum()
        return total, accuracy

    @jax.jit
    def update(params, state, tokens, feats, targets, next_feats, mask, key):
        noise = jax.random.uniform(key, feats.shape, minval=-0.1, maxval=0.1)  # relative to the features' scale
        noise = noise * jnp.sqrt((feats * feats).mean(-1, keepdims=True))
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, feats, targets,
                                                                            next_feats, mask, noise)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, accuracy

    rng, key = np.random.default_rng(seed), jax.random.key(seed)
    length = sequences.shape[1]
    positions = np.arange(length - 2)
    for epoch in range(epochs):
        order, start, losses, accuracies = rng.permutation(len(sequences)), time.perf_counter(), [], []
        for first in range(0, len(order) - batch + 1, batch):
            chosen = order[first: first + batch]
            mask = (positions[None] + 2 < lengths[chosen, None]).astype(np.float32)  # j + 2 within the sequence
            key, sub = jax.random.split(key)
            params, state, loss, accuracy = update(
                params, state, sequences[chosen, 1:-1], features[chosen, :-2], labels[chosen, 1:-1],
                features[chosen, 1:-1], mask, sub)
            losses.append(float(loss))
            accuracies.append(float(accuracy))
        print(json.dumps({"epoch": epoch, "loss": round(float(np.mean(losses)), 4),
                          "first_draft_accuracy": round(float(np.mean(accuracies)), 4),
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return params


def save(params: dict, hf_config: dict, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**hf_config, "num_hidden_layers": 1,
                                                       "architectures": ["LlamaForCausalLM"]}, indent=1))
    save_file({name: np.asarray(value, np.float32) for name, value in params.items()},
              str(directory / "model.safetensors"))


def evaluate(drafter: Path, prompts: list[list[int]], max_tokens: int, k: int, rounds: int,
             streams_list: tuple[int, ...]) -> list[dict]:
    """The prompts `streams` at a time (each of `streams_list`), with the proposer off and with every draft run;
    answers end at the end of turn (or `max_tokens`)."""
    options = {"quantization": "none", "dtype": "float32", "warmup_mode": "full", "max_num_seqs": 32,
               "speculative_config": {"method": "eagle", "model": str(drafter), "num_speculative_tokens": k}}
    engine = LLMEngine(EngineConfig.from_preset("cpu", model=str(bundled_model_path()), **options))
    speculation = engine.scheduler.speculation
    results = []
    for streams in streams_list:
        for index in range(rounds):
            for on in (False, True):
                drafted, accepted = speculation.num_draft_tokens, speculation.num_accepted_tokens
                with drafting(engine, on):
                    start, generated, steps = time.perf_counter(), 0, 0
                    for first in range(0, len(prompts), streams):
                        lengths, taken = greedy_answers_counted(engine, prompts[first: first + streams], max_tokens)
                        generated, steps = generated + sum(lengths), steps + taken
                seconds = time.perf_counter() - start
                result = {"streams": streams, "round": index, "drafts": on, "output_tokens": generated,
                          "seconds": round(seconds, 2), "tokens_per_second": round(generated / seconds, 1),
                          "engine_steps": steps}
                if on:
                    result["acceptance"] = round((speculation.num_accepted_tokens - accepted)
                                                 / max(speculation.num_draft_tokens - drafted, 1), 3)
                print(json.dumps(result), flush=True)
                results.append(result)
    return results


def greedy_answers_counted(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[int], int]:
    """Greedy answers to `prompts` submitted at once: (their lengths, the engine steps they took)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"eval-{time.perf_counter_ns()}-{index}", prompt, params)
    lengths, steps = [], 0
    while engine.has_unfinished_requests():
        steps += 1
        lengths += [len(output.outputs[0].token_ids) for output in engine.step() if output.finished]
    return lengths, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the drafter's directory")
    parser.add_argument("--max-tokens", type=int, default=128, help="the training answers' length at most")
    parser.add_argument("--length", type=int, default=224, help="sequences padded (and cut) to this")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ce-weight", type=float, default=0.1, help="the cross-entropy's weight (EAGLE's 0.1)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--eval-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eval-on", choices=("held-out", "train"), default="held-out",
                        help="the held-out topics' prompts, or as many of the training ones")
    parser.add_argument("--eval-streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--data", default=None, help="the answers and states, saved or to save (default: in --out)")
    args = parser.parse_args()
    out = Path(args.out)
    bundled = str(bundled_model_path())
    target = load_model(bundled, "float32", quantization="none")
    tokenizer = target.tokenizer
    data = Path(args.data) if args.data else out / "data.npz"
    if not args.skip_training and data.exists():  # the answers and states of an earlier run
        with np.load(data) as saved:
            tokens, features, labels, lengths = (saved[name] for name in ("tokens", "features", "labels", "lengths"))
    elif not args.skip_training:
        start = time.perf_counter()
        engine = LLMEngine(EngineConfig.from_preset("cpu", model=bundled, quantization="none", dtype="float32",
                                                    max_num_seqs=64))
        prompts = [prompt_ids(tokenizer, c) for c in conversations(TOPICS, TEMPLATES)]
        sequences = [s[: args.length] for s in greedy_answers(engine, prompts, args.max_tokens)]
        del engine
        lengths = np.array([len(s) for s in sequences])
        print(json.dumps({"training_sequences": len(sequences), "tokens": int(lengths.sum()),
                          "generated_in_s": round(time.perf_counter() - start, 1)}), flush=True)
        start = time.perf_counter()
        features, labels = target_states(target, sequences, args.length)
        tokens = np.zeros((len(sequences), args.length), np.int32)
        for index, sequence in enumerate(sequences):
            tokens[index, : len(sequence)] = sequence
        print(json.dumps({"features_in_s": round(time.perf_counter() - start, 1)}), flush=True)
        data.parent.mkdir(parents=True, exist_ok=True)
        np.savez(data, tokens=tokens, features=features, labels=labels, lengths=lengths)
    if not args.skip_training:
        weights = nnx.to_pure_dict(target.state)
        embeddings = jnp.asarray(weights["embed_tokens"], jnp.float32)
        head = jnp.asarray(weights.get("lm_head", weights["embed_tokens"]), jnp.float32)
        d = target.cfg.hidden_size
        rng = np.random.default_rng(0)
        fc = np.concatenate([rng.standard_normal((d, d)) * 0.02, np.eye(d)], axis=1)  # the feature passed through
        params = {"fc.weight": fc, "fc.bias": np.zeros(d),
                  **{f"layers.0.{name}": value for name, value in hf_layer(target, target.cfg.num_layers - 1).items()}}
        params = {name: jnp.asarray(value, jnp.float32) for name, value in params.items()}
        start = time.perf_counter()
        params = train(params, embeddings, head, tokens, features, labels, lengths, target.cfg, args.epochs,
                       args.batch, args.lr, seed=0, ce_weight=args.ce_weight)
        print(json.dumps({"trained_in_s": round(time.perf_counter() - start, 1)}), flush=True)
        save(params, target.hf_config.to_dict(), out)
    topics = HELD_OUT if args.eval_on == "held-out" else TOPICS[: len(HELD_OUT)]
    prompts = [prompt_ids(tokenizer, c) for c in conversations(topics, TEMPLATES[:2])]
    results = evaluate(out, prompts, args.eval_tokens, args.num_speculative_tokens, args.rounds,
                       tuple(args.eval_streams))
    (out / f"results-{args.eval_on}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
