"""Rewrite the bundled model's converted config and tokenizer (jaxserve/models/bundled/) from a fresh conversion
of its GGUF, after a change to what a conversion writes (`gguf_cache`, `gguf_tokenizer`).
`tests/models/test_gguf_cache.py` fails while they differ.

    .venv/bin/python scripts/refresh_bundled_conversion.py
"""

import gzip
import tempfile
from pathlib import Path

from jaxserve.models.gguf_cache import _SHIPPED_FILES, convert_with_transformers
from jaxserve.models.loader import bundled_model_path


def main() -> None:
    shipped = Path(__file__).resolve().parents[1] / "jaxserve" / "models" / "bundled"
    with tempfile.TemporaryDirectory() as staging:
        convert_with_transformers(bundled_model_path(), Path(staging))
        for name in _SHIPPED_FILES:
            data = (Path(staging) / name.removesuffix(".gz")).read_bytes()
            if name.endswith(".gz"):
                data = gzip.compress(data, compresslevel=9, mtime=0)
            (shipped / name).write_bytes(data)
            print(f"wrote {shipped / name}")


if __name__ == "__main__":
    main()
