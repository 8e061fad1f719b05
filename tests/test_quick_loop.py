"""The quick loop's guard (conftest.py): non-slow tests over QUICK_LIMIT_S are named at its end, slow ones never."""
from types import SimpleNamespace

import conftest


class _Terminal:
    def __init__(self):
        self.lines = []

    def write_sep(self, sep, title, **markup):
        self.lines.append(title)

    def write_line(self, line, **markup):
        self.lines.append(line)


def _summary(markexpr, reports, monkeypatch):
    monkeypatch.setattr(conftest, "_quick_seconds", {})
    for nodeid, keywords, seconds in reports:
        for phase_seconds in (seconds / 2, seconds / 2):  # setup and call add up
            conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, keywords=keywords,
                                                              duration=phase_seconds))
    term = _Terminal()
    conftest.pytest_terminal_summary(term, SimpleNamespace(getoption=lambda name: markexpr))
    return term.lines


def test_a_long_non_slow_test_is_named_and_a_slow_or_short_one_is_not(monkeypatch):
    limit = conftest.QUICK_LIMIT_S
    reports = [("t.py::long", {"t.py": 1}, 2 * limit), ("t.py::short", {}, limit / 2),
               ("t.py::marked", {"slow": 1}, 10 * limit)]
    lines = _summary("not slow", reports, monkeypatch)
    assert len(lines) == 2 and "1 non-slow test(s) over" in lines[0] and "mark them @pytest.mark.slow" in lines[0]
    assert lines[1].split() == [f"{2 * limit:.1f}s", "t.py::long"]
    assert _summary("", reports, monkeypatch) == []  # the full suite is not the quick loop
