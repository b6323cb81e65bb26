"""What a person reads at the end of a run and while data is prepared: rich tables and progress that
stay plain text (no colour or cursor codes) when the output is a CI log or a file."""

from __future__ import annotations

from shardlab.cli.train import rank_table, result_table
from shardlab.data.progress import FileProgress


def test_end_of_run_tables_are_plain_text():
    summary = {"final_loss": 4.6294, "final_val_loss": 4.9069, "final_val_perplexity": 135.22,
               "final_val_bits_per_byte": 1.944, "tokens_per_s": 6146.0, "wall_s": 250.0}
    text = result_table(summary)
    assert "\x1b" not in text and all(line == line.rstrip() for line in text.splitlines())
    assert "validation perplexity" in text and "135.22" in text and "1.944" in text and "6,146" in text
    ranks = [{"rank": r, "coords": {"pp": 0, "dp": r // 2, "tp": r % 2}, "node": 0,
              "peak_mem_bytes": 100 * 2**20, "comm_wait_share": 0.05} for r in range(4)]
    lines = rank_table(ranks).splitlines()
    assert lines[0].split() == ["rank", "dp", "tp", "peak", "mem", "comm", "wait"]  # pp has one value: not shown
    assert lines[-1].split() == ["3", "1", "1", "100.0", "MiB", "5%"]


def test_progress_off_a_terminal_prints_a_line_per_tenth(capsys):
    with FileProgress(total=1000, files=20, label="encoding") as bar:
        for _ in range(20):
            bar.advance(50)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and lines[-1] == "encoding: 20/20 files, 0.0 of 0.0 MiB (100%)"
    assert "\x1b" not in "".join(lines)
