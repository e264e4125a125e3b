"""The tokens-per-step curve against training tokens: its table and plot from `bench acceptance` results."""

import json

from serve_app.bench.draft_curve import load_points, write


def test_curve_table_and_plot(tmp_path):
    paths = []
    for i, tps in enumerate([(1.5, 1.6), (1.7, 1.8)]):
        p = tmp_path / f"acc{i}.json"
        p.write_text(json.dumps({"k": 4, "draft": f"d{i}", "sets": {
            "benchmark": {"tokens_per_step": tps[0]}, "creative": {"tokens_per_step": tps[1]}}}))
        paths.append(p)
    points = load_points([f"small=1000:3:{paths[0]}", f"big=10000:1.5:{paths[1]}"])
    md = write(points, str(tmp_path / "curve"))
    assert "| big | 10,000 | 1.5 | 1.70 | 1.80 | acc1.json |" in md
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert json.loads((tmp_path / "curve.json").read_text())[0]["tokens_per_step"] == {"benchmark": 1.5, "creative": 1.6}
