"""Start-up progress: a bar on a terminal, spaced log lines (no carriage returns) anywhere else."""

import io
import logging

from jaxserve.progress import progress

logger = logging.getLogger("tests.progress")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_progress_is_logged_not_drawn(monkeypatch, caplog):
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert list(progress([10, 20, 30], "Compiling buckets", logger, unit="buckets", interval_s=0.0)) == [
            10, 20, 30
        ]
        assert list(progress(iter("ab"), "Loading weights", logger, unit="tensors", interval_s=0.0)) == ["a", "b"]
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        "Compiling buckets: 1/3 buckets", "Compiling buckets: 2/3 buckets",  # 3/3 is the caller's summary
        "Loading weights: 1 tensors", "Loading weights: 2 tensors",  # an iterator has no known total
    ]
    assert stderr.getvalue() == ""


def test_log_lines_are_spaced_by_the_interval(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger=logger.name):
        list(progress(range(1000), "Compiling buckets", logger, interval_s=60.0))
    assert caplog.records == []  # a fast loop logs nothing; the caller's summary line says it finished


def test_on_a_terminal_a_bar_is_drawn_and_nothing_logged(monkeypatch, caplog):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert list(progress([1, 2, 3], "Compiling buckets", logger, interval_s=0.0)) == [1, 2, 3]
    assert "Compiling buckets" in terminal.getvalue() and "\r" in terminal.getvalue()
    assert caplog.records == []
