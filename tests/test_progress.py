"""A long stage shows its progress where its output goes: a bar in a terminal, lines with
the time left in a log file (a bar there was drawn only once it was done)."""

from components import progress
from components.progress import stage_progress


def test_a_stage_writes_progress_lines_with_the_time_left_to_a_log(capsys):
    with stage_progress("text gate", total=20) as advance:
        for _ in range(20):
            advance(1, "ROUGE-L 0.41")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":", 1)[1].split(" (")[0].strip() for line in lines] == [f"{n}/20" for n in range(2, 21, 2)]  # each tenth, then done
    assert lines[4].startswith("text gate: 10/20 (50 %), 0:00:00 elapsed, about 0:00:00 left, ROUGE-L 0.41")
    assert lines[-1].startswith("text gate: 20/20 (100 %), 0:00:00 elapsed, ROUGE-L") and "left" not in lines[-1]


def test_a_slow_stage_writes_a_line_at_least_every_interval(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    with stage_progress("quality gate", total=1000) as advance:
        for _ in range(5):
            advance(1, "")
    assert len(capsys.readouterr().err.splitlines()) == 5 + 1
