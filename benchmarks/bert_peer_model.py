"""The BERT that `benchmarks/embeddings_vs_llama_server.py` serves on both servers: all-MiniLM-L6-v2's shape with
random weights (`torch.manual_seed(0)`, transformers' init), saved as safetensors with bert-base-uncased's
WordPiece vocabulary, and its GGUFs (F32, F16) written by llama.cpp's own `convert_hf_to_gguf.py`, unmodified.

The vocabulary comes from llama.cpp's test file `models/ggml-vocab-bert-bge.gguf` (bert-base-uncased's 30,522
tokens as its converter writes them: "▁" before a word's first piece, none before a continuation), undone into
WordPiece's form (no mark before a first piece, "##" before a continuation), so that the converter recognises
the tokenizer as BERT's.

    python -m benchmarks.bert_peer_model OUT_DIR [--llama-cpp ~/peers/llama.cpp]
"""

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import torch
import transformers

from jaxserve.model_configs import bundled_config_values


def _vocabulary(llama_cpp: Path) -> list[str]:
    reader = gguf.GGUFReader(llama_cpp / "models" / "ggml-vocab-bert-bge.gguf")
    tokens, types = reader.fields["tokenizer.ggml.tokens"], reader.fields["tokenizer.ggml.token_type"]
    words = [bytes(tokens.parts[i]).decode() for i in tokens.data]
    kinds = [int(types.parts[i][0]) for i in types.data]
    vocabulary = [word if kind == gguf.TokenType.CONTROL else word[1:] if word.startswith("\u2581") else f"##{word}"
                  for word, kind in zip(words, kinds, strict=True)]
    if len(vocabulary) != 30522 or len(set(vocabulary)) != len(vocabulary):
        raise ValueError("the test file's vocabulary is not bert-base-uncased's 30,522 distinct tokens")
    return vocabulary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, default=Path.home() / "peers" / "llama.cpp")
    args = parser.parse_args()
    model_dir = args.out / "hf"
    model_dir.mkdir(parents=True, exist_ok=True)
    vocabulary = _vocabulary(args.llama_cpp)
    (model_dir / "vocab.txt").write_text("\n".join(vocabulary) + "\n", encoding="utf-8")  # (the converter's)
    tokenizer = transformers.BertTokenizer(vocab={token: i for i, token in enumerate(vocabulary)}, do_lower_case=True)
    tokenizer.save_pretrained(model_dir)
    config = transformers.BertConfig(**bundled_config_values("all-minilm-l6-v2"))
    config.architectures = ["BertModel"]
    torch.manual_seed(0)
    transformers.BertModel(config, add_pooling_layer=False).eval().save_pretrained(model_dir, safe_serialization=True)
    for kind in ("f32", "f16"):
        subprocess.run([sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(model_dir),
                        "--outtype", kind, "--outfile", str(args.out / f"model-{kind}.gguf")], check=True)


if __name__ == "__main__":
    main()
