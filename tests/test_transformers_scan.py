"""transformers' scans of its sources remembered between starts (jaxserve/transformers_scan.py): the same
import structure as transformers' own scan, read from the record while the files are unchanged, scanned
afresh when one changes or the record is damaged; a process that remembers them reads configs and
tokenizers as one that does not."""

import ast
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import transformers_scan


@pytest.fixture
def records(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    transformers_scan._files_digest.cache_clear()
    return tmp_path / "cache" / "transformers-scans"


def as_a_new_process() -> None:
    """Forgets this process's digests of the files (a process takes them once, as transformers its scans)."""
    transformers_scan._files_digest.cache_clear()


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A tree shaped like one transformers scans: modules in folders."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for family in ("llama", "qwen2"):
        (root / family).mkdir(parents=True)
        (root / family / "__init__.py").write_text("")
        (root / family / f"configuration_{family}.py").write_text(f"__all__ = ['{family.title()}Config']\n")
    return root


def counting_scan(calls: list):
    """A stand-in for transformers' scan: each module's `__all__`, read from the files."""

    def scan(module_path, prefix=None):
        calls.append((str(module_path), prefix))
        if Path(module_path).is_file():  # a package's __init__.py: its folder (transformers' rule)
            module_path = Path(module_path).parent
        found = {}
        paths = [Path(root, name) for root, _, names in os.walk(module_path, followlinks=True) for name in names
                 if name.startswith("configuration_")]
        for path in sorted(paths):
            names = set(ast.literal_eval(path.read_text().split("=", 1)[1].strip()))
            module = f"{path.parent.name}.{path.stem}"
            found[f"{prefix}.{module}" if prefix else module] = names
        return {frozenset(): found}

    return scan


def test_a_second_scan_of_unchanged_files_is_read_from_the_record(records: Path, package: Path):
    calls = []
    remembered = transformers_scan._remembered(counting_scan(calls))
    first = remembered(package, "models")
    second = remembered(package, "models")
    assert len(calls) == 1 and len(list(records.glob("*.pickle"))) == 1
    assert second == first == counting_scan([])(package, "models")
    assert second is not first  # each caller gets its own (transformers' lazy modules keep theirs)
    assert remembered(package) == counting_scan([])(package)  # another prefix: another record
    assert len(calls) == 2


def test_a_changed_file_is_scanned_afresh(records: Path, package: Path):
    calls = []
    remembered = transformers_scan._remembered(counting_scan(calls))
    remembered(package)
    (package / "llama" / "configuration_llama.py").write_text("__all__ = ['LlamaConfig', 'LlamaTextConfig']\n")
    as_a_new_process()
    assert remembered(package)[frozenset()]["llama.configuration_llama"] == {"LlamaConfig", "LlamaTextConfig"}
    (package / "mistral").mkdir()
    (package / "mistral" / "configuration_mistral.py").write_text("__all__ = ['MistralConfig']\n")
    as_a_new_process()
    assert "mistral.configuration_mistral" in remembered(package)[frozenset()]
    assert len(calls) == 3
    (package / "llama" / "__pycache__").mkdir()  # Python's bytecode caches are not the sources
    (package / "llama" / "__pycache__" / "configuration_llama.cpython-311.pyc").write_bytes(b"\0")
    as_a_new_process()
    remembered(package)
    assert len(calls) == 3


def test_a_packages_init_stands_for_its_folder(records: Path, package: Path):
    """transformers' packages scan themselves by their `__init__.py`: `transformers.models`' own import does."""
    calls = []
    remembered = transformers_scan._remembered(counting_scan(calls))
    want = counting_scan([])(package)
    assert remembered(package / "__init__.py") == want and remembered(package / "__init__.py") == want
    assert len(calls) == 1
    (package / "qwen2" / "configuration_qwen2.py").write_text("__all__ = ['Qwen2Config', 'Qwen2MoeConfig']\n")
    as_a_new_process()
    assert remembered(package / "__init__.py")[frozenset()]["qwen2.configuration_qwen2"] == \
        {"Qwen2Config", "Qwen2MoeConfig"}
    assert len(calls) == 2


def test_a_linked_folder_and_the_scanner_itself_are_part_of_the_key(records: Path, package: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere" / "gemma"
    elsewhere.mkdir(parents=True)
    (elsewhere / "configuration_gemma.py").write_text("__all__ = ['GemmaConfig']\n")
    (package / "gemma").symlink_to(elsewhere)  # transformers follows folders through links
    scanner = tmp_path / "import_utils.py"
    scanner.write_text("# the scan's code\n")
    calls = []
    remembered = transformers_scan._remembered(counting_scan(calls), str(scanner))
    remembered(package)
    (elsewhere / "configuration_gemma.py").write_text("__all__ = ['GemmaConfig', 'Gemma2Config']\n")
    as_a_new_process()
    assert remembered(package)[frozenset()]["gemma.configuration_gemma"] == {"GemmaConfig", "Gemma2Config"}
    assert len(calls) == 2
    scanner.write_text("# the scan's code, changed\n")
    as_a_new_process()
    remembered(package)
    assert len(calls) == 3


def test_a_damaged_record_or_a_cache_that_cannot_be_written_costs_a_scan_only(records: Path, package: Path,
                                                                               monkeypatch):
    calls = []
    remembered = transformers_scan._remembered(counting_scan(calls))
    want = remembered(package)
    [record] = records.glob("*.pickle")
    record.write_bytes(b"not a pickle")
    assert remembered(package) == want and len(calls) == 2
    assert pickle.loads(record.read_bytes()) == want  # written again
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(record))  # a file where the folder would be: nothing written
    assert remembered(package) == want and len(calls) == 3


def test_not_installed_once_transformers_is_imported():
    import transformers  # noqa: F401

    assert transformers_scan.remember_scans() is False


READ_CONFIG = """
import json, sys
from jaxserve.torch_free import keep_torch_out
from jaxserve.transformers_scan import remember_scans
keep_torch_out(None)
installed = sys.argv[1] == "1" and remember_scans()
from transformers import AutoConfig
import transformers.models
from transformers.utils import import_utils
from jaxserve.models.tokenizer import load_tokenizer
config = AutoConfig.from_pretrained(sys.argv[2])
tokenizer = load_tokenizer(__import__("pathlib").Path(sys.argv[2]))
scan = import_utils.define_import_structure
wrapped = getattr(getattr(scan, "__code__", None), "co_filename", "").endswith("transformers_scan.py")
own = scan.__wrapped__ if wrapped else scan
models = transformers.models.__file__.rsplit("/", 1)[0]
scanned = import_utils.create_import_structure_from_path.cache_info().currsize  # folders transformers read
same = all(scan(path, prefix) == own(path, prefix)
           for path in (models, models + "/__init__.py") for prefix in (None, "models"))
print(json.dumps({"installed": bool(installed), "wrapped": wrapped, "same": same, "scanned": scanned,
                  "config": config.to_dict(), "ids": tokenizer("Hello world, 1234")["input_ids"]}))
"""


def test_a_process_that_remembers_the_scans_reads_configs_and_tokenizers_as_one_that_does_not(
        records: Path, smollm2_gguf: Path):
    from jaxserve.models.gguf_cache import converted_dir

    directory = str(converted_dir(smollm2_gguf))

    def run(remember: str) -> dict:
        done = subprocess.run([sys.executable, "-c", READ_CONFIG, remember, directory], capture_output=True,
                              text=True, timeout=300, env=os.environ)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    plain, first, second = run("0"), run("1"), run("1")
    assert not plain["wrapped"] and first["installed"] and first["wrapped"] and second["wrapped"]
    assert first["same"] and second["same"]  # the records give transformers' own scans
    assert plain["scanned"] > 0 and first["scanned"] > 0  # model families' folders, read (an LRU of 128)
    assert second["scanned"] == 0  # every scan of the start (the import's, `transformers.models`') from a record
    assert len(list(records.glob("*.pickle"))) >= 2  # transformers' import's and `transformers.models`' at least
    assert plain["config"] == first["config"] == second["config"]
    assert plain["ids"] == first["ids"] == second["ids"]


ENGINE_FIRST = """
import sys
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
try:
    LLMEngine(EngineConfig.from_preset(None, model=sys.argv[1]))
except Exception:
    pass  # no such model: the engine had installed the wrapper by then
from transformers.utils import import_utils
code = getattr(import_utils.define_import_structure, "__code__", None)
print(code is not None and code.co_filename.endswith("transformers_scan.py"))
"""


def test_an_engine_made_in_python_remembers_the_scans(records: Path, tmp_path: Path):
    """`LLM()` and other engines built in Python (not through `serve`) take the records too."""
    done = subprocess.run([sys.executable, "-c", ENGINE_FIRST, str(tmp_path / "no-such-model")],
                          capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
