"""The step temp-memory records a warm start sizes its KV cache from (runner/temp_records.py): written
whole, read back, anything unreadable taken as no record, keys the same in every process."""

import os
import subprocess
import sys

import pytest

from jaxserve.runner.temp_records import SUBDIRECTORY, TempRecords, fingerprint, source_digest


def test_a_record_reads_back_and_a_missing_one_is_none(tmp_path):
    records = TempRecords(tmp_path)
    assert records.read("a" * 64) is None
    records.write("a" * 64, 123_456_789)
    records.write("b" * 64, 5)
    assert records.read("a" * 64) == 123_456_789 and records.read("b" * 64) == 5
    records.write("a" * 64, 7)  # replaced whole
    assert records.read("a" * 64) == 7
    assert sorted(p.name for p in (tmp_path / SUBDIRECTORY).iterdir()) == ["a" * 64 + ".json", "b" * 64 + ".json"]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"temp_bytes": "many"}', '{"temp_bytes": -1}', '{"other": 1}',
                                  '{"temp_bytes": 1.5}'])
def test_a_record_that_cannot_be_read_counts_as_none(tmp_path, text):
    records = TempRecords(tmp_path)
    records.directory.mkdir()
    (records.directory / "k.json").write_text(text)
    assert records.read("k") is None


def test_a_file_in_the_way_is_logged_not_raised(tmp_path, caplog):
    (tmp_path / SUBDIRECTORY).write_text("not a directory")
    TempRecords(tmp_path).write("k", 1)
    assert "could not record the step's temp memory" in caplog.text


class Activation:  # a default repr: `<...Activation object at 0x...>`
    pass


def test_the_fingerprint_leaves_object_addresses_out_and_tells_parts_apart():
    first, second = Activation(), Activation()
    assert repr(first) != repr(second)  # two addresses, as one object has in two processes
    assert fingerprint({"act": first}, 64) == fingerprint({"act": second}, 64)
    assert fingerprint({"act": first}, 64) != fingerprint({"act": first}, 128)
    assert fingerprint("a", "b") != fingerprint("b", "a")


def test_the_source_digest_is_the_same_in_another_process():
    code = "from jaxserve.runner.temp_records import source_digest; print(source_digest())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "7"})
    assert other.stdout.strip() == source_digest()
    assert len(source_digest()) == 64
