"""The step temp-memory records a warm start sizes its KV cache from (runner/temp_records.py): written
whole with the umask's permissions, read back, anything unreadable taken as no record, keys the same in
every process, and the sources' digest unbothered by what is not a source file."""

import os
import stat

import pytest

from jaxserve.runner.temp_records import SUBDIRECTORY, StepTempRecord, TempRecords, fingerprint, source_digest


def test_a_record_reads_back_and_a_missing_one_is_none(tmp_path):
    records = TempRecords(tmp_path)
    assert records.read("a" * 64) is None
    records.write("a" * 64, StepTempRecord(123_456_789, 100_000_000))
    records.write("b" * 64, StepTempRecord(5, 4))
    assert records.read("a" * 64) == StepTempRecord(123_456_789, 100_000_000)
    assert records.read("b" * 64) == StepTempRecord(5, 4)
    records.write("a" * 64, StepTempRecord(7, 6))  # replaced whole
    assert records.read("a" * 64) == StepTempRecord(7, 6)
    records.forget("b" * 64)
    records.forget("c" * 64)  # none there: nothing to do
    assert records.read("b" * 64) is None
    assert [p.name for p in (tmp_path / SUBDIRECTORY).iterdir()] == ["a" * 64 + ".json"]  # no temporary left


def test_a_record_has_the_umask_s_permissions_as_jax_s_cache_entries(tmp_path):
    previous = os.umask(0o022)
    try:
        TempRecords(tmp_path).write("k", StepTempRecord(1, 1))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / SUBDIRECTORY / "k.json").stat().st_mode) == 0o644


@pytest.mark.parametrize("text", ["", "{", "[]", '{"sized_for_bytes": "many", "compiled_bytes": 1}',
                                  '{"sized_for_bytes": -1, "compiled_bytes": 1}', '{"sized_for_bytes": 1}',
                                  '{"sized_for_bytes": 1.5, "compiled_bytes": 1}', '{"temp_bytes": 1}'])
def test_a_record_that_cannot_be_read_counts_as_none(tmp_path, text):
    records = TempRecords(tmp_path)
    records.directory.mkdir()
    (records.directory / "k.json").write_text(text)
    assert records.read("k") is None


def test_a_file_in_the_way_is_logged_not_raised(tmp_path, caplog):
    (tmp_path / SUBDIRECTORY).write_text("not a directory")
    TempRecords(tmp_path).write("k", StepTempRecord(1, 1))
    assert "could not record the step's temp memory" in caplog.text
    assert TempRecords(tmp_path).read("k") is None


def test_records_only_beside_a_local_cache_directory(tmp_path):
    assert TempRecords.beside(None) is None and TempRecords.beside("") is None
    assert TempRecords.beside("gs://bucket/xla") is None  # JAX takes URLs; these records do not
    assert TempRecords.beside(str(tmp_path)).directory == tmp_path / SUBDIRECTORY


class Activation:  # a default repr: `<...Activation object at 0x...>`
    pass


def test_the_fingerprint_leaves_object_addresses_out_and_tells_parts_apart():
    first, second = Activation(), Activation()
    assert repr(first) != repr(second)  # two addresses, as one object has in two processes
    assert fingerprint({"act": first}, 64) == fingerprint({"act": second}, 64)
    assert fingerprint({"act": first}, 64) != fingerprint({"act": first}, 128)
    assert fingerprint("a", "b") != fingerprint("b", "a")


def test_the_source_digest_reads_source_files_and_passes_over_the_rest(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = source_digest(tmp_path)
    (tmp_path / ".#a.py").symlink_to(tmp_path / "gone")  # an editor's lock: a link to nothing
    (tmp_path / "dir.py").mkdir()  # not a file
    source_digest.cache_clear()
    assert source_digest(tmp_path) == before
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    source_digest.cache_clear()
    assert source_digest(tmp_path) != before
    assert len(source_digest()) == 64  # jaxserve's own
