"""A draft model for `benchmarks/speculative.py` without a download: the bundled SmolLM2-135M cut to its
first N layers (its embeddings, final norm and head kept), saved as a Hugging Face checkpoint. Early layers
plus the head predict the full model's next token often enough to show what a draft model's rounds cost and
what they accept; a real deployment pairs a large target with a small model of its family instead.

    python benchmarks/truncated_draft.py --layers 8 --out /tmp/smollm2-8-layers
    python benchmarks/speculative.py --streams 1 4 --rounds 2 --speculative-config \
        '{"model": "/tmp/smollm2-8-layers", "num_speculative_tokens": 4}'
"""

import argparse
from pathlib import Path

import torch
import transformers

from jaxserve.models.loader import bundled_model_path


def truncated_copy(num_layers: int, out: Path) -> Path:
    """The bundled model's first `num_layers` layers, in float32, with its tokenizer, under `out`."""
    gguf = bundled_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32)
    if not 1 <= num_layers <= model.config.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {model.config.num_hidden_layers}]")
    config = model.config
    config.num_hidden_layers = num_layers
    config.quantization_config = None  # read from GGUF: a plain checkpoint is saved
    copy = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = copy.load_state_dict(model.state_dict(), strict=False)  # the later layers' are left out
    assert not missing, missing
    copy.save_pretrained(out, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(truncated_copy(args.layers, args.out))


if __name__ == "__main__":
    main()
