"""The study of how much of one big cache a fleet keeps (``arc_simulator.one_cache``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arc_simulator.cli import main as cli
from arc_simulator.one_cache import SETTINGS, Row, Setting, main, study, table


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("one-cache") / "chat.jsonl"
    assert cli(["generate", "conversation", "--out", str(path), "--sessions", "60"]) == 0
    return str(path)


def test_each_row_is_the_fleets_hit_rate_over_one_big_caches(chat: str) -> None:
    settings = [Setting("round_robin", "round_robin"), Setting("drawn", "kv_aware", 1.0)]
    rows = study([chat], [2, 4], seeds=3, settings=settings)
    assert [(row.replicas, row.setting) for row in rows] == [
        (2, "round_robin"), (2, "drawn"), (4, "round_robin"), (4, "drawn"),
    ]  # fmt: skip
    for row in rows:
        assert row.kept == pytest.approx(row.hit_rate / row.one_cache_hit_rate)
        assert row.kept_low <= row.kept <= row.kept_high
    round_robin = [row for row in rows if row.setting == "round_robin"]
    assert [row.imbalance for row in round_robin] == [1.0, 1.0]
    assert [row.seeds for row in rows] == [1, 3, 1, 3]
    # The fleet's cache is split: each of 4 replicas holds about half of each of 2.
    assert rows[2].capacity_per_replica == pytest.approx(rows[0].capacity_per_replica / 2, abs=1)


def test_the_target_is_both_kept_and_balanced() -> None:
    def row(kept: float, imbalance: float) -> Row:
        return Row("t", 2, "s", "trio", 10, 0.5, 0.5 * kept, kept, kept, kept, imbalance, 1)

    assert row(0.95, 1.25).meets_target
    assert not row(0.94, 1.0).meets_target
    assert not row(1.0, 1.26).meets_target
    assert "**95% (1.25)**" in table([row(0.95, 1.25)])


def test_the_command_prints_the_table_and_writes_every_row(
    chat: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "rows.json"
    assert main(["--trace", chat, "--replicas", "2", "--seeds", "1", "--json", str(rows)]) == 0
    printed = capsys.readouterr().out
    assert all(f"| {setting.label} |" in printed for setting in SETTINGS)
    assert rows.read_text().count('"setting"') == len(SETTINGS)
    with pytest.raises(SystemExit):
        main(["--trace", chat, "--replicas", "1"])
