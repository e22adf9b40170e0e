"""benchmarks/goodput.py's command line: serve flags after `--` pass through to `pdserve serve`
(so `-- --mode colocated` works once the flag exists), and bad sweeps stop before any server
starts."""

import pytest

from benchmarks.goodput import parse_args


def test_flags_after_double_dash_go_to_pdserve_serve():
    args, extra = parse_args(["--rates", "0.5,2", "-n", "6", "--", "--mode", "colocated", "--decode", "2"])
    assert extra == ["--mode", "colocated", "--decode", "2"] and args.rates == [0.5, 2.0]
    assert args.num_requests == 6 and args.label == "pdserve serve --mode colocated --decode 2"


@pytest.mark.parametrize("argv,words", [
    (["--rates", "1,x"], "--rates"),
    (["--rates", "0"], "each > 0"),
    (["--base-url", "http://127.0.0.1:1", "--", "--mode", "colocated"], "only apply to a server this script starts"),
    (["--concurrency", "4"], "--max-concurrency"),
    (["--slo-ttft-ms", "100"], "go together"),
    (["--output-len", "uniform:0:3"], "output_len: low"),
])
def test_bad_sweeps_are_refused_naming_the_flag(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert words in capsys.readouterr().err


def test_compare_sets_runs_side_by_side_against_the_best_of_the_others(tmp_path):
    import json

    from benchmarks.goodput import compare

    def run(label, goodputs, ttft_ms=1000.0):
        rows = [{"rate": r, "goodput_req_s": g, "slo_attainment": g / r, "itl_ms": {"p99": 50.0}}
                for r, g in zip((1.0, 2.0), goodputs)]
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps({"label": label, "slo": {"ttft_ms": ttft_ms, "tpot_ms": 70.0,
                                                            "unloaded_ttft_ms": len(label)}, "rows": rows}))
        return path

    a, b, c = run("a", (1.0, 1.0)), run("b", (0.5, 1.5)), run("elastic", (1.0, 1.2))
    table = compare([a, b, c], tmp_path / "plot.png").splitlines()
    assert table[0] == "| rate req/s | a | b | elastic | elastic / best other |"
    assert table[2] == "| 1 | 1.00 (100%) | 0.50 (50%) | 1.00 (100%) | 1.00x |"
    assert table[3] == "| 2 | 1.00 (50%) | 1.50 (75%) | 1.20 (60%) | 0.80x |"
    assert (tmp_path / "plot.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="same rates and the same SLO"):
        compare([a, run("other", (1.0, 1.0), ttft_ms=2000.0)], None)
