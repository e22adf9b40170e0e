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
