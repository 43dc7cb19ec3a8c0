"""Embedding throughput of an encoder on this CPU: jaxserve's `LLM.embed` against transformers' PyTorch
`BertModel` run as sentence-transformers runs it (prompts sorted by length, batches of 32 padded to their
longest, mean pooling over the attention mask), the same random weights in both (all-MiniLM-L6-v2's shape:
6 layers, 384 wide, 12 heads), the same token ids, both on every core this process may use.

    python -m benchmarks.encoder_throughput [--prompts 512] [--min-len 8] [--max-len 128] [--dtype float32]

Prints one JSON line per engine (prompts/s, tokens/s, the seconds of the timed run after a warm-up run of
the same prompts) and their ratio, and the largest cosine distance between the two engines' vectors.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from jaxserve.model_configs import bundled_config_values


def _model_dir(directory: Path):
    """all-MiniLM-L6-v2's shape with random weights (HF's init) and a WordPiece tokenizer of its vocabulary's
    size (its tokens made up: the benchmark feeds token ids)."""
    import transformers

    config = transformers.BertConfig(**{**bundled_config_values("all-minilm-l6-v2"), "sep_token_id": 3})  # ours
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(directory, safe_serialization=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"t{i}" for i in range(config.vocab_size - 5)]
    transformers.BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(directory)
    return model


def _torch_embed(model, prompts: list[list[int]], batch_size: int = 32) -> np.ndarray:
    order = np.argsort([-len(p) for p in prompts])
    out = np.zeros((len(prompts), model.config.hidden_size), np.float32)
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(prompts[r]) for r in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, :len(prompts[r])] = torch.tensor(prompts[r])
                mask[i, :len(prompts[r])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            out[rows] = pooled.numpy()
    return out


def _timed(embed, prompts: list[list[int]]) -> tuple[np.ndarray, float]:
    embed(prompts)  # warm-up: compiles (jaxserve), first touches (both)
    start = time.perf_counter()
    vectors = embed(prompts)
    return vectors, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="jaxserve's --dtype (torch runs float32)")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.prompts)
    prompts = [[2, *rng.integers(5, 30522, size=n - 2).tolist(), 3] for n in lengths]  # [CLS] ... [SEP]
    num_tokens = int(lengths.sum())

    with tempfile.TemporaryDirectory() as directory:
        model = _model_dir(Path(directory))
        reference, torch_s = _timed(lambda p: _torch_embed(model, p), prompts)

        from jaxserve.llm import LLM

        llm = LLM(model=directory, dtype=args.dtype, pooling_type="mean", compilation_cache_dir=None)
        ours, jax_s = _timed(lambda p: np.asarray([o.outputs.embedding for o in llm.embed(p, use_tqdm=False)]),
                             prompts)
    cosine = np.sum(ours * reference, 1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    for name, seconds in (("transformers-torch", torch_s), (f"jaxserve-{args.dtype}", jax_s)):
        print(json.dumps({"engine": name, "prompts": args.prompts, "tokens": num_tokens, "seconds": round(seconds, 3),
                          "prompts_per_s": round(args.prompts / seconds, 1),
                          "tokens_per_s": round(num_tokens / seconds)}))
    print(json.dumps({"jaxserve_over_torch": round(torch_s / jax_s, 2), "threads": threads,
                      "max_cosine_distance": float(1 - cosine.min())}))


if __name__ == "__main__":
    main()
