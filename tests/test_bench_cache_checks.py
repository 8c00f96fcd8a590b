"""bench.cache_checks end to end on a tiny synthetic cache (the numbers themselves are not checked)."""

import json

from bench import cache_checks


def test_cache_checks_bench_runs_and_reports_every_cost(tmp_path, capsys):
    out = tmp_path / "checks.json"
    assert cache_checks.main(["--images", "40", "--shards", "2", "--image-size", "64", "--items", "50",
                              "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert result["latent_shape"] == [4, 8, 8] and result["cache_gb"] > 0
    for key in ("open_us_per_file", "item_us", "finite_check_us_per_item", "verify_s_per_gb"):
        assert result[key] > 0 and key in printed
