"""GGUF tokenizers, jaxserve's against llama.cpp's and the models' own.

For each GGUF file (vocabulary-only files serve: llama.cpp's `models/ggml-vocab-*.gguf`), jaxserve converts
the tokenizer as `serve` does, and the token ids of each text are compared with:
- llama.cpp's `llama-tokenize` on the same file (`--llama-tokenize`), and
- the ids the model's own tokenizer gave, where llama.cpp ships them beside the file (`<file>.inp`/`.out`,
  written by its `convert_hf_to_gguf_update.py` with transformers and the model's `tokenizer.json`).

`--as-pre NAME` first writes a copy of each file naming another `tokenizer.ggml.pre`: a split jaxserve reads
whose own vocabulary is not at hand is then checked against llama.cpp's reading of the same name.

    python benchmarks/tokenizers_vs_llama_cpp.py ~/llama.cpp/models/ggml-vocab-*.gguf \
        --llama-tokenize ~/llama.cpp/build/bin/llama-tokenize
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Texts beyond llama.cpp's own test inputs: digits in runs, CJK beside kana and digits, Hangul, marks
# (composed and not), scripts the splits treat differently, code, and whitespace at the edges
EXTRA_TEXTS = (
    "1234567890 12345 3.14159 1,000,000 0x7fff",
    "東京タワーは333メートルです。カタカナとひらがな",
    "中文句子，包含标点！以及English混合123",
    "한국어 문장입니다 2024년",
    "Tiếng Việt có dấu: Cửa Việt, người",
    "Ελληνικά κείμενα και Армянский: Բարեւ բարեւ",
    "e\u0301 re\u0301sume\u0301 \u00e9 na\u00efve",
    "def f(x):\n\treturn x**2 + 1  # comment\r\n",
    "  leading and trailing spaces   ",
    "a  1\n\n2024\nx = [\n    1,\n\t\t42]",
    "\n\n\nnewlines\n\n",
    "emoji 🦙🦙 and ½ ¾ ² ① symbols",
    "ＦＵＬＬＷＩＤＴＨ　ｔｅｘｔ！？",
    "don't I'LL we've SHE'S",
    "<|fake_special|> <s> text",
)


def _texts(gguf: Path) -> tuple[list[str], list[list[int]] | None]:
    """The texts to tokenize, and the model's own ids for llama.cpp's (None where it ships none)."""
    inputs, outputs = gguf.with_name(gguf.name + ".inp"), gguf.with_name(gguf.name + ".out")
    if not inputs.exists():
        return list(EXTRA_TEXTS), None
    texts = inputs.read_text().split("\n__ggml_vocab_test__\n")
    expected = [[int(t) for t in line.split()] for line in outputs.read_text().split("\n")][:len(texts)]
    return texts + list(EXTRA_TEXTS), expected


def _retagged(gguf: Path, pre: str, directory: Path) -> Path:
    """A copy of `gguf`'s metadata (it has no tensors) naming `pre` as its pre-tokenizer."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()
    out = directory / f"{gguf.stem}-as-{pre}.gguf"
    writer = gguf_lib.GGUFWriter(str(out), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _llama_cpp_ids(llama_tokenize: str, gguf: Path, text: str, directory: Path, bos: bool = False) -> list[int]:
    """llama.cpp's ids of the text alone, or with the BOS it adds for the file (`bos`)."""
    prompt = directory / "prompt.txt"
    prompt.write_text(text)
    result = subprocess.run([llama_tokenize, "-m", str(gguf), "-f", str(prompt), "--ids", "--no-escape",
                             "--log-disable", *([] if bos else ["--no-bos"])],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(gguf: Path, llama_tokenize: str | None, directory: Path, retagged_from: Path | None = None) -> dict:
    """The file's ids against llama.cpp's and the model's own; a retagged copy is given its original's texts,
    and its ids are no longer the model's own."""
    from jaxserve.models.gguf_cache import convert_with_transformers
    from jaxserve.models.tokenizer import load_tokenizer

    converted = directory / f"{gguf.stem}-converted"
    converted.mkdir()
    convert_with_transformers(gguf, converted)
    tokenizer = load_tokenizer(converted)
    texts, expected = _texts(retagged_from or gguf)
    expected = None if retagged_from else expected
    report = {"file": gguf.name, "texts": len(texts), "vs_llama_cpp": None, "vs_own": None, "bos": None,
              "differ": []}
    ours = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    if expected is not None:
        same = [a == b for a, b in zip(ours, expected, strict=False)]  # its ids: llama.cpp's texts, first
        report["vs_own"] = f"{sum(same)}/{len(expected)}"
        report["differ"] += [("own", texts[i][:40], ours[i][:8], expected[i][:8]) for i, s in enumerate(same) if not s]
    if llama_tokenize is not None:
        theirs = [_llama_cpp_ids(llama_tokenize, gguf, text, directory) for text in texts]
        same = [a == b for a, b in zip(ours, theirs, strict=True)]
        report["vs_llama_cpp"] = f"{sum(same)}/{len(texts)}"
        report["differ"] += [("llama.cpp", texts[i][:40], ours[i][:8], theirs[i][:8])
                             for i, s in enumerate(same) if not s]
        # the special tokens a text begins with: BOS where the file (or llama.cpp's default for its kind) says
        with_bos = (tokenizer.encode(texts[0]), _llama_cpp_ids(llama_tokenize, gguf, texts[0], directory, bos=True))
        report["bos"] = "same" if with_bos[0] == with_bos[1] else "differs"
        if with_bos[0] != with_bos[1]:
            report["differ"].append(("llama.cpp with BOS", texts[0][:40], with_bos[0][:8], with_bos[1][:8]))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", nargs="+", type=Path)
    parser.add_argument("--llama-tokenize", help="llama.cpp's llama-tokenize binary")
    parser.add_argument("--as-pre", help="check each file as if it named this tokenizer.ggml.pre")
    args = parser.parse_args()
    failed = False
    for gguf in args.gguf:
        with tempfile.TemporaryDirectory() as directory:
            path = _retagged(gguf, args.as_pre, Path(directory)) if args.as_pre else gguf
            try:
                report = check(path, args.llama_tokenize, Path(directory), gguf if args.as_pre else None)
            except Exception as e:  # a file transformers cannot read: say so, go on, fail at the end
                print(json.dumps({"file": path.name, "error": f"{type(e).__name__}: {str(e)[:120]}"}))
                failed = True
                continue
            failed |= bool(report["differ"])
            print(json.dumps(report, ensure_ascii=False))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
