"""The main job's plots of times carry the console's busy-machine warning, and our rows' colours differ."""

import pytest

from selective_ckpt.bench import report
from selective_ckpt.bench.config import ROWS
from selective_ckpt.bench.output import busy_note

CFG = dict(rows=ROWS, hidden=64, heads=4, batch=2, layers=1, dtype="torch.float32", device="cpu", quick=False)


def test_busy_note_only_when_the_load_showed_other_work():
    assert busy_note(None, 2) is None and busy_note("", 2) is None and busy_note(2.4, 2) is None
    note = busy_note(7.9, 2)
    assert "unreliable" in note.lower() and "7.9" in note and "2 CPUs" in note


def test_time_plots_carry_the_note(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    titles = {}
    finish = report._finish

    def recording(fig, ax, path, title, note=None):
        finish(fig, ax, path, title, note)
        titles[path.name] = ax.get_title()

    monkeypatch.setattr(report, "_finish", recording)
    results = [dict(row=row, seq=s, kept_bytes_per_layer=s * (i + 1), step_s=1e-3 * s * (i + 1),
                    step_s_p20=0.9e-3 * s * (i + 1), step_s_p80=1.1e-3 * s * (i + 1))
               for i, row in enumerate(ROWS) for s in (64, 128)]
    paths = report.write_plots(results, {**CFG, "load_avg_peak": 50.0}, tmp_path)
    assert all(p.exists() for p in paths)
    for name in ("step_time.png", "tradeoff.png"):
        assert "UNRELIABLE TIMES" in titles[name], titles
    assert "UNRELIABLE" not in titles["kept_memory.png"]  # bytes do not depend on the load
    report.write_plots(results, {**CFG, "load_avg_peak": 0.1}, tmp_path)
    assert not any("UNRELIABLE" in t for t in titles.values())


def test_our_rows_have_distinct_hues():
    import colorsys

    ours = ("none", "selective", "full", "selective-compile")
    rgb = {r: tuple(int(report.STYLES[r][0][i:i + 2], 16) / 255 for i in (1, 3, 5)) for r in ours}
    hls = {r: colorsys.rgb_to_hls(*c) for r, c in rgb.items()}
    for i, a in enumerate(ours):
        for b in ours[i + 1:]:
            hue = abs(hls[a][0] - hls[b][0])
            hue = min(hue, 1 - hue)
            apart = hue > 0.08 or abs(hls[a][1] - hls[b][1]) > 0.25 or min(hls[a][2], hls[b][2]) < 0.1
            assert apart, (a, b, report.STYLES[a][0], report.STYLES[b][0])
        assert len({report.STYLES[r][1] for r in ours}) == len(ours)  # and unlike markers
